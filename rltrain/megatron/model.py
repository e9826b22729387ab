"""Model construction for the megatron engine: TransformerConfig, GPTModel chunks, DDP, optimizer, lr schedule.

Builds the dense decoder families of rlconf.model_spec (llama, mistral, qwen2, qwen3: RMSNorm, SwiGLU, RoPE
with optional linear / llama3 scaling, GQA, optional qkv bias, optional per-head QK-norm, tied embeddings)
from `ModelArch` with megatron-core's own modules, the mixtures of experts (softmax routing; DeepSeek's sigmoid
group-limited routing) and deepseek_v3's multi-head latent attention (rltrain.megatron.mla); YaRN on
non-MLA models is refused (`EngineSupportError`). Core attention is chosen by `model.attention_backend`:
`SdpaAttention` (below: torch `scaled_dot_product_attention`, fused kernels; 34k vs 21k tok/s for megatron's
unfused local attention on H200), megatron's local `DotProductAttention`, or the Transformer Engine spec.
Pipeline stages (and virtual stages) become a list of model chunks, each wrapped in megatron DDP; the
optimizer is megatron's (`get_megatron_optimizer`); the lr of each step is the plan's (`PlanLrSchedule`).
A critic is the same trunk with `ValueHead` replacing the vocabulary projection.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from rlconf.arch import ModelArch
from rlconf.lora import LoraPlan
from rlconf.model_spec import is_moe_layer
from rlconf.plan import DdpSettings, EngineSettings, LrRow, OptimPlan, RoleLayout
from rltrain import device as devices
from rltrain.megatron import context_parallel as cp
from rltrain.megatron.fused import (  # noqa: F401  (re-exported: the engine's kernels were defined here)
    FusedKernelsError,
    bench_off,
    check_fused_kernels,
    compiled_rope,
    fused_rotate,
    rope_bshd,
    rotate,
    use_compiled_rope,
    use_unbacked_swiglu,
)
from rltrain.megatron.multi_tensor import use_foreach_multi_tensor
from rltrain.megatron.triton_rms_norm import TritonRMSNorm

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def te_available() -> bool:
    """Whether Transformer Engine is importable (decides `attention_backend: auto`)."""
    return importlib.util.find_spec("transformer_engine") is not None


def padded_vocab_size(vocab_size: int, tp_size: int, multiple: int = 128) -> int:
    """Vocabulary padded to a multiple of `multiple` x TP (megatron's rule), so every TP shard is equal."""
    step = multiple * tp_size
    return ((vocab_size + step - 1) // step) * step


# ------------------------------------------------------------------------------------ core attention
class SdpaAttention(DotProductAttention):
    """megatron core attention computed by `torch.nn.functional.scaled_dot_product_attention`.

    Same constructor and partition bookkeeping as megatron's `DotProductAttention` (so specs, TP and
    sharded state dicts are unchanged); only the math differs: one fused SDPA call with native GQA instead
    of baddbmm + softmax + bmm. Inputs are megatron's [s, b, heads, dim]; the mask, when given, follows
    megatron's convention (True = masked out); without one the attention is causal, aligned bottom-right
    when the query is shorter than the keys (KV-cache decode: the queries are the *last* positions), and
    absent when megatron's inference path says `no_mask` (decode of one token sees every cached key).
    With context parallel (CP group > 1) the queries are this rank's chunks of the sequence and attention
    runs through `context_parallel.cp_attention`.
    """

    def __init__(self, config: TransformerConfig, *args: Any, **kwargs: Any) -> None:
        # megatron's DotProductAttention refuses CP > 1 (its math cannot split sequences); ours can, and
        # nothing else its constructor builds depends on the CP size.
        super().__init__(dataclasses.replace(config, context_parallel_size=1), *args, **kwargs)
        self.config = config

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        assert attention_bias is None, "SdpaAttention does not support attention bias"
        if packed_seq_params is not None:
            return self._packed_forward(query, key, value, packed_seq_params)
        sq, b, sk = query.shape[0], query.shape[1], key.shape[0]
        # [s, b, h, d] -> [b, h, s, d]
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        dropout_p = self.config.attention_dropout if self.training else 0.0
        if cp.cp_world_size() > 1:
            # Context parallel: the queries are this rank's two chunks; keys come from every CP rank.
            assert attention_mask is None, "context parallel attention takes no attention mask"
            ctx = cp.cp_attention(
                q, k, v, self.softmax_scale,
                self.num_attention_heads_per_partition != self.num_query_groups_per_partition, dropout_p,
            )  # fmt: skip
            return ctx.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
        # megatron's boolean mask (True = masked) or, from the decode step, SDPA's additive one as is.
        if attention_mask is None or attention_mask.is_floating_point():
            mask = attention_mask
        else:
            mask = ~attention_mask
        causal = mask is None and getattr(attn_mask_type, "name", "causal") != "no_mask"
        if causal and sq != sk:
            # SDPA's is_causal aligns the mask top-left, wrong when sq < sk: query i sits at key sk - sq + i.
            mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
            causal = False
        kwargs: dict[str, Any] = {
            "attn_mask": mask,
            "dropout_p": dropout_p,
            "is_causal": causal,
            "scale": self.softmax_scale,
            "enable_gqa": self.num_attention_heads_per_partition != self.num_query_groups_per_partition,
        }
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            # Attention dropout differs per TP rank (heads are sharded), as in megatron's local attention.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                ctx = F.scaled_dot_product_attention(q, k, v, **kwargs)
        else:
            ctx = F.scaled_dot_product_attention(q, k, v, **kwargs)
        # [b, h, s, d] -> [s, b, h*d]
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _packed_forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Any
    ) -> torch.Tensor:
        """Packed rows (megatron's THD layout: q [T, heads, d], `params.cu_seqlens_q` where each row starts):
        causal attention within each row (`packing.packed_attention`); returns [T, heads * d]."""
        from rltrain.megatron import packing

        assert params.qkv_format == "thd", f"packed layout {params.qkv_format!r}: SdpaAttention runs thd"
        assert cp.cp_world_size() == 1, "packed sequences with context parallel are refused by the plan"
        dropout_p = self.config.attention_dropout if self.training else 0.0
        t = query.shape[0]

        def attend() -> torch.Tensor:
            return packing.packed_attention(query, key, value, params, self.softmax_scale, dropout_p)

        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                ctx = attend()
        else:
            ctx = attend()
        return ctx.reshape(t, self.hidden_size_per_partition)


class TorchRMSNorm:
    """torch RMSNorm usable with sequence parallel (megatron's WrappedTorchNorm refuses it).

    With sequence parallel each TP rank normalises its own slice of the sequence, so the norm weight's
    gradient is partial per rank; marking the parameter `sequence_parallel` makes megatron's
    finalize_model_grads all-reduce it over the TP group, exactly as it does for TE/Apex norms.
    Engines with fused kernels (`config.bias_activation_fusion`, the plan's `fused_kernels`) get a
    `triton_rms_norm.TritonRMSNorm`: the same module, its forward and backward Triton kernels on CUDA.
    """

    def __new__(
        cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any
    ) -> torch.nn.Module:
        norm_type = TritonRMSNorm if config.bias_activation_fusion else torch.nn.RMSNorm
        norm = norm_type(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def layer_spec(
    backend: str,
    qk_layernorm: bool = False,
    num_experts: int | None = None,
    grouped_gemm: bool = False,
    multi_latent_attention: bool = False,
) -> ModuleSpec:
    """Transformer layer spec for `model.attention_backend` (auto: te when installed, else sdpa), with an
    RMSNorm over each query / key head when `qk_layernorm` (Qwen3) and routed experts when `num_experts`.

    MoE layers use megatron's SequentialMLP (one ColumnParallelLinear / RowParallelLinear pair per local
    expert): its GroupedMLP needs the CUDA-only `grouped_gemm` package and TEGroupedMLP Transformer Engine,
    neither of which installs here; with `grouped_gemm` (`model.moe_grouped_gemm`) its subclass
    `moe_experts.GroupedGemmExperts` computes them with torch's grouped GEMM instead, and `build` makes the
    layer a `moe_decode.GroupedMoELayer` (no token dispatcher host syncs where it applies).

    `multi_latent_attention` (deepseek_v3): megatron's MLASelfAttention from its local spec, core attention
    `mla.MlaSdpaAttention` whatever the backend (megatron's local DotProductAttention takes no separate
    key / value widths, and no Transformer Engine spec is built for it here), its q / kv latent norms
    `TorchRMSNorm`."""
    if multi_latent_attention:
        from rltrain.megatron.mla import mla_layer_spec

        spec = mla_layer_spec(num_experts)
        attention = spec.submodules.self_attention.submodules
        attention.q_layernorm = TorchRMSNorm
        attention.kv_layernorm = TorchRMSNorm
        return _torch_norms_and_experts(spec, num_experts, grouped_gemm)
    if backend == "te" or (backend == "auto" and te_available()):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, qk_layernorm=qk_layernorm)
    with warnings.catch_warnings():
        # "Apex is not installed. Falling back to Torch Norm": expected, torch RMSNorm is what we want.
        warnings.simplefilter("ignore")
        spec = get_gpt_layer_local_spec(
            num_experts=num_experts,
            moe_grouped_gemm=False,
            normalization="RMSNorm",
            qk_layernorm=qk_layernorm,
        )
    attention = spec.submodules.self_attention.submodules
    if backend in ("sdpa", "auto"):
        # get_gpt_layer_local_spec builds fresh spec objects per call, so editing in place is safe.
        attention.core_attention = SdpaAttention
    if qk_layernorm:
        attention.q_layernorm = TorchRMSNorm
        attention.k_layernorm = TorchRMSNorm
    return _torch_norms_and_experts(spec, num_experts, grouped_gemm)


def _torch_norms_and_experts(spec: Any, num_experts: int | None, grouped_gemm: bool) -> Any:
    """A local layer spec's layer norms as torch RMSNorm, and its routed experts as one grouped GEMM when
    `grouped_gemm` (the part the MLA and the GQA specs share)."""
    spec.submodules.input_layernorm = TorchRMSNorm
    spec.submodules.pre_mlp_layernorm = TorchRMSNorm
    if num_experts is not None and grouped_gemm:
        from rltrain.megatron.moe_experts import GroupedGemmExperts

        spec.submodules.mlp.submodules.experts.module = GroupedGemmExperts
    return spec


def layer_specs(backend: str, arch: ModelArch, grouped_gemm: bool = False) -> list[ModuleSpec]:
    """One layer spec per global layer: routed experts where `is_moe_layer`, a dense MLP elsewhere."""
    mla = arch.multi_latent_attention
    dense = layer_spec(backend, arch.qk_layernorm, multi_latent_attention=mla)
    if arch.num_moe_experts is None:
        return [dense] * arch.num_layers
    moe = layer_spec(backend, arch.qk_layernorm, arch.num_moe_experts, grouped_gemm, mla)
    return [moe if is_moe_layer(arch, i) else dense for i in range(arch.num_layers)]


class EngineSupportError(RuntimeError):
    """An architecture the plan accepts but this engine does not build yet (rlconf.validate's
    engine-support rule reports the same before a run starts)."""


def rope_inv_freq(arch: ModelArch, device: torch.device | str = "cpu") -> torch.Tensor:
    """RoPE inverse frequencies with the architecture's scaling, computed as transformers does.

    megatron-core 0.16's RotaryEmbedding implements llama3 scaling with low_freq_factor, high_freq_factor and
    the original context hard-coded (1, 4, 8192) and linear scaling by rescaling positions (a different
    rounding); overwriting `inv_freq` with transformers' formula keeps log-probs equal to HF's for every
    config.json value.
    """
    dim = arch.kv_channels or arch.hidden_size // arch.num_attention_heads
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    inv_freq = 1.0 / (arch.rotary_base**exponent)
    rs = arch.rope_scaling
    if rs.type == "linear":
        return inv_freq / rs.factor
    if rs.type == "llama3":
        old_context = rs.original_max_position_embeddings or arch.max_position_embeddings
        low_wavelen = old_context / rs.low_freq_factor
        high_wavelen = old_context / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (old_context / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if rs.type != "none":
        raise EngineSupportError(f"rope scaling {rs.type!r} is not built in the megatron engine yet")
    return inv_freq


def block_spec(
    specs: Sequence[ModuleSpec], config: TransformerConfig, vp_stage: int | None
) -> TransformerBlockSubmodules:
    """The decoder block: this stage's layers (picked by global layer number, so dense and MoE layers land
    where config.json puts them) plus the final norm (TorchRMSNorm, or TE's norm with the TE spec)."""
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    mine = list(specs[offset : offset + num_layers])
    if mine and mine[0].submodules.input_layernorm is not TorchRMSNorm:
        from megatron.core.extensions.transformer_engine import TENorm

        return TransformerBlockSubmodules(layer_specs=mine, layer_norm=TENorm)
    return TransformerBlockSubmodules(layer_specs=mine, layer_norm=TorchRMSNorm)


# ------------------------------------------------------------------------------------ transformer config
def transformer_config(
    arch: ModelArch, layout: RoleLayout, settings: EngineSettings, device: str, fused: bool = False
) -> TransformerConfig:
    """megatron TransformerConfig for a Qwen2/Llama-style decoder and one role's parallel layout, from the
    role's plan alone: the architecture, the layout (parallel sizes, sequence parallel) and the resolved
    engine settings.

    `fused` (the plan's `EnginePlan.fused_kernels`) turns on two of megatron's fusions, served by
    torch.compile'd functions: SwiGLU (megatron.core.jit's, whose backward keeps only the fc1 output; one
    kernel instead of a strided silu and a multiply, 0.73 s of a 5.2 s 1.5B log-prob pass on an H200,
    docs/benchmarks.md) and RoPE (`use_compiled_rope`; ~11 small kernels per query and key per layer); on CUDA
    both as Triton kernels (`triton_swiglu`, `triton_rope`)."""
    mla = arch.multi_latent_attention
    ts = settings.transformer
    dtype = _DTYPES[ts.params_dtype]
    if fused:
        use_unbacked_swiglu(device, dtype)
    if fused and not mla:  # MLA's RoPE stays megatron's unfused one (it de-interleaves the rope dims)
        use_compiled_rope(device, dtype)
    rc = ts.recompute
    recompute: dict[str, Any] = {}
    if rc.granularity is not None:
        recompute["recompute_granularity"] = rc.granularity
        if rc.granularity == "full":
            recompute["recompute_method"] = rc.method
            recompute["recompute_num_layers"] = rc.num_layers
        else:
            recompute["recompute_modules"] = list(rc.modules)
    attention: dict[str, Any] = {
        "num_query_groups": arch.num_query_groups,
        "kv_channels": arch.kv_channels,
        "add_qkv_bias": arch.add_qkv_bias,
        "qk_layernorm": arch.qk_layernorm,
    }
    config_class = TransformerConfig
    if mla:
        from rltrain.megatron.mla import mla_config_fields

        config_class, attention = MLATransformerConfig, mla_config_fields(arch)
    return config_class(
        **moe_config(arch, settings),
        **attention,
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        layernorm_epsilon=arch.norm_epsilon,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        attention_dropout=ts.attention_dropout,
        hidden_dropout=ts.hidden_dropout,
        init_method_std=ts.init_method_std,
        # The other fusions need apex / TE kernels; the unfused paths are the portable ones.
        bias_activation_fusion=fused,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=fused and not mla,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not devices.is_accelerator(device),
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        num_layers_in_first_pipeline_stage=ts.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=ts.num_layers_in_last_pipeline_stage,
        account_for_embedding_in_pipeline_split=ts.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=ts.account_for_loss_in_pipeline_split,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        # The plan's effective value: off at TP=1 (megatron rejects it there).
        sequence_parallel=layout.sequence_parallel,
        # RL batches change length every step: let the pipeline exchange shapes per micro-batch.
        variable_seq_lengths=True,
        # gloo matches point-to-point messages between two ranks in posting order. megatron's batched p2p
        # posts (send_prev, recv_prev, send_next, recv_next) on both ranks, so with PP=2 and interleaving
        # (traffic both ways between the same pair) activations and gradients arrive swapped. Its
        # unbatched path orders even/odd ranks to match; use it on cpu, keep megatron's default on GPU.
        batch_p2p_comm=devices.dist_backend(device) != "gloo",
        # megatron checks it on dense models too: allgather (its default) refuses variable_seq_lengths.
        moe_token_dispatcher_type="alltoall",
        **recompute,
    )


def define_missing_te_names() -> None:
    """Give megatron-core 0.16.1's moe_utils the `te_general_gemm = None` it expects without Transformer
    Engine.

    moe_utils imports `te_general_gemm` (and the fused permute / top-k kernels) only when TE imports, but its
    router linear reads `te_general_gemm is not None` unconditionally, so every MoE forward without TE raises
    NameError. With the name defined as None it takes its own torch.mm path; the fused kernels stay unused
    because `moe_config` switches their flags off. Idempotent, and a no-op where TE is installed.
    """
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def moe_config(arch: ModelArch, settings: EngineSettings) -> dict[str, Any]:
    """TransformerConfig's MoE fields for `arch` (none for a dense model).

    Routing as transformers computes it for these families: softmax over all experts, the top k, then
    renormalised over those k when `moe_norm_topk_prob` (mixtral always). megatron's softmax router does
    exactly that with `moe_router_pre_softmax=False` (top k of the logits, softmax over the k: the same
    numbers as a softmax renormalised over the k) and, with `pre_softmax=True`, keeps the unnormalised
    probabilities. The load-balancing loss is megatron's `aux_loss` (switch-transformer form, as
    transformers' load_balancing_loss_func) with the plan's coefficient (`MoeSettings.aux_loss_coeff`:
    config.json's router_aux_loss_coef unless overridden); the z-loss is off unless set.
    The dispatcher is alltoall: megatron's allgather dispatcher refuses `variable_seq_lengths` (RL batches
    change length every step), and gloo runs the uneven all_to_all_single it needs (measured: rank 0 sends
    [2, 3] rows, rank 1 [4, 1], each receives its rows in order).
    """
    moe = settings.moe
    if arch.num_moe_experts is None or moe is None:
        return {}
    from rltrain.megatron.mla import deepseek_routing

    softmax_routing = {
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not arch.moe_norm_topk_prob,
    }
    freq: int | list[int] = 1
    if arch.moe_dense_layers:
        # A list marks the layers non-homogeneous for dist checkpointing (sharded keys per layer type).
        freq = [int(is_moe_layer(arch, i)) for i in range(arch.num_layers)]
    return {
        **(deepseek_routing(arch) if arch.moe_router_score_function == "sigmoid" else softmax_routing),
        "num_moe_experts": arch.num_moe_experts,
        "moe_router_topk": arch.moe_router_topk,
        "moe_ffn_hidden_size": moe.ffn_hidden_size,
        "moe_shared_expert_intermediate_size": arch.moe_shared_expert_intermediate_size,
        "moe_shared_expert_gate": arch.moe_shared_expert_gate,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": moe.aux_loss_coeff,
        "moe_z_loss_coeff": moe.z_loss_coeff,
        "moe_layer_freq": freq,
        "moe_grouped_gemm": False,
        # No token is dropped: transformers' MoE blocks have no capacity limit either.
        "moe_expert_capacity_factor": None,
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
        **({"moe_router_dtype": moe.router_dtype} if moe.router_dtype is not None else {}),
    }


# ------------------------------------------------------------------------------------ MoE metrics
def moe_padding_mask_supported(config: TransformerConfig) -> bool:
    """Whether the engine passes GPTModel a padding mask for MoE routing: a MoE model, except with sequence
    parallel across pipeline stages (megatron 0.16.1 splits the mask over the sequence-parallel ranks on the
    first stage only; later stages would get the whole mask). Without it, padding columns take part in the
    load-balancing loss as tokens."""
    return config.num_moe_experts is not None and not (
        config.sequence_parallel and config.pipeline_model_parallel_size > 1
    )


def moe_padding_mask(tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[b, L] True on the padding columns of left-aligned `tokens` (rltrain.megatron.engine.align_batch puts
    each row's attention_mask.sum() valid tokens first): megatron's router leaves them out of the
    load-balancing loss and its token counts, as transformers' load_balancing_loss_func does with the
    attention mask."""
    valid = attention_mask.sum(-1).to(tokens.device)
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0) >= valid.unsqueeze(1)


class MoeRoutingStats:
    """Routing metrics of one update of a mixture-of-experts model (context manager around the update).

    `actor/moe_aux_loss`: megatron's load-balancing loss (switch-transformer form, before its coefficient) as
    its router records it, averaged over MoE layers, micro-batches and ranks; megatron computes it only while
    training with a coefficient > 0, so it is absent with `moe_aux_loss_coeff: 0`.
    `actor/moe_expert_load_max`: the busiest expert's share of the routed tokens over the mean share
    (tokens routed to each expert over the whole update, summed over ranks), averaged over MoE layers: 1.0
    is perfect balance, num_experts / topk means every token went to the same experts.
    Each routing counts once: the forward a recomputed layer runs without autograd is left out.
    Collective on exit: every rank of the engine calls it. A dense model yields no metrics.
    """

    def __init__(self, chunks: Sequence[torch.nn.Module], device: torch.device) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.device = device
        self.routers = [m for c in chunks for m in unwrap(c).modules() if isinstance(m, TopKRouter)]
        self._router_ids = {id(r) for r in self.routers}
        self.counts: dict[int, torch.Tensor] = {}
        self.calls = 0
        self.handles: list[Any] = []
        self.metrics: dict[str, float] = {}

    def __enter__(self) -> MoeRoutingStats:
        from megatron.core.transformer.moe.moe_utils import (
            clear_aux_losses_tracker,
            get_moe_layer_wise_logging_tracker,
        )

        if not self.routers:
            return self
        clear_aux_losses_tracker()
        # megatron keeps a tracker entry (zeroed) once any engine of the process recorded the loss: drop it,
        # so that an entry on exit means this update recorded it (an engine trained without the loss after
        # one with it would otherwise report 0).
        get_moe_layer_wise_logging_tracker().pop("load_balancing_loss", None)
        for router in self.routers:
            self.handles.append(router.register_forward_hook(self._record))
        # Routers that moe_decode.train_route stands in for (their forward, so its hooks, never runs).
        from rltrain.megatron.moe_decode import ROUTE_OBSERVERS

        ROUTE_OBSERVERS.append(self._record_index)
        return self

    def _record(
        self, router: torch.nn.Module, inputs: Any, output: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        routing_map = output[1]  # [tokens, experts] bool: which experts each token goes to
        padding = inputs[1] if len(inputs) > 1 else None  # [s, b] True on padding (MoELayer.route's order)
        if padding is not None:
            # Padding columns are routed too but are not tokens: leave them out, as the load-balancing loss
            # does (context parallel pads rows to a multiple of 2 x CP, so counting them would make the
            # load depend on CP).
            routing_map = routing_map & ~padding.reshape(-1, 1).to(routing_map.device)
        # Summed on the device, read back once on exit: a host read here would wait for every MoE layer's
        # forward in turn (one sync per layer per micro-batch), so the host could never run ahead of the
        # device.
        self._add(router, routing_map.sum(0, dtype=torch.float64).detach())

    def _record_index(
        self, router: torch.nn.Module, index: torch.Tensor, padding: torch.Tensor | None
    ) -> None:
        """`_record` for a routing given as top-k indices [T, k] (padding [T] True on padding)."""
        from rltrain.megatron.moe_decode import tokens_per_expert

        if id(router) not in self._router_ids:
            return  # another engine's
        self._add(router, tokens_per_expert(index, router.num_experts, padding, torch.float64))

    def _add(self, router: torch.nn.Module, tokens: torch.Tensor) -> None:
        if not torch.is_grad_enabled():
            # The first forward of a recomputed layer (full or MoE recompute runs it without autograd, then
            # again in the backward): its routing is counted once, where megatron records its loss.
            return
        layer = router.layer_number
        if layer in self.counts:
            self.counts[layer].add_(tokens)
        else:
            self.counts[layer] = tokens
        # megatron's per-rank load-balancing loss is a part of the TP x CP group's (their values add up):
        # count each group's router calls once.
        if (
            parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_context_parallel_rank() == 0
        ):
            self.calls += 1

    def __exit__(self, *exc: object) -> None:
        from megatron.core.transformer.moe.moe_utils import (
            clear_aux_losses_tracker,
            get_moe_layer_wise_logging_tracker,
        )

        for handle in self.handles:
            handle.remove()
        from rltrain.megatron.moe_decode import ROUTE_OBSERVERS

        if self._record_index in ROUTE_OBSERVERS:
            ROUTE_OBSERVERS.remove(self._record_index)
        if not self.routers or exc[0] is not None:
            return
        config = self.routers[0].config
        experts = config.num_moe_experts
        # [layer, expert] token counts, [aux loss sum, router calls]: summed over every rank (pipeline stages
        # hold different layers; DP / EP ranks route their own tokens; TP ranks that route the same tokens
        # scale a layer's counts alike, which the ratio below cancels).
        counts = torch.zeros(config.num_layers, experts, dtype=torch.float64, device=self.device)
        for layer, c in self.counts.items():
            counts[layer - 1] = c
        tracker = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        aux = tracker["values"].sum().to(counts) if tracker is not None else counts.new_zeros(())
        sums = torch.stack(
            [aux, counts.new_tensor(float(self.calls)), counts.new_tensor(float(tracker is not None))]
        )
        packed = torch.cat([counts.flatten(), sums])
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(packed)
        packed = packed.cpu()  # the one host read of the update's routing
        counts, sums = packed[: counts.numel()].view_as(counts), packed[counts.numel() :]
        clear_aux_losses_tracker()
        routed = counts[counts.sum(1) > 0]
        if len(routed):
            load = routed.max(1).values / routed.mean(1)
            self.metrics["actor/moe_expert_load_max"] = float(load.mean())
        if sums[2] > 0 and sums[1] > 0:
            self.metrics["actor/moe_aux_loss"] = float(sums[0] / sums[1])


# ------------------------------------------------------------------------------------ value head
class ValueHead(torch.nn.Module):
    """Scalar value projection replacing GPTModel's vocabulary projection (`output_layer`) for a critic.

    Replicated on every TP rank: it sees the full hidden state (gathered from sequence-parallel shards
    without a gradient reduce, since every rank computes the same loss) and returns [s, b, 1].
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.sequence_parallel = config.sequence_parallel
        self.weight = torch.nn.Parameter(torch.zeros(1, config.hidden_size, dtype=config.params_dtype))
        torch.nn.init.normal_(self.weight, std=config.init_method_std)

    def forward(
        self,
        hidden_states: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: Any = None,
    ) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False
            )
        return F.linear(hidden_states, self.weight), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> Any:
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(
            self.state_dict(keep_vars=True), prefix, {}, sharded_offsets
        )


# ------------------------------------------------------------------------------------ model chunks
def build_model_chunks(
    arch: ModelArch,
    layout: RoleLayout,
    settings: EngineSettings,
    device: str,
    value_head: bool = False,
    wrap_ddp: bool = True,
    fused: bool = False,
    lora: LoraPlan | None = None,
) -> list[torch.nn.Module]:
    """This rank's model chunks (one per virtual pipeline stage), optionally wrapped in megatron DDP; with
    `fused` (the plan's fused kernels) and DDP, the trained linears accumulate their weight gradients in
    their products (`wgrad.use_fused_wgrad`).

    Each chunk is `DDP(Float16Module?(GPTModel))`; the bare GPTModel (for weights and sharded state dicts)
    is `unwrap(chunk)`. A critic (`value_head=True`) has no tied output layer: its last stage ends in
    `ValueHead`.
    """
    # Before building anything: refuses scalings it cannot compute. MLA builds its own rotary embedding
    # (megatron's RotaryEmbedding / YarnRotaryEmbedding over the rope dims, inside each attention module).
    inv_freq = None if arch.multi_latent_attention else rope_inv_freq(arch)
    if fused:
        check_fused_kernels(device, _DTYPES[settings.transformer.params_dtype])
    if arch.num_moe_experts is not None:
        define_missing_te_names()
    config = transformer_config(arch, layout, settings, device, fused)
    if layout.cp > 1:
        cp.use_portable_rope_split()
    grouped = settings.transformer.moe_grouped_gemm
    specs = layer_specs(settings.transformer.attention_backend, arch, grouped)
    vpp = layout.vpp
    vocab = layout.padded_vocab_size
    chunks: list[torch.nn.Module] = []
    for i in range(vpp or 1):
        vp_stage = i if vpp is not None else None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        model = GPTModel(
            config=config,
            transformer_layer_spec=block_spec(specs, config, vp_stage),
            vocab_size=vocab,
            max_sequence_length=arch.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=arch.share_embeddings_and_output_weights and not value_head,
            position_embedding_type="rope",
            rotary_base=arch.rotary_base,
            vp_stage=vp_stage,
        )
        if inv_freq is not None:
            # The rotary module caches its table per length on first use; set HF's frequencies before that.
            model.rotary_pos_emb.inv_freq = inv_freq.clone()
        if value_head and post:
            model.output_layer = ValueHead(config)
        elif post and not config.sequence_parallel:
            batch_first_logits(model.output_layer)
        mark_expert_params(model)
        if arch.moe_router_enable_expert_bias:
            from rltrain.megatron.mla import freeze_expert_bias

            freeze_expert_bias(model)
        if grouped:
            from rltrain.megatron.moe_decode import GroupedMoELayer, is_moe

            for layer in model.decoder.layers:
                if is_moe(layer.mlp):
                    # A subclass with only another forward, set on the built module: megatron's layer hands
                    # its process groups only to a spec naming MoELayer itself.
                    layer.mlp.__class__ = GroupedMoELayer
        if lora is not None:  # before Float16Module and DDP: the adapters are the only trainable parameters
            from rltrain.megatron.lora import adapt

            adapt(model, lora, arch, settings.seed)
        if devices.is_accelerator(device):
            model.to(devices.torch_device(device))
        if config.bf16 or config.fp16:
            model = Float16Module(config, model)
        chunks.append(model)
    if wrap_ddp:
        ddp_cfg = ddp_config(settings.ddp)
        chunks = [
            DistributedDataParallel(config=config, ddp_config=ddp_cfg, module=m, disable_bucketing=i > 0)
            for i, m in enumerate(chunks)
        ]
        for chunk in chunks:  # whether DDP's hooks need each gradient (moe_experts._hooks_needed)
            for param in chunk.parameters():
                param.ddp_hook_needed = ddp_cfg.overlap_grad_reduce
        if fused and not bench_off("wgrad"):  # megatron's gradient accumulation fusion, once DDP gave the
            from rltrain.megatron.wgrad import use_fused_wgrad  # weights their main_grads

            use_fused_wgrad(chunks)
    return chunks


def batch_first_logits(layer: torch.nn.Module) -> None:
    """Have the output layer lay its [s, b, V/tp] logits out batch-first in memory (a transposed view of a
    [b, s, V/tp] tensor), so that GPTModel's closing `logits.transpose(0, 1).contiguous()` copies nothing.

    Why: that copy of the largest tensor of a step (3.5 GiB for 12k tokens of a 152k vocabulary) took
    0.23 s of every 1.5B log-prob pass on an H200, and as much again in the update's forward and backward
    (docs/benchmarks.md). Transposing the layer's input instead moves V / h = 100x fewer bytes. Not with
    sequence parallel, whose output layer gathers the sequence dimension of its input. Same math: each
    logit is the same dot product."""
    column_forward = layer.forward

    def forward(
        input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: bool | None = None
    ):
        out, bias = column_forward(
            input_.transpose(0, 1).contiguous(), weight=weight, runtime_gather_output=runtime_gather_output
        )
        return out.transpose(0, 1), bias

    layer.forward = forward


def mark_expert_params(model: torch.nn.Module) -> None:
    """Mark routed experts' weights `allreduce = False` at every expert parallel size, as megatron does only at
    EP > 1.

    The mark sends a weight to DDP's expert buffers (gradients reduced over the expert-data-parallel group,
    which at EP = 1 is the data-parallel group: the same reduction) and to a second, expert optimizer in
    megatron's ChainedOptimizer. With it the optimizer has the same two parts at EP = 1 as at EP > 1, so an
    optimizer checkpoint saved at one expert parallel size loads at another (a checkpoint's common state
    is nested per chained optimizer).
    """
    for name, param in model.named_parameters():
        if ".mlp.experts.local_experts." in name:
            param.allreduce = False


def ddp_config(ddp: DdpSettings) -> DistributedDataParallelConfig:
    """megatron DistributedDataParallelConfig from the plan's DDP settings."""
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=ddp.grad_reduce_in_fp32,
        overlap_grad_reduce=ddp.overlap_grad_reduce,
        overlap_param_gather=ddp.overlap_param_gather,
        bucket_size=ddp.bucket_size,
        average_in_collective=ddp.average_in_collective,
        use_distributed_optimizer=ddp.use_distributed_optimizer,
    )


def unwrap(chunk: torch.nn.Module) -> GPTModel:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while not isinstance(chunk, GPTModel):
        chunk = chunk.module
    return chunk


# ------------------------------------------------------------------------------------ optimizer
def build_optimizer(
    chunks: Sequence[torch.nn.Module], optim: OptimPlan, params_dtype: str, ddp: DdpSettings
) -> MegatronOptimizer:
    """megatron optimizer (AdamW or SGD, fp32 master weights for 16-bit params, global grad clip) with the
    plan's settings. `lr` / `min_lr` here only seed megatron's param groups: `PlanLrSchedule` sets each
    training step's lr from the plan's table before the step runs. The gradient norm, clipping and fp32
    copies run torch's foreach kernels (`multi_tensor.use_foreach_multi_tensor`), not megatron's per-parameter
    fallbacks."""
    dtype = _DTYPES[params_dtype]
    cfg = OptimizerConfig(
        optimizer=optim.optimizer,
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        adam_eps=optim.eps,
        clip_grad=optim.clip_grad,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=ddp.use_distributed_optimizer,
        overlap_param_gather=ddp.overlap_param_gather,
    )
    if not bench_off("foreach"):
        use_foreach_multi_tensor()  # before the optimizer copies its first parameters
    optimizer = get_megatron_optimizer(cfg, list(chunks))
    use_fused_torch_adam(optimizer)
    return optimizer


def guarded_optimizer_step(
    optimizer: MegatronOptimizer, loss_finite: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron's optimizer step (ChainedOptimizer.step: prepare grads, global norm, clip, update) that is
    not applied when megatron's found_inf check fires, the global gradient norm is not finite, or
    `loss_finite` (a bool tensor on `device`) is False on any rank of the default process group (the
    engine's world). Returns (applied, grad_norm) as 0-dim tensors; grad_norm is NaN when found_inf fired
    before a norm was computed.

    Where `steps_on_device(optimizer)` the whole step is decided on the device (`_step_on_device`): no value
    is read back to the host, so the host goes on to the next mini-batch while the device still runs this
    one (megatron's own step reads the norm, the guard read the loss and the flag: three waits per step)."""
    if steps_on_device(optimizer):
        return _step_on_device(optimizer, loss_finite, device)
    applied, grad_norm = _step_on_host(optimizer, bool(loss_finite), device)
    return torch.tensor(applied), torch.tensor(grad_norm, dtype=torch.float64)


def sub_optimizers(optimizer: MegatronOptimizer) -> list[Any]:
    """A ChainedOptimizer's optimizers (dense and expert parameters), or the optimizer itself."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _step_on_host(
    optimizer: MegatronOptimizer, loss_finite: bool, device: torch.device
) -> tuple[bool, float]:
    """The guarded step as megatron decides a step, on the host (fp16 loss scaling, SGD, foreach Adam)."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    found_inf = optimizer.prepare_grads()  # megatron's own inf / NaN check (fp16 loss scaling)
    grad_norm = float("nan") if found_inf else float(optimizer.get_grad_norm())
    ok = loss_finite and math.isfinite(grad_norm)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        bad = torch.tensor([0.0 if ok else 1.0], device=device)
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        ok = bad.item() == 0
    if not ok:
        return False, grad_norm
    for opt in sub_optimizers(optimizer):
        params = [] if getattr(opt, "is_stub_optimizer", False) else opt.get_parameters()
        if params and opt.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(
                params, max_norm=opt.config.clip_grad, total_norm=grad_norm,
                use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
            )  # fmt: skip
    return bool(optimizer.step_with_ready_grads()), grad_norm


def steps_on_device(optimizer: MegatronOptimizer) -> bool:
    """Whether the guarded step can be decided on the device: every update is torch's fused Adam, which
    takes a `found_inf` flag tensor and then leaves the weights and the state as they were (the step counter
    included); no fp16 loss scaler (megatron reads its found_inf on the host); no decoupled gradients or
    megatron FSDP (DTensor gradients), whose norm and clipping stay megatron's."""
    if bench_off("deviceguard"):
        return False
    for opt in sub_optimizers(optimizer):
        if getattr(opt, "is_stub_optimizer", False):
            continue
        ddp = getattr(opt, "ddp_config", None)
        if (
            getattr(opt, "grad_scaler", None) is not None
            or opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
            or (ddp is not None and ddp.use_megatron_fsdp)
        ):
            return False
        inner = opt.optimizer
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            return False
        if not all(group["fused"] or not group["params"] for group in inner.param_groups):
            return False
    return True


def _step_on_device(
    optimizer: MegatronOptimizer, loss_finite: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_step_on_host`'s decisions as device tensors: the norm megatron computes (`grad_norm_on_device`), the
    guard's flag all-reduced without a read, megatron's clipping as a multiply by min(1, coefficient) (x 1.0
    where megatron skips it: the same bits), and the flag handed to the fused Adam as its `found_inf`."""
    optimizer.prepare_grads()  # no loss scaler here: megatron's copies of the gradients, no check
    grad_norm = grad_norm_on_device(optimizer, device)
    ok = loss_finite & torch.isfinite(grad_norm)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        bad = (~ok).to(torch.float32).reshape(1)
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        ok = bad[0] == 0
    found_inf = (~ok).to(torch.float32)
    stepped = [opt for opt in sub_optimizers(optimizer) if not getattr(opt, "is_stub_optimizer", False)]
    for opt in stepped:
        params = opt.get_parameters()
        grads = [g for p in params if (g := p.grad) is not None]
        if grads and opt.config.clip_grad > 0.0:
            coeff = opt.config.clip_grad / (grad_norm + 1.0e-6)  # megatron's, in fp64 as on its host
            torch._foreach_mul_(grads, torch.where(coeff < 1.0, coeff, 1.0).to(torch.float32))
        opt.optimizer.found_inf = found_inf  # as torch's GradScaler hands it to a fused optimizer
    try:
        optimizer.step_with_ready_grads()
    finally:
        for opt in stepped:
            del opt.optimizer.found_inf
    return ok, grad_norm


def grad_norm_on_device(optimizer: MegatronOptimizer, device: torch.device) -> torch.Tensor:
    """megatron's global L2 gradient norm (`ChainedOptimizer.get_grad_norm`, p = 2) as a 0-dim fp64 tensor on
    the device, where megatron reads it back: each sub-optimizer's `get_main_grads_for_grad_norm`, megatron's
    `l2_norm_impl`, the squares summed over each one's grad-stats group, combined as megatron combines them."""
    from megatron.core.optimizer import clip_grads

    def norm(grads: list[torch.Tensor], group: Any) -> torch.Tensor:
        if grads:
            overflow = torch.zeros(1, dtype=torch.int, device=device)
            total, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, overflow, [grads], False)
        else:
            total = torch.zeros(1, dtype=torch.float, device=device)
        total = total**2.0
        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=group)
        return total.reshape(()).double().sqrt()

    subs = sub_optimizers(optimizer)
    if len(subs) == 1 or optimizer.grads_states_parallel_group_is_shared():
        grads = [g for opt in subs for g in opt.get_main_grads_for_grad_norm()]
        return norm(grads, subs[0].get_grad_stats_parallel_group())
    norms = [norm(opt.get_main_grads_for_grad_norm(), opt.get_grad_stats_parallel_group()) for opt in subs]
    return torch.stack(norms).square().sum().sqrt()


def use_fused_torch_adam(optimizer: MegatronOptimizer) -> int:
    """Switch megatron's torch AdamW fallback to torch's fused kernel on accelerator params; returns how many
    param groups were switched.

    Without Transformer Engine or apex, megatron-core builds `torch.optim.AdamW` with torch's default, the
    multi-tensor `foreach` path (several kernels per tensor list per update term). `fused=True` does the
    whole update in one kernel per chunk of tensors; on the 1.5B shape the step moves ~25 GB of fp32 state
    either way, and the fused kernel reads and writes it once (docs/benchmarks.md has the measurement).
    The flag is read per group at every `step()`, so setting it after construction is enough. CPU params
    keep the foreach path (the CPU tests' reference numbers were made with it).
    """
    switched = 0
    for sub in sub_optimizers(optimizer):
        inner = getattr(sub, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            if group["params"] and all(p.device.type != "cpu" for p in group["params"]):
                group["fused"], group["foreach"] = True, False
                switched += 1
    return switched


class PlanLrSchedule:
    """The plan's lr table (`OptimPlan.table`, computed by rlconf.plan.lr_at) applied to the optimizer: the
    only lr schedule in rlplan.

    Why not megatron's OptimizerParamScheduler: the plan must print and diff the lr of every step before a
    run, so it computes the schedule anyway; driving megatron's scheduler with the same numbers would keep
    two implementations that a change to either could split. Here the worker looks up the row of the
    training step and writes it into the param groups, as megatron's scheduler does (`lr`, and
    `weight_decay` x the group's `wd_mult`: megatron's groups without weight decay keep none). The lr
    therefore depends on the step alone: a resumed run needs no scheduler state to get it right.
    `num_steps` counts the updates done (megatron's name, kept in checkpoints) and gives the next step of
    an engine used outside a run.
    """

    def __init__(self, optimizer: MegatronOptimizer, optim: OptimPlan) -> None:
        self.optimizer = optimizer
        self.plan = optim
        self.num_steps = 0
        first = next((row for row in optim.table if row.update), None)
        if first is not None:
            self._set(first)  # the optimizer holds the first update's lr from the start

    def row(self, step: int) -> LrRow:
        """The plan's row of training step `step`; an error when the plan has no update there."""
        table = self.plan.table
        if not 1 <= step <= len(table):
            raise ValueError(
                f"{self.plan.role}: training step {step} is outside the plan's lr table (steps 1..{len(table)}, "
                "trainer.total_steps)"
            )
        row = table[step - 1]
        if not row.update:
            raise ValueError(
                f"{self.plan.role}: the plan has no update at training step {step} (trainer.critic_warmup)"
            )
        return row

    def next_update_step(self) -> int:
        """The training step of this engine's next update when nobody says (engines outside a run)."""
        updates = [row.step for row in self.plan.table if row.update]
        if self.num_steps >= len(updates):
            raise ValueError(
                f"{self.plan.role}: all {len(updates)} updates of the plan's lr table are done "
                "(build the engine with a larger total_steps)"
            )
        return updates[self.num_steps]

    def apply(self, step: int) -> float:
        """Set training step `step`'s lr and weight decay on every param group; returns the lr."""
        row = self.row(step)
        self._set(row)
        return row.lr

    def _set(self, row: LrRow) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = row.lr
            group["weight_decay"] = row.weight_decay * group.get("wd_mult", 1.0)

    def step(self, increment: int = 1) -> None:
        """Count finished updates (called once after each training step's update)."""
        self.num_steps += increment

    def state_dict(self) -> dict[str, int]:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Checkpoints of megatron's scheduler hold more keys; only the count carries over.
        self.num_steps = int(state["num_steps"])
