"""LoRA adapters on megatron-core's tensor-parallel linears (the actor with `actor.lora`; rlconf/lora.py
plans which linears and how many parameters).

Each adapted `ColumnParallelLinear` (linear_qkv, linear_fc1) or `RowParallelLinear` (linear_proj,
linear_fc2) keeps its own weight, frozen, and gains `lora_A.<proj>` / `lora_B.<proj>` parameters, one pair
per Hugging Face projection it holds (q_proj / k_proj / v_proj, gate_proj / up_proj, o_proj, down_proj), so
the adapters are PEFT's own: y = W x + (alpha / r) B A dropout(x) per projection. Base parameter names do
not change (HF loading, export and weight sync skip `is_adapter_name` parameters).

Tensor parallel, so that TP = 1 and TP = 2 compute the same function:
  * column-parallel: A [r, in] is whole on every rank, B [out_p / tp, r] is split with the output rows.
    h = A x is identical on every rank; its gradient is summed over TP (`copy_to_tensor_model_parallel_region`)
    because each rank's B sees only its own output rows. With sequence parallel, x is all-gathered first
    (its gradient is then split, not reduce-scattered: the summed dh already makes it whole).
  * row-parallel: A [r, in / tp] is split with the input columns, B [out, r] is whole. h = A x is a partial
    sum, all-reduced over TP (reduce-scattered over the sequence with sequence parallel, where B's gradient
    is then summed over TP by megatron's `sequence_parallel` parameter rule, as for the norms).
  A fused linear_qkv keeps megatron's per-query-group layout ([q heads of group g, k_g, v_g] per g): the
  q / k / v adapters' outputs are interleaved the same way; linear_fc1's are [gate_local; up_local].
  Dropout draws from torch's generator on a replicated input (the same mask on every TP rank) and from
  megatron's model-parallel stream on a TP-split one, and only in training mode, as PEFT (nn.Dropout).

The adapters apply on the fly in every forward (log-probs, the update). The embedded rollout engine
samples with them merged into the base weights for the call (`generation_weights`: measured faster, same
function), restored bit-exactly afterwards. `adapters_disabled` switches them off (the reference policy =
the base model, rlconf StepPasses.ref_from); `merged_weights` also serves export --merge.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from rlconf.arch import ModelArch
from rlconf.lora import COLUMN_PARALLEL, MEGATRON_PARENT, LoraModule, LoraPlan, part_dims

ADAPTER_KEYS = (".lora_A.", ".lora_B.")


def is_adapter_name(name: str) -> bool:
    """Whether a parameter / state-dict name is a LoRA adapter's (not a base weight)."""
    return any(k in name for k in ADAPTER_KEYS)


def _init_seed(seed: int, layer: int, linear: str, part: str) -> int:
    digest = hashlib.sha256(f"lora-init:{seed}:{layer}:{linear}:{part}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _initial_a(plan: LoraPlan, fan_in: int, seed: int) -> torch.Tensor:
    """The whole A [r, fan_in] (every TP rank draws the same and keeps its part): PEFT's kaiming-uniform
    (a = sqrt(5), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in))) or a normal with std 1 / r."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.empty(plan.rank, fan_in)
    if plan.init == "gaussian":
        return a.normal_(0.0, 1.0 / plan.rank, generator=gen)
    bound = 1.0 / math.sqrt(fan_in)
    return a.uniform_(-bound, bound, generator=gen)


class _Adapted:
    """What one adapted linear needs in its forward (kept on the module as `_lora`)."""

    def __init__(self, module: LoraModule, plan: LoraPlan, arch: ModelArch, column: bool) -> None:
        self.parts = module.parts
        self.scaling = plan.scaling
        self.dropout = plan.dropout
        self.column = column
        self.enabled = True
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.qkv: tuple[int, int, int] | None = None
        if module.linear == "linear_qkv":
            d = part_dims(arch, "k_proj")[1] // arch.num_query_groups
            groups = arch.num_query_groups // tp
            self.qkv = (groups, arch.num_attention_heads // arch.num_query_groups * d, d)


def _drop(x: torch.Tensor, p: float, training: bool, split: bool) -> torch.Tensor:
    if p <= 0 or not training:
        return x
    if split:  # a TP-split input: each rank draws its own part (megatron's model-parallel stream)
        with get_cuda_rng_tracker().fork():
            return torch.nn.functional.dropout(x, p, True)
    return torch.nn.functional.dropout(x, p, True)


def _column_delta(layer: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
    st: _Adapted = layer._lora
    if layer.sequence_parallel:
        x = mappings.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
    x = _drop(x, st.dropout, layer.training, split=False)
    outs = {}
    for p in st.parts:
        h = torch.matmul(x, layer.lora_A[p].t())
        h = mappings.copy_to_tensor_model_parallel_region(h)  # dh summed over TP: B is split by rows
        outs[p] = torch.matmul(h, layer.lora_B[p].t()) * st.scaling
    lead = x.shape[:-1]
    if st.qkv is not None:  # interleave per query group: [q heads of g, k_g, v_g]
        groups, qw, d = st.qkv
        widths = {"q_proj": qw, "k_proj": d, "v_proj": d}
        cols = []
        for p in ("q_proj", "k_proj", "v_proj"):
            if p in outs:
                cols.append(outs[p].reshape(*lead, groups, widths[p]))
            else:
                cols.append(x.new_zeros(*lead, groups, widths[p]))
        return torch.cat(cols, -1).reshape(*lead, groups * (qw + 2 * d))
    # linear_fc1: [gate_local; up_local] (a missing projection adds zeros to its rows)
    width = layer.output_size_per_partition // 2
    cols = [outs[p] if p in outs else x.new_zeros(*lead, width) for p in ("gate_proj", "up_proj")]
    return torch.cat(cols, -1)


def _row_delta(layer: RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
    st: _Adapted = layer._lora
    (p,) = st.parts
    x = _drop(x, st.dropout, layer.training, split=True)
    h = torch.matmul(x, layer.lora_A[p].t())  # a partial sum over this rank's input columns
    if layer.sequence_parallel:
        h = mappings.reduce_scatter_to_sequence_parallel_region(h)
    else:
        h = mappings.reduce_from_tensor_model_parallel_region(h)
    return torch.matmul(h, layer.lora_B[p].t()) * st.scaling


def _wrap_forward(layer: torch.nn.Module, column: bool) -> None:
    base_forward = layer.forward

    def forward(input_: torch.Tensor, *args: Any, **kwargs: Any):
        out, bias = base_forward(input_, *args, **kwargs)
        st: _Adapted = layer._lora
        if not st.enabled:
            return out, bias
        if column and getattr(layer, "gather_output", False):
            raise NotImplementedError("LoRA on a column-parallel linear that gathers its output")
        delta = _column_delta(layer, input_) if column else _row_delta(layer, input_)
        return out + delta.to(out.dtype), bias

    layer.forward = forward


def _wrap_sharded_state_dict(layer: torch.nn.Module, column: bool) -> None:
    """The adapters' sharding in dist checkpoints: B by rows on a column-parallel linear, A by columns on a
    row-parallel one (the base linear's own method would save them as TP-replicated)."""
    axes = {"weight": 0, "bias": 0} if column else {"weight": 1}
    for p in layer._lora.parts:
        axes[f"lora_B.{p}" if column else f"lora_A.{p}"] = 0 if column else 1

    def sharded_state_dict(prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None):
        state = layer.state_dict(prefix="", keep_vars=True)
        dp_cp = metadata["dp_cp_group"] if metadata and "dp_cp_group" in metadata else None
        return make_sharded_tensors_for_checkpoint(
            state, prefix, axes, sharded_offsets, tp_group=layer.tp_group,
            dp_cp_group=dp_cp if dp_cp is not None else parallel_state.get_data_parallel_group(with_context_parallel=True),
        )  # fmt: skip

    layer.sharded_state_dict = sharded_state_dict


def _local_layers(model: torch.nn.Module) -> Iterator[tuple[int, torch.nn.Module]]:
    decoder = getattr(model, "decoder", None)
    for layer in getattr(decoder, "layers", ()):
        yield layer.layer_number - 1, layer


def adapt(model: torch.nn.Module, plan: LoraPlan, arch: ModelArch, seed: int) -> int:
    """Add the plan's adapters to this rank's layers of a bare GPTModel and freeze everything else; returns
    the number of linears adapted here. Call before Float16Module / DDP wrap it (they see the adapters as
    the only trainable parameters)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    for p in model.parameters():
        p.requires_grad_(False)
    count = 0
    for index, layer in _local_layers(model):
        for mod in (m for m in plan.modules if m.layer == index):
            parent = getattr(layer, MEGATRON_PARENT[mod.linear])
            linear = getattr(parent, mod.linear)
            column = mod.linear in COLUMN_PARALLEL
            expected = ColumnParallelLinear if column else RowParallelLinear
            if not isinstance(linear, expected):
                raise NotImplementedError(
                    f"actor.lora: {mod.megatron_path} is a {type(linear).__name__}, not megatron-core's "
                    f"{expected.__name__} (rule lora: use model.attention_backend sdpa)"
                )
            device = linear.weight.device
            a_dict, b_dict = torch.nn.ParameterDict(), torch.nn.ParameterDict()
            for part in mod.parts:
                fan_in, fan_out = part_dims(arch, part)
                a = _initial_a(plan, fan_in, _init_seed(seed, mod.layer, mod.linear, part))
                if column:
                    b = torch.zeros(fan_out // tp, plan.rank)
                else:
                    a = a.chunk(tp, dim=1)[tp_rank]
                    b = torch.zeros(fan_out, plan.rank)
                pa = torch.nn.Parameter(a.to(device=device, dtype=linear.weight.dtype).contiguous())
                pb = torch.nn.Parameter(b.to(device=device, dtype=linear.weight.dtype))
                set_tensor_model_parallel_attributes(pa, not column, 1, 1)
                set_tensor_model_parallel_attributes(pb, column, 0, 1)
                if not column and linear.sequence_parallel:
                    # B multiplies this rank's sequence shard only: megatron sums its gradient over TP.
                    pb.sequence_parallel = True
                a_dict[part], b_dict[part] = pa, pb
            linear.lora_A, linear.lora_B = a_dict, b_dict
            linear._lora = _Adapted(mod, plan, arch, column)
            _wrap_forward(linear, column)
            _wrap_sharded_state_dict(linear, column)
            count += 1
    return count


def adapted_linears(chunks: Sequence[torch.nn.Module]) -> Iterator[tuple[int, str, torch.nn.Module]]:
    """(global layer, megatron linear name, module) of every adapted linear of these chunks."""
    for chunk in chunks:
        # The GPTModel inside the DDP / Float16Module wrappers (not rltrain.megatron.model.unwrap: that module
        # imports this one to adapt the models it builds).
        gpt = next(m for m in chunk.modules() if isinstance(m, GPTModel))
        for index, layer in _local_layers(gpt):
            for linear_name, parent_name in MEGATRON_PARENT.items():
                linear = getattr(getattr(layer, parent_name, None), linear_name, None)
                if linear is not None and hasattr(linear, "_lora"):
                    yield index, linear_name, linear


@contextlib.contextmanager
def adapters_disabled(chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Run the base model: every adapter off inside the block (the reference policy of a LoRA run)."""
    layers = [m for _, _, m in adapted_linears(chunks)]
    before = [m._lora.enabled for m in layers]
    for m in layers:
        m._lora.enabled = False
    try:
        yield
    finally:
        for m, on in zip(layers, before, strict=True):
            m._lora.enabled = on


def delta_weight(linear: torch.nn.Module, arch: ModelArch) -> torch.Tensor:
    """This rank's (alpha / r) B A in the layout of the linear's local weight (fp32)."""
    st: _Adapted = linear._lora
    per = {p: st.scaling * (linear.lora_B[p].float() @ linear.lora_A[p].float()) for p in st.parts}
    w = linear.weight
    if not st.column:
        return per[st.parts[0]]
    rows_in = w.shape[1]
    if st.qkv is not None:
        groups, qw, d = st.qkv
        widths = {"q_proj": qw, "k_proj": d, "v_proj": d}
        blocks = [
            per[p].reshape(groups, widths[p], rows_in)
            if p in per
            else torch.zeros(groups, widths[p], rows_in, device=w.device)
            for p in ("q_proj", "k_proj", "v_proj")
        ]
        return torch.cat(blocks, 1).reshape(w.shape)
    half = w.shape[0] // 2
    return torch.cat(
        [per.get(p, torch.zeros(half, rows_in, device=w.device)) for p in ("gate_proj", "up_proj")]
    )


@contextlib.contextmanager
@torch.no_grad()
def merged_weights(chunks: Sequence[torch.nn.Module], arch: ModelArch) -> Iterator[None]:
    """Fold every adapter into its base weight (W + (alpha / r) B A, adapters off) inside the block; the
    base weights are restored bit-exactly afterwards (from a copy, not by subtracting: W + d - d is not W in
    16 bits). The copy is kept in host memory, so the device holds no second copy of the adapted weights."""
    layers = [m for _, _, m in adapted_linears(chunks)]
    enabled = [m._lora.enabled for m in layers]
    saved = [m.weight.detach().to("cpu", copy=True) for m in layers]
    try:
        for m in layers:
            if m._lora.enabled:
                m.weight.data.copy_((m.weight.float() + delta_weight(m, arch)).to(m.weight.dtype))
            m._lora.enabled = False
        yield
    finally:
        for m, w, on in zip(layers, saved, enabled, strict=True):
            m.weight.data.copy_(w.to(m.weight.device))
            m._lora.enabled = on


def generation_weights(engine: Any) -> contextlib.AbstractContextManager[None]:
    """The weights the embedded rollout engine samples with: a LoRA engine's adapters merged into its base
    weights for the call (`merged_weights`; with adapters disabled, the base as is), anything else as is.

    Merged rather than applied on the fly because it measured faster and is the same function (CPU, fp32,
    greedy, 64 rows x 32 new tokens, rank 8: 4 x 64 model 16.1k tok/s on the fly vs 23.9k merged incl.
    the merge and restore; 4 x 256 4.3k vs 5.3k; identical tokens): decode runs the per-token linears
    hundreds of times per call and the adapters add two small matmuls to each."""
    if getattr(engine, "lora", None) is None:
        return contextlib.nullcontext()
    return merged_weights(engine.chunks, engine.arch)
