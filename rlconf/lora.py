"""LoRA in the plan: `actor.lora` checked (rule `lora`) and resolved into the adapted modules, their trainable
parameter count and their per-device share (what rltrain/megatron/lora.py builds and the memory estimate
counts).

Adapters follow PEFT's definition, per Hugging Face projection: y = W x + (alpha / r) B A dropout(x), one
(A, B) pair per q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj. megatron fuses q, k, v into
`linear_qkv` and gate, up into `linear_fc1`: a fused linear keeps one pair per projection it adapts, so the
adapters are PEFT's exactly (an adapter folder exports and loads 1:1) and a partial target such as q_proj
alone adapts only the query slice of linear_qkv (k and v get no adapter). Routed experts are never
adapted (not built yet); `all-linear` takes every attention and MLP linear of a dense model and the
attention linears of a mixture-of-experts model (its dense layers' MLPs too are left alone: PEFT with
transformers v5 maps gate_proj / up_proj / down_proj of a MoE model onto the fused expert weights).

This module imports nothing beyond rlconf (and the standard library).
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

from rlconf.config import ModelArch, RLConfig
from rlconf.errors import ConfigError, Issue, error
from rlconf.model_spec import head_dim, is_moe_layer

RULE = "lora"

# Hugging Face projection -> the megatron linear that holds it.
HF_TO_MEGATRON: dict[str, str] = {
    "q_proj": "linear_qkv",
    "k_proj": "linear_qkv",
    "v_proj": "linear_qkv",
    "o_proj": "linear_proj",
    "gate_proj": "linear_fc1",
    "up_proj": "linear_fc1",
    "down_proj": "linear_fc2",
}
# megatron linear -> its projections, in the order of its output (column-parallel) or input (row-parallel).
MEGATRON_PARTS: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
ATTENTION = ("linear_qkv", "linear_proj")
MLP = ("linear_fc1", "linear_fc2")
ALL_LINEAR = "all-linear"
COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")
"""Output sharded over TP: B is split with the output rows, A is whole on every rank."""
# Hugging Face submodule of each megatron linear (PEFT module paths).
HF_PARENT: dict[str, str] = {
    "linear_qkv": "self_attn",
    "linear_proj": "self_attn",
    "linear_fc1": "mlp",
    "linear_fc2": "mlp",
}
MEGATRON_PARENT: dict[str, str] = {
    "linear_qkv": "self_attention",
    "linear_proj": "self_attention",
    "linear_fc1": "mlp",
    "linear_fc2": "mlp",
}


@dataclass(frozen=True)
class LoraModule:
    """One adapted megatron linear of one layer."""

    layer: int
    """Global 0-based layer number."""
    linear: str
    """linear_qkv, linear_proj, linear_fc1 or linear_fc2."""
    parts: tuple[str, ...]
    """Its adapted Hugging Face projections (one (A, B) pair each), in MEGATRON_PARTS order."""

    @property
    def megatron_path(self) -> str:
        return f"decoder.layers.{self.layer}.{MEGATRON_PARENT[self.linear]}.{self.linear}"

    def hf_path(self, part: str) -> str:
        return f"model.layers.{self.layer}.{HF_PARENT[self.linear]}.{part}"


@dataclass(frozen=True)
class LoraPlan:
    """The adapters one engine builds (EnginePlan.lora) and what the plan reports about them."""

    rank: int
    alpha: float
    dropout: float
    init: str
    adapter_path: str | None
    modules: tuple[LoraModule, ...]
    params: int
    """Adapter parameters of the whole model (unsharded): the policy's trainable parameters."""
    hf_targets: tuple[str, ...]
    """The adapted Hugging Face projection names (adapter_config.json's target_modules)."""

    @property
    def scaling(self) -> float:
        """PEFT's lora scaling: alpha / rank."""
        return self.alpha / self.rank

    def module(self, layer: int, linear: str) -> LoraModule | None:
        for m in self.modules:
            if m.layer == layer and m.linear == linear:
                return m
        return None


def part_dims(arch: ModelArch, part: str, moe_layer: bool = False) -> tuple[int, int]:
    """(in_features, out_features) of one Hugging Face projection of a layer (dense MLP width)."""
    h = arch.hidden_size
    d = head_dim(arch)
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    ffn = arch.ffn_hidden_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, ffn),
        "up_proj": (h, ffn),
        "down_proj": (ffn, h),
    }[part]


def adapter_params(arch: ModelArch, module: LoraModule, rank: int, tp: int = 1) -> int:
    """Adapter parameters of one adapted linear on one of `tp` tensor-parallel ranks: column-parallel
    linears split B's output rows, row-parallel ones split A's input columns; the other factor is whole."""
    total = 0
    for part in module.parts:
        fan_in, fan_out = part_dims(arch, part)
        if module.linear in COLUMN_PARALLEL:
            total += rank * fan_in + rank * fan_out // tp
        else:
            total += rank * fan_in // tp + rank * fan_out
    return total


def config_issues(c: RLConfig) -> Iterator[Issue]:
    """The checks that need only the config (the rule `lora` in rlconf.validate runs these)."""
    lo = c.actor.lora
    if lo.rank < 0:
        yield error(
            "actor.lora.rank", f"must be >= 0, got {lo.rank}", "use 0 (off) or a rank such as 8", RULE
        )
    if lo.rank <= 0:
        return
    if not lo.alpha > 0:
        yield error(
            "actor.lora.alpha", f"must be > 0, got {lo.alpha}", "use alpha = 2 x rank (e.g. 16)", RULE
        )
    if not 0.0 <= lo.dropout < 1.0:
        yield error("actor.lora.dropout", f"a dropout probability must be in [0, 1), got {lo.dropout}",
                    "use 0.0 or 0.05", RULE)  # fmt: skip
    known = (ALL_LINEAR, *MEGATRON_PARTS, *HF_TO_MEGATRON)
    if not lo.target_modules:
        yield error("actor.lora.target_modules", "is empty: no module would get an adapter",
                    f"use [{ALL_LINEAR}] or e.g. [linear_qkv, linear_proj]", RULE)  # fmt: skip
    for name in lo.target_modules:
        if name not in known:
            yield error("actor.lora.target_modules", f"unknown module {name!r}",
                        f"use names among {', '.join(known)}", RULE)  # fmt: skip
    # What LoRA cannot combine with yet, each with its reason.
    cannot = []
    if c.rollout.placement == "separate":
        cannot.append(("rollout.placement", "a separate rollout pool receives full-weight pushes of the base "
                       "weights; adapter pushes are not built yet", "use rollout.placement: colocated"))  # fmt: skip
    if c.rollout.engine != "embedded":
        cannot.append(("rollout.engine", f"the {c.rollout.engine} engine would load the base weights without the "
                       "adapters (refit with adapters is not built yet)", "use rollout.engine: embedded"))  # fmt: skip
    if c.model.attention_backend == "te":
        cannot.append(("model.attention_backend", "Transformer Engine's fused linears are not adapted (only "
                       "megatron-core's ColumnParallelLinear / RowParallelLinear)", "use attention_backend: sdpa"))  # fmt: skip
    if c.actor.megatron.use_dist_checkpointing:
        cannot.append(("actor.megatron.use_dist_checkpointing", "the initial dist checkpoint holds no adapters; "
                       "start from model.path (and actor.lora.adapter_path for an existing adapter)",
                       "set actor.megatron.use_dist_checkpointing: false"))  # fmt: skip
    if "hf_model" in c.actor.checkpoint.save_contents:
        cannot.append(("actor.checkpoint.save_contents", "the in-run hf_model export writes the base weights; a "
                       "LoRA checkpoint exports with `rltrain export-hf CKPT OUT` (a PEFT adapter folder) or "
                       "`--merge` (a merged model)", "remove hf_model from actor.checkpoint.save_contents"))  # fmt: skip
    for path, why, fix in cannot:
        yield error(path, f"actor.lora: {why}", fix, RULE)


def _issue(path: str, message: str, fix: str) -> ConfigError:
    return ConfigError([error(path, message, fix, RULE)])


def resolve(c: RLConfig, arch: ModelArch) -> LoraPlan | None:
    """The adapters of the policy with this architecture, or None without LoRA. Raises ConfigError (rule
    lora) for targets the architecture cannot take and exclude patterns that match nothing."""
    lo = c.actor.lora
    if lo.rank <= 0:
        return None
    if arch.multi_latent_attention:
        raise _issue(
            "actor.lora.rank",
            f"LoRA on a {arch.family} model: multi-head latent attention has no q/k/v/o projections of the "
            "kind the adapters are built for (its q_a / q_b / kv_a / kv_b projections are not adapted yet)",
            "set actor.lora.rank: 0 (full fine-tuning), or use a model of another family",
        )
    wanted: dict[str, set[str]] = {}
    explicit_mlp = False
    for name in lo.target_modules:
        if name == ALL_LINEAR:
            for linear, parts in MEGATRON_PARTS.items():
                wanted.setdefault(linear, set()).update(parts)
        elif name in MEGATRON_PARTS:
            wanted.setdefault(name, set()).update(MEGATRON_PARTS[name])
            explicit_mlp |= name in MLP
        else:
            linear = HF_TO_MEGATRON[name]
            wanted.setdefault(linear, set()).add(name)
            explicit_mlp |= linear in MLP
    moe_layers = [i for i in range(arch.num_layers) if is_moe_layer(arch, i)]
    if explicit_mlp and moe_layers:
        raise _issue(
            "actor.lora.target_modules",
            f"MLP targets on a mixture-of-experts model ({len(moe_layers)} of {arch.num_layers} layers route "
            "to experts): LoRA on routed and shared experts is not built yet",
            "adapt attention only (target_modules: [linear_qkv, linear_proj]), or all-linear (attention + the "
            "dense layers' MLPs)",
        )
    modules = []
    for layer in range(arch.num_layers):
        for linear, parts in MEGATRON_PARTS.items():
            # A MoE model's MLPs are not adapted, its dense layers' included: PEFT (with transformers v5)
            # reads gate_proj / up_proj / down_proj of a MoE model as the routed experts' fused weights, so an
            # adapter folder for dense-layer MLPs would load onto the experts instead.
            if linear in MLP and moe_layers:
                continue
            chosen = tuple(p for p in parts if p in wanted.get(linear, ()))
            if chosen:
                modules.append(LoraModule(layer, linear, chosen))
    used: set[str] = set()

    def excluded(m: LoraModule, part: str | None) -> bool:
        names = [m.megatron_path, m.linear] if part is None else [m.hf_path(part), part]
        for pattern in lo.exclude_modules:
            if any(fnmatch.fnmatchcase(n, pattern) for n in names):
                used.add(pattern)
                return True
        return False

    kept = []
    for m in modules:
        if excluded(m, None):
            continue
        parts = tuple(p for p in m.parts if not excluded(m, p))
        if parts:
            kept.append(LoraModule(m.layer, m.linear, parts))
    unused = [p for p in lo.exclude_modules if p not in used]
    if unused:
        raise _issue(
            "actor.lora.exclude_modules",
            f"{', '.join(repr(p) for p in unused)} match no adapted module",
            "use paths such as decoder.layers.0.self_attention.linear_qkv, decoder.layers.*.mlp.linear_fc2 or "
            "model.layers.0.self_attn.q_proj (fnmatch patterns)",
        )
    if not kept:
        raise _issue("actor.lora.target_modules", "no module of this model gets an adapter (targets and "
                     "exclude_modules leave none)", "target more modules or exclude fewer")  # fmt: skip
    if lo.adapter_path is not None:
        _check_adapter_folder(lo.adapter_path, lo.rank, lo.alpha)
    params = sum(adapter_params(arch, m, lo.rank) for m in kept)
    hf_targets = tuple(p for p in HF_TO_MEGATRON if any(p in m.parts for m in kept))
    return LoraPlan(lo.rank, lo.alpha, lo.dropout, lo.init, lo.adapter_path, tuple(kept), params, hf_targets)


MAX_ADAPTER_CONFIG_BYTES = 1 << 20


def _check_adapter_folder(folder: str, rank: int, alpha: float) -> None:
    """actor.lora.adapter_path: a PEFT LoRA folder whose r and lora_alpha are this run's (the engine checks
    every tensor's name and shape when it loads them)."""
    path = os.path.join(folder, "adapter_config.json")
    fix = "point actor.lora.adapter_path at a PEFT adapter folder (adapter_config.json + adapter_model.safetensors)"
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(folder, "adapter_model.safetensors")):
        raise _issue(
            "actor.lora.adapter_path", f"{folder} has no adapter_config.json / adapter_model.safetensors", fix
        )
    if os.path.getsize(path) > MAX_ADAPTER_CONFIG_BYTES:
        raise _issue("actor.lora.adapter_path", f"{path} is over {MAX_ADAPTER_CONFIG_BYTES} bytes", fix)
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise _issue("actor.lora.adapter_path", f"{path} cannot be read as JSON ({exc})", fix) from exc
    if not isinstance(raw, dict) or raw.get("peft_type") != "LORA":
        raise _issue("actor.lora.adapter_path", f"{path} is not a LoRA adapter (peft_type LORA)", fix)
    if raw.get("r") != rank or raw.get("lora_alpha") != alpha:
        raise _issue(
            "actor.lora.adapter_path",
            f"{path} has r {raw.get('r')}, lora_alpha {raw.get('lora_alpha')}; this run has rank {rank}, alpha {alpha:g}",
            "set actor.lora.rank and actor.lora.alpha to the adapter's",
        )


def stage_adapter_params(plan: LoraPlan, arch: ModelArch, layers: range, tp: int) -> int:
    """Adapter parameters one TP rank of a pipeline stage holding `layers` keeps."""
    return sum(adapter_params(arch, m, plan.rank, tp) for m in plan.modules if m.layer in layers)
