"""Cross-field validation: named rules that see the whole config and report every problem at once.

Each rule is a small generator registered with `@rule(name)`; it yields `Issue`s (errors or warnings) that
name the config path to change and the fix. `check_config` runs all of them, so a file with three
independent mistakes reports three errors. Rules never raise on odd values: sizes are checked for
positivity by one rule and the others guard against zero.

This is the one checker of what a run rejects: the data loader's file types, the plan's limits, the seed
range torch and numpy accept, and (with `filesystem=True`) the files a run reads or writes before any
worker starts: prompt files, the resume checkpoint and `trainer.output_dir`. `rlconf validate` and
`rltrain` (with or without --dry-run) run the same rules. Filesystem rules are separate because a config
is also checked where its files do not live (a verl import on a laptop, property tests).
Nothing here imports user code: `reward.function` is only checked for its form.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

from rlconf.config import (
    BUILTIN_REWARDS,
    BUILTIN_TOOLS,
    CHECKPOINT_CONTENTS,
    LAYOUT_FIELDS,
    ROLES,
    MegatronConfig,
    ModelArch,
    MultiTurnConfig,
    Optim,
    RLConfig,
    RolloutConfig,
)
from rlconf.errors import ConfigError, Issue, error, warning
from rlconf.fields import (
    Leaf,
    field_types,
    get_path,
    is_dataclass_type,
    iter_leaves,
    literal_values,
    strip_optional,
    tuple_item_types,
    type_name,
)
from rlconf.files import MAX_DATA_BYTES, check_regular
from rlconf.model_files import RULE as MODEL_FILES_RULE
from rlconf.model_files import model_files_issues
from rlconf.model_spec import (
    UNSUPPORTED_RULE,
    engine_gaps,
    expert_layout_issues,
    family_issues,
    read_model_arch,
)
from rlconf.reward_file import RULE as REWARD_FILE_RULE
from rlconf.reward_file import file_spec_issues, split_file_spec
from rlconf.run_length import RULE as RUN_LENGTH_RULE
from rlconf.run_length import resolved_or_same, run_length, setting_issues
from rlconf.tokenizer_check import RULE as TOKENIZER_RULE
from rlconf.tokenizer_check import tokenizer_issues

RuleFn = Callable[[RLConfig], Iterator[Issue]]

# Bounds that keep the plan's tables (rank grids, lr rows) to a size a controller can hold; far beyond any
# real run, they only turn absurd inputs into a ConfigError instead of an hour of list building. They live
# with the checker that enforces them (rule plan-limits); rlconf.plan re-exports them.
MAX_DEVICES = 1 << 17
MAX_TOTAL_STEPS = 100_000
MAX_INT = 1 << 40


@dataclass(frozen=True)
class Rule:
    """A named cross-field check; `fields` are glob patterns of the config paths it reads (for the docs)."""

    name: str
    doc: str
    fn: RuleFn
    fields: tuple[str, ...]
    filesystem: bool = False
    """Reads the filesystem (paths the run reads or writes); runs only when check_config is asked to."""

    def involves(self, path: str) -> bool:
        return any(fnmatch.fnmatchcase(path, pattern) for pattern in self.fields)


RULES: dict[str, Rule] = {}
# Names that a rule reports under, more specific than the rule itself (documented with their rule).
SUB_RULES: dict[str, str] = {
    "mini-batch-divides-batch": "batch-layout",
    "batch-divisible-by-dp-micro": "batch-layout",
    "mini-batch-covers-micro": "batch-layout",
    "token-budget-fits-sequence": "batch-layout",
}


def rule(name: str, *fields: str, filesystem: bool = False) -> Callable[[RuleFn], RuleFn]:
    def register(fn: RuleFn) -> RuleFn:
        RULES[name] = Rule(name, " ".join((fn.__doc__ or "").split()), fn, fields, filesystem)
        return fn

    return register


def check_config(config: RLConfig, *, filesystem: bool = False) -> tuple[Issue, ...]:
    """Run every rule; returns errors and warnings (an empty tuple means the config is clean).

    `filesystem=True` adds the rules that look at paths (prompt files, the resume checkpoint, the output
    folder) as the run would see them from the current directory: what `rlconf validate` and `rltrain`
    check before a run starts.
    """
    # A config built in Python (a library caller, a preset) skipped the loader's type checks; the other rules
    # do arithmetic on the values, so a value of the wrong type is reported alone.
    if mistyped := tuple(RULES[TYPE_RULE].fn(config)):
        return mistyped
    issues: list[Issue] = []
    # The total_epochs rules judge the config as given; the others see the step count it derives (warmup,
    # profile steps and critic warmup are checked against the run's real length).
    counted = resolved_or_same(config)
    for r in RULES.values():
        if r.name != TYPE_RULE and (filesystem or not r.filesystem):
            issues.extend(r.fn(config if r.name.startswith(RUN_LENGTH_RULE) else counted))
    return tuple(issues)


# -------------------------------------------------------------------------------------------- helpers
def rollout_tp(c: RLConfig) -> int:
    """The rollout's tensor parallel size: rollout.tensor_model_parallel_size, or the actor's when null."""
    tp = c.rollout.tensor_model_parallel_size
    return c.actor.megatron.tensor_model_parallel_size if tp is None else tp


def total_devices(c: RLConfig) -> int:
    return c.cluster.nnodes * c.cluster.gpus_per_node


def separate_devices(c: RLConfig) -> int:
    """Devices of the pools that are not the actor's (a separate rollout, critic or reward model)."""
    n = c.rollout.num_devices if c.rollout.placement == "separate" else 0
    if c.critic.enable and c.critic.placement == "separate":
        n += c.critic.num_devices
    rm = c.reward.reward_model
    if rm.enable and rm.placement == "separate":
        n += rm.num_devices
    return n


def actor_world(c: RLConfig) -> int:
    """Devices of the actor pool (shared by rollout and ref)."""
    return total_devices(c) - separate_devices(c)


def model_parallel(m: MegatronConfig) -> int:
    return m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size


def uses_ref(c: RLConfig) -> bool:
    return c.actor.use_kl_loss or c.algorithm.use_kl_in_reward


def _roles_present(c: RLConfig) -> set[str]:
    roles = {"generate_sequences", "actor_compute_log_prob", "actor_update", "reward_compute"}
    if uses_ref(c):
        roles.add("ref_compute_log_prob")
    if c.critic.enable:
        roles |= {"critic_compute_values", "critic_update"}
    return roles


def _megatron_roles(c: RLConfig) -> Iterator[tuple[str, MegatronConfig, int]]:
    """(config prefix, layout, world size) for every Megatron role present in the run."""
    aw = actor_world(c)
    yield "actor", c.actor.megatron, aw
    if uses_ref(c):
        yield "ref", c.ref.megatron, aw
    if c.critic.enable:
        yield "critic", c.critic.megatron, c.critic.num_devices if c.critic.placement == "separate" else aw
    rm = c.reward.reward_model
    if rm.enable:
        yield "reward.reward_model", rm.megatron, rm.num_devices if rm.placement == "separate" else aw


def builds_model_arch(c: RLConfig, prefix: str) -> bool:
    """Whether the role at config `prefix` builds the built-in `model.arch`; with a config.json of its own
    (model.path, critic.model_path, reward.reward_model.path) the plan reads and checks that instead."""
    own = {"critic": c.critic.model_path, "reward.reward_model": c.reward.reward_model.path}.get(prefix)
    return c.model.path is None and own is None


def _sizes_ok(c: RLConfig) -> bool:
    """Whether every size the arithmetic rules divide by is positive (the positivity rule reports the rest)."""
    return not any(True for _ in positive_sizes(c))


_POSITIVE_INT_FIELDS = re.compile(
    r"(_size|_size_per_gpu|_per_gpu|num_layers|hidden_size|num_attention_heads|num_query_groups|vocab_size"
    r"|max_position_embeddings|kv_channels|_length|total_steps|nnodes|gpus_per_node|ppo_epochs|^rollout\.n"
    r"|max_num_seqs|horizon|val\.n|num_moe_experts|sliding_window)$"
)
# Fields that match the pattern above but may legitimately be zero or negative.
_MAY_BE_NON_POSITIVE = {
    "rollout.top_k",
    "rollout.num_devices",
    "critic.num_devices",
    "reward.reward_model.num_devices",
}


# ---------------------------------------------------------------------------------------------- rules
TYPE_RULE = "type"


@cache
def _shape(tp: Any) -> tuple[str, bool, Any]:
    """(kind, whether None is allowed, detail) of a field type, worked out once per type (the walk below
    visits every field of every config compiled)."""
    inner, optional = strip_optional(tp)
    if is_dataclass_type(inner):
        return "section", optional, inner
    if (choices := literal_values(inner)) is not None:
        return "literal", optional, choices
    if (items := tuple_item_types(inner)) is not None:
        return "tuple", optional, items
    kinds = {bool: "bool", int: "int", float: "float", str: "str"}
    return kinds.get(inner, "any"), optional, inner


def _mistyped(value: Any, tp: Any, path: str) -> Iterator[Issue]:
    """The loader's type coercion (rlconf.load), as a check of a config built in Python."""
    kind, optional, detail = _shape(tp)
    if value is None:
        if not optional:
            yield error(path, f"expected {type_name(tp)}, got null", f"set {type_name(tp)}", TYPE_RULE)
        return
    if kind == "section":
        if not isinstance(value, detail):
            yield error(path, f"expected section {detail.__name__}, got {type(value).__name__}",
                        f"give {path} as a {detail.__name__}", TYPE_RULE)  # fmt: skip
            return
        for name, field_tp in field_types(detail).items():
            yield from _mistyped(getattr(value, name), field_tp, f"{path}.{name}" if path else name)
        return
    if kind == "tuple" and isinstance(value, tuple):
        item, variadic = detail
        if not variadic and len(value) != len(item):
            yield error(path, f"expected {len(item)} items, got {len(value)}", f"give {type_name(tp)}",
                        TYPE_RULE)  # fmt: skip
            return
        for i, v in enumerate(value):
            yield from _mistyped(v, item if variadic else item[i], f"{path}[{i}]")
        return
    if kind == "float" and isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):
            yield error(path, f"must be a finite number, got {value}", "write a finite number", TYPE_RULE)
        return
    if kind == "literal":
        ok = value in detail
    elif kind in ("bool", "str"):
        ok = isinstance(value, bool if kind == "bool" else str)
    elif kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = kind == "any"  # a float or tuple field holding something else; no other field types exist
    if not ok:
        yield error(path, f"expected {type_name(tp)}, got {type(value).__name__} {value!r:.60}",
                    f"set {type_name(tp)}", TYPE_RULE)  # fmt: skip


@rule(TYPE_RULE)  # every field: not listed field by field in the docs
def field_value_types(c: RLConfig) -> Iterator[Issue]:
    """Every value has its field's type, and floats are finite. Files and flags are checked for this when
    they are read (rlconf.load); this rule holds configs built in Python to the same standard, and the other
    rules run only on a config that passes it."""
    yield from _mistyped(c, RLConfig, "")


@rule(
    "positive-size",
    "*_size",
    "*_size_per_gpu",
    "*_per_gpu",
    "model.arch.*",
    "*_length",
    "trainer.total_steps",
    "cluster.nnodes",
    "cluster.gpus_per_node",
    "*.ppo_epochs",
    "rollout.n",
    "rollout.max_num_seqs",
    "*.horizon",
    "rollout.val.n",
)
def positive_sizes(c: RLConfig) -> Iterator[Issue]:
    """Sizes, counts, lengths and parallel degrees must be >= 1."""
    for path in _positive_paths():
        value = get_path(c, path)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            yield error(path, f"must be >= 1, got {value}", "use a positive integer", "positive-size")


@cache
def _leaves() -> tuple[Leaf, ...]:
    return tuple(iter_leaves(RLConfig))


@cache
def _positive_paths() -> tuple[str, ...]:
    """Fields positive-size checks (the rules that divide call it often: computed once)."""
    return tuple(
        leaf.path
        for leaf in _leaves()
        if leaf.path not in _MAY_BE_NON_POSITIVE and _POSITIVE_INT_FIELDS.search(leaf.path)
    )


@rule(
    "world-divisible-by-model-parallel",
    "cluster.nnodes",
    "cluster.gpus_per_node",
    "*.megatron.tensor_model_parallel_size",
    "*.megatron.pipeline_model_parallel_size",
    "*.megatron.context_parallel_size",
    "*.megatron.expert_model_parallel_size",
    "*.megatron.expert_tensor_parallel_size",
    "*.num_devices",
)
def world_divisible(c: RLConfig) -> Iterator[Issue]:
    """Each Megatron role's world size is divisible by tp x pp x cp, and by the expert layout."""
    if not _sizes_ok(c):
        return
    for prefix, m, world in _megatron_roles(c):
        mp = model_parallel(m)
        if world < 1:
            continue  # reported by the pool rule
        if world % mp:
            yield error(
                f"{prefix}.megatron.tensor_model_parallel_size",
                f"{prefix} world size {world} is not divisible by tp x pp x cp = "
                f"{m.tensor_model_parallel_size} x {m.pipeline_model_parallel_size} x {m.context_parallel_size} = {mp}",
                f"choose tp, pp and cp whose product divides {world}, or change cluster.nnodes x cluster.gpus_per_node",
                "world-divisible-by-model-parallel",
            )
            continue
        etp = m.expert_tensor_parallel_size or m.tensor_model_parallel_size
        ep_mp = etp * m.expert_model_parallel_size * m.pipeline_model_parallel_size
        if world % ep_mp:
            yield error(
                f"{prefix}.megatron.expert_model_parallel_size",
                f"{prefix} world size {world} is not divisible by expert tp x ep x pp = {ep_mp}",
                "choose expert_model_parallel_size and expert_tensor_parallel_size that divide the world / pp",
                "world-divisible-by-model-parallel",
            )


@rule(
    "engine-support",
    "*.megatron.context_parallel_size",
    "*.megatron.expert_model_parallel_size",
    "*.megatron.expert_tensor_parallel_size",
    "*.megatron.sequence_parallel",
    "model.arch.num_moe_experts",
    "model.arch.moe_ffn_hidden_size",
    "model.arch.ffn_hidden_size",
)
def engine_support(c: RLConfig) -> Iterator[Issue]:
    """Layouts the Megatron engine does not run yet. Context parallel runs through the engine's own SDPA
    attention (rltrain/megatron/context_parallel.py), with dense and mixture-of-experts layers (each CP rank
    routes its own tokens; megatron reduces the router's token counts over TP x CP) and with pipeline
    parallel (each stage's CP ranks send their own chunks' activations on): not with megatron's `local` or
    Transformer Engine attention or virtual pipeline parallel (its interleaved schedule hung at CP=2 x
    PP=2 x VPP=2 on CPU; not resolved yet). Expert parallel runs on mixture-of-experts models: for the
    built-in `model.arch` each role's ep divides num_moe_experts and its expert tp the expert width (the
    plan checks a config.json's architecture the same way), and a dense model takes no ep."""
    for prefix, m, _ in _megatron_roles(c):
        if m.context_parallel_size > 1:
            cp_path = f"{prefix}.megatron.context_parallel_size"
            unsupported = [
                (c.model.attention_backend in ("local", "te"),
                 f"with model.attention_backend: {c.model.attention_backend}", "model.attention_backend: sdpa"),
                ((m.virtual_pipeline_model_parallel_size or 1) > 1,
                 "with virtual pipeline parallel (the interleaved schedule)",
                 f"{prefix}.megatron.virtual_pipeline_model_parallel_size: null"),
            ]  # fmt: skip
            for bad, what, instead in unsupported:
                if bad:
                    yield error(
                        cp_path,
                        f"context parallel is not supported by the rlplan Megatron engine {what} yet",
                        f"use context_parallel_size: 1 or {instead}",
                        "engine-support",
                    )
        if not builds_model_arch(c, prefix) or not _sizes_ok(c):
            continue  # config.json: the plan checks it; a size < 1: positive-size reports it
        for path, message, fix in expert_layout_issues(
            c.model.arch, "model.arch", m.expert_model_parallel_size,
            m.expert_tensor_parallel_size or m.tensor_model_parallel_size, m.tensor_model_parallel_size,
            m.sequence_parallel,
        ):  # fmt: skip
            yield error(f"{prefix}.megatron.{path}", message, fix, "engine-support")


@rule("moe", "actor.router_replay", "model.arch.num_moe_experts", "rollout.engine",
      "rollout.tensor_model_parallel_size", "rollout.multi_turn.enable")  # fmt: skip
def moe_options(c: RLConfig) -> Iterator[Issue]:
    """Mixture-of-experts options need a MoE model: actor.router_replay on the built-in `model.arch` needs
    num_moe_experts (a config.json model is checked when the run builds it), and the routing is recorded by
    the embedded rollout engine in the actor's own layout (not vLLM, not a rollout tensor parallel size of
    its own)."""
    if not c.actor.router_replay:
        return
    if c.model.path is None and c.model.arch.num_moe_experts is None:
        yield error("actor.router_replay", "router replay needs a mixture-of-experts model; model.arch is dense "
                    "(num_moe_experts: null)", "set actor.router_replay: false, or a MoE model "
                    "(model.arch.num_moe_experts, or model.path to a MoE checkpoint)", "moe")  # fmt: skip
    if c.rollout.engine != "embedded":
        yield error("actor.router_replay", f"router replay records the routing of the embedded rollout engine, "
                    f"not rollout.engine: {c.rollout.engine}", "use rollout.engine: embedded or "
                    "actor.router_replay: false", "moe")  # fmt: skip
    if c.rollout.tensor_model_parallel_size is not None:
        yield error("actor.router_replay", "router replay records the routing of the rollout in the actor's "
                    "layout; a rollout tensor parallel size of its own is not recorded yet",
                    "use rollout.tensor_model_parallel_size: null or actor.router_replay: false", "moe")  # fmt: skip
    if c.rollout.multi_turn.enable:
        yield error("actor.router_replay", "router replay records one generation call per batch; a multi-turn "
                    "rollout generates in turns, whose routings are not joined yet",
                    "set actor.router_replay: false, or rollout.multi_turn.enable: false", "moe")  # fmt: skip


@rule(
    "rollout-engine",
    "rollout.engine",
    "rollout.tensor_model_parallel_size",
    "actor.megatron.tensor_model_parallel_size",
    "actor.megatron.pipeline_model_parallel_size",
    "actor.megatron.expert_model_parallel_size",
)
def rollout_engine(c: RLConfig) -> Iterator[Issue]:
    """A rollout tp of its own must divide or be a multiple of the actor's tp (the refit gathers or splits
    inside tp groups); rollout.engine: vllm needs CUDA and an importable vLLM (an optional extra), and its
    refit streams the weights of an actor without pipeline or expert parallel."""
    r, tp = c.rollout, c.actor.megatron.tensor_model_parallel_size
    rtp = r.tensor_model_parallel_size
    # A separate rollout receives whole tensors (the push) and slices them for any tp of its own.
    regrouped = r.placement == "colocated"
    if (
        regrouped
        and isinstance(rtp, int)
        and isinstance(tp, int)
        and rtp >= 1
        and tp >= 1
        and max(rtp, tp) % min(rtp, tp)
    ):
        choices = sorted({d for d in range(1, tp + 1) if tp % d == 0} | {tp * 2, tp * 4})
        yield error(
            "rollout.tensor_model_parallel_size",
            f"rollout tp = {rtp} neither divides nor is a multiple of the actor's tp = {tp}, so the actor's "
            "tensor-parallel shards cannot be regrouped into the rollout's",
            f"use one of {', '.join(map(str, choices))} (or null: the actor's layout, no weight copy)",
            "rollout-engine",
        )
    if r.engine == "vllm":
        installed = importlib.util.find_spec("vllm") is not None
        if c.cluster.device != "cuda":
            missing = "" if installed else " (and vLLM, an optional extra, is not installed here)"
            yield error(
                "rollout.engine",
                f"vLLM runs on CUDA devices only, but cluster.device = {c.cluster.device}{missing}",
                "use rollout.engine: embedded (rlplan's own engine, any device)",
                "rollout-engine",
            )
        elif not installed:
            yield error(
                "rollout.engine",
                "rollout.engine is vllm, but vLLM is not installed here (it is an optional extra: a CUDA-only "
                "wheel that needs its own torch version)",
                "pip install 'rlplan[vllm]' on a CUDA host, or use rollout.engine: embedded",
                "rollout-engine",
            )
        m = c.actor.megatron
        # weight_sync.iter_hf_weights gathers tp shards only: the refit cannot stream pp stages or experts.
        for name, size in (("pipeline_model_parallel_size", m.pipeline_model_parallel_size),
                           ("expert_model_parallel_size", m.expert_model_parallel_size)):  # fmt: skip
            if isinstance(size, int) and size > 1:
                yield error(
                    f"actor.megatron.{name}",
                    f"rollout.engine: vllm refits from an actor without {name.split('_model')[0]} parallel; "
                    f"{name} = {size}",
                    f"use actor.megatron.{name}: 1 (raise tensor_model_parallel_size instead), or "
                    "rollout.engine: embedded (it reshards any actor layout)",
                    "rollout-engine",
                )


@rule(
    "ref-layout-matches-actor",
    "ref.megatron.*_size",
    "actor.megatron.*_size",
)
def ref_layout(c: RLConfig) -> Iterator[Issue]:
    """The reference policy lives in the actor's processes (colocated), so it uses the actor's layout."""
    if not uses_ref(c):
        return
    for name in LAYOUT_FIELDS:
        ref_v, act_v = getattr(c.ref.megatron, name), getattr(c.actor.megatron, name)
        if ref_v != act_v:
            yield error(
                f"ref.megatron.{name}",
                f"ref {name} = {ref_v} differs from the actor's {act_v}; the reference policy runs in the actor's "
                "processes and shares its parallel groups",
                f"set ref.megatron.{name} = {act_v}",
                "ref-layout-matches-actor",
            )


@rule("device-pools", "*.placement", "*.num_devices", "cluster.gpus_per_node", "cluster.nnodes")
def device_pools(c: RLConfig) -> Iterator[Issue]:
    """Separate rollout / critic / reward-model pools have devices and leave some for the actor."""
    for prefix, enabled, placement, n in (
        ("rollout", True, c.rollout.placement, c.rollout.num_devices),
        ("critic", c.critic.enable, c.critic.placement, c.critic.num_devices),
        ("reward.reward_model", c.reward.reward_model.enable, c.reward.reward_model.placement,
         c.reward.reward_model.num_devices),
    ):  # fmt: skip
        if enabled and placement == "separate" and n < 1:
            yield error(
                f"{prefix}.num_devices",
                f"{prefix} has its own pool (placement: separate) but num_devices = {n}",
                "give it at least 1 device, or use placement: colocated",
                "device-pools",
            )
        if enabled and placement == "colocated" and n:
            yield warning(
                f"{prefix}.num_devices",
                f"num_devices = {n} is ignored with placement: colocated",
                "remove num_devices or use placement: separate",
                "device-pools",
            )
    if total_devices(c) >= 1 and actor_world(c) < 1:
        yield error(
            "cluster.gpus_per_node",
            f"separate pools use {separate_devices(c)} of {total_devices(c)} devices, none is left for the actor",
            "add devices or shrink the separate pools",
            "device-pools",
        )


PUSH_TIMEOUT_RANGE_S = (1.0, 86400.0)
"""rollout.push_timeout_s bounds: a store connect takes about a second at most; a day is far beyond any push."""


@rule(
    "rollout-placement",
    "rollout.placement",
    "rollout.num_devices",
    "rollout.engine",
    "rollout.tensor_model_parallel_size",
    "rollout.push_timeout_s",
    "algorithm.off_policy_steps",
    "actor.megatron.expert_model_parallel_size",
    "cluster.device",
)
def rollout_placement(c: RLConfig) -> Iterator[Issue]:
    """A separate rollout runs the embedded engine on whole tensor-parallel groups of its own devices and
    gets its weights by a push from the trainer; generating ahead (off_policy_steps > 0) needs it."""
    r, steps = c.rollout, c.algorithm.off_policy_steps
    if isinstance(steps, int) and steps < 0:
        yield error("algorithm.off_policy_steps", f"off_policy_steps = {steps} is negative",
                    "use 0 (on-policy) or the number of steps generation may run ahead", "rollout-placement")  # fmt: skip
    if not PUSH_TIMEOUT_RANGE_S[0] <= r.push_timeout_s <= PUSH_TIMEOUT_RANGE_S[1]:
        # Below a second the push groups cannot even connect to their store; above a day the process
        # groups' millisecond timeouts overflow (and a stuck push would hold the devices that long).
        yield error("rollout.push_timeout_s",
                    f"push_timeout_s = {r.push_timeout_s} is outside [{PUSH_TIMEOUT_RANGE_S[0]:g}, "
                    f"{PUSH_TIMEOUT_RANGE_S[1]:g}] seconds",
                    "use the most seconds a weight push may take, e.g. 600", "rollout-placement")  # fmt: skip
    if r.placement == "colocated":
        if isinstance(steps, int) and steps > 0:
            yield error(
                "algorithm.off_policy_steps",
                f"off_policy_steps = {steps} generates the next batch while the current one trains, which needs "
                "devices of its own for the rollout; rollout.placement is colocated",
                "set rollout.placement: separate and rollout.num_devices (the trainer keeps the other devices), "
                "or off_policy_steps: 0",
                "rollout-placement",
            )
        return
    if c.cluster.device == "npu":
        yield error(
            "rollout.placement",
            "the weight push to a separate rollout pool runs over gloo (cpu) or NCCL (cuda); HCCL is not wired",
            "use rollout.placement: colocated on npu",
            "rollout-placement",
        )
    if r.engine != "embedded":
        yield error(
            "rollout.engine",
            f"rollout.placement: separate runs the embedded engine; rollout.engine = {r.engine}",
            "use rollout.engine: embedded, or rollout.placement: colocated",
            "rollout-placement",
        )
    tp = rollout_tp(c)
    if r.num_devices >= 1 and isinstance(tp, int) and tp >= 1 and r.num_devices % tp:
        yield error(
            "rollout.num_devices",
            f"the separate rollout's {r.num_devices} devices do not hold whole tensor-parallel groups of {tp}",
            f"use a multiple of {tp} devices, or set rollout.tensor_model_parallel_size to a divisor of "
            f"{r.num_devices}",
            "rollout-placement",
        )
    ep = c.actor.megatron.expert_model_parallel_size
    if isinstance(ep, int) and ep > 1:
        yield error(
            "actor.megatron.expert_model_parallel_size",
            f"the weight push to a separate rollout streams tensor-parallel shards; with expert parallel = {ep} "
            "each trainer rank holds other experts",
            "use actor.megatron.expert_model_parallel_size: 1 with rollout.placement: separate, or "
            "rollout.placement: colocated",
            "rollout-placement",
        )


@rule(
    "heads-divisible-by-tp",
    "model.arch.num_attention_heads",
    "model.arch.num_query_groups",
    "*tensor_model_parallel_size",
)
def heads_divisible(c: RLConfig) -> Iterator[Issue]:
    """Attention heads and query groups are divisible by each role's tensor parallel size."""
    if c.model.path is not None or not _sizes_ok(c):
        return  # the architecture comes from config.json; the plan checks it
    a = c.model.arch
    layouts = [(p, m.tensor_model_parallel_size) for p, m, _ in _megatron_roles(c) if builds_model_arch(c, p)]
    layouts.append(("rollout", rollout_tp(c)))
    for prefix, tp in layouts:
        field = f"{prefix}.tensor_model_parallel_size" if prefix == "rollout" else (
            f"{prefix}.megatron.tensor_model_parallel_size")  # fmt: skip
        for name, value in (
            ("num_attention_heads", a.num_attention_heads),
            ("num_query_groups", a.num_query_groups),
        ):
            if value % tp:
                yield error(
                    field,
                    f"model.arch.{name} = {value} is not divisible by {prefix} tp = {tp}",
                    f"use a tensor parallel size that divides {value}",
                    "heads-divisible-by-tp",
                )
    if a.num_attention_heads % a.num_query_groups:
        yield error(
            "model.arch.num_query_groups",
            f"num_attention_heads = {a.num_attention_heads} is not a multiple of num_query_groups = {a.num_query_groups}",
            "use a number of query groups that divides the number of heads",
            "heads-divisible-by-tp",
        )


@rule(
    "layers-divisible-by-pp",
    "model.arch.num_layers",
    "*.megatron.pipeline_model_parallel_size",
    "*.megatron.virtual_pipeline_model_parallel_size",
)
def layers_divisible(c: RLConfig) -> Iterator[Issue]:
    """num_layers is divisible by pp (x vpp when set); vpp needs pp > 1."""
    if not _sizes_ok(c):
        return
    for prefix, m, _ in _megatron_roles(c):
        pp, vpp = m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size
        if vpp is not None and pp <= 1:
            yield error(
                f"{prefix}.megatron.virtual_pipeline_model_parallel_size",
                "virtual pipeline stages need pipeline_model_parallel_size > 1",
                "set virtual_pipeline_model_parallel_size: null, or raise pipeline_model_parallel_size",
                "layers-divisible-by-pp",
            )
            continue
        if not builds_model_arch(c, prefix):
            continue  # the plan checks the layers of a config.json
        chunks = pp * (vpp or 1)
        if c.model.arch.num_layers % chunks:
            yield error(
                f"{prefix}.megatron.pipeline_model_parallel_size",
                f"model.arch.num_layers = {c.model.arch.num_layers} is not divisible by pp x vpp = {chunks}",
                "choose pp (and vpp) whose product divides the number of layers",
                "layers-divisible-by-pp",
            )


@rule("sequence-parallel-needs-tp", "*.megatron.sequence_parallel", "*.megatron.tensor_model_parallel_size")
def sequence_parallel(c: RLConfig) -> Iterator[Issue]:
    """sequence_parallel with tp = 1 is switched off (a warning, as megatron does; the plan shows it off)."""
    for prefix, m, _ in _megatron_roles(c):
        if m.sequence_parallel and m.tensor_model_parallel_size == 1:
            yield warning(
                f"{prefix}.megatron.sequence_parallel",
                "sequence_parallel needs tensor_model_parallel_size > 1; it is switched off for this run",
                "set sequence_parallel: false, or raise tensor_model_parallel_size",
                "sequence-parallel-needs-tp",
            )


def _batch_checks(
    c: RLConfig,
    prefix: str,
    mini: int,
    micro: int,
    dynamic: bool,
    token_budget: int,
    world: int,
    m: MegatronConfig,
) -> Iterator[Issue]:
    n = c.rollout.n
    tbs = c.data.train_batch_size
    dp = world // model_parallel(m) if world % model_parallel(m) == 0 else 0
    if tbs % mini:
        yield error(
            f"{prefix}.ppo_mini_batch_size",
            f"ppo_mini_batch_size = {mini} does not divide data.train_batch_size = {tbs}",
            f"use a divisor of {tbs} (prompts per mini-batch)",
            "mini-batch-divides-batch",
        )
    if dynamic:
        need = c.data.max_prompt_length + c.rollout.max_response_length
        if token_budget < need:
            yield error(
                f"{prefix}.ppo_max_token_len_per_gpu",
                f"token budget {token_budget} is smaller than one full sequence "
                f"(max_prompt_length + max_response_length = {need})",
                f"set ppo_max_token_len_per_gpu >= {need}",
                "token-budget-fits-sequence",
            )
        return
    if dp < 1:
        return  # the layout rule reports it
    if (tbs * n) % (dp * micro):
        yield error(
            f"{prefix}.ppo_micro_batch_size_per_gpu",
            f"responses per step (train_batch_size x rollout.n = {tbs} x {n} = {tbs * n}) are not divisible by "
            f"data-parallel size x micro-batch = {dp} x {micro}",
            "choose train_batch_size, rollout.n and the micro-batch so the responses split evenly",
            "batch-divisible-by-dp-micro",
        )
    per_rank = mini * n / dp
    if per_rank < micro:
        yield error(
            f"{prefix}.ppo_micro_batch_size_per_gpu",
            f"a mini-batch gives each of {dp} data-parallel ranks {per_rank:g} responses, fewer than "
            f"ppo_micro_batch_size_per_gpu = {micro}",
            f"lower the micro-batch to <= {int(per_rank)} or raise ppo_mini_batch_size",
            "mini-batch-covers-micro",
        )
    elif per_rank != int(per_rank) or int(per_rank) % micro:
        yield error(
            f"{prefix}.ppo_mini_batch_size",
            f"a mini-batch of {mini} prompts x {n} responses over {dp} data-parallel ranks gives {per_rank:g} "
            f"responses per rank, not a multiple of ppo_micro_batch_size_per_gpu = {micro}",
            "make ppo_mini_batch_size x rollout.n / dp a multiple of the micro-batch",
            "mini-batch-covers-micro",
        )


@rule(
    "batch-layout",
    "data.train_batch_size",
    "rollout.n",
    "*.ppo_mini_batch_size",
    "*.ppo_micro_batch_size_per_gpu",
    "*.use_dynamic_bsz",
    "*.ppo_max_token_len_per_gpu",
    "data.max_prompt_length",
    "rollout.max_response_length",
)
def batch_layout(c: RLConfig) -> Iterator[Issue]:
    """Batches split evenly: mini-batches divide the batch; responses divide over dp x micro-batch; a
    mini-batch covers a micro-batch per rank; the token budget fits one full sequence."""
    if not _sizes_ok(c) or actor_world(c) < 1:
        return
    a = c.actor
    yield from _batch_checks(
        c, "actor", a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_gpu, a.use_dynamic_bsz,
        a.ppo_max_token_len_per_gpu, actor_world(c), a.megatron,
    )  # fmt: skip
    if c.critic.enable:
        cr = c.critic
        world = cr.num_devices if cr.placement == "separate" else actor_world(c)
        if world >= 1:
            yield from _batch_checks(
                c, "critic", cr.ppo_mini_batch_size, cr.ppo_micro_batch_size_per_gpu, cr.use_dynamic_bsz,
                cr.ppo_max_token_len_per_gpu, world, cr.megatron,
            )  # fmt: skip


@rule("estimator-needs", "algorithm.adv_estimator", "rollout.n", "critic.enable")
def estimator_needs(c: RLConfig) -> Iterator[Issue]:
    """grpo, rloo, grpo_passk and gpg need rollout.n >= 2; gae needs a critic; a critic without gae is
    unused."""
    est = c.algorithm.adv_estimator
    if est in ("grpo", "rloo", "grpo_passk", "gpg") and c.rollout.n < 2:
        yield error(
            "rollout.n",
            f"{est} compares responses to the same prompt, but rollout.n = {c.rollout.n}",
            "set rollout.n >= 2 (4-16 is common)",
            "estimator-needs",
        )
    if est == "gae" and not c.critic.enable:
        yield error(
            "critic.enable",
            "adv_estimator gae needs a value model, but the critic is disabled",
            "set critic.enable: true, or use algorithm.adv_estimator: grpo",
            "estimator-needs",
        )
    if est != "gae" and c.critic.enable:
        yield warning(
            "critic.enable",
            f"the critic is trained but {est} does not use its values",
            "set critic.enable: false, or use algorithm.adv_estimator: gae",
            "estimator-needs",
        )


def _optim_checks(prefix: str, o: Optim, total_steps: int) -> Iterator[Issue]:
    p = f"{prefix}.optim"
    if o.lr <= 0:
        yield error(
            f"{p}.lr", f"learning rate must be > 0, got {o.lr}", "use e.g. 1e-6 for an actor", "optim"
        )
    if o.min_lr < 0 or (o.lr > 0 and o.min_lr > o.lr):
        yield error(
            f"{p}.min_lr", f"min_lr = {o.min_lr} must be in [0, lr = {o.lr}]", "set min_lr <= lr", "optim"
        )
    if o.lr_warmup_init < 0 or (o.lr > 0 and o.lr_warmup_init > o.lr):
        yield error(
            f"{p}.lr_warmup_init", f"lr_warmup_init = {o.lr_warmup_init} must be in [0, lr]", "set 0", "optim"
        )
    if not 0.0 <= o.lr_warmup_steps_ratio <= 1.0:
        yield error(
            f"{p}.lr_warmup_steps_ratio",
            f"must be in [0, 1], got {o.lr_warmup_steps_ratio}",
            "use e.g. 0.05",
            "optim",
        )
    if o.lr_warmup_steps is not None and not 0 <= o.lr_warmup_steps <= total_steps:
        yield error(
            f"{p}.lr_warmup_steps",
            f"warmup of {o.lr_warmup_steps} steps is outside the run's 0..{total_steps} steps",
            f"use at most trainer.total_steps = {total_steps}",
            "optim",
        )
    if o.lr_decay_steps is not None and o.lr_decay_steps < 1:
        yield error(
            f"{p}.lr_decay_steps", f"must be >= 1, got {o.lr_decay_steps}", "or null for total steps", "optim"
        )
    if o.lr_wsd_decay_steps is not None and o.lr_wsd_decay_steps < 1:
        yield error(
            f"{p}.lr_wsd_decay_steps", f"must be >= 1, got {o.lr_wsd_decay_steps}", "or null", "optim"
        )
    if o.weight_decay < 0:
        yield error(f"{p}.weight_decay", f"must be >= 0, got {o.weight_decay}", "use e.g. 0.01", "optim")
    for i, b in enumerate(o.betas):
        if not 0.0 <= b < 1.0:
            yield error(f"{p}.betas[{i}]", f"must be in [0, 1), got {b}", "use e.g. [0.9, 0.999]", "optim")
    if o.eps <= 0:
        yield error(f"{p}.eps", f"must be > 0, got {o.eps}", "use e.g. 1e-8", "optim")
    if o.clip_grad < 0:
        yield error(f"{p}.clip_grad", f"must be >= 0, got {o.clip_grad}", "use 1.0, or 0 to disable", "optim")


@rule("optim", "*.optim.*")
def optim(c: RLConfig) -> Iterator[Issue]:
    """lr > 0, min_lr <= lr, warmup within the run, sane Adam settings (actor, and critic when enabled)."""
    yield from _optim_checks("actor", c.actor.optim, c.trainer.total_steps)
    if c.critic.enable:
        yield from _optim_checks("critic", c.critic.optim, c.trainer.total_steps)


@rule("checkpoint-contents", "*.checkpoint.*", "trainer.save_freq")
def checkpoint_contents(c: RLConfig) -> Iterator[Issue]:
    """load_contents is within save_contents; no duplicates; the actor saves the model."""
    roles = [("actor", c.actor.checkpoint)] + ([("critic", c.critic.checkpoint)] if c.critic.enable else [])
    for prefix, ck in roles:
        for name in ("save_contents", "load_contents"):
            items = getattr(ck, name)
            for i, item in enumerate(items):
                if items.index(item) != i:
                    yield warning(
                        f"{prefix}.checkpoint.{name}[{i}]",
                        f"{item!r} is listed twice",
                        "remove it",
                        "checkpoint-contents",
                    )
        missing = [x for x in ck.load_contents if x not in ck.save_contents]
        if missing:
            yield error(
                f"{prefix}.checkpoint.load_contents",
                f"loads {', '.join(missing)} which save_contents never writes",
                f"add {', '.join(missing)} to save_contents or drop it from load_contents "
                f"(allowed: {', '.join(CHECKPOINT_CONTENTS)})",
                "checkpoint-contents",
            )
        if "model" not in ck.save_contents and c.trainer.save_freq > 0:
            yield error(
                f"{prefix}.checkpoint.save_contents",
                "checkpoints without `model` cannot resume training",
                "add model to save_contents",
                "checkpoint-contents",
            )


@rule("trainer", "trainer.*")
def trainer_rules(c: RLConfig) -> Iterator[Issue]:
    """Save/test frequencies are >= 0, resume_path mode names a path, retention keeps >= 1."""
    t = c.trainer
    for name in ("save_freq", "test_freq", "critic_warmup"):
        if getattr(t, name) < 0:
            yield error(
                f"trainer.{name}", f"must be >= 0, got {getattr(t, name)}", "use 0 to disable", "trainer"
            )
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        yield error(
            "trainer.resume_from_path",
            "resume_mode is resume_path but no resume_from_path is given",
            "set resume_from_path to a checkpoints/global_step_N folder, or use resume_mode: auto",
            "trainer",
        )
    if t.max_ckpt_to_keep is not None and t.max_ckpt_to_keep < 1:
        yield error(
            "trainer.max_ckpt_to_keep",
            f"must be >= 1, got {t.max_ckpt_to_keep}",
            "or null to keep all",
            "trainer",
        )
    if t.max_bad_steps < 1:
        yield error("trainer.max_bad_steps", f"must be >= 1, got {t.max_bad_steps}",
                    "use e.g. 3 (bad steps in a row before the run stops)", "trainer")  # fmt: skip
    if not t.output_dir.strip():
        yield error("trainer.output_dir", "is empty: the run would write into the current directory",
                    "name a folder, e.g. --trainer.output_dir outputs/my-run", "trainer")  # fmt: skip
    if c.critic.enable and t.critic_warmup >= t.total_steps > 0:
        yield warning("trainer.critic_warmup", "the actor never updates: critic_warmup >= total_steps",
                      "lower critic_warmup", "trainer")  # fmt: skip


VLLM_ONLY_ROLLOUT_FIELDS = ("gpu_memory_utilization", "max_num_seqs", "free_cache_engine")
"""Rollout fields that only rollout.engine: vllm reads (rltrain/rollout/vllm_adapter.py)."""


MIN_TEMPERATURE = 1e-3
"""Smallest sampling temperature: logits / temperature stays finite in fp32 for any logit below 3e35."""
MAX_TEMPERATURE = 100.0
"""Largest sampling temperature: above it sampling is uniform noise in all but name."""


@rule("sampling", "rollout.*", "data.max_prompt_length", "model.arch.max_position_embeddings")
def sampling(c: RLConfig) -> Iterator[Issue]:
    """Sampling parameters are in range; sequences fit the model."""
    r = c.rollout
    if not MIN_TEMPERATURE <= r.temperature <= MAX_TEMPERATURE:  # NaN fails too
        yield error("rollout.temperature", f"training rollouts must sample with a temperature in [{MIN_TEMPERATURE}"
                    f", {MAX_TEMPERATURE}], got {r.temperature} (logits / temperature overflows below it)",
                    "use a temperature > 0 (1.0 is usual)", "sampling")  # fmt: skip
    if not 0 < r.top_p <= 1:
        yield error("rollout.top_p", f"must be in (0, 1], got {r.top_p}", "use 1.0 to disable", "sampling")
    if r.top_k == 0 or r.top_k < -1:
        yield error("rollout.top_k", f"must be >= 1, or -1 to disable, got {r.top_k}", "use -1", "sampling")
    if not 0 <= r.min_p < 1:
        yield error("rollout.min_p", f"must be in [0, 1), got {r.min_p}", "use 0 to disable", "sampling")
    if not 0 < r.gpu_memory_utilization <= 1:
        yield error("rollout.gpu_memory_utilization", f"must be in (0, 1], got {r.gpu_memory_utilization}",
                    "use e.g. 0.5", "sampling")  # fmt: skip
    if not (r.val.temperature == 0 or MIN_TEMPERATURE <= r.val.temperature <= MAX_TEMPERATURE):
        yield error("rollout.val.temperature", f"must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
                    f"got {r.val.temperature}", "use 0 for greedy", "sampling")  # fmt: skip
    if not 0 < r.val.top_p <= 1:
        yield error("rollout.val.top_p", f"must be in (0, 1], got {r.val.top_p}", "use 1.0", "sampling")
    if r.engine == "embedded":
        # Fields only the vLLM adapter reads: a changed value would silently do nothing.
        for name in VLLM_ONLY_ROLLOUT_FIELDS:
            if getattr(r, name) != getattr(RolloutConfig(), name):
                yield warning(f"rollout.{name}", "applies to rollout.engine: vllm only; the embedded engine "
                              "does not read it", f"remove rollout.{name}, or set rollout.engine: vllm",
                              "sampling")  # fmt: skip
    if c.model.path is None:
        need = c.data.max_prompt_length + r.max_response_length
        if need > c.model.arch.max_position_embeddings:
            yield error(
                "rollout.max_response_length",
                f"prompt + response = {need} tokens exceeds model.arch.max_position_embeddings = "
                f"{c.model.arch.max_position_embeddings}",
                "shorten data.max_prompt_length / rollout.max_response_length or raise max_position_embeddings",
                "sampling",
            )


@rule(
    "ppo-loss",
    "actor.clip_ratio*",
    "actor.entropy_coeff",
    "actor.kl_loss_coef",
    "actor.use_kl_loss",
    "algorithm.*",
    "critic.cliprange_value",
)
def ppo_loss(c: RLConfig) -> Iterator[Issue]:
    """Clip ranges are positive, dual clip > 1, coefficients >= 0; KL in loss and reward is doubled."""
    a = c.actor
    for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        v = getattr(a, name)
        if v is not None and v <= 0:
            yield error(f"actor.{name}", f"must be > 0, got {v}", "use e.g. 0.2", "ppo-loss")
    if a.clip_ratio_c <= 1:
        yield error(
            "actor.clip_ratio_c", f"dual-clip bound must be > 1, got {a.clip_ratio_c}", "use 3.0", "ppo-loss"
        )
    for name in ("entropy_coeff", "kl_loss_coef"):
        if getattr(a, name) < 0:
            yield error(
                f"actor.{name}", f"must be >= 0, got {getattr(a, name)}", "use 0 to disable", "ppo-loss"
            )
    if a.use_kl_loss and c.algorithm.use_kl_in_reward:
        yield warning("actor.use_kl_loss", "KL is penalised twice (in the loss and in the reward)",
                      "choose one: actor.use_kl_loss or algorithm.use_kl_in_reward", "ppo-loss")  # fmt: skip
    al = c.algorithm
    if not 0 <= al.gamma <= 1:
        yield error(
            "algorithm.gamma", f"must be in [0, 1], got {al.gamma}", "use 1.0 for outcome rewards", "ppo-loss"
        )
    if not 0 <= al.lam <= 1:
        yield error("algorithm.lam", f"must be in [0, 1], got {al.lam}", "use 0.95", "ppo-loss")
    if al.kl_ctrl.kl_coef < 0:
        yield error("algorithm.kl_ctrl.kl_coef", "must be >= 0", "use e.g. 0.001", "ppo-loss")
    if al.kl_ctrl.type == "adaptive" and al.kl_ctrl.target_kl <= 0:
        yield error(
            "algorithm.kl_ctrl.target_kl", "adaptive control needs target_kl > 0", "use e.g. 0.1", "ppo-loss"
        )
    if c.critic.enable and c.critic.cliprange_value <= 0:
        yield error("critic.cliprange_value", "must be > 0", "use 0.5", "ppo-loss")


_USER_FN = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")


@rule("reward-function", "reward.function")
def reward_function(c: RLConfig) -> Iterator[Issue]:
    """reward.function is a built-in name, an importable `package.module:function` path or a
    `path/to/file.py:function` (verl's custom_reward_function)."""
    fn = c.reward.function
    if fn in BUILTIN_REWARDS or _USER_FN.match(fn):
        return
    if split_file_spec(fn) is not None:
        yield from file_spec_issues(fn, filesystem=False)
        return
    import difflib

    hint = difflib.get_close_matches(fn, BUILTIN_REWARDS, n=1)
    yield error(
        "reward.function",
        f"{fn!r} is neither a built-in reward, a `module:function` path nor a `file.py:function`",
        (f"did you mean `{hint[0]}`? " if hint else "") + f"built-ins: {', '.join(BUILTIN_REWARDS)}",
        "reward-function",
    )


@rule(REWARD_FILE_RULE, "reward.function", filesystem=True)
def reward_function_file(c: RLConfig) -> Iterator[Issue]:
    """A `path/to/file.py:function` reward is a regular Python file of bounded size that parses and
    defines the function at its top level (checked with `ast`: the file is never run here)."""
    if split_file_spec(c.reward.function) is not None:
        yield from file_spec_issues(c.reward.function, filesystem=True)


@rule(TOKENIZER_RULE, "model.path", "model.tokenizer_path", filesystem=True)
def tokenizer_load(c: RLConfig) -> Iterator[Issue]:
    """The model folder's tokenizer loads: the packages are installed, the folder has tokenizer files,
    tokenizer.json loads, tokenizer_config.json parses and the chat template compiles (rlconf.tokenizer_check:
    no torch, bounded reads)."""
    yield from tokenizer_issues(c.model)


@rule("multi-turn", "rollout.multi_turn.*", "rollout.max_response_length")
def multi_turn(c: RLConfig) -> Iterator[Issue]:
    """rollout.multi_turn: turns, lengths and tool limits are positive, max_total_tokens fits in
    rollout.max_response_length (the plan sizes sequences by it), tools are built-in names or
    `module:function` paths and there is at least one when the agent loop is on."""
    mt, path = c.rollout.multi_turn, "rollout.multi_turn"
    for name in ("max_assistant_turns", "max_tool_response_length", "tool_memory_mib", "max_parallel_tools"):
        if getattr(mt, name) < 1:
            yield error(f"{path}.{name}", f"must be >= 1, got {getattr(mt, name)}",
                        f"use the default {getattr(MultiTurnConfig(), name)}", "multi-turn")  # fmt: skip
    if mt.tool_timeout_s <= 0:
        yield error(f"{path}.tool_timeout_s", f"must be > 0, got {mt.tool_timeout_s}", "use e.g. 5.0",
                    "multi-turn")  # fmt: skip
    limit = c.rollout.max_response_length
    if mt.max_total_tokens is not None and not 1 <= mt.max_total_tokens <= limit:
        yield error(f"{path}.max_total_tokens",
                    f"must be 1..rollout.max_response_length = {limit} (the plan sizes sequences by it), got "
                    f"{mt.max_total_tokens}",
                    "raise rollout.max_response_length, or leave max_total_tokens null to use it", "multi-turn")  # fmt: skip
    if mt.enable and not mt.tools and mt.interaction is None:
        yield error(f"{path}.tools", "the agent loop is on but has no tool and no interaction",
                    "list tools, e.g. [calculator], or set rollout.multi_turn.enable: false", "multi-turn")  # fmt: skip
    for i, spec in enumerate(mt.tools):
        if spec not in BUILTIN_TOOLS and not _USER_FN.match(spec):
            yield error(f"{path}.tools[{i}]", f"{spec!r} is neither a built-in tool nor a `module:function` path",
                        f"built-ins: {', '.join(BUILTIN_TOOLS)}; user tools: package.module:function",
                        "multi-turn")  # fmt: skip
    if mt.interaction is not None and not _USER_FN.match(mt.interaction):
        yield error(f"{path}.interaction", f"{mt.interaction!r} is not a `module:Class` path",
                    "name an importable class, e.g. my_envs.math:Checker", "multi-turn")  # fmt: skip


@cache
def sandbox_problem() -> str | None:
    """What keeps this machine from building the python tool's sandbox, or None. It runs the sandbox itself
    once per process on a probe program (`python -I -S rltrain/tools/sandbox.py --probe`): the check is the
    mechanism, not a guess about it. rlconf imports nothing of rltrain; it only runs that file."""
    spec = importlib.util.find_spec("rltrain")
    if spec is None or not spec.submodule_search_locations:
        return "rltrain is not installed"
    script = os.path.join(next(iter(spec.submodule_search_locations)), "tools", "sandbox.py")
    exe = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    try:
        done = subprocess.run([exe, "-I", "-S", script, "--probe"], capture_output=True, text=True, timeout=30,
                              stdin=subprocess.DEVNULL)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the sandbox probe did not run: {exc}"
    answer = (done.stdout.strip().splitlines() or [done.stderr.strip() or f"exit code {done.returncode}"])[-1]
    return None if done.returncode == 0 and answer == "ok" else answer


@rule("tool-sandbox", "rollout.multi_turn.tools", "rollout.multi_turn.sandbox", filesystem=True)
def tool_sandbox(c: RLConfig) -> Iterator[Issue]:
    """The python tool runs model-written code: with rollout.multi_turn.sandbox isolated (the default) this
    machine must be able to build the sandbox (user, mount, PID and network namespaces, seccomp); the check
    builds it once. sandbox none is allowed, with a warning."""
    mt = c.rollout.multi_turn
    if not mt.enable or "python" not in mt.tools:
        return
    if mt.sandbox == "none":
        yield warning("rollout.multi_turn.sandbox",
                      "none: the python tool runs model-written code without isolation (your files, your network)",
                      "use sandbox: isolated unless you trust every line the model writes", "tool-sandbox")  # fmt: skip
        return
    if (problem := sandbox_problem()) is not None:
        yield error("rollout.multi_turn.tools",
                    f"the python tool needs a sandbox this machine cannot build: {problem}",
                    "enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 / "
                    "user.max_user_namespaces > 0; in Docker run with a seccomp profile that allows unshare, or "
                    "--privileged), install libseccomp (Debian: libseccomp2), or drop `python` from the tools; "
                    "`rollout.multi_turn.sandbox: none` runs it unisolated for code you trust", "tool-sandbox")  # fmt: skip


PROMPT_FILE_TYPES = (".parquet", ".jsonl")
"""Suffixes the data loader reads (rltrain.data; case-insensitive)."""


@rule("policy-loss", "actor.policy_loss.*", "actor.loss_agg_mode")
def policy_loss_options(c: RLConfig) -> Iterator[Issue]:
    """The options of actor.policy_loss are in range: ratios in (0, 1], clip_cov_lb < clip_cov_ub,
    ppo_kl_coef >= 0, SAPO temperatures > 0. GSPO and SAPO aggregate their policy term seq-mean-token-mean
    (their papers' objectives, as verl): another actor.loss_agg_mode is a warning (it still aggregates the
    entropy and KL terms)."""
    pl = c.actor.policy_loss
    if pl.loss_mode in ("gspo", "sapo") and c.actor.loss_agg_mode != "seq-mean-token-mean":
        yield warning("actor.loss_agg_mode", f"{pl.loss_mode} aggregates its policy loss seq-mean-token-mean "
                      f"(its paper's objective, as verl); {c.actor.loss_agg_mode} applies to the entropy and "
                      "KL terms only", "set actor.loss_agg_mode: seq-mean-token-mean", "policy-loss")  # fmt: skip
    for name in ("clip_cov_ratio", "kl_cov_ratio"):
        v = getattr(pl, name)
        if not 0 < v <= 1:
            yield error(f"actor.policy_loss.{name}", f"a fraction of tokens must be in (0, 1], got {v}",
                        "use e.g. 0.0002 (the paper's value)", "policy-loss")  # fmt: skip
    if pl.clip_cov_lb >= pl.clip_cov_ub:
        yield error("actor.policy_loss.clip_cov_lb",
                    f"the covariance band ({pl.clip_cov_lb}, {pl.clip_cov_ub}) is empty",
                    "set clip_cov_lb < clip_cov_ub (the paper uses 1 and 5)", "policy-loss")  # fmt: skip
    if pl.ppo_kl_coef < 0:
        yield error("actor.policy_loss.ppo_kl_coef", f"must be >= 0, got {pl.ppo_kl_coef}", "use e.g. 0.1",
                    "policy-loss")  # fmt: skip
    for name in ("tau_pos", "tau_neg"):
        if getattr(pl, name) <= 0:
            yield error(f"actor.policy_loss.{name}", f"a gate temperature must be > 0, got {getattr(pl, name)}",
                        "use the SAPO paper's tau_pos 1.0, tau_neg 1.05", "policy-loss")  # fmt: skip


@rule("filter-groups", "algorithm.filter_groups.*", "rollout.n")
def filter_groups(c: RLConfig) -> Iterator[Issue]:
    """DAPO dynamic sampling: max_num_gen_batches >= 0, and groups of >= 2 responses to compare."""
    fg = c.algorithm.filter_groups
    if fg.max_num_gen_batches < 0:
        yield error("algorithm.filter_groups.max_num_gen_batches", f"must be >= 0, got {fg.max_num_gen_batches}",
                    "use 0 for no bound, or e.g. 10", "filter-groups")  # fmt: skip
    if fg.enable and c.rollout.n < 2:
        yield warning("algorithm.filter_groups.enable",
                      "with rollout.n = 1 every group has one response and is kept: the filter does nothing",
                      "set rollout.n >= 2, or algorithm.filter_groups.enable: false", "filter-groups")  # fmt: skip


@rule("overlong-buffer", "reward.overlong_buffer.*", "rollout.max_response_length")
def overlong_buffer(c: RLConfig) -> Iterator[Issue]:
    """The overlong buffer fits in the response length and its penalty factor is >= 0."""
    ob = c.reward.overlong_buffer
    if ob.enable and not 0 < ob.len <= c.rollout.max_response_length:
        yield error("reward.overlong_buffer.len",
                    f"the buffer must be 1..rollout.max_response_length = {c.rollout.max_response_length} tokens, "
                    f"got {ob.len}",
                    f"set reward.overlong_buffer.len to e.g. {max(c.rollout.max_response_length // 4, 1)} "
                    "(DAPO: 4096 of 20480)", "overlong-buffer")  # fmt: skip
    if ob.penalty_factor < 0:
        yield error("reward.overlong_buffer.penalty_factor", f"must be >= 0, got {ob.penalty_factor}",
                    "use 1.0 (DAPO)", "overlong-buffer")  # fmt: skip


@rule("rollout-correction", "algorithm.rollout_correction.*")
def rollout_correction(c: RLConfig) -> Iterator[Issue]:
    """Truncation and rejection thresholds of rollout correction are > 1."""
    rc = c.algorithm.rollout_correction
    for name in ("rollout_is_threshold", "rollout_rs_threshold"):
        v = getattr(rc, name)
        if v <= 1:
            yield error(f"algorithm.rollout_correction.{name}", f"a ratio bound must be > 1, got {v}",
                        "use e.g. 2.0", "rollout-correction")  # fmt: skip


@rule("data-files", "data.train_files", "data.val_files")
def data_files(c: RLConfig) -> Iterator[Issue]:
    """Prompt files are .parquet or .jsonl (the types the data loader reads)."""
    for name in ("train_files", "val_files"):
        for i, f in enumerate(getattr(c.data, name)):
            if not f.lower().endswith(PROMPT_FILE_TYPES):
                hint = " (JSON lines: rename it to .jsonl)" if f.lower().endswith(".json") else ""
                yield error(f"data.{name}[{i}]", f"{f!r} is not a .parquet or .jsonl file{hint}",
                            "convert it to parquet or jsonl (one JSON object per line)", "data-files")  # fmt: skip


@rule(RUN_LENGTH_RULE, "trainer.total_epochs", "trainer.total_steps", "data.train_files")
def total_epochs(c: RLConfig) -> Iterator[Issue]:
    """trainer.total_epochs is >= 1, replaces trainer.total_steps (which stays at its default: setting both
    is an error naming both) and needs data.train_files (a synthetic task is an unbounded stream)."""
    yield from setting_issues(c)


@rule(f"{RUN_LENGTH_RULE}-prompts", "trainer.total_epochs", "data.train_files", "data.train_batch_size",
      filesystem=True)  # fmt: skip
def total_epochs_prompts(c: RLConfig) -> Iterator[Issue]:
    """With trainer.total_epochs, data.train_files can be counted and hold at least one full batch of
    data.train_batch_size prompts, and the steps they give stay within the plan's limit."""
    files = c.data.train_files
    if c.trainer.total_epochs is None or setting_issues(c) or not _sizes_ok(c):
        return
    if not all(os.path.isfile(f) and f.lower().endswith(PROMPT_FILE_TYPES) for f in files):
        return  # data-files and data-files-exist report these
    name = f"{RUN_LENGTH_RULE}-prompts"
    try:
        length = run_length(c)
    except ConfigError as exc:
        yield from (replace(i, rule=name) for i in exc.issues)
        return
    if length.total_steps > MAX_TOTAL_STEPS:
        yield error("trainer.total_epochs", f"{length.describe()} is more than a plan supports "
                    f"({MAX_TOTAL_STEPS:,} steps)", "use fewer epochs (a longer run resumes from its checkpoint "
                    "with more epochs)", name)  # fmt: skip


@rule("data-files-exist", "data.train_files", "data.val_files", filesystem=True)
def data_files_exist(c: RLConfig) -> Iterator[Issue]:
    """Prompt files exist (relative paths are relative to the directory the run starts in)."""
    for name in ("train_files", "val_files"):
        for i, f in enumerate(getattr(c.data, name)):
            if os.path.lexists(f) and not os.path.isdir(
                f
            ):  # a FIFO or device: refused, never opened blocking
                try:
                    check_regular(f, MAX_DATA_BYTES, key=f"data.{name}[{i}]", what="prompt file")
                except ConfigError as exc:
                    yield replace(exc.issues[0], rule="data-files-exist")
                continue
            if not os.path.isfile(f):
                what = "is a folder" if os.path.isdir(f) else "does not exist"
                yield error(f"data.{name}[{i}]", f"prompt file {f!r} {what}",
                            f"fix the path (relative to {os.getcwd()})", "data-files-exist")  # fmt: skip


@rule("model-engine-support", "model.path", "model.arch.*", "critic.model_path", "reward.reward_model.path",
      filesystem=True)  # fmt: skip
def model_engine_support(c: RLConfig) -> Iterator[Issue]:
    """Models rlconf.model_spec reads but the megatron engine does not build yet (YaRN rope scaling): refused
    before a run's workers start, and by `rlconf plan` too (the plan reads a config.json and asks
    `engine_gap_issues` the same)."""
    sources = [("model.path", c.model.path, "model.arch")]
    sources += [("critic.model_path", c.critic.model_path, None)] if c.critic.enable else []
    rm = c.reward.reward_model
    sources += [("reward.reward_model.path", rm.path, None)] if rm.enable else []
    for path, folder, builtin in sources:
        if folder is None and builtin is None:
            continue
        try:
            arch = c.model.arch if folder is None else read_model_arch(folder, path)
        except ConfigError:
            continue  # the plan reports a config.json it cannot read
        yield from engine_gap_issues(arch, path if folder is not None else None, builtin or "model.arch")


def engine_gap_issues(arch: ModelArch, path: str | None, builtin: str = "model.arch") -> list[Issue]:
    """rule model-engine-support's errors for `arch`, read from the config.json at config path `path` (None:
    the built-in `builtin` section, whose field each error names)."""
    fix = ("choose a model without it (config.json's rope_scaling / rope_parameters rope_type)" if path
           else f"set {builtin}.rope_scaling.type to none, linear or llama3")  # fmt: skip
    return [error(path if path is not None else f"{builtin}.{field}", gap, fix, "model-engine-support")
            for field, gap in engine_gaps(arch)]  # fmt: skip


@rule(MODEL_FILES_RULE, "model.path", "model.tokenizer_path", "critic.model_path", "reward.reward_model.path",
      "data.max_prompt_length", "rollout.max_response_length", filesystem=True)  # fmt: skip
def model_files(c: RLConfig) -> Iterator[Issue]:
    """Model folders agree with their config.json before anything starts (rlconf.model_files): every
    safetensors header is sound (length, byte ranges inside the file, no overlaps), every tensor the loader
    reads is there with its shape and a float dtype (embedding rows == vocab_size), the tokenizer exists
    and its ids fit vocab_size, and prompt + response fit max_position_embeddings."""
    yield from model_files_issues(c)


def sliding_window_issue(c: RLConfig, arch: ModelArch, source: str, path: str) -> Issue | None:
    """The error for an attention window shorter than the run's sequences, a feature the engine does not build
    (within the window, windowed and full causal attention are the same computation); `source` names where
    the architecture comes from. The plan asks the same of an architecture read from config.json."""
    seq = c.data.max_prompt_length + c.rollout.max_response_length
    if arch.sliding_window is None or seq <= arch.sliding_window:
        return None
    return error(
        path,
        f"{source}: family {arch.family} attends within a sliding window of {arch.sliding_window} tokens, "
        f"shorter than prompt + response = {seq}; rlplan builds full causal attention only",
        f"keep data.max_prompt_length + rollout.max_response_length <= {arch.sliding_window}",
        UNSUPPORTED_RULE,
    )


@rule(UNSUPPORTED_RULE, "model.path", "model.arch.family", "model.arch.add_qkv_bias", "model.arch.qk_layernorm",
      "model.arch.num_moe_experts", "model.arch.moe_router_topk", "model.arch.moe_norm_topk_prob",
      "model.arch.moe_dense_layers",
      "model.arch.sliding_window", "data.max_prompt_length", "rollout.max_response_length")  # fmt: skip
def model_unsupported(c: RLConfig) -> Iterator[Issue]:
    """The built-in `model.arch` is a model rlplan can run: its fields agree with its family (q/k/v biases,
    QK-norm, experts) and a sliding attention window covers prompt + response. A config.json at
    `model.path` (or a critic's / reward model's path) is checked under the same rule when the plan reads
    it: vision-language, multi-token prediction, hybrid attention and other families fail there."""
    if c.model.path is not None:
        return  # model.arch is not used
    for path, message, fix in family_issues(c.model.arch, "model.arch"):
        yield error(path, message, fix, UNSUPPORTED_RULE)
    if (
        issue := sliding_window_issue(c, c.model.arch, "model.arch", "model.arch.sliding_window")
    ) is not None:
        yield issue


SEED_FIELDS = ("trainer.seed", "data.seed", "actor.megatron.seed", "ref.megatron.seed", "critic.megatron.seed",
               "reward.reward_model.megatron.seed")  # fmt: skip
SEED_LIMIT = 2**62
"""Seeds are in [0, SEED_LIMIT): numpy's SeedSequence takes no negative seed, torch.manual_seed no seed of
2**64 or more, and workers add offsets to a seed (megatron: 2718 + rank; rlconf.seeding: rank, step)."""


@rule("seed-range", *SEED_FIELDS)
def seed_range(c: RLConfig) -> Iterator[Issue]:
    """Seeds are whole numbers in [0, 2**62), the range every random generator of the run accepts."""
    for path in SEED_FIELDS:
        value = get_path(c, path)
        if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value < SEED_LIMIT:
            yield error(path, f"seed {value} is outside [0, 2**62)", "use a non-negative seed below 2**62, "
                        "e.g. 1", "seed-range")  # fmt: skip


@rule("plan-limits", "trainer.total_steps", "cluster.nnodes", "cluster.gpus_per_node")
def plan_limits(c: RLConfig) -> Iterator[Issue]:
    """Numbers stay within what the plan can lay out: at most 100,000 steps and 131,072 devices, and no
    integer beyond 2**40 (the plan's step, rank and lr tables are built from them)."""
    if c.trainer.total_steps > MAX_TOTAL_STEPS:
        yield error("trainer.total_steps", f"{c.trainer.total_steps} steps is more than a plan supports "
                    f"({MAX_TOTAL_STEPS:,})", f"use at most {MAX_TOTAL_STEPS:,} steps per run (a longer "
                    "run resumes from its checkpoint with a larger total_steps)", "plan-limits")  # fmt: skip
    if total_devices(c) > MAX_DEVICES:
        yield error("cluster.nnodes", f"{c.cluster.nnodes} x {c.cluster.gpus_per_node} devices is more than a "
                    f"plan supports ({MAX_DEVICES:,})", "check cluster.nnodes and cluster.gpus_per_node",
                    "plan-limits")  # fmt: skip
    for leaf in _leaves():
        if leaf.path in SEED_FIELDS or leaf.path == "trainer.total_steps":
            continue  # reported above and by seed-range
        value = get_path(c, leaf.path)
        values = value if isinstance(value, tuple) else (value,)
        for i, v in enumerate(values):
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_INT:
                where = f"{leaf.path}[{i}]" if isinstance(value, tuple) else leaf.path
                yield error(where, f"{v} is too large to plan", f"use a value of at most 2**40 "
                            f"({MAX_INT:,})", "plan-limits")  # fmt: skip


CHECKPOINT_COMPLETE_MARKER = "COMPLETE"
"""The file a complete checkpoint folder holds (rltrain.checkpoint.COMPLETE)."""
_STEP_FOLDER = re.compile(r"^global_step_\d+$")


def _complete_steps(root: str) -> list[int]:
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(
        int(n.rsplit("_", 1)[1])
        for n in names
        if _STEP_FOLDER.match(n) and os.path.isfile(os.path.join(root, n, CHECKPOINT_COMPLETE_MARKER))
    )


@rule("resume-path", "trainer.resume_mode", "trainer.resume_from_path", filesystem=True)
def resume_path(c: RLConfig) -> Iterator[Issue]:
    """With resume_mode resume_path, resume_from_path is a complete checkpoints/global_step_N folder (or a
    role folder in one). The run re-checks every file's digest at start; this catches a wrong path first."""
    t = c.trainer
    if t.resume_mode != "resume_path" or not t.resume_from_path:
        return  # the trainer rule reports a missing path
    folder = os.path.abspath(t.resume_from_path)
    if not _STEP_FOLDER.match(os.path.basename(folder)) and _STEP_FOLDER.match(
        os.path.basename(os.path.dirname(folder))
    ):
        folder = os.path.dirname(folder)  # a role folder (global_step_N/actor) names its checkpoint
    fix = "point it at a checkpoints/global_step_N folder of an earlier run, or use resume_mode: auto"
    # The user may have named the run folder, the checkpoints folder or a sibling step: show what is there.
    for root in (os.path.dirname(folder), folder, os.path.join(folder, "checkpoints")):
        if steps := _complete_steps(root):
            fix += f" (complete checkpoints in {root}: steps {steps})"
            break
    if not os.path.exists(folder):
        problem = f"{t.resume_from_path} does not exist"
    elif not os.path.isdir(folder):
        problem = f"{t.resume_from_path} is a file, not a checkpoint folder"
    elif not _STEP_FOLDER.match(os.path.basename(folder)):
        problem = f"{t.resume_from_path} is not a global_step_N folder"
    elif not os.path.isfile(os.path.join(folder, CHECKPOINT_COMPLETE_MARKER)):
        problem = f"{folder} has no {CHECKPOINT_COMPLETE_MARKER} marker (the save did not finish)"
    else:
        return
    yield error("trainer.resume_from_path", f"cannot resume: {problem}", fix, "resume-path")


def _unwritable_reason(path: str) -> str | None:
    """Why a folder cannot be used (or created) for output, or None when it can."""
    target = os.path.abspath(path)
    if os.path.exists(target):
        if not os.path.isdir(target):
            return f"{path} is not a folder"
        if not os.access(target, os.W_OK | os.X_OK):
            return f"{path} is not writable"
        return None
    parent = os.path.dirname(target)
    while not os.path.exists(parent):  # the nearest existing folder decides whether it can be created
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is a file, so {path} cannot be created"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{path} cannot be created: {parent} is not writable"
    return None


@rule("output-dir", "trainer.output_dir", "profile.save_path", filesystem=True)
def output_dir(c: RLConfig) -> Iterator[Issue]:
    """trainer.output_dir (and an absolute profile.save_path) is a writable folder or can be created."""
    if (reason := _unwritable_reason(c.trainer.output_dir)) is not None:
        yield error("trainer.output_dir", f"the run cannot write its outputs: {reason}",
                    "choose a folder you can write to (it is created if missing)", "output-dir")  # fmt: skip
    p = c.profile
    if p.tool != "none" and os.path.isabs(p.save_path) and (reason := _unwritable_reason(p.save_path)):
        yield error("profile.save_path", f"the profiler cannot write: {reason}",
                    "choose a folder you can write to, or a path relative to trainer.output_dir",
                    "output-dir")  # fmt: skip


@rule("profile", "profile.*", "cluster.device")
def profile(c: RLConfig) -> Iterator[Issue]:
    """Profile ranks are within the world, steps within the run, roles present, tool options fit the tool."""
    p = c.profile
    world = total_devices(c)
    for i, r in enumerate(p.ranks):
        if not 0 <= r < max(world, 1) and not p.all_ranks:
            yield error(f"profile.ranks[{i}]", f"rank {r} is outside the world of {world} devices",
                        f"use ranks in 0..{world - 1}, or all_ranks: true", "profile")  # fmt: skip
    for i, s in enumerate(p.steps):
        if not 1 <= s <= c.trainer.total_steps:
            yield error(f"profile.steps[{i}]", f"step {s} is outside the run's steps 1..{c.trainer.total_steps}",
                        "steps count from 1", "profile")  # fmt: skip
    present = _roles_present(c)
    for i, role in enumerate(p.roles):
        if role not in present:
            yield warning(f"profile.roles[{i}]", f"role {role} does not run in this config, nothing to profile",
                          f"roles of this run: {', '.join(r for r in ROLES if r in present)}", "profile")  # fmt: skip
    if p.tool == "none":
        return
    if not p.steps:
        yield warning("profile.steps", f"tool is {p.tool} but no steps are listed: nothing is profiled",
                      "list steps, e.g. [2, 3]", "profile")  # fmt: skip
    needs = {"nsys": "cuda", "npu": "npu"}
    if p.tool in needs and c.cluster.device != needs[p.tool]:
        yield error("profile.tool", f"{p.tool} profiles {needs[p.tool]} devices, but cluster.device = {c.cluster.device}",
                    "use profile.tool: torch, or the matching device", "profile")  # fmt: skip
    if p.tool == "torch":
        wrong = {"cuda": "cuda", "npu": "npu"}
        for i, act in enumerate(p.torch.activities):
            if (
                act in wrong
                and c.cluster.device != wrong[act]
                and not (act == "cuda" and c.cluster.device == "cpu")
            ):
                yield error(f"profile.torch.activities[{i}]",
                            f"activity {act} needs cluster.device = {wrong[act]}", "remove it", "profile")  # fmt: skip
    from rlconf.config import NpuProfileOptions, NsysProfileOptions, TorchProfileOptions

    for name, default in (
        ("torch", TorchProfileOptions()),
        ("npu", NpuProfileOptions()),
        ("nsys", NsysProfileOptions()),
    ):
        if name != p.tool and getattr(p, name) != default:
            yield warning(f"profile.{name}", f"options for {name} are set but profile.tool = {p.tool}; they are ignored",
                          f"remove profile.{name} or set profile.tool: {name}", "profile")  # fmt: skip


@rule(
    "model-source",
    "*.use_dist_checkpointing",
    "*.dist_checkpointing_path",
    "*.override_transformer_config.*_dropout",
    "model.attention_backend",
    "model.fused_kernels",
    "model.arch.kv_channels",
    "model.arch.hidden_size",
)
def model_source(c: RLConfig) -> Iterator[Issue]:
    """A model path and dist checkpoint path are consistent; TE attention is not available on npu/cpu,
    compiled fused kernels not on npu; dropout probabilities are in [0, 1)."""
    for prefix, m, _ in _megatron_roles(c):
        if m.use_dist_checkpointing and not m.dist_checkpointing_path:
            yield error(f"{prefix}.megatron.dist_checkpointing_path", "use_dist_checkpointing needs a path",
                        "set dist_checkpointing_path or use_dist_checkpointing: false", "model-source")  # fmt: skip
        ov = m.override_transformer_config
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(ov, name) < 1.0:
                yield error(f"{prefix}.megatron.override_transformer_config.{name}",
                            f"a dropout probability must be in [0, 1), got {getattr(ov, name)}",
                            "use 0.0 (RL fine-tuning usually trains without dropout)", "model-source")  # fmt: skip
    if c.model.attention_backend == "te" and c.cluster.device != "cuda":
        yield error("model.attention_backend", f"Transformer Engine needs cuda, cluster.device = {c.cluster.device}",
                    "use attention_backend: sdpa", "model-source")  # fmt: skip
    if c.model.fused_kernels == "compiled" and c.cluster.device == "npu":
        # torch.compile's generated kernels target cuda (Triton) and cpu (C++); none was run on Ascend.
        yield error("model.fused_kernels", "compiled kernels were never run on npu",
                    "use fused_kernels: eager (or auto)", "model-source")  # fmt: skip
    a = c.model.arch
    heads = max(a.num_attention_heads, 1)
    if a.kv_channels is None and c.model.path is None and a.hidden_size % heads:
        yield error(
            "model.arch.kv_channels",
            "hidden_size is not divisible by num_attention_heads, so the head width is undefined",
            "set kv_channels, or make hidden_size a multiple of the head count",
            "model-source",
        )


@rule("cluster", "cluster.*", "rollout.tensor_model_parallel_size")
def cluster(c: RLConfig) -> Iterator[Issue]:
    """Device memory, if given, is positive; CPU workers and rollout TP fit."""
    if c.cluster.device_memory_gib is not None and c.cluster.device_memory_gib <= 0:
        yield error(
            "cluster.device_memory_gib", "must be > 0", "give the device memory in GiB, or null", "cluster"
        )
    if c.cluster.cpus_per_worker <= 0:
        yield error("cluster.cpus_per_worker", "must be > 0", "use 1", "cluster")
    if not 0 < c.cluster.connect_timeout_s <= 3600:
        yield error(
            "cluster.connect_timeout_s", "must be > 0 and at most 3600 (seconds)", "use 30", "cluster"
        )
    aw = actor_world(c)
    tp = rollout_tp(c)
    # A separate rollout has a pool of its own (rule rollout-placement checks that one).
    if c.rollout.placement == "colocated" and aw >= 1 and tp >= 1 and aw % tp:
        yield error("rollout.tensor_model_parallel_size", f"the actor pool of {aw} devices is not divisible by {tp}",
                    "use a rollout tp that divides the actor pool", "cluster")  # fmt: skip


# Rules kept in modules of their own register here (they import `rule` from this module).
import rlconf.folder_rules  # noqa: E402
import rlconf.run_paths  # noqa: E402, F401
