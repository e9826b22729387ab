"""The role table, written once, and the cross-section facts derived from it.

Each worker role of a run (actor, rollout, ref, critic, reward_model) is one `RoleSpec` row: its config
section, its megatron section, whether it may run on a pool of its own, the profiled passes it serves, its
checkpoint section, the worker class that hosts it and whether it trains. The facts several sections decide
together (which roles run, the pools' sizes, each role's world and the rollout's tensor parallel size, whether
a reference policy is needed, heads against tp) are derived here once: rlconf.validate's rules check them and
rlconf.plan.compile builds the plan from the same functions. Pure: imports only rlconf.config and leaf
modules, never the rest of rlconf.plan (the validator imports this module).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rlconf.config import Checkpoint, MegatronConfig, ModelArch, RLConfig
from rlconf.errors import Issue, error
from rlconf.fields import get_path
from rlconf.pipeline_split import PipelineSplit, split_errors
from rlconf.tp_heads import tp_head_errors

HEADS_RULE = "heads-divisible-by-tp"
LAYERS_RULE = "layers-divisible-by-pp"


@dataclass(frozen=True)
class RoleSpec:
    """One worker role of a run, as the config spells it."""

    name: str
    """The plan's role name (rlconf.plan.types.WORKER_ROLES)."""
    section: str
    """Config path of the role's section (`reward.reward_model` for the reward model)."""
    megatron: str
    """Config path of the megatron section its engine is built with (a separate rollout: the actor's)."""
    pool: str
    """The device pool it runs on when placed `separate` (actor_pool for a role that cannot be)."""
    separable: bool
    """Whether the section has `placement` / `num_devices` (it may run on a pool of its own)."""
    passes: tuple[str, ...]
    """The profiled passes (rlconf.config.ROLES) the role serves."""
    checkpoint: str | None
    """Config path of its checkpoint section (save_contents, load_contents), or None: not checkpointed."""
    worker: str
    """The rltrain.workers class that hosts it (the ref and a colocated rollout share the actor's)."""
    trained: bool
    """Whether it has an optimizer and updates (batch and lr plans)."""
    model: str
    """The plan's model it runs (ModelSpec.name)."""
    model_path: str
    """Config path of the folder its model is read from (model.path for the policy's roles)."""
    forward_micro_batch: str
    """Config path of the rows per micro-batch of its forward passes (log-prob / value / reward)."""
    token_budget: str | None
    """Config path of the section whose use_dynamic_bsz / ppo_max_token_len_per_gpu cut its forward
    micro-batches by tokens (the ref: the actor's, as verl); None: fixed row counts only."""
    log_prob_budget: str | None = None
    """Config path of the section whose log_prob_use_dynamic_bsz / log_prob_max_token_len_per_gpu, where
    set, override token_budget's for its forward passes (verl's rollout.log_prob_* and ref.log_prob_*)."""

    def section_of(self, c: RLConfig) -> Any:
        """The role's config section."""
        return get_path(c, self.section)

    def megatron_of(self, c: RLConfig) -> MegatronConfig:
        """The megatron section its engine is built with."""
        return get_path(c, self.megatron)

    def checkpoint_of(self, c: RLConfig) -> Checkpoint | None:
        """Its checkpoint section (None for a role that is not checkpointed)."""
        return None if self.checkpoint is None else get_path(c, self.checkpoint)


ROLE_TABLE: tuple[RoleSpec, ...] = (
    RoleSpec(
        name="actor",
        section="actor",
        megatron="actor.megatron",
        pool="actor_pool",
        separable=False,
        passes=("actor_compute_log_prob", "actor_update"),
        checkpoint="actor.checkpoint",
        worker="PolicyWorker",
        trained=True,
        model="policy",
        model_path="model.path",
        forward_micro_batch="actor.log_prob_micro_batch_size_per_gpu",
        token_budget="actor",
        log_prob_budget="actor",
    ),
    RoleSpec(
        name="rollout",
        section="rollout",
        megatron="actor.megatron",
        pool="rollout_pool",
        separable=True,
        passes=("generate_sequences",),
        checkpoint=None,
        worker="RolloutWorker",
        trained=False,
        model="policy",
        model_path="model.path",
        forward_micro_batch="actor.log_prob_micro_batch_size_per_gpu",
        token_budget="actor",
        log_prob_budget="actor",
    ),
    RoleSpec(
        name="ref",
        section="ref",
        megatron="ref.megatron",
        pool="actor_pool",
        separable=False,
        passes=("ref_compute_log_prob",),
        checkpoint=None,
        worker="PolicyWorker",
        trained=False,
        model="policy",
        model_path="model.path",
        forward_micro_batch="ref.log_prob_micro_batch_size_per_gpu",
        token_budget="actor",
        log_prob_budget="ref",
    ),
    RoleSpec(
        name="critic",
        section="critic",
        megatron="critic.megatron",
        pool="critic_pool",
        separable=True,
        passes=("critic_compute_values", "critic_update"),
        checkpoint="critic.checkpoint",
        worker="CriticWorker",
        trained=True,
        model="critic",
        model_path="critic.model_path",
        forward_micro_batch="critic.ppo_micro_batch_size_per_gpu",
        token_budget="critic",
    ),
    RoleSpec(
        name="reward_model",
        section="reward.reward_model",
        megatron="reward.reward_model.megatron",
        pool="reward_model_pool",
        separable=True,
        passes=("reward_compute",),
        checkpoint=None,
        worker="RewardModelWorker",
        trained=False,
        model="reward_model",
        model_path="reward.reward_model.path",
        forward_micro_batch="reward.reward_model.micro_batch_size_per_gpu",
        token_budget=None,
    ),
)
"""Every worker role, in the order the plan lists them (rlconf.plan.types.WORKER_ROLES)."""

ROLE_SPECS: dict[str, RoleSpec] = {r.name: r for r in ROLE_TABLE}
ACTOR_POOL = "actor_pool"
"""The pool of the actor's devices (shared by the ref and every role not placed separate)."""


def role_spec(role: str) -> RoleSpec:
    """The table row of a worker role."""
    return ROLE_SPECS[role]


def megatron_of(c: RLConfig, role: str) -> tuple[str, MegatronConfig]:
    """(config path, megatron section) of a megatron role (a separate rollout's: the actor's)."""
    spec = ROLE_SPECS[role]
    return spec.megatron, spec.megatron_of(c)


def forward_batching(c: RLConfig, role: str) -> tuple[int, bool, int | None]:
    """(rows per forward micro-batch, token-budget batching on, the token budget) of a megatron role's
    log-prob / value / reward passes: what its engine runs and what the memory estimate sizes (the role
    table's forward_micro_batch and token_budget: the ref cuts by the actor's token budget, as verl; its
    log_prob_budget section's log_prob_use_dynamic_bsz / log_prob_max_token_len_per_gpu where set)."""
    spec = role_spec(role)
    rows = get_path(c, spec.forward_micro_batch)
    if spec.token_budget is None:
        return rows, False, None
    section = get_path(c, spec.token_budget)
    dynamic, budget = section.use_dynamic_bsz, section.ppo_max_token_len_per_gpu
    if spec.log_prob_budget is not None:
        own = get_path(c, spec.log_prob_budget)
        if own.log_prob_use_dynamic_bsz is not None:
            dynamic = own.log_prob_use_dynamic_bsz
        if own.log_prob_max_token_len_per_gpu is not None:
            budget = own.log_prob_max_token_len_per_gpu
    return rows, dynamic, budget


# ====================================================================================== which roles run
def uses_ref(c: RLConfig) -> bool:
    """Whether the run needs reference-policy log-probs (a KL loss or a KL penalty in the reward)."""
    return c.actor.use_kl_loss or c.algorithm.use_kl_in_reward


def ref_from_adapters(c: RLConfig) -> bool:
    """Whether the reference log-probs come from the actor's engine with its LoRA adapters off (no ref
    worker, StepPasses.ref_from)."""
    return uses_ref(c) and c.actor.lora.rank > 0


def _enabled(c: RLConfig, role: str) -> bool:
    if role in ("actor", "rollout"):
        return True
    if role == "ref":
        return uses_ref(c)
    return bool(ROLE_SPECS[role].section_of(c).enable)


def configured_roles(c: RLConfig) -> tuple[str, ...]:
    """The roles the config enables, in table order: the ref whenever a reference policy is needed (LoRA
    or not), as the checker sees the layouts it must validate."""
    return tuple(r.name for r in ROLE_TABLE if _enabled(c, r.name))


def present_roles(c: RLConfig) -> tuple[str, ...]:
    """The worker roles of the plan, in table order: with LoRA the reference policy is the actor's engine
    with its adapters off, so there is no ref worker."""
    return tuple(r for r in configured_roles(c) if r != "ref" or not ref_from_adapters(c))


def present_passes(c: RLConfig) -> set[str]:
    """The profiled passes (rlconf.config.ROLES) the run executes."""
    passes = {"reward_compute"}
    for role in configured_roles(c):
        if role != "reward_model":
            passes |= set(ROLE_SPECS[role].passes)
    return passes


def separate(c: RLConfig, role: str) -> bool:
    """Whether the role runs on a pool of its own (`placement: separate`)."""
    spec = ROLE_SPECS[role]
    return spec.separable and spec.section_of(c).placement == "separate"


# ============================================================================================= pools
def total_devices(c: RLConfig) -> int:
    """Devices of the whole cluster."""
    return c.cluster.nnodes * c.cluster.gpus_per_node


def separate_pools(c: RLConfig, roles: tuple[str, ...] | None = None) -> list[tuple[str, int, str]]:
    """(pool, devices, role) of every role present that runs on a pool of its own, in table order."""
    present = configured_roles(c) if roles is None else roles
    return [
        (ROLE_SPECS[r].pool, ROLE_SPECS[r].section_of(c).num_devices, r) for r in present if separate(c, r)
    ]


def separate_devices(c: RLConfig) -> int:
    """Devices of the pools that are not the actor's (a separate rollout, critic or reward model)."""
    return sum(n for _, n, _ in separate_pools(c))


def actor_world(c: RLConfig) -> int:
    """Devices of the actor pool (shared by rollout and ref)."""
    return total_devices(c) - separate_devices(c)


def pool_sizes(c: RLConfig, roles: tuple[str, ...]) -> list[tuple[str, int, tuple[str, ...]]]:
    """(pool, devices, member roles) of each pool of a plan with `roles`, the actor's first."""
    own = separate_pools(c, roles)
    alone = {r for _, _, r in own}
    actor_roles = tuple(r for r in roles if r not in alone)
    return [(ACTOR_POOL, actor_world(c), actor_roles), *((p, n, (r,)) for p, n, r in own)]


def role_world(c: RLConfig, role: str) -> int:
    """Devices of the pool a role runs on."""
    return ROLE_SPECS[role].section_of(c).num_devices if separate(c, role) else actor_world(c)


def model_parallel(m: MegatronConfig) -> int:
    """Ranks of one model replica: tp x pp x cp."""
    return m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size


def data_parallel(world: int, tp: int, pp: int, cp: int) -> int:
    """The data-parallel size of a role of `world` devices at tp x pp x cp: the validator's batch checks and
    the plan's layouts. 0 when the layout does not divide the world (rule world-divisible-by-model-parallel
    reports that)."""
    mp = tp * pp * cp
    return world // mp if world % mp == 0 else 0


def trained_roles(c: RLConfig) -> list[RoleSpec]:
    """The roles the config enables that train (the actor and a critic), in table order."""
    return [ROLE_SPECS[r] for r in configured_roles(c) if ROLE_SPECS[r].trained]


def overlaps_param_gather(m: MegatronConfig) -> bool:
    """Whether a layout runs megatron's overlapped parameter all-gather: override_ddp_config's
    overlap_param_gather, which only the distributed optimizer has (off without it)."""
    return m.override_ddp_config.overlap_param_gather and m.use_distributed_optimizer


def gathers_params_async(megatron_path: str, m: MegatronConfig) -> bool:
    """Whether the role whose megatron section is at `megatron_path` (e.g. "actor.megatron") trains (actor,
    critic) with the overlapped parameter all-gather after each optimizer step (`overlaps_param_gather`)."""
    trained = any(spec.trained and spec.megatron == megatron_path for spec in ROLE_SPECS.values())
    return trained and overlaps_param_gather(m)


def megatron_roles(c: RLConfig) -> Iterator[tuple[str, MegatronConfig, int]]:
    """(config prefix, layout, world size) for every trained or frozen Megatron role the config enables."""
    for role in configured_roles(c):
        if role != "rollout":
            spec = ROLE_SPECS[role]
            yield spec.section, spec.megatron_of(c), role_world(c, role)


# ============================================================================================= layouts
def rollout_tp(c: RLConfig) -> int:
    """The rollout's tensor parallel size: rollout.tensor_model_parallel_size, or the actor's when null."""
    tp = c.rollout.tensor_model_parallel_size
    return c.actor.megatron.tensor_model_parallel_size if tp is None else tp


def rollout_resharded(c: RLConfig) -> bool:
    """Whether the rollout runs in a layout of its own (tp = rollout_tp, pp 1): always for vLLM and on a
    separate rollout pool; for the embedded engine when its tp differs from the actor's. Otherwise it
    generates on the actor's weights in the actor's layout, pipeline stages included (zero copy), as
    configs that set the actor's tp here always have."""
    if c.rollout.engine != "embedded" or c.rollout.placement == "separate":
        return True
    return rollout_tp(c) != c.actor.megatron.tensor_model_parallel_size


def head_issues(
    heads: int, groups: int, tp: int, path: str, prefix: str = "", suffix: str = ""
) -> list[Issue]:
    """Errors at `path` (rule heads-divisible-by-tp) for each way `heads` attention heads and `groups` query
    groups do not split over `tp` ranks (rlconf.tp_heads), each message as `{prefix}{message}{suffix}`: the
    one check of the validator (model.arch) and the compiler (a config.json's architecture)."""
    return [
        error(path, f"{prefix}{message}{suffix}", fix, HEADS_RULE)
        for _, message, fix in tp_head_errors(heads, groups, tp)
    ]


def pipeline_split(
    num_layers: int, pp: int, vpp: int | None, m: MegatronConfig | None = None
) -> PipelineSplit:
    """How megatron splits `num_layers` over pp (x vpp) stages, with the uneven options of `m` when given."""
    if m is None:
        return PipelineSplit(num_layers, pp, vpp)
    return PipelineSplit(
        num_layers, pp, vpp, m.num_layers_in_first_pipeline_stage, m.num_layers_in_last_pipeline_stage,
        m.account_for_embedding_in_pipeline_split, m.account_for_loss_in_pipeline_split,
    )  # fmt: skip


def layer_split_issues(split: PipelineSplit, path: str, note: str) -> list[Issue]:
    """Errors at `path` (rule layers-divisible-by-pp) for each way the split breaks megatron's rules
    (rlconf.pipeline_split), each message followed by ` ({note})`: the validator's and the compiler's check."""
    return [
        error(
            path,
            f"{message} ({note})",
            "choose pp (and vpp, num_layers_in_first/last_pipeline_stage or account_for_embedding/"
            "loss_in_pipeline_split) that split the layers as megatron requires",
            LAYERS_RULE,
        )
        for message in split_errors(split)
    ]


def model_folders(c: RLConfig) -> list[tuple[str, str | None, RoleSpec]]:
    """(config path, folder or None, first role) of each model the config enables, in table order: the
    policy's (model.path), a critic's (critic.model_path) and a reward model's (reward.reward_model.path)."""
    seen: dict[str, tuple[str, str | None, RoleSpec]] = {}
    for role in configured_roles(c):
        spec = ROLE_SPECS[role]
        seen.setdefault(spec.model, (spec.model_path, get_path(c, spec.model_path), spec))
    return list(seen.values())


def builds_model_arch(c: RLConfig, prefix: str) -> bool:
    """Whether the role at config `prefix` builds the built-in `model.arch`; with a config.json of its own
    (model.path, critic.model_path, reward.reward_model.path) the plan reads and checks that instead."""
    spec = next(r for r in ROLE_TABLE if r.section == prefix)
    return c.model.path is None and (spec.model_path == "model.path" or get_path(c, spec.model_path) is None)


def checkpointed_roles(
    c: RLConfig, roles: tuple[str, ...] | None = None
) -> list[tuple[RoleSpec, Checkpoint]]:
    """(role, checkpoint section) of every role present (of `roles`, or that the config enables) whose
    state a checkpoint saves, in table order: the actor and a critic."""
    present = configured_roles(c) if roles is None else roles
    return [(r, ck) for r in ROLE_TABLE if r.name in present and (ck := r.checkpoint_of(c)) is not None]


# ============================================================================================= packing
def packing_blocker(c: RLConfig, role: str, arch: ModelArch | None) -> str | None:
    """What keeps a megatron role from running packed (THD) micro-batches, or None when it can (`arch`
    None: the model is not known yet, its architecture is not checked).

    The packed layout is built for the log-prob, value, reward and update passes of dense and
    mixture-of-experts models without context parallel, virtual pipeline stages or routing replay (rltrain/megatron/packing.py); megatron's local attention
    has no packed path. A separate rollout engine only generates (its passes are not micro-batched)."""
    _, m = megatron_of(c, role)
    if role == "rollout":
        return "a generation engine (no micro-batched passes)"
    if c.model.attention_backend == "local":
        return "model.attention_backend local (megatron's unfused attention has no packed-sequence path)"
    if m.context_parallel_size > 1:
        return "context parallel (its load-balanced split cuts padded rows)"
    if m.pipeline_model_parallel_size > 1 and m.virtual_pipeline_model_parallel_size is not None:
        return "virtual pipeline parallel (its interleaved schedule needs one activation shape)"
    if arch is not None and arch.multi_latent_attention:
        return "multi-head latent attention (its core attention has no packed path yet)"
    if role == "actor" and c.actor.router_replay:
        return "actor.router_replay (the recorded routes follow padded rows)"
    if c.cluster.device not in ("cpu", "cuda"):
        return f"cluster.device {c.cluster.device} (packed attention was run on cpu and cuda only)"
    return None


def packing_issue(role: str, blocker: str) -> Issue:
    """The error of model.use_remove_padding: true where `role` cannot run packed."""
    return error(
        "model.use_remove_padding", f"packed sequences cannot run for the {role} with {blocker}",
        "set model.use_remove_padding: null (packed where supported) or false", "model-source",
    )  # fmt: skip
