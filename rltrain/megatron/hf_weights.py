"""Hugging Face <-> megatron-core weights for the families of rlconf.model_spec (llama, mistral, qwen2, qwen3
and the mixtures of experts qwen2_moe, qwen3_moe, mixtral).

Import: with the `ModelArch` the plan read from config.json (ModelSpec.arch; rlconf.model_spec is the one
reader), read safetensors, and fill this rank's megatron parameters
(its TP shard of its PP stage's layers): q/k/v fused into `linear_qkv` in megatron's per-query-group
layout ([q heads of group g, k_g, v_g] for each g), gate/up fused into `linear_fc1` per TP shard
([gate_r; up_r] on rank r), vocabulary rows padded with zeros (they are masked in log-probs).
Export: gather TP shards, each pipeline stage writes its own safetensors file (DP rank 0, TP rank 0), and
global rank 0 writes the index and a config.json that `transformers.AutoModelForCausalLM` loads
(rlconf.model_spec.hf_config: the source folder's own config.json when `base_config` is the file the model
was read from, which callers exporting a trained model pass; else one written from the arch). Qwen3's per-head QK-norm weights are
`self_attn.q_norm` / `k_norm` in HF and `self_attention.q_layernorm` / `k_layernorm` in megatron.
Layers are matched by megatron's global `layer_number`, so any PP / virtual-PP split maps correctly.

Mixture-of-experts layers: megatron's `mlp.router.weight` is HF's `mlp.gate.weight` (mixtral:
`block_sparse_moe.gate.weight`); routed expert g (`mlp.experts.local_experts.j` on expert-parallel rank r,
g = r x experts per rank + j) is HF's `mlp.experts.g.{gate,up,down}_proj` (mixtral: `w1`, `w3`, `w2`), its
gate/up fused per expert-tensor-parallel shard; qwen2_moe's shared expert is `mlp.shared_experts.linear_fc1/2`
(`mlp.shared_expert.*` in HF) and its sigmoid gate `mlp.shared_experts.gate_weight` (`mlp.shared_expert_gate`).
Export gathers expert shards over the expert-TP group and the experts over the expert-parallel group, and
writes them in the per-expert layout transformers itself saves.

deepseek_v3 (multi-head latent attention, rltrain.megatron.mla): megatron's MLA projections are HF's
unfused ones under other names (`_MLA`; their RoPE dims map unpermuted, megatron de-interleaves them as
transformers' rope_interleave does), the shared experts are `mlp.shared_experts.*` in both, and the router's
`expert_bias` buffer is HF's `mlp.gate.e_score_correction_bias` (a buffer, not a parameter: `global_params`
yields it beside the parameters, so it is loaded, exported and synced like them).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state
from safetensors import safe_open
from safetensors.torch import save_file

from rlconf.arch import ModelArch
from rlconf.errors import ConfigError, error
from rlconf.model_files import weights_issues
from rlconf.model_spec import hf_config, read_model_arch
from rlconf.safe_paths import FOLDER_PATHS_RULE, INDEX_FILE, PathEscapeError, resolve_inside
from rltrain.megatron.model import unwrap

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
# megatron layer-relative name -> HF layer-relative name of Qwen3's per-head QK-norm weights.
_QK_NORMS = {
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
# megatron layer-relative name -> HF layer-relative name of MLA's projections and latent norms (deepseek_v3).
_MLA = {
    f"self_attention.{meg}.weight": f"self_attn.{hf}.weight"
    for meg, hf in (("linear_q_proj", "q_proj"), ("linear_q_down_proj", "q_a_proj"),
                    ("q_layernorm", "q_a_layernorm"), ("linear_q_up_proj", "q_b_proj"),
                    ("linear_kv_down_proj", "kv_a_proj_with_mqa"), ("kv_layernorm", "kv_a_layernorm"),
                    ("linear_kv_up_proj", "kv_b_proj"))
}  # fmt: skip
_EXPERT_BIAS = "mlp.router.expert_bias"


# ------------------------------------------------------------------------------------ config.json
def arch_from_hf(path: str | os.PathLike) -> ModelArch:
    """ModelArch of a local HF folder, read by rlconf.model_spec (raises ConfigError like the plan does)."""
    return read_model_arch(os.fspath(path))


def hf_config_from_arch(
    arch: ModelArch, dtype: torch.dtype, base: dict[str, Any] | None = None
) -> dict[str, Any]:
    """config.json for `arch` (its family's model_type and transformers class), over `base` if given."""
    return hf_config(arch, str(dtype).removeprefix("torch."), base)


def check_hf_folder(
    path: str | os.PathLike, arch: ModelArch, key: str = "model.path", value_head: bool = False
) -> None:
    """Raise ConfigError (rule model-files) unless the folder's safetensors hold every tensor this loader
    reads, with its shape (rlconf.model_files.hf_tensors: the list `rlconf validate` checks too)."""
    if issues := weights_issues(os.fspath(path), arch, key, lm_head=not value_head):
        raise ConfigError(issues)


# ------------------------------------------------------------------------------------ fused layouts
def _heads(arch: ModelArch) -> tuple[int, int, int]:
    d = arch.kv_channels or arch.hidden_size // arch.num_attention_heads
    return arch.num_attention_heads, arch.num_query_groups, d


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    """HF q/k/v ([nh*d, ...], [ng*d, ...], [ng*d, ...]) -> megatron linear_qkv, grouped per query group."""
    nh, ng, d = _heads(arch)
    rest = q.shape[1:]
    q = q.reshape(ng, nh // ng * d, *rest)
    k = k.reshape(ng, d, *rest)
    v = v.reshape(ng, d, *rest)
    return torch.cat([q, k, v], 1).reshape((nh + 2 * ng) * d, *rest)


def split_qkv(qkv: torch.Tensor, arch: ModelArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of fuse_qkv."""
    nh, ng, d = _heads(arch)
    rest = qkv.shape[1:]
    g = qkv.reshape(ng, (nh // ng + 2) * d, *rest)
    q, k, v = torch.split(g, [nh // ng * d, d, d], 1)
    return q.reshape(nh * d, *rest), k.reshape(ng * d, *rest), v.reshape(ng * d, *rest)


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor, tp: int) -> torch.Tensor:
    """HF gate/up [F, H] -> megatron linear_fc1 laid out so that TP shard r is [gate_r; up_r]."""
    return torch.cat([torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp), strict=True)])


def split_gate_up(fc1: torch.Tensor, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of fuse_gate_up."""
    parts = [p.chunk(2) for p in fc1.chunk(tp)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _pad_vocab(w: torch.Tensor, rows: int) -> torch.Tensor:
    if w.shape[0] == rows:
        return w
    out = w.new_zeros((rows, *w.shape[1:]))
    out[: w.shape[0]] = w
    return out


# ------------------------------------------------------------------------------------ reading
class _HFReader:
    """Lazy access to the tensors of a (possibly sharded) safetensors checkpoint.

    Every file it opens is a name from the folder (index entries, the *.safetensors it holds) resolved by
    `resolve_inside`: a name or symlink pointing outside the folder is ConfigError naming `config_path`
    (exit 2), before any file is opened."""

    def __init__(self, path: str | os.PathLike, config_path: str = "model.path") -> None:
        root = Path(path)
        index = root / INDEX_FILE
        try:
            if index.exists():
                resolve_inside(root, INDEX_FILE, INDEX_FILE)
                with open(index) as f:
                    names: dict[str, str] = json.load(f)["weight_map"]
                files = {
                    entry: resolve_inside(root, entry, f"{INDEX_FILE} weight_map entry {name!r}")
                    for name, entry in names.items()
                }
                weight_map = {name: files[entry] for name, entry in names.items()}
            else:
                found = sorted(root.glob("*.safetensors"))
                if not found:
                    raise FileNotFoundError(f"{path}: no safetensors files")
                weight_map = {}
                for fname in found:
                    real = resolve_inside(root, fname.name, f"the weights file {fname.name}")
                    with safe_open(real, "pt") as f:
                        weight_map.update(dict.fromkeys(f.keys(), real))
        except PathEscapeError as exc:
            raise ConfigError([error(config_path, str(exc), "use a model folder whose files are all inside "
                                     "it (copy the files in instead of naming them)", FOLDER_PATHS_RULE)]
                              ) from None  # fmt: skip
        self.root = root
        self.weight_map: dict[str, Path] = weight_map

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        with safe_open(self.weight_map[name], "pt") as f:
            return f.get_tensor(name)


def hf_full_tensor(
    name: str, reader: _HFReader, arch: ModelArch, tp: int, vocab_rows: int, etp: int | None = None
) -> torch.Tensor:
    """The full (all TP ranks) megatron tensor `name` (global layer and expert numbering) from HF tensors;
    `etp` is the expert tensor-parallel size (None: tp)."""
    if name == "embedding.word_embeddings.weight":
        return _pad_vocab(reader.get("model.embed_tokens.weight"), vocab_rows)
    if name == "output_layer.weight":
        key = "lm_head.weight" if "lm_head.weight" in reader else "model.embed_tokens.weight"
        return _pad_vocab(reader.get(key), vocab_rows)
    if name == "decoder.final_layernorm.weight":
        return reader.get("model.norm.weight")
    m = _LAYER.match(name)
    if m is None:
        raise KeyError(f"no Hugging Face source for megatron parameter {name}")
    layer, rest = int(m.group(1)), m.group(2)
    p = f"model.layers.{layer}."
    if rest == "input_layernorm.weight":
        return reader.get(p + "input_layernorm.weight")
    if rest == "pre_mlp_layernorm.weight":
        return reader.get(p + "post_attention_layernorm.weight")
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        return fuse_qkv(*(reader.get(f"{p}self_attn.{x}_proj.{kind}") for x in "qkv"), arch)
    if rest == "self_attention.linear_proj.weight":
        return reader.get(p + "self_attn.o_proj.weight")
    if arch.multi_latent_attention and rest in _MLA:
        return reader.get(p + _MLA[rest])
    if rest in _QK_NORMS:
        return reader.get(p + _QK_NORMS[rest])
    if rest == "mlp.linear_fc1.weight":
        return fuse_gate_up(reader.get(p + "mlp.gate_proj.weight"), reader.get(p + "mlp.up_proj.weight"), tp)
    if rest == "mlp.linear_fc2.weight":
        return reader.get(p + "mlp.down_proj.weight")
    moe = _moe_names(rest, arch)
    if moe is not None:
        if len(moe) == 2:  # gate / up of an expert: fused per shard of its tensor-parallel group
            shards = tp if rest.startswith("mlp.shared_experts.") else (etp or tp)
            return fuse_gate_up(reader.get(p + moe[0]), reader.get(p + moe[1]), shards)
        return reader.get(p + moe[0])
    raise KeyError(f"no Hugging Face source for megatron parameter {name}")


def _moe_names(rest: str, arch: ModelArch) -> tuple[str, ...] | None:
    """HF layer-relative names of a megatron MoE parameter (layer-relative, global expert number): one name,
    or (gate, up) for a fused linear_fc1; None for a name that is not an MoE parameter."""
    mixtral = arch.family == "mixtral"
    block = "block_sparse_moe" if mixtral else "mlp"
    shared = "mlp.shared_experts" if arch.family == "deepseek_v3" else "mlp.shared_expert"
    if rest == "mlp.router.weight":
        return (f"{block}.gate.weight",)
    if rest == _EXPERT_BIAS:
        return ("mlp.gate.e_score_correction_bias",)
    if rest == "mlp.shared_experts.gate_weight":
        return ("mlp.shared_expert_gate.weight",)
    if rest == "mlp.shared_experts.linear_fc1.weight":
        return (f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight")
    if rest == "mlp.shared_experts.linear_fc2.weight":
        return (f"{shared}.down_proj.weight",)
    m = _EXPERT.match(rest)
    if m is None:
        return None
    e = f"{block}.experts.{m.group(1)}."
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    if m.group(2) == "linear_fc1":
        return (f"{e}{gate}.weight", f"{e}{up}.weight")
    return (f"{e}{down}.weight",)


def is_expert_param(param: torch.Tensor) -> bool:
    """A routed expert's weight (megatron marks them `allreduce = False`: their gradients are reduced over the
    expert-data-parallel group, and they are split over the expert-parallel and expert-TP groups)."""
    return not getattr(param, "allreduce", True)


def global_params(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(name with global layer and expert numbers, parameter) of one GPTModel chunk, and its routers'
    `expert_bias` buffers (deepseek_v3's e_score_correction_bias: state of the model, not trained)."""
    offsets = {}
    if hasattr(module, "decoder"):
        for local, layer in enumerate(module.decoder.layers):
            offsets[local] = layer.layer_number - 1
    experts_first = 0
    if getattr(module.config, "num_moe_experts", None):
        ep = parallel_state.get_expert_model_parallel_world_size()
        experts_first = parallel_state.get_expert_model_parallel_rank() * (
            module.config.num_moe_experts // ep
        )
    biases = [(n, b) for n, b in module.named_buffers() if n.endswith("." + _EXPERT_BIAS)]
    for name, param in [*module.named_parameters(), *biases]:
        if ".lora_A." in name or ".lora_B." in name:
            continue  # LoRA adapters: rltrain/megatron/peft_io.py reads and writes them (PEFT's format)
        m = _LAYER.match(name)
        if m is not None:
            rest = m.group(2)
            e = _EXPERT.match(rest)
            if e is not None:
                rest = f"mlp.experts.local_experts.{experts_first + int(e.group(1))}.{e.group(2)}.weight"
            name = f"decoder.layers.{offsets[int(m.group(1))]}.{rest}"
        yield name, param


def tp_shard(full: torch.Tensor, param: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """This rank's part of `full`; `tp` / `rank` are the expert-TP group's for a routed expert's weight."""
    if getattr(param, "tensor_model_parallel", False) and tp > 1:
        return full.chunk(tp, dim=param.partition_dim)[rank]
    return full


def _expert_tp() -> tuple[int, int]:
    return (
        parallel_state.get_expert_tensor_parallel_world_size(),
        parallel_state.get_expert_tensor_parallel_rank(),
    )


@torch.no_grad()
def load_hf_weights(
    chunks: Sequence[torch.nn.Module],
    path: str | os.PathLike,
    arch: ModelArch,
    value_head: bool = False,
    config_path: str = "model.path",
) -> None:
    """Copy an HF checkpoint into this rank's model chunks (DDP-wrapped or bare). `arch` is the architecture
    the plan read from the folder's config.json (ModelSpec.arch; the folder's config.json is not read
    again). A critic's value head keeps its fresh init (an HF causal LM has none). `config_path` is the
    setting errors name (a file name in the folder that points outside it)."""
    reader = _HFReader(path, config_path)  # refuses index entries outside the folder before anything opens
    check_hf_folder(path, arch, value_head=value_head)  # a named error, not a KeyError mid-load
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    etp, etp_rank = _expert_tp()
    for chunk in chunks:
        module = unwrap(chunk)
        vocab_rows = module.vocab_size
        for name, param in global_params(module):
            if value_head and name.startswith("output_layer."):
                continue
            full = hf_full_tensor(name, reader, arch, tp, vocab_rows, etp)
            if is_expert_param(param):
                local = tp_shard(full, param, etp, etp_rank)
            else:
                local = tp_shard(full, param, tp, rank)
            if local.shape != param.shape:
                raise ValueError(
                    f"{name}: HF gives {tuple(local.shape)}, megatron expects {tuple(param.shape)}"
                )
            if name.endswith(_EXPERT_BIAS):  # megatron keeps the routing bias in fp32 (16-bit models too)
                param.data = local.to(device=param.device, dtype=torch.float32)
                continue
            param.data.copy_(local.to(param.dtype))
    # The distributed optimizer keeps fp32 main params of 16-bit models: callers that built an optimizer
    # before loading must reload them (MegatronEngine loads before building the optimizer).


# ------------------------------------------------------------------------------------ export
def _gather_tp(param: torch.Tensor) -> torch.Tensor:
    """The full tensor of `param` over its TP group (the expert-TP group for a routed expert's weight)."""
    expert = is_expert_param(param)
    tp = _expert_tp()[0] if expert else parallel_state.get_tensor_model_parallel_world_size()
    data = param.detach()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return data.cpu()
    parts = [torch.empty_like(data) for _ in range(tp)]
    group = (
        parallel_state.get_expert_tensor_parallel_group()
        if expert
        else parallel_state.get_tensor_model_parallel_group()
    )
    torch.distributed.all_gather(parts, data.contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim).cpu()


def _gather_experts(name: str, full: torch.Tensor, num_experts: int) -> list[tuple[str, torch.Tensor]]:
    """(global name, tensor) of routed expert `name` on every expert-parallel rank (collective over EP)."""
    ep = parallel_state.get_expert_model_parallel_world_size()
    per_rank = num_experts // ep
    if ep == 1:
        return [(name, full)]
    parts = [torch.empty_like(full) for _ in range(ep)]
    torch.distributed.all_gather(
        parts, full.contiguous(), group=parallel_state.get_expert_model_parallel_group()
    )
    layer, rest = _LAYER.match(name).groups()  # type: ignore[union-attr]
    m = _EXPERT.match(rest)
    assert m is not None, name
    local = int(m.group(1)) - parallel_state.get_expert_model_parallel_rank() * per_rank
    out = []
    for r, part in enumerate(parts):
        g = r * per_rank + local
        out.append((f"decoder.layers.{layer}.mlp.experts.local_experts.{g}.{m.group(2)}.weight", part))
    return out


def to_hf(
    name: str, full: torch.Tensor, arch: ModelArch, tp: int, etp: int | None = None
) -> dict[str, torch.Tensor]:
    if name == "embedding.word_embeddings.weight":
        return {"model.embed_tokens.weight": full[: arch.vocab_size]}
    if name == "output_layer.weight":
        return {"lm_head.weight": full[: arch.vocab_size]}
    if name == "decoder.final_layernorm.weight":
        return {"model.norm.weight": full}
    m = _LAYER.match(name)
    if m is None:
        raise KeyError(f"no Hugging Face name for megatron parameter {name}")
    p = f"model.layers.{int(m.group(1))}."
    rest = m.group(2)
    if rest == "input_layernorm.weight":
        return {p + "input_layernorm.weight": full}
    if rest == "pre_mlp_layernorm.weight":
        return {p + "post_attention_layernorm.weight": full}
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        q, k, v = split_qkv(full, arch)
        return {
            f"{p}self_attn.q_proj.{kind}": q,
            f"{p}self_attn.k_proj.{kind}": k,
            f"{p}self_attn.v_proj.{kind}": v,
        }
    if rest == "self_attention.linear_proj.weight":
        return {p + "self_attn.o_proj.weight": full}
    if arch.multi_latent_attention and rest in _MLA:
        return {p + _MLA[rest]: full}
    if rest in _QK_NORMS:
        return {p + _QK_NORMS[rest]: full}
    if rest == "mlp.linear_fc1.weight":
        gate, up = split_gate_up(full, tp)
        return {p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up}
    if rest == "mlp.linear_fc2.weight":
        return {p + "mlp.down_proj.weight": full}
    moe = _moe_names(rest, arch)
    if moe is not None:
        if len(moe) == 2:
            gate, up = split_gate_up(full, tp if rest.startswith("mlp.shared_experts.") else (etp or tp))
            return {p + moe[0]: gate, p + moe[1]: up}
        return {p + moe[0]: full}
    raise KeyError(f"no Hugging Face name for megatron parameter {name}")


def _copy_mtp_layers(arch: ModelArch, source: str | os.PathLike, out: Path) -> tuple[str, list[str]]:
    """Copy the source folder's multi-token prediction tensors (model.layers.L.., L = arch.num_layers) into
    out/model-mtp.safetensors unchanged; returns (file name, tensor names) for the index."""
    reader = _HFReader(source)
    prefixes = tuple(f"model.layers.{arch.num_layers + i}." for i in range(arch.num_mtp_layers))
    names = sorted(n for n in reader.weight_map if n.startswith(prefixes))
    fname = "model-mtp.safetensors"
    save_file({n: reader.get(n) for n in names}, str(out / fname), metadata={"format": "pt"})
    return fname, names


@torch.no_grad()
def export_hf_weights(
    chunks: Sequence[torch.nn.Module],
    arch: ModelArch,
    out_dir: str | os.PathLike,
    base_config: dict[str, Any] | None = None,
    mtp_source: str | os.PathLike | None = None,
) -> None:
    """Write this model as an HF folder (safetensors + config.json). Collective: every rank calls it.

    `mtp_source`: the folder the model was read from; its multi-token prediction layers (deepseek_v3
    num_nextn_predict_layers: model.layers.L.. after the decoder's L layers, not built or trained) are
    copied unchanged into `model-mtp.safetensors` (with an index), so the export holds what the source
    held. Required when `arch` has such layers."""
    if arch.num_mtp_layers and mtp_source is None:
        raise ValueError(
            f"{arch.num_mtp_layers} multi-token prediction layer(s): export needs the source folder"
        )
    tp = parallel_state.get_tensor_model_parallel_world_size()
    etp = _expert_tp()[0]
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    writer = (
        parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_data_parallel_rank() == 0
    )
    tensors: dict[str, torch.Tensor] = {}
    dtype = torch.float32
    for chunk in chunks:
        module = unwrap(chunk)
        for name, param in global_params(module):
            full = _gather_tp(param)  # collective over TP: every TP rank takes part
            if isinstance(param, torch.nn.Parameter):  # not the fp32 routing bias buffers
                dtype = param.dtype
            if name == "output_layer.weight" and arch.share_embeddings_and_output_weights:
                continue  # tied: HF reads the embedding
            if is_expert_param(param):
                assert arch.num_moe_experts is not None
                # collective over EP: every EP rank takes part
                for expert_name, expert in _gather_experts(name, full, arch.num_moe_experts):
                    tensors.update(to_hf(expert_name, expert, arch, tp, etp))
                continue
            tensors.update(to_hf(name, full, arch, tp))
    if arch.multi_latent_attention and arch.moe_shared_expert_intermediate_size is None:
        # n_shared_experts: 0: transformers still builds (and loads) zero-width shared experts.
        for name in [n for n in tensors if n.endswith(".mlp.gate.weight")]:
            p, h = name.removesuffix("gate.weight") + "shared_experts.", arch.hidden_size
            tensors.update({p + "gate_proj.weight": torch.zeros(0, h, dtype=dtype),
                            p + "up_proj.weight": torch.zeros(0, h, dtype=dtype),
                            p + "down_proj.weight": torch.zeros(h, 0, dtype=dtype)})  # fmt: skip
    out = Path(out_dir)
    fname = "model.safetensors" if pp == 1 else f"model-{pp_rank + 1:05d}-of-{pp:05d}.safetensors"
    if writer:
        out.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, str(out / fname), metadata={"format": "pt"}
        )
    names = list(tensors) if writer else []
    if pp > 1:
        gathered: list[Any] = [None] * pp
        torch.distributed.all_gather_object(
            gathered, (fname, names), group=parallel_state.get_pipeline_model_parallel_group()
        )
    else:
        gathered = [(fname, names)]
    if torch.distributed.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        if mtp_source is not None and arch.num_mtp_layers:
            gathered.append(_copy_mtp_layers(arch, mtp_source, out))
        if len(gathered) > 1:
            weight_map = {k: f for f, ks in gathered for k in ks}
            with open(out / "model.safetensors.index.json", "w") as f:
                json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
        with open(out / "config.json", "w") as f:
            json.dump(hf_config_from_arch(arch, dtype, base_config), f, indent=2)
    torch.distributed.barrier()
