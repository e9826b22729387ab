"""The trainer plan: the single, inspectable answer to "what will this run do".

`compile_plan(config)` turns a validated `RLConfig` into a `TrainerPlan`, a tree of frozen dataclasses:
which devices each role gets, every rank's place in its parallel grid, the batch schedule, the learning
rate of every training step, the profiler's output folders, the checkpoint steps and paths, and an
estimate of the memory each device needs. Workers read the plan, never the raw config: the controller
compiles it once, writes `plan.json` (`plan_to_dict`) and hands the plan to every worker.

Design choices
- Pure: standard library only (`rlconf` never imports torch, ray or megatron). The only input besides the
  config is `config.json` of `model.path` (and of `critic.model_path` / `reward.reward_model.path` when
  set), read to learn the architecture.
- Settings the plan does not derive (seeds, DDP and TransformerConfig overrides, sampling parameters,
  loss coefficients, ...) travel in `plan.config`: the *effective* config. It is the input config with
  the derived values resolved so that a worker reading it cannot disagree with the plan:
  `sequence_parallel` is off at tp = 1 (megatron switches it off), `expert_tensor_parallel_size` is the
  tp size when None, `model.arch` holds the architecture read from config.json when `model.path` is set,
  each `optim` has `lr_warmup_steps`, `lr_decay_steps` and `lr_wsd_decay_steps` resolved to numbers, and
  `data.seed` and every `megatron.seed` left None hold `trainer.seed` (rlconf.seeding), and with
  `trainer.total_epochs` `trainer.total_steps` holds the steps it derives (rlconf.run_length). Everything else
  equals the input. (The user's own config is saved separately as config.yaml.)
- Conventions: ranks are 0-based within a role's world (= the process index inside its device pool);
  layers are 0-based; steps are 1-based training steps (step N is the N-th step of the run, across
  resumes); memory is in GiB (2**30 bytes).
- Failure: the plan assumes `rlconf.validate` passed. It still never raises anything but `ConfigError`:
  sizes it divides by are checked first, and the rules validate.py leaves to the plan (heads, query
  groups and layers against tp / pp when the architecture comes from config.json) are checked here
  with the same rule names. Batch sizes that do not divide evenly are planned with the largest share a
  rank gets (`BatchPlan.even` is false) rather than rejected. The memory estimate exceeding
  `cluster.device_memory_gib` is an error (rule `memory-exceeds-device`) whose fix lists concrete
  changes with the estimate each would give.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import TypeVar

from rlconf.config import (
    ROLES,
    MegatronConfig,
    ModelArch,
    ModelConfig,
    NpuProfileOptions,
    NsysProfileOptions,
    Optim,
    OverrideTransformerConfig,
    RLConfig,
    TorchProfileOptions,
)
from rlconf.errors import ConfigError, Issue, error
from rlconf.fields import get_path
from rlconf.model_spec import (
    UNSUPPORTED_RULE,
    count_parameters,
    expert_layout_issues,
    family_issues,
    head_dim,
    is_moe_layer,
    layer_params,
    read_model_arch,
)
from rlconf.run_length import RunLength, run_length, with_run_length
from rlconf.seeding import resolve_seed

PLAN_VERSION = 1
GIB = 2**30
MEGATRON_ORDER = "tp-cp-ep-dp-pp"
"""megatron-core's default rank order: tp varies fastest, pp slowest."""
VOCAB_DIVISIBLE_BY = 128
"""megatron pads the vocabulary to a multiple of this x tp (make_vocab_size_divisible_by)."""
DTYPE_BYTES: Mapping[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
# Bounds that keep the plan's tables (rank grids, lr rows) to a size a controller can hold; far beyond any
# real run, they only turn absurd inputs into a ConfigError instead of an hour of list building.
MAX_DEVICES = 1 << 17
MAX_TOTAL_STEPS = 100_000
MAX_INT = 1 << 40

WORKER_ROLES: tuple[str, ...] = ("actor", "rollout", "ref", "critic", "reward_model")
"""Worker roles in the order the plan lists them."""
CONTROLLER = "controller"
"""Where the rule-based reward runs when no reward model is enabled (one process, rank 0)."""
# Which worker role executes each profiled role (rlconf.config.ROLES).
PROFILE_ROLE_WORKER: Mapping[str, str] = {
    "generate_sequences": "rollout",
    "actor_compute_log_prob": "actor",
    "ref_compute_log_prob": "ref",
    "actor_update": "actor",
    "critic_compute_values": "critic",
    "critic_update": "critic",
    "reward_compute": "reward_model",
}


# ============================================================================================ the plan
@dataclass(frozen=True)
class ModelSpec:
    """The architecture one model is built with."""

    name: str
    """policy (actor, rollout, ref), critic or reward_model."""
    source: str
    """Where the architecture comes from: `model.arch`, or the config.json file that was read."""
    arch: ModelArch
    """The architecture (Megatron names)."""
    head: str
    """lm (vocabulary logits) or value (one scalar per token: critic and reward model)."""
    params_total: int
    """Parameters of the unpadded, unsharded model (embedding, layers with every expert, final norm,
    output layer)."""
    params_active: int
    """Parameters one token passes through: params_total with only moe_router_topk routed experts per MoE
    layer; equal to params_total for dense models."""
    used_by: tuple[str, ...]
    """Worker roles built from this model."""
    weights: str | None
    """Hugging Face folder its weights load from (model.path, critic.model_path, reward.reward_model.path; a
    value model without a folder of its own starts from the policy's weights); None: random initialisation."""


@dataclass(frozen=True)
class Pool:
    """A set of devices; the roles in it share one worker process per device."""

    name: str
    """actor_pool, critic_pool or reward_model_pool."""
    first_device: int
    """Global index of its first device (devices are numbered node by node)."""
    num_devices: int
    """Devices in the pool (= processes: one per device)."""
    nodes: tuple[int, ...]
    """Nodes the pool's devices are on."""
    roles: tuple[str, ...]
    """Worker roles placed in this pool."""


@dataclass(frozen=True)
class Placement:
    """Where one worker role runs."""

    role: str
    """actor, rollout, ref, critic or reward_model."""
    pool: str
    """Name of its pool."""
    world_size: int
    """Ranks of the role (its pool's devices)."""
    num_processes: int
    """Processes the role runs in: one per device; colocated roles share these processes."""
    device: str
    """cpu, cuda or npu."""
    colocated_with: tuple[str, ...]
    """Other roles in the same processes."""


@dataclass(frozen=True)
class Resources:
    """Devices, pools and the placement of every role."""

    device: str
    nnodes: int
    gpus_per_node: int
    total_devices: int
    pools: tuple[Pool, ...]
    placements: tuple[Placement, ...]


@dataclass(frozen=True)
class RankCoord:
    """A rank's coordinate in its role's megatron grid."""

    rank: int
    pp: int
    tp: int
    cp: int
    dp: int


@dataclass(frozen=True)
class LayerChunk:
    """Consecutive transformer layers run by one (virtual) pipeline stage."""

    virtual_stage: int
    """Index of the virtual chunk on its stage (always 0 without vpp)."""
    first_layer: int
    """0-based global index of the chunk's first layer."""
    num_layers: int


@dataclass(frozen=True)
class StageLayers:
    """What one pipeline stage holds."""

    stage: int
    num_layers: int
    chunks: tuple[LayerChunk, ...]
    embedding: bool
    """Holds the input embedding (first stage)."""
    output_layer: bool
    """Holds the output layer (last stage; with tied embeddings and pp > 1 megatron keeps a copy here)."""


@dataclass(frozen=True)
class RoleLayout:
    """The effective parallel layout of one role and every rank's coordinate in it."""

    role: str
    model: str
    """Name of the ModelSpec the role is built from."""
    pool: str
    world_size: int
    tp: int
    pp: int
    vpp: int | None
    cp: int
    ep: int
    etp: int
    """Expert tensor parallel size (tp when not configured)."""
    dp: int
    """Data-parallel size = world / (tp x pp x cp)."""
    expert_dp: int
    """Data-parallel size of expert layers = world / (etp x ep x pp)."""
    sequence_parallel: bool
    """Effective: configured and tp > 1 (megatron switches it off at tp = 1)."""
    order: str
    """megatron rank order; rank = tp + TP*(cp + CP*(dp + DP*pp))."""
    padded_vocab_size: int
    """Vocabulary padded to a multiple of 128 x tp (megatron's make_vocab_size_divisible_by)."""
    num_layers: int
    layers_per_stage: tuple[int, ...]
    even_layers: bool
    """Every (virtual) chunk has the same number of layers (false only for configs that skipped validation)."""
    stages: tuple[StageLayers, ...]
    grid: tuple[RankCoord, ...]
    """One entry per rank, in rank order."""

    def rank_of(self, pp: int, tp: int, cp: int, dp: int) -> int:
        """The global rank at a grid coordinate (megatron's tp-cp-ep-dp-pp order)."""
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))


@dataclass(frozen=True)
class BatchPlan:
    """How one training step's rollouts are cut into optimizer updates for a trained role.

    ppo_mini_batch_size counts prompts (verl semantics): one mini-batch is ppo_mini_batch_size x rollout.n
    responses, spread over the data-parallel ranks, cut into micro-batches per rank (gradient accumulation).
    """

    role: str
    prompts_per_step: int
    """data.train_batch_size."""
    responses_per_prompt: int
    """rollout.n."""
    responses_per_step: int
    mini_batch_prompts: int
    """ppo_mini_batch_size (prompts)."""
    mini_batches_per_step: int
    """Optimizer updates per epoch = train_batch_size / ppo_mini_batch_size."""
    responses_per_mini_batch: int
    dp: int
    responses_per_mini_batch_per_rank: int
    """The share of one data-parallel rank (the largest share when it does not divide evenly)."""
    use_dynamic_bsz: bool
    micro_batch_size_per_rank: int | None
    """Responses per forward/backward (None with use_dynamic_bsz)."""
    micro_batches_per_mini_batch: int | None
    """Gradient accumulation steps per rank (None with use_dynamic_bsz: it depends on the lengths)."""
    max_token_len_per_micro_batch: int | None
    """With use_dynamic_bsz: the token budget of one micro-batch per rank (ppo_max_token_len_per_gpu)."""
    max_micro_batches_per_mini_batch: int
    """Most micro-batches per rank and mini-batch (with use_dynamic_bsz: when every sequence is full length)."""
    max_seq_len: int
    """data.max_prompt_length + rollout.max_response_length."""
    tokens_per_micro_batch_per_rank: int
    """Most tokens one rank holds in a micro-batch (micro x max_seq_len / cp, or the token budget)."""
    ppo_epochs: int
    optimizer_steps_per_training_step: int
    """mini_batches_per_step x ppo_epochs."""
    update_steps: int
    """Training steps in which this role updates (the actor waits trainer.critic_warmup steps with a critic)."""
    first_update_step: int
    optimizer_steps_total: int
    """optimizer_steps_per_training_step x update_steps."""
    log_prob_micro_batch_size_per_rank: int | None
    """Responses per forward when computing log-probs / values (None with use_dynamic_bsz)."""
    even: bool
    """Every division above is exact (always true after validation)."""


@dataclass(frozen=True)
class LrRow:
    """Learning rate and weight decay of one training step."""

    step: int
    """Training step (1-based)."""
    scheduler_step: int
    """OptimizerParamScheduler.num_steps when this step's updates run: the number of earlier training
    steps in which the role updated (the scheduler is stepped once after each updating step)."""
    update: bool
    """The role updates in this step (false for the actor during trainer.critic_warmup)."""
    lr: float
    weight_decay: float


@dataclass(frozen=True)
class OptimPlan:
    """Optimizer settings and the resolved learning-rate schedule of one trained role."""

    role: str
    optimizer: str
    lr: float
    min_lr: float
    lr_warmup_init: float
    warmup_steps: int
    """lr_warmup_steps, or round(lr_warmup_steps_ratio x total_steps) (Python round, half to even)."""
    decay_steps: int
    """lr_decay_steps, or trainer.total_steps."""
    decay_style: str
    wsd_decay_steps: int | None
    """WSD only: lr_wsd_decay_steps, or max(1, round(0.1 x decay_steps))."""
    wsd_decay_style: str | None
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    clip_grad: float
    granularity: str
    """`training_step`: the scheduler advances once per training step, not per optimizer step."""
    table: tuple[LrRow, ...]
    """One row per training step 1..trainer.total_steps (indexed by TRAINING step, not optimizer step):
    every optimizer step of training step N (mini-batches x ppo_epochs of them) uses row N's lr, which
    is megatron's OptimizerParamScheduler.get_lr() at num_steps = row.scheduler_step. Weight decay is
    constant (start_wd = end_wd). The engines set each update's lr and weight decay from this table
    (rltrain.megatron.model.PlanLrSchedule): it is the only implementation of the schedule."""


@dataclass(frozen=True)
class ProfileTarget:
    """One profiled role and the ranks that record it."""

    role: str
    """A profiled role (rlconf.config.ROLES) or `e2e` in continuous mode."""
    worker: str
    """The worker role executing it (actor, rollout, ref, critic, reward_model or controller)."""
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class ProfilePlan:
    """What the profiler records and where."""

    enabled: bool
    """tool is not none and at least one step of the run is listed."""
    tool: str
    mode: str
    """discrete (one profile per role call) or continuous (one per step, `e2e`)."""
    save_path: str
    """profile.save_path resolved (a relative path is under trainer.output_dir)."""
    steps: tuple[int, ...]
    """Profiled steps within the run, sorted."""
    roles: tuple[str, ...]
    """Profiled roles present in this run (profile.roles, or all present when empty)."""
    targets: tuple[ProfileTarget, ...]
    folders: tuple[str, ...]
    """Every output folder: save_path/step_N/ROLE/rank_R (discrete), save_path/step_N/e2e/rank_R."""
    options: TorchProfileOptions | NpuProfileOptions | NsysProfileOptions | None
    """The options of the selected tool."""
    notes: tuple[str, ...]


@dataclass(frozen=True)
class RoleCheckpoint:
    """What a role saves and restores."""

    role: str
    save_contents: tuple[str, ...]
    load_contents: tuple[str, ...]
    async_save: bool
    path_template: str
    """Folder of a save, with {step}: output_dir/checkpoints/global_step_{step}/ROLE."""
    hf_path_template: str | None
    """Hugging Face export folder when hf_model is saved (ROLE/huggingface), else None."""


@dataclass(frozen=True)
class RolePath:
    role: str
    path: str
    hf_path: str | None


@dataclass(frozen=True)
class CheckpointSave:
    """One checkpoint written during the run."""

    step: int
    path: str
    roles: tuple[RolePath, ...]


@dataclass(frozen=True)
class CheckpointPlan:
    """Checkpoint steps, contents, paths, retention and resume."""

    enabled: bool
    save_freq: int
    save_steps: tuple[int, ...]
    """Every save_freq steps and the last step (empty when save_freq = 0)."""
    root: str
    """output_dir/checkpoints."""
    latest_file: str
    """root/latest_checkpointed_iteration.txt: the newest complete step, plain text."""
    max_ckpt_to_keep: int | None
    retained_steps: tuple[int, ...]
    """Checkpoints left on disk at the end of the run (the newest max_ckpt_to_keep)."""
    async_save: bool
    """Any role saves in the background."""
    roles: tuple[RoleCheckpoint, ...]
    saves: tuple[CheckpointSave, ...]
    resume_mode: str
    resume_from: str | None
    """The checkpoint resumed from with resume_mode = resume_path; None otherwise."""
    resume: str
    """What happens at start-up, in words."""


@dataclass(frozen=True)
class RoleMemory:
    """Per-device memory of one role on its most loaded pipeline stage (GiB)."""

    role: str
    pool: str
    stage: int
    trained: bool
    params_per_device: int
    params_gib: float
    grads_gib: float
    optimizer_gib: float
    activations_gib: float
    """Stored activations of the micro-batches in flight on the stage (1F1B / interleaved schedule)."""
    logits_gib: float
    """fp32 logits of one micro-batch on the last stage (tokens x vocab / tp x 4 bytes)."""
    total_gib: float
    """Everything above: the role's own peak."""
    in_flight_micro_batches: int
    tokens_per_micro_batch: int
    offloaded: tuple[str, ...]
    """Parts moved to host memory while other roles use the device (params, grads, optimizer)."""


@dataclass(frozen=True)
class MemoryPart:
    label: str
    gib: float


@dataclass(frozen=True)
class PhaseMemory:
    """Memory of one device while one role call runs."""

    phase: str
    total_gib: float
    parts: tuple[MemoryPart, ...]


@dataclass(frozen=True)
class PoolMemory:
    """The most loaded device of a pool."""

    pool: str
    roles: tuple[str, ...]
    rank: int
    """A rank with the highest estimate (its pipeline stages are the most loaded)."""
    peak_phase: str
    peak_gib: float
    phases: tuple[PhaseMemory, ...]
    fits: bool | None
    """peak_gib <= cluster.device_memory_gib; None when the device memory is not given."""


@dataclass(frozen=True)
class MemoryPlan:
    """Estimated memory per device (GiB); see the notes for what is and is not counted."""

    device_memory_gib: float | None
    peak_gib: float
    """The largest pool peak: the per-device total to compare with the device."""
    fits: bool | None
    roles: tuple[RoleMemory, ...]
    pools: tuple[PoolMemory, ...]
    notes: tuple[str, ...]


@dataclass(frozen=True)
class StepPasses:
    """The forward-only passes a training step runs between generation and the updates, decided here once
    (rltrain.controller.train_step executes them; `format_plan` shows them with the reason)."""

    actor_on_policy: bool
    """The actor makes one optimizer step per training step (one mini-batch, one epoch): the policy it
    updates is the one whose log-probs a separate pass would compute, so the update's own forward, detached,
    is the old log-prob (PPO ratio exactly 1, nothing clipped)."""
    old_log_prob: str
    """Where the PPO ratio's old log-probs come from. recompute: a forward pass of the actor over the batch
    before the update; rollout: the sampler's own (algorithm.rollout_correction.bypass_mode); update: the
    update's own forward (actor_on_policy, and nothing reads them before the update)."""
    ref_log_prob: bool
    """A forward pass of the reference policy (only with actor.use_kl_loss or algorithm.use_kl_in_reward)."""
    fused: bool
    """The old and the ref log-probs are computed in one worker call (one scatter of the batch, one round
    trip) when the step needs both."""
    reason: str
    """Why, in words."""


@dataclass(frozen=True)
class RolloutRefit:
    """How the rollout engine gets the actor's weights before each generation (rltrain/rollout/reshard.py)."""

    mode: str
    """zero-copy: the embedded engine generates on the actor's own weights (same layout); reshard: the
    actor's weights are gathered / split into the rollout layout on the same devices; vllm: loaded into
    the vLLM engine (HF names, in buckets)."""
    actor_tp: int
    actor_pp: int
    rollout_tp: int
    rollout_dp: int
    bucket_mib: int
    """Largest all-gather / broadcast of one refit bucket (bounds the transient memory)."""
    extra_gib: float
    """Per device, held from the refit to the end of generation: the rollout-layout weights plus one bucket
    (0 for zero-copy)."""
    estimated_s: float
    """Estimated refit time per step (bytes moved / a conservative bandwidth of cluster.device; an order of
    magnitude, not a measurement)."""


@dataclass(frozen=True)
class TrainerPlan:
    """Everything a run will do, derived from one config. Workers read this, never the raw config."""

    version: int
    roles: tuple[str, ...]
    """Worker roles present: actor and rollout always; ref, critic, reward_model when used."""
    models: tuple[ModelSpec, ...]
    resources: Resources
    layouts: tuple[RoleLayout, ...]
    batch: tuple[BatchPlan, ...]
    optim: tuple[OptimPlan, ...]
    profile: ProfilePlan
    checkpoint: CheckpointPlan
    memory: MemoryPlan
    config: RLConfig
    """The effective config (see the module docstring): settings the plan does not derive."""
    refit: RolloutRefit | None = None
    """How the rollout gets the actor's weights (always set by compile_plan)."""
    length: RunLength | None = None
    """The run's training steps and their source: trainer.total_steps, or trainer.total_epochs x batches
    per epoch (always set by compile_plan; config.trainer.total_steps holds the same number)."""
    passes: StepPasses | None = None
    """The log-prob passes of each training step (always set by compile_plan)."""

    def layout(self, role: str) -> RoleLayout:
        return _by_role(self.layouts, role)

    def placement(self, role: str) -> Placement:
        return _by_role(self.resources.placements, role)

    def batch_plan(self, role: str) -> BatchPlan:
        return _by_role(self.batch, role)

    def optim_plan(self, role: str) -> OptimPlan:
        return _by_role(self.optim, role)

    def model(self, name: str) -> ModelSpec:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    def engine(self, role: str) -> EnginePlan:
        """What the megatron engine of `role` (actor, ref, critic, reward_model) is built from."""
        return _engine_plan(self, role)


@dataclass(frozen=True)
class EnginePlan:
    """Everything one megatron role's engine is built from (rltrain.megatron.engine): the plan's own model,
    layout, batch schedule and lr table of that role, gathered by `TrainerPlan.engine(role)`. The engine
    builds TransformerConfig, GPTModel, DDP, optimizer, lr and batch iteration from it and nothing else."""

    role: str
    """actor, ref, critic or reward_model."""
    model: ModelSpec
    """Architecture, head (lm / value) and the folder the weights load from."""
    settings: ModelConfig
    """The effective model section, for what the plan does not derive (params_dtype, attention_backend,
    init_method_std); its path and arch are the policy's: use `model` for this role's."""
    layout: RoleLayout
    megatron: MegatronConfig
    """The role's effective megatron section (sequence_parallel, expert tp and seed resolved)."""
    device: str
    batch: BatchPlan | None
    """The update's batch schedule (trained roles: actor, critic)."""
    optim: OptimPlan | None
    """Optimizer settings and the lr of every training step (trained roles)."""
    forward_micro_batch_size: int
    """Rows per forward micro-batch of log-prob / value / reward passes (the sampler's too)."""
    forward_use_dynamic_bsz: bool
    forward_max_token_len: int | None
    """With forward_use_dynamic_bsz: the token budget of a forward micro-batch."""

    @property
    def trainable(self) -> bool:
        return self.optim is not None

    def frozen(self, role: str) -> EnginePlan:
        """The same engine without optimizer and update (a reference policy built on this layout)."""
        return replace(self, role=role, batch=None, optim=None)


_T = TypeVar("_T")

ENGINE_ROLES: tuple[str, ...] = ("actor", "ref", "critic", "reward_model")
"""Roles with a megatron engine of their own."""


def _engine_plan(plan: TrainerPlan, role: str) -> EnginePlan:
    if role not in ENGINE_ROLES or role not in plan.roles:
        raise KeyError(f"role {role!r} has no engine in this plan (roles: {', '.join(plan.roles)})")
    c = plan.config
    # Forward passes: the actor and ref cut by the actor's token budget when use_dynamic_bsz (verl).
    if role == "actor":
        micro, dynamic, budget = (
            c.actor.log_prob_micro_batch_size_per_gpu, c.actor.use_dynamic_bsz, c.actor.ppo_max_token_len_per_gpu
        )  # fmt: skip
    elif role == "ref":
        micro, dynamic, budget = (
            c.ref.log_prob_micro_batch_size_per_gpu, c.actor.use_dynamic_bsz, c.actor.ppo_max_token_len_per_gpu
        )  # fmt: skip
    elif role == "critic":
        micro, dynamic, budget = (
            c.critic.ppo_micro_batch_size_per_gpu, c.critic.use_dynamic_bsz, c.critic.ppo_max_token_len_per_gpu
        )  # fmt: skip
    else:
        micro, dynamic, budget = c.reward.reward_model.micro_batch_size_per_gpu, False, None
    trained = role in ("actor", "critic")
    return EnginePlan(
        role=role,
        model=next(m for m in plan.models if role in m.used_by),
        settings=c.model,
        layout=plan.layout(role),
        megatron=_megatron_of(c, role)[1],
        device=plan.resources.device,
        batch=plan.batch_plan(role) if trained else None,
        optim=plan.optim_plan(role) if trained else None,
        forward_micro_batch_size=micro,
        forward_use_dynamic_bsz=bool(dynamic),
        forward_max_token_len=budget if dynamic else None,
    )


def _by_role(items: tuple[_T, ...], role: str) -> _T:
    for item in items:
        if item.role == role:  # type: ignore[attr-defined]
            return item
    raise KeyError(f"role {role!r} is not in this plan")


# ========================================================================================= entry points
def compile_plan(config: RLConfig) -> TrainerPlan:
    """Derive the trainer plan of a (validated) config; raises ConfigError, and nothing else, when it
    cannot be planned or its memory estimate exceeds cluster.device_memory_gib."""
    plan = _compile(config)
    _check_memory(config, plan)
    return plan


def plan_to_dict(plan: TrainerPlan) -> dict[str, object]:
    """The plan as plain JSON data (dicts, lists, str, int, float, bool, None); `json.dumps` works on it."""
    out = _jsonable(plan)
    assert isinstance(out, dict)
    # Keyed by model name (`models.policy.params_total`): a model is looked up by name, never by position.
    out["models"] = {m["name"]: m for m in out["models"]}  # type: ignore[index, union-attr]
    return out


def diff_plans(
    a: TrainerPlan | Mapping[str, object], b: TrainerPlan | Mapping[str, object]
) -> list[tuple[str, object, object]]:
    """Differences between two plans (or plan dicts) as (dotted path, value in a, value in b), sorted.

    Lists of records are keyed by their identity when they have one (`layouts[role=actor].tp`,
    `optim[role=actor].table[step=3].lr`), otherwise by index (`models[0]...`); lists of plain values
    compare whole. A value missing on one side is the string "<missing>".
    """
    da = plan_to_dict(a) if isinstance(a, TrainerPlan) else dict(a)
    db = plan_to_dict(b) if isinstance(b, TrainerPlan) else dict(b)
    fa, fb = dict(_flatten(da)), dict(_flatten(db))
    out: list[tuple[str, object, object]] = []
    for key in sorted(fa.keys() | fb.keys()):
        va, vb = fa.get(key, MISSING), fb.get(key, MISSING)
        if va != vb or type(va) is not type(vb):
            out.append((key, va, vb))
    return out


MISSING = "<missing>"
_IDENTITY_KEYS = ("role", "name", "pool", "phase", "label", "step", "rank")


def _flatten(value: object, prefix: str = "") -> Iterator[tuple[str, object]]:
    if isinstance(value, dict):
        if not value:
            yield prefix, {}
        for k, v in value.items():
            yield from _flatten(v, f"{prefix}.{k}" if prefix else str(k))
        return
    if isinstance(value, list) and value and all(isinstance(x, dict) for x in value):
        key = next(
            (
                k
                for k in _IDENTITY_KEYS
                if all(k in x for x in value) and len({repr(x[k]) for x in value}) == len(value)
            ),
            None,
        )
        for i, item in enumerate(value):
            label = f"{key}={item[key]}" if key is not None else str(i)
            yield from _flatten(item, f"{prefix}[{label}]")
        return
    yield prefix, value


def _jsonable(obj: object) -> object:
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(x) for x in obj]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        # JSON has no NaN / Infinity; the plan never produces them from a checked config.
        return obj if math.isfinite(obj) else str(obj)
    return str(obj)


# ========================================================================================= preconditions
class _Checks:
    """Collects the problems that would stop the plan's arithmetic (reported all at once)."""

    def __init__(self) -> None:
        self.issues: list[Issue] = []

    def add(self, path: str, message: str, fix: str, rule: str) -> None:
        self.issues.append(error(path, message, fix, rule))

    def integer(
        self, path: str, value: object, minimum: int, *, optional: bool = False, rule: str = "positive-size"
    ) -> bool:
        if optional and value is None:
            return True
        if isinstance(value, bool) or not isinstance(value, int):
            self.add(path, f"must be an integer, got {value!r}", f"use an integer >= {minimum}", rule)
            return False
        if value < minimum:
            self.add(path, f"must be >= {minimum}, got {value}", f"use an integer >= {minimum}", rule)
            return False
        if value > MAX_INT:
            self.add(path, f"{value} is too large to plan", f"use a value <= {MAX_INT}", rule)
            return False
        return True

    def number(self, path: str, value: object, minimum: float | None = None, *, rule: str = "optim") -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.add(path, f"must be a finite number, got {value!r}", "use a finite number", rule)
            return False
        if minimum is not None and value < minimum:
            self.add(path, f"must be >= {minimum}, got {value}", f"use a number >= {minimum}", rule)
            return False
        return True

    def choice(self, path: str, value: object, allowed: tuple[str, ...], rule: str) -> bool:
        if value not in allowed:
            self.add(
                path,
                f"{value!r} is not one of {', '.join(allowed)}",
                f"use one of {', '.join(allowed)}",
                rule,
            )
            return False
        return True

    def raise_if_any(self) -> None:
        if self.issues:
            raise ConfigError(self.issues)


_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
_WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


def _uses_ref(c: RLConfig) -> bool:
    return bool(c.actor.use_kl_loss or c.algorithm.use_kl_in_reward)


def _megatron_of(c: RLConfig, role: str) -> tuple[str, MegatronConfig]:
    """(config path prefix, megatron section) of a megatron role."""
    if role == "actor":
        return "actor.megatron", c.actor.megatron
    if role == "ref":
        return "ref.megatron", c.ref.megatron
    if role == "critic":
        return "critic.megatron", c.critic.megatron
    return "reward.reward_model.megatron", c.reward.reward_model.megatron


def rollout_tp(c: RLConfig) -> int:
    """The rollout's tensor parallel size: rollout.tensor_model_parallel_size, or the actor's when null."""
    tp = c.rollout.tensor_model_parallel_size
    return c.actor.megatron.tensor_model_parallel_size if tp is None else tp


def rollout_resharded(c: RLConfig) -> bool:
    """Whether the rollout runs in a layout of its own (tp = rollout_tp, pp 1): always for vLLM; for the
    embedded engine when its tp differs from the actor's. Otherwise it generates on the actor's weights in
    the actor's layout, pipeline stages included (zero copy), as configs that set the actor's tp here
    always have."""
    if c.rollout.engine != "embedded":
        return True
    return rollout_tp(c) != c.actor.megatron.tensor_model_parallel_size


def _present_roles(c: RLConfig) -> tuple[str, ...]:
    present = {"actor", "rollout"}
    if _uses_ref(c):
        present.add("ref")
    if c.critic.enable:
        present.add("critic")
    if c.reward.reward_model.enable:
        present.add("reward_model")
    return tuple(r for r in WORKER_ROLES if r in present)


def _check_basics(c: RLConfig) -> None:
    ck = _Checks()
    cl = c.cluster
    ok_nodes = ck.integer("cluster.nnodes", cl.nnodes, 1)
    ok_gpus = ck.integer("cluster.gpus_per_node", cl.gpus_per_node, 1)
    if ok_nodes and ok_gpus and cl.nnodes * cl.gpus_per_node > MAX_DEVICES:
        ck.add(
            "cluster.nnodes",
            f"{cl.nnodes} x {cl.gpus_per_node} devices is more than the plan supports ({MAX_DEVICES})",
            "check cluster.nnodes and cluster.gpus_per_node",
            "positive-size",
        )
    mem = cl.device_memory_gib
    if mem is not None and ck.number("cluster.device_memory_gib", mem, rule="cluster") and mem <= 0:
        ck.add(
            "cluster.device_memory_gib", "must be > 0", "give the device memory in GiB, or null", "cluster"
        )
    t = c.trainer
    if ck.integer("trainer.total_steps", t.total_steps, 1) and t.total_steps > MAX_TOTAL_STEPS:
        ck.add(
            "trainer.total_steps",
            f"{t.total_steps} steps is more than the plan supports",
            "shorten the run",
            "trainer",
        )
    ck.integer("trainer.save_freq", t.save_freq, 0)
    ck.integer("trainer.critic_warmup", t.critic_warmup, 0)
    ck.integer("trainer.max_ckpt_to_keep", t.max_ckpt_to_keep, 1, optional=True)
    for path, value in (("trainer.output_dir", t.output_dir), ("profile.save_path", c.profile.save_path)):
        if not isinstance(value, str):
            ck.add(path, f"must be a path, got {value!r}", "use a string path", "trainer")
    ck.integer("data.train_batch_size", c.data.train_batch_size, 1)
    ck.integer("data.max_prompt_length", c.data.max_prompt_length, 0)
    ck.integer("rollout.n", c.rollout.n, 1)
    ck.integer("rollout.max_response_length", c.rollout.max_response_length, 1)
    ck.integer("rollout.tensor_model_parallel_size", c.rollout.tensor_model_parallel_size, 1, optional=True)
    ck.choice("model.params_dtype", c.model.params_dtype, tuple(DTYPE_BYTES), "model-source")

    roles = _present_roles(c)
    for role in roles:
        if role == "rollout":
            continue
        prefix, m = _megatron_of(c, role)
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        ):
            ck.integer(f"{prefix}.{name}", getattr(m, name), 1)
        ck.integer(
            f"{prefix}.virtual_pipeline_model_parallel_size",
            m.virtual_pipeline_model_parallel_size,
            1,
            optional=True,
        )
        ck.integer(f"{prefix}.expert_tensor_parallel_size", m.expert_tensor_parallel_size, 1, optional=True)
        ov = m.override_transformer_config
        ck.integer(
            f"{prefix}.override_transformer_config.recompute_num_layers",
            ov.recompute_num_layers,
            1,
            optional=True,
        )
        ck.number(
            f"{prefix}.override_transformer_config.hidden_dropout",
            ov.hidden_dropout,
            0.0,
            rule="model-source",
        )
    for prefix, role_cfg in (("actor", c.actor), ("critic", c.critic)):
        if prefix == "critic" and not c.critic.enable:
            continue
        ck.integer(f"{prefix}.ppo_mini_batch_size", role_cfg.ppo_mini_batch_size, 1)
        ck.integer(f"{prefix}.ppo_epochs", role_cfg.ppo_epochs, 1)
        if role_cfg.use_dynamic_bsz:
            ck.integer(f"{prefix}.ppo_max_token_len_per_gpu", role_cfg.ppo_max_token_len_per_gpu, 1)
        else:
            ck.integer(f"{prefix}.ppo_micro_batch_size_per_gpu", role_cfg.ppo_micro_batch_size_per_gpu, 1)
        o = role_cfg.optim
        p = f"{prefix}.optim"
        ck.choice(f"{p}.optimizer", o.optimizer, ("adam", "sgd"), "optim")
        for name in ("lr", "min_lr", "lr_warmup_init", "weight_decay"):
            ck.number(f"{p}.{name}", getattr(o, name))
        ck.number(f"{p}.lr_warmup_steps_ratio", o.lr_warmup_steps_ratio, 0.0)
        ck.integer(f"{p}.lr_warmup_steps", o.lr_warmup_steps, 0, optional=True)
        ck.integer(f"{p}.lr_decay_steps", o.lr_decay_steps, 1, optional=True)
        ck.integer(f"{p}.lr_wsd_decay_steps", o.lr_wsd_decay_steps, 1, optional=True)
        ck.choice(f"{p}.lr_decay_style", o.lr_decay_style, _DECAY_STYLES, "optim")
        ck.choice(f"{p}.lr_wsd_decay_style", o.lr_wsd_decay_style, _WSD_STYLES, "optim")
    ck.integer("actor.log_prob_micro_batch_size_per_gpu", c.actor.log_prob_micro_batch_size_per_gpu, 1)
    if "ref" in roles:
        ck.integer("ref.log_prob_micro_batch_size_per_gpu", c.ref.log_prob_micro_batch_size_per_gpu, 1)
    rm = c.reward.reward_model
    if rm.enable:
        ck.integer("reward.reward_model.micro_batch_size_per_gpu", rm.micro_batch_size_per_gpu, 1)
    for prefix, enabled, placement, n in (
        ("critic", c.critic.enable, c.critic.placement, c.critic.num_devices),
        ("reward.reward_model", rm.enable, rm.placement, rm.num_devices),
    ):
        if enabled and placement == "separate":
            ck.integer(f"{prefix}.num_devices", n, 1, rule="device-pools")
    for i, r in enumerate(c.profile.ranks):
        ck.integer(f"profile.ranks[{i}]", r, 0)
    for i, s in enumerate(c.profile.steps):
        if isinstance(s, bool) or not isinstance(s, int):
            ck.add(
                f"profile.steps[{i}]", f"must be an integer step, got {s!r}", "steps count from 1", "profile"
            )
    ck.raise_if_any()


# ============================================================================================ model
def _check_arch(arch: ModelArch, prefix: str) -> None:
    ck = _Checks()
    for name in (
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "vocab_size",
        "max_position_embeddings",
    ):
        ck.integer(f"{prefix}.{name}", getattr(arch, name), 1)
    ck.integer(f"{prefix}.kv_channels", arch.kv_channels, 1, optional=True)
    ck.integer(f"{prefix}.num_moe_experts", arch.num_moe_experts, 1, optional=True)
    ck.integer(f"{prefix}.moe_ffn_hidden_size", arch.moe_ffn_hidden_size, 1, optional=True)
    ck.integer(f"{prefix}.moe_shared_expert_intermediate_size", arch.moe_shared_expert_intermediate_size, 1,
               optional=True)  # fmt: skip
    ck.integer(f"{prefix}.sliding_window", arch.sliding_window, 1, optional=True)
    ck.raise_if_any()
    for path, message, fix in family_issues(arch, prefix):
        ck.add(path, message, fix, UNSUPPORTED_RULE)
    ck.raise_if_any()


def _check_sequence_fits(c: RLConfig, arch: ModelArch, source: str, path: str) -> None:
    """A sliding attention window shorter than the run's sequences is a feature the engine does not build
    (within the window, windowed and full causal attention are the same computation)."""
    seq = c.data.max_prompt_length + c.rollout.max_response_length
    if arch.sliding_window is not None and seq > arch.sliding_window:
        raise ConfigError([error(
            path,
            f"{source}: family {arch.family} attends within a sliding window of {arch.sliding_window} tokens, "
            f"shorter than prompt + response = {seq}; rlplan builds full causal attention only",
            f"keep data.max_prompt_length + rollout.max_response_length <= {arch.sliding_window}",
            UNSUPPORTED_RULE,
        )])  # fmt: skip


def _kv_channels(arch: ModelArch) -> int:
    return head_dim(arch)


def _model_spec(
    name: str, source: str, arch: ModelArch, head: str, used_by: tuple[str, ...], weights: str | None
) -> ModelSpec:
    total, active = count_parameters(arch, head)
    return ModelSpec(name, source, arch, head, total, active, used_by, weights)


@dataclass(frozen=True)
class _Models:
    policy: ModelSpec
    critic: ModelSpec | None
    reward_model: ModelSpec | None

    def for_role(self, role: str) -> ModelSpec:
        if role == "critic" and self.critic is not None:
            return self.critic
        if role == "reward_model" and self.reward_model is not None:
            return self.reward_model
        return self.policy

    def all(self) -> tuple[ModelSpec, ...]:
        return tuple(m for m in (self.policy, self.critic, self.reward_model) if m is not None)


def _resolve_models(c: RLConfig, roles: tuple[str, ...]) -> _Models:
    if c.model.path is not None:
        if not isinstance(c.model.path, str):
            raise ConfigError(
                [
                    error(
                        "model.path",
                        f"must be a folder path, got {c.model.path!r}",
                        "use a string",
                        "model-config-json",
                    )
                ]
            )
        policy_arch, source = (
            read_model_arch(c.model.path, "model.path"),
            os.path.join(c.model.path, "config.json"),
        )
        _check_sequence_fits(c, policy_arch, source, "model.path")
    else:
        policy_arch, source = c.model.arch, "model.arch"
        _check_arch(policy_arch, "model.arch")
        _check_sequence_fits(c, policy_arch, source, "model.arch.sliding_window")
    policy_users = tuple(r for r in ("actor", "rollout", "ref") if r in roles)

    def value_model(name: str, path: str | None, path_name: str) -> ModelSpec:
        if path is not None:
            if not isinstance(path, str):
                raise ConfigError(
                    [
                        error(
                            path_name,
                            f"must be a folder path, got {path!r}",
                            "use a string",
                            "model-config-json",
                        )
                    ]
                )
            arch, src = read_model_arch(path, path_name), os.path.join(path, "config.json")
            _check_sequence_fits(c, arch, src, path_name)
        else:
            arch, src = policy_arch, source  # the policy's architecture with a value head
        return _model_spec(name, src, arch, "value", (name,), path if path is not None else c.model.path)

    critic = value_model("critic", c.critic.model_path, "critic.model_path") if "critic" in roles else None
    rm_cfg = c.reward.reward_model
    rm = (
        value_model("reward_model", rm_cfg.path, "reward.reward_model.path")
        if "reward_model" in roles
        else None
    )
    policy = _model_spec("policy", source, policy_arch, "lm", policy_users, c.model.path)
    return _Models(policy, critic, rm)


# ============================================================================================ resources
def _pool_sizes(c: RLConfig, roles: tuple[str, ...]) -> list[tuple[str, int, tuple[str, ...]]]:
    total = c.cluster.nnodes * c.cluster.gpus_per_node
    separate: list[tuple[str, int, tuple[str, ...]]] = []
    actor_roles = [r for r in roles if r in ("actor", "rollout", "ref")]
    if "critic" in roles:
        if c.critic.placement == "separate":
            separate.append(("critic_pool", c.critic.num_devices, ("critic",)))
        else:
            actor_roles.append("critic")
    if "reward_model" in roles:
        if c.reward.reward_model.placement == "separate":
            separate.append(("reward_model_pool", c.reward.reward_model.num_devices, ("reward_model",)))
        else:
            actor_roles.append("reward_model")
    actor_devices = total - sum(n for _, n, _ in separate)
    if actor_devices < 1:
        raise ConfigError(
            [
                error(
                    "cluster.gpus_per_node",
                    f"separate pools use {total - actor_devices} of {total} devices, none is left for the actor",
                    "add devices or shrink critic.num_devices / reward.reward_model.num_devices",
                    "device-pools",
                )
            ]
        )
    return [("actor_pool", actor_devices, tuple(actor_roles)), *separate]


def _resources(c: RLConfig, roles: tuple[str, ...]) -> Resources:
    gpn = c.cluster.gpus_per_node
    pools: list[Pool] = []
    first = 0
    for name, n, members in _pool_sizes(c, roles):
        nodes = tuple(range(first // gpn, (first + n - 1) // gpn + 1))
        pools.append(Pool(name, first, n, nodes, members))
        first += n
    placements: list[Placement] = []
    for role in roles:
        pool = next(p for p in pools if role in p.roles)
        others = tuple(r for r in pool.roles if r != role)
        placements.append(
            Placement(role, pool.name, pool.num_devices, pool.num_devices, c.cluster.device, others)
        )
    return Resources(
        device=c.cluster.device,
        nnodes=c.cluster.nnodes,
        gpus_per_node=gpn,
        total_devices=c.cluster.nnodes * gpn,
        pools=tuple(pools),
        placements=tuple(placements),
    )


# ============================================================================================ layouts
def _split_layers(num_layers: int, pp: int, vpp: int | None) -> tuple[tuple[StageLayers, ...], bool]:
    """Layers of each stage. Model order of the chunks is (virtual stage, stage): chunk v of stage p holds
    the (v * pp + p)-th block of layers, as megatron's interleaved schedule lays them out. Uneven counts
    (only possible without validation) give the earlier chunks one layer more."""
    v = vpp or 1
    n_chunks = pp * v
    base, extra = divmod(num_layers, n_chunks)
    sizes = [base + (1 if i < extra else 0) for i in range(n_chunks)]
    starts = [sum(sizes[:i]) for i in range(n_chunks)]
    stages = []
    for p in range(pp):
        chunks = tuple(LayerChunk(k, starts[k * pp + p], sizes[k * pp + p]) for k in range(v))
        stages.append(StageLayers(p, sum(ch.num_layers for ch in chunks), chunks, p == 0, p == pp - 1))
    return tuple(stages), extra == 0


def _grid(world: int, tp: int, cp: int, dp: int) -> tuple[RankCoord, ...]:
    coords = []
    for rank in range(world):
        rest, t = divmod(rank, tp)
        rest, c_ = divmod(rest, cp)
        pp_, d = divmod(rest, dp)
        coords.append(RankCoord(rank, pp_, t, c_, d))
    return tuple(coords)


def _padded_vocab(vocab: int, tp: int) -> int:
    multiple = VOCAB_DIVISIBLE_BY * tp
    return -(-vocab // multiple) * multiple


def _layouts(
    c: RLConfig, roles: tuple[str, ...], resources: Resources, models: _Models
) -> tuple[RoleLayout, ...]:
    ck = _Checks()
    layouts: list[RoleLayout] = []
    for role in roles:
        place = next(p for p in resources.placements if p.role == role)
        world = place.world_size
        spec = models.for_role(role)
        arch = spec.arch
        if role == "rollout" and rollout_resharded(c):
            tp, pp, vpp, cp, ep, etp, sp = rollout_tp(c), 1, None, 1, 1, None, False
            tp_path = "rollout.tensor_model_parallel_size"
        else:
            # Zero-copy: the embedded engine generates with the actor's own weights in the actor's layout.
            prefix, m = _megatron_of(c, "actor" if role == "rollout" else role)
            tp, pp, vpp = (
                m.tensor_model_parallel_size,
                m.pipeline_model_parallel_size,
                m.virtual_pipeline_model_parallel_size,
            )
            cp, ep, etp = m.context_parallel_size, m.expert_model_parallel_size, m.expert_tensor_parallel_size
            sp = bool(m.sequence_parallel) and tp > 1
            tp_path = f"{prefix}.tensor_model_parallel_size"
        etp = etp or tp
        mp = tp * pp * cp
        if world % mp:
            ck.add(
                tp_path,
                f"{role} world size {world} is not divisible by tp x pp x cp = {tp} x {pp} x {cp} = {mp}",
                f"choose tp, pp and cp whose product divides {world}",
                "world-divisible-by-model-parallel",
            )
            continue
        if world % (etp * ep * pp):
            ck.add(
                tp_path.replace("tensor_model_parallel_size", "expert_model_parallel_size"),
                f"{role} world size {world} is not divisible by expert tp x ep x pp = {etp * ep * pp}",
                "choose expert_model_parallel_size and expert_tensor_parallel_size that divide the world / pp",
                "world-divisible-by-model-parallel",
            )
            continue
        if spec.source != "model.arch":
            # validate.py checks model.arch; an architecture read from config.json is checked here.
            _check_arch_layout(ck, spec, role, tp_path, tp, pp, vpp)
            for field, message, fix in (
                expert_layout_issues(arch, spec.source, ep, etp, tp, sp) if role != "rollout" else ()
            ):
                ck.add(tp_path.replace("tensor_model_parallel_size", field), message, fix, "engine-support")
        dp = world // mp
        stages, even = _split_layers(arch.num_layers, pp, vpp)
        layouts.append(
            RoleLayout(
                role=role,
                model=spec.name,
                pool=place.pool,
                world_size=world,
                tp=tp,
                pp=pp,
                vpp=vpp,
                cp=cp,
                ep=ep,
                etp=etp,
                dp=dp,
                expert_dp=world // (etp * ep * pp),
                sequence_parallel=sp,
                order=MEGATRON_ORDER,
                padded_vocab_size=_padded_vocab(arch.vocab_size, tp),
                num_layers=arch.num_layers,
                layers_per_stage=tuple(s.num_layers for s in stages),
                even_layers=even,
                stages=stages,
                grid=_grid(world, tp, cp, dp),
            )
        )
    ck.raise_if_any()
    return tuple(layouts)


def _check_arch_layout(
    ck: _Checks, spec: ModelSpec, role: str, tp_path: str, tp: int, pp: int, vpp: int | None
) -> None:
    a = spec.arch
    for name, value in (
        ("num_attention_heads", a.num_attention_heads),
        ("num_query_groups", a.num_query_groups),
    ):
        if value % tp:
            ck.add(
                tp_path,
                f"{name} = {value} ({spec.source}) is not divisible by {role} tp = {tp}",
                f"use a tensor parallel size that divides {value}",
                "heads-divisible-by-tp",
            )
    chunks = pp * (vpp or 1)
    if role != "rollout" and a.num_layers % chunks:
        ck.add(
            tp_path.replace("tensor_model_parallel_size", "pipeline_model_parallel_size"),
            f"num_layers = {a.num_layers} ({spec.source}) is not divisible by pp x vpp = {chunks}",
            "choose pp (and vpp) whose product divides the number of layers",
            "layers-divisible-by-pp",
        )


# ============================================================================================ batches
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _batch_plans(
    c: RLConfig, roles: tuple[str, ...], layouts: tuple[RoleLayout, ...]
) -> tuple[BatchPlan, ...]:
    plans = []
    max_seq = c.data.max_prompt_length + c.rollout.max_response_length
    for role in ("actor", "critic"):
        if role not in roles:
            continue
        rc = c.actor if role == "actor" else c.critic
        lay = _by_role(layouts, role)
        prompts, n = c.data.train_batch_size, c.rollout.n
        mini = rc.ppo_mini_batch_size
        mini_batches = prompts // mini
        per_mini = mini * n
        per_rank = _cdiv(per_mini, lay.dp)
        even = prompts % mini == 0 and per_mini % lay.dp == 0
        if rc.use_dynamic_bsz:
            budget = rc.ppo_max_token_len_per_gpu
            # verl packs sequences (before the cp split) up to budget x cp tokens; each cp rank then holds
            # about `budget` tokens. Worst case: every sequence has full length.
            seqs_per_micro = max(1, budget * lay.cp // max_seq)
            micro, micro_batches, max_micro_batches = None, None, _cdiv(per_rank, seqs_per_micro)
            tokens = budget
            log_prob_micro = None
        else:
            micro = rc.ppo_micro_batch_size_per_gpu
            micro_batches = _cdiv(per_rank, micro)
            max_micro_batches = micro_batches
            even = even and per_rank % micro == 0
            tokens = _cdiv(micro * max_seq, lay.cp)
            log_prob_micro = c.actor.log_prob_micro_batch_size_per_gpu if role == "actor" else micro
        steps_per = mini_batches * rc.ppo_epochs
        first_update = 1
        if role == "actor" and "critic" in roles:
            first_update = c.trainer.critic_warmup + 1
        update_steps = max(0, c.trainer.total_steps - first_update + 1)
        plans.append(
            BatchPlan(
                role=role,
                prompts_per_step=prompts,
                responses_per_prompt=n,
                responses_per_step=prompts * n,
                mini_batch_prompts=mini,
                mini_batches_per_step=mini_batches,
                responses_per_mini_batch=per_mini,
                dp=lay.dp,
                responses_per_mini_batch_per_rank=per_rank,
                use_dynamic_bsz=bool(rc.use_dynamic_bsz),
                micro_batch_size_per_rank=micro,
                micro_batches_per_mini_batch=micro_batches,
                max_token_len_per_micro_batch=rc.ppo_max_token_len_per_gpu if rc.use_dynamic_bsz else None,
                max_micro_batches_per_mini_batch=max_micro_batches,
                max_seq_len=max_seq,
                tokens_per_micro_batch_per_rank=tokens,
                ppo_epochs=rc.ppo_epochs,
                optimizer_steps_per_training_step=steps_per,
                update_steps=update_steps,
                first_update_step=first_update,
                optimizer_steps_total=steps_per * update_steps,
                log_prob_micro_batch_size_per_rank=log_prob_micro,
                even=even,
            )
        )
    return tuple(plans)


def _step_passes(c: RLConfig, roles: tuple[str, ...], batches: tuple[BatchPlan, ...]) -> StepPasses:
    actor = _by_role(batches, "actor")
    on_policy = actor.mini_batches_per_step == 1 and actor.ppo_epochs == 1
    rc = c.algorithm.rollout_correction
    ref = "ref" in roles
    old = "recompute"
    if rc.bypass_mode:
        old = "rollout"
        reason = "algorithm.rollout_correction.bypass_mode: the sampler's log-probs are the old ones"
    elif not on_policy:
        reason = (
            f"{actor.optimizer_steps_per_training_step} actor optimizer steps per training step "
            f"({actor.mini_batches_per_step} mini-batches x {actor.ppo_epochs} epochs) compare with the "
            "weights before the first"
        )
    elif c.algorithm.use_kl_in_reward:
        reason = "on-policy, but algorithm.use_kl_in_reward reads them before the update"
    elif rc.rollout_is is not None or rc.rollout_rs is not None:
        reason = "on-policy, but algorithm.rollout_correction (rollout_is / rollout_rs) weighs the loss"
    else:
        old = "update"
        reason = "on-policy (one mini-batch, one epoch): the update's own forward (ratio exactly 1)"
    return StepPasses(
        actor_on_policy=on_policy,
        old_log_prob=old,
        ref_log_prob=ref,
        fused=ref and old == "recompute",
        reason=reason,
    )


# ============================================================================================ lr schedule
def _warmup_steps(o: Optim, total_steps: int) -> int:
    if o.lr_warmup_steps is not None:
        return o.lr_warmup_steps
    return round(o.lr_warmup_steps_ratio * total_steps)


def _resolved_optim(o: Optim, total_steps: int) -> Optim:
    decay = o.lr_decay_steps if o.lr_decay_steps is not None else total_steps
    wsd = o.lr_wsd_decay_steps if o.lr_wsd_decay_steps is not None else max(1, round(0.1 * decay))
    return replace(
        o, lr_warmup_steps=_warmup_steps(o, total_steps), lr_decay_steps=decay, lr_wsd_decay_steps=wsd
    )


def lr_at(o: Optim, num_steps: int, total_steps: int) -> float:
    """megatron-core OptimizerParamScheduler.get_lr() at `num_steps` for a resolved optimizer config.

    Follows megatron exactly, plus two guards where megatron asserts instead: a decay span of zero
    steps (warmup >= decay steps) gives min_lr after warmup, and the result is clamped to >= min_lr.
    """
    r = _resolved_optim(o, total_steps)
    warmup, decay, wsd = r.lr_warmup_steps or 0, r.lr_decay_steps or 0, r.lr_wsd_decay_steps or 0
    max_lr, min_lr, init = float(o.lr), float(o.min_lr), float(o.lr_warmup_init)
    if warmup > 0 and num_steps <= warmup:
        return init + (max_lr - init) * num_steps / warmup
    if o.lr_decay_style == "constant":
        return max_lr
    if num_steps > decay:
        return min_lr
    if o.lr_decay_style == "inverse-square-root":
        lr = max_lr * max(warmup, 1) ** 0.5 / max(num_steps, 1) ** 0.5
        return max(min_lr, lr)
    span = decay - warmup
    if span <= 0:
        return min_lr
    ratio = min(max((num_steps - warmup) / span, 0.0), 1.0)
    if o.lr_decay_style == "linear":
        coeff = 1.0 - ratio
    elif o.lr_decay_style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:  # WSD: stable at max_lr, then the last `wsd` steps of the decay span anneal
        anneal_start = decay - wsd
        if num_steps <= anneal_start or wsd <= 0:
            coeff = 1.0
        else:
            w = min((num_steps - anneal_start) / wsd, 1.0)
            if o.lr_wsd_decay_style == "linear":
                coeff = 1.0 - w
            elif o.lr_wsd_decay_style == "cosine":
                coeff = 0.5 * (math.cos(math.pi * w) + 1.0)
            elif o.lr_wsd_decay_style == "exponential":
                coeff = 2.0 * 0.5**w - 1.0
            else:  # minus_sqrt
                coeff = 1.0 - math.sqrt(w)
    return max(min_lr, min_lr + coeff * (max_lr - min_lr))


def _optim_plans(c: RLConfig, batches: tuple[BatchPlan, ...]) -> tuple[OptimPlan, ...]:
    plans = []
    total = c.trainer.total_steps
    for b in batches:
        o = c.actor.optim if b.role == "actor" else c.critic.optim
        r = _resolved_optim(o, total)
        rows = []
        for step in range(1, total + 1):
            updates = step >= b.first_update_step
            sched = max(0, step - b.first_update_step)
            rows.append(LrRow(step, sched, updates, lr_at(o, sched, total), float(o.weight_decay)))
        wsd = o.lr_decay_style == "WSD"
        plans.append(
            OptimPlan(
                role=b.role,
                optimizer=o.optimizer,
                lr=float(o.lr),
                min_lr=float(o.min_lr),
                lr_warmup_init=float(o.lr_warmup_init),
                warmup_steps=r.lr_warmup_steps or 0,
                decay_steps=r.lr_decay_steps or 0,
                decay_style=o.lr_decay_style,
                wsd_decay_steps=r.lr_wsd_decay_steps if wsd else None,
                wsd_decay_style=o.lr_wsd_decay_style if wsd else None,
                weight_decay=float(o.weight_decay),
                betas=(float(o.betas[0]), float(o.betas[1])),
                eps=float(o.eps),
                clip_grad=float(o.clip_grad),
                granularity="training_step",
                table=tuple(rows),
            )
        )
    return tuple(plans)


# ============================================================================================ profile
def _join(base: str, path: str) -> str:
    return os.path.normpath(os.path.join(base, path))


def _profile(c: RLConfig, roles: tuple[str, ...], layouts: tuple[RoleLayout, ...]) -> ProfilePlan:
    p = c.profile
    save_path = _join(c.trainer.output_dir, p.save_path)
    mode = "discrete" if p.discrete else "continuous"
    options: TorchProfileOptions | NpuProfileOptions | NsysProfileOptions | None = None
    if p.tool == "torch":
        options = p.torch
    elif p.tool == "npu":
        options = p.npu
    elif p.tool == "nsys":
        options = p.nsys
    notes: list[str] = []
    steps = tuple(sorted({s for s in p.steps if 1 <= s <= c.trainer.total_steps}))
    dropped = sorted({s for s in p.steps if s not in steps})
    if dropped:
        notes.append(f"steps {dropped} are outside the run's steps 1..{c.trainer.total_steps}; not profiled")
    present = tuple(r for r in ROLES if PROFILE_ROLE_WORKER[r] in roles or r == "reward_compute")
    wanted = tuple(dict.fromkeys(p.roles)) or present
    missing = [r for r in wanted if r not in present]
    if missing:
        notes.append(f"roles {missing} do not run in this config; not profiled")
    profiled = tuple(r for r in ROLES if r in wanted and r in present)

    def ranks_of(world: int, label: str) -> tuple[int, ...]:
        if p.all_ranks:
            return tuple(range(world))
        kept = tuple(sorted({r for r in p.ranks if r < world}))
        outside = sorted({r for r in p.ranks if r >= world})
        if outside:
            notes.append(f"{label}: ranks {outside} are outside its world of {world}; skipped there")
        return kept

    targets: list[ProfileTarget] = []
    if mode == "discrete":
        for role in profiled:
            worker = PROFILE_ROLE_WORKER[role]
            if worker not in roles:  # reward_compute without a reward model runs in the controller
                targets.append(ProfileTarget(role, CONTROLLER, (0,)))
            else:
                targets.append(
                    ProfileTarget(role, worker, ranks_of(_by_role(layouts, worker).world_size, role))
                )
    else:
        # One trace per step over the actor pool's processes (they run actor, rollout and ref).
        targets.append(ProfileTarget("e2e", "actor", ranks_of(_by_role(layouts, "actor").world_size, "e2e")))
        if any(lay.pool != "actor_pool" for lay in layouts):
            notes.append("continuous mode records the actor pool's processes; separate pools are not traced")
    enabled = p.tool != "none" and bool(steps)
    if p.tool != "none" and not steps:
        notes.append("no step of the run is listed in profile.steps: nothing is profiled")
    folders = (
        tuple(f"{save_path}/step_{s}/{t.role}/rank_{r}" for s in steps for t in targets for r in t.ranks)
        if enabled
        else ()
    )
    return ProfilePlan(
        enabled=enabled,
        tool=p.tool,
        mode=mode,
        save_path=save_path,
        steps=steps if enabled else (),
        roles=profiled if enabled else (),
        targets=tuple(targets) if enabled else (),
        folders=folders,
        options=options if enabled else None,
        notes=tuple(notes) if p.tool != "none" else (),
    )


# ============================================================================================ checkpoint
def _checkpoint(c: RLConfig, roles: tuple[str, ...]) -> CheckpointPlan:
    t = c.trainer
    root = _join(t.output_dir, "checkpoints")
    if t.save_freq > 0:
        steps = sorted({s for s in range(t.save_freq, t.total_steps + 1, t.save_freq)} | {t.total_steps})
    else:
        steps = []
    role_cks = []
    for role in ("actor", "critic"):
        if role not in roles:
            continue
        ck = c.actor.checkpoint if role == "actor" else c.critic.checkpoint
        hf = "hf_model" in ck.save_contents
        tmpl = f"{root}/global_step_{{step}}/{role}"
        role_cks.append(
            RoleCheckpoint(
                role=role,
                save_contents=tuple(ck.save_contents),
                load_contents=tuple(ck.load_contents),
                async_save=bool(ck.async_save),
                path_template=tmpl,
                hf_path_template=f"{tmpl}/huggingface" if hf else None,
            )
        )
    saves = []
    for s in steps:
        step_dir = f"{root}/global_step_{s}"
        rps = tuple(
            RolePath(
                rc.role,
                rc.path_template.format(step=s),
                rc.hf_path_template.format(step=s) if rc.hf_path_template else None,
            )
            for rc in role_cks
        )
        saves.append(CheckpointSave(s, step_dir, rps))
    keep = t.max_ckpt_to_keep
    retained = tuple(steps[-keep:]) if keep is not None else tuple(steps)
    latest = f"{root}/latest_checkpointed_iteration.txt"
    resume_from = None
    if t.resume_mode == "auto":
        resume = f"resume from the step named in {latest} when it exists, else start at step 1"
    elif t.resume_mode == "resume_path":
        resume_from = t.resume_from_path
        resume = f"resume from {resume_from}"
    else:
        resume = "start at step 1 (existing checkpoints are ignored)"
    return CheckpointPlan(
        enabled=bool(steps),
        save_freq=t.save_freq,
        save_steps=tuple(steps),
        root=root,
        latest_file=latest,
        max_ckpt_to_keep=keep,
        retained_steps=retained,
        async_save=any(rc.async_save for rc in role_cks),
        roles=tuple(role_cks),
        saves=tuple(saves),
        resume_mode=t.resume_mode,
        resume_from=resume_from,
        resume=resume,
    )


# ============================================================================================ memory
@dataclass(frozen=True)
class _StageMem:
    """Bytes one role needs on one device at one pipeline stage."""

    params: int
    param_bytes: float
    grad_bytes: float
    optim_bytes: float
    act_bytes: float
    logits_train: float
    logits_infer: float
    in_flight: int
    tokens: int
    rollout_kv: float = 0.0
    """Embedded rollout's KV cache during generate_sequences (actor only; 0 for other roles)."""
    rollout_weights: float = 0.0
    """The resharded rollout's own weights + one refit bucket during generate_sequences (actor only)."""


@dataclass(frozen=True)
class _RoleMemModel:
    role: str
    trained: bool
    offload: tuple[bool, bool, bool]  # params, grads, optimizer
    stages: tuple[_StageMem, ...]
    infer_phase: str


def _stage_params(arch: ModelArch, lay: RoleLayout, stage: StageLayers, head: str) -> int:
    """Parameters one rank of `stage` holds: tp shards of attention and dense MLPs, routed experts split
    over ep x etp ranks (num_moe_experts / ep experts, each sharded by etp), replicated norms and router."""
    tp = lay.tp
    moe_layers = sum(
        is_moe_layer(arch, layer) for ch in stage.chunks for layer in range(ch.first_layer, ch.first_layer + ch.num_layers)
    )  # fmt: skip
    n = 0
    for moe, count in ((True, moe_layers), (False, stage.num_layers - moe_layers)):
        p = layer_params(arch, moe)
        n += count * (_cdiv(p.tp_sharded, tp) + p.replicated + _cdiv(p.experts, lay.ep * lay.etp))
    emb = lay.padded_vocab_size * arch.hidden_size // tp
    if stage.embedding:
        n += emb
    if stage.output_layer:
        n += arch.hidden_size  # final norm
        if head == "value":
            n += arch.hidden_size  # value head: hidden -> 1
        elif not arch.share_embeddings_and_output_weights or lay.pp > 1:
            # Tied embeddings with pp > 1: megatron keeps a copy of the embedding on the last stage.
            n += emb
    return n


def _activation_bytes_per_token(
    arch: ModelArch, lay: RoleLayout, ov: OverrideTransformerConfig, elem: int
) -> tuple[float, float]:
    """(bytes stored per token by one layer for backward, bytes of one layer input per token).

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"), adapted to
    SwiGLU, grouped-query attention and flash/SDPA attention (no s^2 softmax term): per layer the two
    norm inputs and outputs (4h), q/k/v (q + 2g) and the attention output (q), the gate/up output (2f)
    and the SwiGLU output (f). Tensor-parallel regions are split by tp; the norm region only with
    sequence parallel. Dropout masks (1 byte) when hidden_dropout > 0.
    """
    h, f = arch.hidden_size, arch.ffn_hidden_size
    kv = _kv_channels(arch)
    q, g = arch.num_attention_heads * kv, arch.num_query_groups * kv
    selective = ov.recompute_modules if ov.recompute_granularity == "selective" else ()
    replicated = 4 * h
    if "layernorm" in selective:
        replicated -= 2 * h  # norm outputs are recomputed from the stored inputs
    mlp = 3 * f
    if "mlp" in selective:
        mlp = 0  # only the MLP input (a norm output, counted above) is kept
    elif "moe_act" in selective:
        mlp -= f
    # core_attn recompute saves nothing with flash attention: q, k, v are kept as the checkpoint's inputs.
    sharded = 2 * q + 2 * g + mlp
    rep_div = lay.tp if lay.sequence_parallel else 1
    per_token = elem * (replicated / rep_div + sharded / lay.tp)
    if ov.hidden_dropout > 0:
        per_token += 2 * h / rep_div
    return per_token, elem * h / rep_div


def _in_flight(lay: RoleLayout, stage: int, micro_batches: int) -> tuple[int, float]:
    """(micro-batches in flight, stage activations held as a multiple of one micro-batch's)."""
    m = max(micro_batches, 1)
    if lay.pp == 1:
        return 1, 1.0
    if lay.vpp is None:
        n = min(lay.pp - stage, m)
        return n, float(n)
    # Interleaved 1F1B (megatron get_pp_rank_microbatches): warmup chunks + 1, each a 1/vpp share.
    chunks = min((lay.pp - stage - 1) * 2 + (lay.vpp - 1) * lay.pp + 1, m * lay.vpp)
    return _cdiv(chunks, lay.vpp), chunks / lay.vpp


def _stage_activation_bytes(
    arch: ModelArch, lay: RoleLayout, stage: StageLayers, ov: OverrideTransformerConfig, elem: int, tokens: int,
    held: float,
) -> float:  # fmt: skip
    full, inp = _activation_bytes_per_token(arch, lay, ov, elem)
    layers = stage.num_layers
    if ov.recompute_granularity != "full" or layers == 0:
        return held * layers * full * tokens
    if ov.recompute_method == "block":
        per_chunk = ov.recompute_num_layers if ov.recompute_num_layers is not None else layers
        recomputed = sum(min(per_chunk, ch.num_layers) for ch in stage.chunks)
        stored = recomputed * inp + (layers - recomputed) * full
        working = full if recomputed else 0.0  # one layer re-materialised during backward
    else:  # uniform (megatron's default when a method is missing)
        group = ov.recompute_num_layers or 1
        stored = sum(_cdiv(ch.num_layers, group) for ch in stage.chunks) * inp
        working = min(group, layers) * full  # one group re-materialised during backward
    return (held * stored + working) * tokens


def _rollout_kv_bytes(c: RLConfig, lay: RoleLayout, arch: ModelArch, num_layers: int) -> float:
    """The embedded engine's KV cache on one actor device: keys and values of every layer of this stage,
    kv_heads / tp heads, at the full sequence length, for the rows one DP rank generates (rltrain/megatron/
    inference.py allocates [P + N, rows, groups/tp, head_dim] twice per layer in params_dtype).

    0 for vLLM (its own pool, capped by rollout.gpu_memory_utilization) and with context parallel (the
    engine then falls back to the cache-less path).
    """
    if c.rollout.engine != "embedded" or lay.cp > 1:
        return 0.0
    rows = _cdiv(c.data.train_batch_size * c.rollout.n, lay.dp)
    seq = c.data.max_prompt_length + c.rollout.max_response_length
    kv_heads = max(arch.num_query_groups // lay.tp, 1)
    return float(
        2 * num_layers * kv_heads * _kv_channels(arch) * seq * rows * DTYPE_BYTES[c.model.params_dtype]
    )


REFIT_BUCKET_MIB = 256
"""Largest gathered bucket of one refit collective (rltrain/rollout/reshard.py reads it from the plan)."""
REFIT_BYTES_PER_S: Mapping[str, float] = {"cuda": 100e9, "npu": 50e9, "cpu": 1e9}
"""Conservative all-gather + copy bandwidths for the refit time estimate (H200 NVLink moves ~3x more)."""


def _refit_extra_bytes(c: RLConfig, spec: ModelSpec, r_tp: int) -> float:
    """Per device while generating: the rollout replica's weights (every layer, 1/r_tp of the tp-split
    matrices; norms are negligible) plus one gathered bucket and its local part in flight."""
    full = spec.params_total * DTYPE_BYTES[c.model.params_dtype]
    return full / r_tp + 2 * min(REFIT_BUCKET_MIB * 2**20, full)


def _rollout_refit(c: RLConfig, layouts: tuple[RoleLayout, ...], models: _Models) -> RolloutRefit:
    actor, rollout = _by_role(layouts, "actor"), _by_role(layouts, "rollout")
    spec = models.for_role("actor")
    mode = (
        "zero-copy" if not rollout_resharded(c) else ("reshard" if c.rollout.engine == "embedded" else "vllm")
    )
    extra = 0.0 if mode == "zero-copy" else _refit_extra_bytes(c, spec, rollout.tp)
    full = spec.params_total * DTYPE_BYTES[c.model.params_dtype]
    seconds = 0.0 if mode == "zero-copy" else full / REFIT_BYTES_PER_S.get(c.cluster.device, 1e9)
    return RolloutRefit(
        mode=mode,
        actor_tp=actor.tp,
        actor_pp=actor.pp,
        rollout_tp=rollout.tp,
        rollout_dp=rollout.dp,
        bucket_mib=REFIT_BUCKET_MIB,
        extra_gib=_gib(extra),
        estimated_s=round(seconds, 4),
    )


def _role_mem_model(
    c: RLConfig, role: str, lay: RoleLayout, spec: ModelSpec, batch: BatchPlan | None
) -> _RoleMemModel:
    _, m = _megatron_of(c, role)
    elem = DTYPE_BYTES[c.model.params_dtype]
    trained = role in ("actor", "critic")
    max_seq = c.data.max_prompt_length + c.rollout.max_response_length
    ov = m.override_transformer_config
    ddp = m.override_ddp_config
    if role == "actor":
        infer_micro, dynamic, budget = (
            c.actor.log_prob_micro_batch_size_per_gpu,
            c.actor.use_dynamic_bsz,
            c.actor.ppo_max_token_len_per_gpu,
        )
        infer_phase = "actor_compute_log_prob"
    elif role == "critic":
        infer_micro, dynamic, budget = (
            c.critic.ppo_micro_batch_size_per_gpu,
            c.critic.use_dynamic_bsz,
            c.critic.ppo_max_token_len_per_gpu,
        )
        infer_phase = "critic_compute_values"
    elif role == "ref":
        infer_micro, dynamic, budget = (
            c.ref.log_prob_micro_batch_size_per_gpu,
            c.actor.use_dynamic_bsz,
            c.actor.ppo_max_token_len_per_gpu,
        )
        infer_phase = "ref_compute_log_prob"
    else:
        infer_micro, dynamic, budget = c.reward.reward_model.micro_batch_size_per_gpu, False, 0
        infer_phase = "reward_compute"
    infer_tokens = budget if dynamic else _cdiv(infer_micro * max_seq, lay.cp)
    out_width = lay.padded_vocab_size / lay.tp if spec.head == "lm" else 1.0
    stages = []
    for st in lay.stages:
        params = _stage_params(spec.arch, lay, st, spec.head)
        pbytes = float(params * elem)
        grads = optim = acts = logits_train = 0.0
        in_flight, tokens = 0, 0
        if trained and batch is not None:
            grads = float(params * (4 if ddp.grad_reduce_in_fp32 else elem))
            o = c.actor.optim if role == "actor" else c.critic.optim
            per_param = (4 if elem != 4 else 0) + (8 if o.optimizer == "adam" else 4)
            shards = lay.dp * lay.cp if m.use_distributed_optimizer else 1
            optim = params * per_param / shards
            tokens = batch.tokens_per_micro_batch_per_rank
            in_flight, held = _in_flight(lay, st.stage, batch.max_micro_batches_per_mini_batch)
            acts = _stage_activation_bytes(spec.arch, lay, st, ov, elem, tokens, held)
            if st.output_layer:
                logits_train = tokens * out_width * 4.0
        logits_infer = infer_tokens * out_width * 4.0 if st.output_layer else 0.0
        kv = _rollout_kv_bytes(c, lay, spec.arch, st.num_layers) if role == "actor" else 0.0
        refit = 0.0
        if role == "actor" and rollout_resharded(c) and c.rollout.engine == "embedded":
            # The rollout replica holds every layer at its own tp and generates rows / rollout dp.
            r_tp = rollout_tp(c)
            r_lay = replace(lay, tp=r_tp, pp=1, cp=1, dp=max(lay.world_size // r_tp, 1))
            kv = _rollout_kv_bytes(c, r_lay, spec.arch, spec.arch.num_layers)
            refit = _refit_extra_bytes(c, spec, r_tp)
        mem = _StageMem(
            params, pbytes, grads, optim, acts, logits_train, logits_infer, in_flight, tokens, kv, refit
        )
        stages.append(mem)
    offload = (bool(m.param_offload), bool(m.grad_offload) and trained, bool(m.optimizer_offload) and trained)
    return _RoleMemModel(role, trained, offload, tuple(stages), infer_phase)


def _resident(r: _RoleMemModel, s: _StageMem) -> list[tuple[str, float]]:
    """What a role keeps on the device while another role's call runs."""
    po, go, oo = r.offload
    parts = [] if po else [(f"{r.role} params", s.param_bytes)]
    if r.trained:
        parts += [] if go else [(f"{r.role} grads", s.grad_bytes)]
        parts += [] if oo else [(f"{r.role} optimizer", s.optim_bytes)]
    return parts


def _phases(models: list[_RoleMemModel], stage_of: dict[str, int]) -> list[PhaseMemory]:
    phases = []
    for r in models:
        s = r.stages[stage_of[r.role]]
        others = [p for o in models if o is not r for p in _resident(o, o.stages[stage_of[o.role]])]
        calls: list[tuple[str, list[tuple[str, float]]]] = []
        if r.trained:
            own = [
                (f"{r.role} params", s.param_bytes),
                (f"{r.role} grads", s.grad_bytes),
                (f"{r.role} optimizer", s.optim_bytes),
                (f"{r.role} activations", s.act_bytes),
                (f"{r.role} logits", s.logits_train),
            ]
            calls.append((f"{r.role}_update", own))
        _, go, oo = r.offload
        infer = [(f"{r.role} params", s.param_bytes)]
        if r.trained:
            infer += [] if go else [(f"{r.role} grads", s.grad_bytes)]
            infer += [] if oo else [(f"{r.role} optimizer", s.optim_bytes)]
        infer.append((f"{r.role} logits", s.logits_infer))
        calls.append((r.infer_phase, infer))
        if s.rollout_kv > 0:
            # generate_sequences on the actor's weights: what stays resident for the actor (as in its
            # log-prob call) plus the KV cache; compacting the cache (when at most half of the rows still
            # run) briefly holds the old cache and the new one of at most half its rows.
            gen = [
                *infer[:-1],
                ("rollout weights (resharded)", s.rollout_weights),
                ("rollout kv cache", s.rollout_kv),
                ("rollout kv compaction", s.rollout_kv / 2),
            ]
            calls.append(("generate_sequences", gen))
        for name, own_parts in calls:
            parts = tuple(MemoryPart(label, _gib(b)) for label, b in own_parts + others if b > 0)
            phases.append(PhaseMemory(name, _gib(sum(b for _, b in own_parts + others)), parts))
    return phases


def _gib(nbytes: float) -> float:
    return round(nbytes / GIB, 6)


def _memory(
    c: RLConfig,
    resources: Resources,
    layouts: tuple[RoleLayout, ...],
    models: _Models,
    batches: tuple[BatchPlan, ...],
) -> MemoryPlan:
    mem_roles = [lay for lay in layouts if lay.role != "rollout"]
    role_models = {
        lay.role: _role_mem_model(
            c,
            lay.role,
            lay,
            models.for_role(lay.role),
            next((b for b in batches if b.role == lay.role), None),
        )
        for lay in mem_roles
    }
    role_mems = []
    for lay in mem_roles:
        rm = role_models[lay.role]

        def own(s: _StageMem) -> float:
            return (
                s.param_bytes
                + s.grad_bytes
                + s.optim_bytes
                + s.act_bytes
                + max(s.logits_train, s.logits_infer)
            )

        idx = max(range(len(rm.stages)), key=lambda i: own(rm.stages[i]))
        s = rm.stages[idx]
        role_mems.append(
            RoleMemory(
                role=lay.role,
                pool=lay.pool,
                stage=idx,
                trained=rm.trained,
                params_per_device=s.params,
                params_gib=_gib(s.param_bytes),
                grads_gib=_gib(s.grad_bytes),
                optimizer_gib=_gib(s.optim_bytes),
                activations_gib=_gib(s.act_bytes),
                logits_gib=_gib(max(s.logits_train, s.logits_infer)),
                total_gib=_gib(own(s)),
                in_flight_micro_batches=s.in_flight,
                tokens_per_micro_batch=s.tokens,
                offloaded=tuple(
                    name
                    for name, flag in zip(("params", "grads", "optimizer"), rm.offload, strict=True)
                    if flag
                ),
            )
        )
    dev = c.cluster.device_memory_gib
    pools = []
    for pool in resources.pools:
        members = [lay for lay in mem_roles if lay.pool == pool.name]
        if not members:
            continue
        # Each device is at one pipeline stage per role; evaluate every distinct combination once.
        combos: dict[tuple[int, ...], int] = {}
        for rank in range(pool.num_devices):
            combos.setdefault(tuple(lay.grid[rank].pp for lay in members), rank)
        best: tuple[float, int, list[PhaseMemory]] | None = None
        for combo, rank in combos.items():
            stage_of = {lay.role: st for lay, st in zip(members, combo, strict=True)}
            phases = _phases([role_models[lay.role] for lay in members], stage_of)
            peak = max(p.total_gib for p in phases)
            if best is None or peak > best[0]:
                best = (peak, rank, phases)
        assert best is not None
        peak, rank, phases = best
        top = max(phases, key=lambda p: p.total_gib)
        pools.append(
            PoolMemory(
                pool=pool.name,
                roles=tuple(lay.role for lay in members),
                rank=rank,
                peak_phase=top.phase,
                peak_gib=peak,
                phases=tuple(phases),
                fits=None if dev is None else peak <= dev,
            )
        )
    peak = max(p.peak_gib for p in pools)
    notes = [
        "estimate per device; parameters on the most loaded pipeline stage; megatron's allocator overhead, "
        "NCCL buffers and fragmentation are not included (keep ~10-20% headroom)",
        "rollout: the embedded engine generates with the actor's weights; its KV cache (2 x layers x "
        "kv_heads/tp x head_dim x (max_prompt_length + max_response_length) x rows per DP rank x dtype bytes, "
        "+50% while compacting) is counted in generate_sequences and freed after it; "
        "rollout.gpu_memory_utilization caps only a vLLM engine's pool and is not used here",
        "optimizer: fp32 master weights (when params are not fp32) + Adam m and v, sharded over dp x cp "
        "with use_distributed_optimizer; gradients in fp32 with grad_reduce_in_fp32",
        "activations: Korthikanti et al. per layer without the attention s^2 term (flash/SDPA attention), "
        "for the micro-batches in flight under 1F1B, reduced by recompute; plus one fp32 logits slice",
    ]
    if rollout_resharded(c) and c.rollout.engine == "embedded":
        notes.append(
            "rollout in its own layout: generate_sequences also holds the rollout replica's weights (params x "
            "dtype bytes / rollout tp) and one refit bucket, from the refit to the end of generation; its KV "
            "cache uses the rollout's tp and dp"
        )
    offloaded = [f"{r.role}: {', '.join(r.offloaded)}" for r in role_mems if r.offloaded]
    if offloaded:
        notes.append(
            "offloaded to host while other roles run (counted only in the role's own calls): "
            + "; ".join(offloaded)
        )
    return MemoryPlan(
        device_memory_gib=dev,
        peak_gib=peak,
        fits=None if dev is None else peak <= dev,
        roles=tuple(role_mems),
        pools=tuple(pools),
        notes=tuple(notes),
    )


# ============================================================================================ assembly
def _effective_megatron(m: MegatronConfig, trainer_seed: int) -> MegatronConfig:
    tp = m.tensor_model_parallel_size
    return replace(
        m,
        sequence_parallel=bool(m.sequence_parallel) and tp > 1,
        expert_tensor_parallel_size=m.expert_tensor_parallel_size or tp,
        seed=resolve_seed(m.seed, trainer_seed),
    )


def _effective_config(c: RLConfig, models: _Models, roles: tuple[str, ...]) -> RLConfig:
    total = c.trainer.total_steps
    seed = c.trainer.seed  # seeds left None derive from it (rlconf.seeding)
    actor = replace(
        c.actor,
        megatron=_effective_megatron(c.actor.megatron, seed),
        optim=_resolved_optim(c.actor.optim, total),
    )
    critic = c.critic
    if "critic" in roles:
        critic = replace(
            critic,
            megatron=_effective_megatron(critic.megatron, seed),
            optim=_resolved_optim(critic.optim, total),
        )
    ref = replace(c.ref, megatron=_effective_megatron(c.ref.megatron, seed)) if "ref" in roles else c.ref
    reward = c.reward
    if "reward_model" in roles:
        rm = replace(reward.reward_model, megatron=_effective_megatron(reward.reward_model.megatron, seed))
        reward = replace(reward, reward_model=rm)
    model = replace(c.model, arch=models.policy.arch)
    data = replace(c.data, seed=resolve_seed(c.data.seed, seed))
    return replace(c, model=model, data=data, actor=actor, critic=critic, ref=ref, reward=reward)


def _compile(config: RLConfig) -> TrainerPlan:
    if not isinstance(config, RLConfig):
        raise ConfigError(
            [error("", f"expected an RLConfig, got {type(config).__name__}", "load the config first", "plan")]
        )
    # trainer.total_epochs becomes a step count here, once: every table below and the workers read it.
    length = run_length(config)
    config = with_run_length(config, length)
    _check_basics(config)
    roles = _present_roles(config)
    models = _resolve_models(config, roles)
    resources = _resources(config, roles)
    layouts = _layouts(config, roles, resources, models)
    batches = _batch_plans(config, roles, layouts)
    return TrainerPlan(
        version=PLAN_VERSION,
        roles=roles,
        models=models.all(),
        resources=resources,
        layouts=layouts,
        batch=batches,
        optim=_optim_plans(config, batches),
        profile=_profile(config, roles, layouts),
        checkpoint=_checkpoint(config, roles),
        memory=_memory(config, resources, layouts, models, batches),
        config=_effective_config(config, models, roles),
        refit=_rollout_refit(config, layouts, models),
        length=length,
        passes=_step_passes(config, roles, batches),
    )


# ============================================================================================ memory check
def _check_memory(config: RLConfig, plan: TrainerPlan) -> None:
    dev = config.cluster.device_memory_gib
    if dev is None:
        return
    issues = []
    for pool in plan.memory.pools:
        if pool.peak_gib <= dev:
            continue
        phase = next(p for p in pool.phases if p.phase == pool.peak_phase)
        big = [p for p in sorted(phase.parts, key=lambda p: -p.gib) if p.gib >= 0.05]
        parts = " + ".join(f"{p.label} {p.gib:.1f}" for p in big) or "small parts"
        others = [p.phase for p in pool.phases if p.total_gib > dev and p.phase != pool.peak_phase]
        message = (
            f"estimated peak memory per device is {pool.peak_gib:.1f} GiB, more than cluster.device_memory_gib = "
            f"{dev:g} GiB: on {pool.pool} rank {pool.rank}, {pool.peak_phase} needs {parts} GiB"
            + (f" ({', '.join(others)} also exceed{'s' if len(others) == 1 else ''} it)" if others else "")
            + "; the run would run out of memory after start-up"
        )
        options = _memory_options(config, pool.pool, pool.peak_gib, dev)
        fix = "change one or more of (estimated peak after each change alone): " + "; ".join(options)
        issues.append(error("cluster.device_memory_gib", message, fix, "memory-exceeds-device"))
    if issues:
        raise ConfigError(issues)


def _set(config: object, dotted: str, value: object) -> RLConfig:
    """`config` with the field at a dotted path replaced (frozen dataclasses all the way down)."""
    head, _, rest = dotted.partition(".")
    inner = value if not rest else _set(getattr(config, head), rest, value)
    return replace(config, **{head: inner})  # type: ignore[type-var]


def _role_variants(
    config: RLConfig, plan: TrainerPlan, role: str, shared: bool
) -> Iterator[tuple[str, RLConfig]]:
    """Single changes that lower one role's memory on its devices: (flag text, changed config)."""
    lay = plan.layout(role)
    arch = plan.model(lay.model).arch
    prefix, m = _megatron_of(config, role)
    tp2, pp2 = lay.tp * 2, lay.pp * 2
    if (
        lay.world_size % (tp2 * lay.pp * lay.cp) == 0
        and arch.num_attention_heads % tp2 == 0
        and arch.num_query_groups % tp2 == 0
    ):
        yield (
            f"{prefix}.tensor_model_parallel_size={tp2}",
            _set(config, f"{prefix}.tensor_model_parallel_size", tp2),
        )
    if lay.world_size % (lay.tp * pp2 * lay.cp) == 0 and arch.num_layers % (pp2 * (lay.vpp or 1)) == 0:
        yield (
            f"{prefix}.pipeline_model_parallel_size={pp2}",
            _set(config, f"{prefix}.pipeline_model_parallel_size", pp2),
        )
    if role in ("actor", "critic"):
        rc = config.actor if role == "actor" else config.critic
        if not m.use_distributed_optimizer and lay.dp * lay.cp > 1:
            yield (
                f"{prefix}.use_distributed_optimizer=true",
                _set(config, f"{prefix}.use_distributed_optimizer", True),
            )
        ov = m.override_transformer_config
        if ov.recompute_granularity != "full":
            full = replace(
                ov, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
            )
            yield (
                f"{prefix}.override_transformer_config.recompute_granularity=full (with recompute_method=uniform, "
                "recompute_num_layers=1)",
                _set(config, f"{prefix}.override_transformer_config", full),
            )
        if rc.use_dynamic_bsz:
            half = rc.ppo_max_token_len_per_gpu // 2
            if half >= config.data.max_prompt_length + config.rollout.max_response_length:
                yield (
                    f"{role}.ppo_max_token_len_per_gpu={half}",
                    _set(config, f"{role}.ppo_max_token_len_per_gpu", half),
                )
        elif rc.ppo_micro_batch_size_per_gpu > 1:
            half = rc.ppo_micro_batch_size_per_gpu // 2
            yield (
                f"{role}.ppo_micro_batch_size_per_gpu={half}",
                _set(config, f"{role}.ppo_micro_batch_size_per_gpu", half),
            )
        # Offloading frees the device for the other roles' calls.
        if shared and not (m.param_offload and m.grad_offload and m.optimizer_offload):
            off = replace(m, param_offload=True, grad_offload=True, optimizer_offload=True)
            yield (
                f"{prefix}.param_offload=true, grad_offload=true, optimizer_offload=true",
                _set(config, prefix, off),
            )
    elif shared and not m.param_offload:
        yield f"{prefix}.param_offload=true", _set(config, f"{prefix}.param_offload", True)
    # Log-prob / value / reward forwards materialise fp32 logits for their whole micro-batch.
    micro_field = {
        "actor": "actor.log_prob_micro_batch_size_per_gpu",
        "ref": "ref.log_prob_micro_batch_size_per_gpu",
        "reward_model": "reward.reward_model.micro_batch_size_per_gpu",
    }
    dynamic = config.actor.use_dynamic_bsz and role in ("actor", "ref")
    if role in micro_field and not dynamic:
        path = micro_field[role]
        value = get_path(config, path)
        if isinstance(value, int) and value > 1:
            yield f"{path}={value // 2}", _set(config, path, value // 2)


def _evaluate_variants(config: RLConfig, pool: str) -> list[tuple[float, str, RLConfig]]:
    """Every single change that lowers the pool's peak: (new peak, flag text, changed config), best first."""
    base = _compile(config)
    current = next(p.peak_gib for p in base.memory.pools if p.pool == pool)
    members = next(p for p in base.resources.pools if p.name == pool).roles
    shared = len([r for r in members if r != "rollout"]) > 1
    results: list[tuple[float, str, RLConfig]] = []
    for role in members:
        if role == "rollout":
            continue
        for label, changed in _role_variants(config, base, role, shared):
            try:
                plan = _compile(changed)
            except ConfigError:
                continue  # the change breaks another rule (e.g. a batch no longer divides): not offered
            peak = next(p.peak_gib for p in plan.memory.pools if p.pool == pool)
            if peak < current - 1e-6:
                results.append((peak, label, changed))
    results.sort(key=lambda r: (r[0], r[1]))
    return results


def _memory_options(config: RLConfig, pool: str, current: float, dev: float) -> list[str]:
    """Concrete config changes for an over-full pool, each with the pool's re-estimated peak, best first;
    when no single change fits, also a combination found greedily (best change, then the next, ...)."""
    singles = _evaluate_variants(config, pool)
    out = [f"{label} -> {peak:.1f} GiB{' (fits)' if peak <= dev else ''}" for peak, label, _ in singles[:8]]
    if singles and singles[0][0] > dev:
        chosen: dict[str, str] = {}  # field -> its latest change (tp=2 then tp=4 shows tp=4)
        cfg, peak = config, current
        for _ in range(4):
            step = _evaluate_variants(cfg, pool)
            if not step:
                break
            peak, label, cfg = step[0]
            chosen.pop(label.split("=")[0], None)
            chosen[label.split("=")[0]] = label
            if peak <= dev:
                break
        if len(chosen) > 1 or (chosen and peak < singles[0][0]):
            verdict = "fits" if peak <= dev else "still too much: add devices"
            head = "together: " if len(chosen) > 1 else ""
            out.insert(0, f"{head}{' AND '.join(chosen.values())} -> {peak:.1f} GiB ({verdict})")
    out.append("more devices (a larger dp shards the distributed optimizer further)")
    out.append("cluster.device_memory_gib, if the device really has more memory (null skips this check)")
    return out


# ============================================================================================ text
def _table(headers: tuple[str, ...], rows: list[tuple[object, ...]], indent: str = "  ") -> list[str]:
    cells = [tuple(str(x) for x in headers)] + [tuple("-" if x is None else str(x) for x in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return [indent + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in cells]


def _elide(lines: list[str], head: int, tail: int, indent: str = "    ") -> list[str]:
    if len(lines) <= head + tail + 1:
        return lines
    return [*lines[:head], f"{indent}... ({len(lines) - head - tail} more)", *lines[-tail:]]


def _fmt_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _ranks_text(ranks: tuple[int, ...] | list[int]) -> str:
    if not ranks:
        return "none"
    rs = sorted(ranks)
    if rs == list(range(rs[0], rs[-1] + 1)) and len(rs) > 2:
        return f"{rs[0]}-{rs[-1]}"
    text = ",".join(str(r) for r in rs[:12])
    return text + (f",... ({len(rs)})" if len(rs) > 12 else "")


def _layers_text(lay: RoleLayout) -> str:
    if lay.vpp is None:
        return ", ".join(str(n) for n in lay.layers_per_stage)
    return " | ".join(
        "+".join(f"{ch.first_layer}-{ch.first_layer + ch.num_layers - 1}" for ch in st.chunks)
        for st in lay.stages
    )


def _grid_lines(lay: RoleLayout) -> list[str]:
    """One line per (pp, dp) block: its tp x cp ranks are contiguous."""
    block = lay.tp * lay.cp
    lines = []
    for pp in range(lay.pp):
        for dp in range(lay.dp):
            start = lay.rank_of(pp, 0, 0, dp)
            if block <= 16:
                groups = [
                    " ".join(str(lay.rank_of(pp, t, c, dp)) for t in range(lay.tp)) for c in range(lay.cp)
                ]
                ranks = " | ".join(groups)
            else:
                ranks = f"{start}-{start + block - 1}"
            lines.append(f"    pp={pp} dp={dp}: {ranks}")
    return _elide(lines, 8, 2, "    ")


def _model_of_role(plan: TrainerPlan, role: str) -> ModelSpec | None:
    return next((m for m in plan.models if role in m.used_by), None)


def _vocab_padding_note(plan: TrainerPlan, model: str, vocab: int) -> str:
    """' (padded to N in layouts)' when a layout of this model pads its vocabulary, else ''."""
    padded = sorted({lay.padded_vocab_size for lay in plan.layouts
                     if (spec := _model_of_role(plan, lay.role)) is not None and spec.name == model})  # fmt: skip
    padded = [p for p in padded if p != vocab]
    return f" (padded to {' / '.join(map(str, padded))} in layouts)" if padded else ""


def _vocab_lines(plan: TrainerPlan) -> list[str]:
    """Why a layout's vocab differs from the model's: megatron pads the embedding and output layer to a
    multiple of VOCAB_DIVISIBLE_BY x tp so every tp rank holds an equal slice; logits past the real
    vocabulary are cut off before sampling and log-probs."""
    seen: set[tuple[int, int, int]] = set()
    lines = []
    for lay in plan.layouts:
        spec = _model_of_role(plan, lay.role)
        if spec is None or (spec.arch.vocab_size, lay.tp, lay.padded_vocab_size) in seen:
            continue
        seen.add((spec.arch.vocab_size, lay.tp, lay.padded_vocab_size))
        if lay.padded_vocab_size != spec.arch.vocab_size:
            lines.append(
                f"  vocab {lay.padded_vocab_size} = {spec.arch.vocab_size} padded to a multiple of "
                f"{VOCAB_DIVISIBLE_BY} x tp {lay.tp} (megatron's make_vocab_size_divisible_by: equal slices per "
                f"tp rank; the padded rows are never sampled or scored)"
            )
    return lines


def _refit_lines(plan: TrainerPlan) -> list[str]:
    """How the rollout gets the actor's weights each step, with the refit's extra memory and time."""
    r = plan.refit
    if r is None:
        return []
    if r.mode == "zero-copy":
        return ["  rollout refit: zero-copy (generates on the actor's own weights, actor layout)"]
    how = "resharded on the actor's devices" if r.mode == "reshard" else "loaded into vLLM"
    return [
        f"  rollout refit: {how}, actor tp {r.actor_tp} x pp {r.actor_pp} -> rollout tp {r.rollout_tp} x dp "
        f"{r.rollout_dp}; +{r.extra_gib:.2f} GiB per device while generating (buckets of {r.bucket_mib} MiB), "
        f"~{r.estimated_s:.2g} s per step (estimate)"
    ]


def format_plan(plan: TrainerPlan) -> str:
    """A compact, readable rendering of the plan (what `rlconf plan FILE` prints)."""
    out: list[str] = [f"rlplan trainer plan (v{plan.version}): roles {', '.join(plan.roles)}", ""]

    out.append("models")
    for m in plan.models:
        a = m.arch
        out.append(
            f"  {m.name}: {_fmt_count(m.params_total)} params"
            + (
                f" ({_fmt_count(m.params_active)} active: {a.num_moe_experts} experts, {a.moe_router_topk} per token)"
                if a.num_moe_experts is not None
                else ""
            )
            + f", {a.family}, {a.num_layers} layers, hidden {a.hidden_size}, "
            f"ffn {a.ffn_hidden_size}, heads {a.num_attention_heads}/{a.num_query_groups} groups, vocab "
            f"{a.vocab_size}{_vocab_padding_note(plan, m.name, a.vocab_size)}, {m.head} head{', tied embeddings' if a.share_embeddings_and_output_weights and m.head == 'lm' else ''}"
            f" [{m.source}]"
        )
    r = plan.resources
    out += ["", f"resources: {r.total_devices} x {r.device} ({r.nnodes} node(s) x {r.gpus_per_node})"]
    out += _table(
        ("pool", "devices", "nodes", "roles"),
        [
            (p.name, f"{_ranks_text(list(range(p.first_device, p.first_device + p.num_devices)))} ({p.num_devices})",
             _ranks_text(p.nodes), ", ".join(p.roles))
            for p in r.pools
        ],
    )  # fmt: skip

    out += ["", "layouts (rank = tp + TP*(cp + CP*(dp + DP*pp)), megatron order tp-cp-ep-dp-pp)"]
    out += _table(
        ("role", "pool", "world", "tp", "pp", "vpp", "cp", "ep", "etp", "dp", "sp", "vocab", "layers/stage"),
        [
            (lay.role, lay.pool, lay.world_size, lay.tp, lay.pp, lay.vpp, lay.cp, lay.ep, lay.etp, lay.dp,
             "on" if lay.sequence_parallel else "off", lay.padded_vocab_size,
             _layers_text(lay) + ("" if lay.even_layers else " (uneven)"))
            for lay in plan.layouts
        ],
    )  # fmt: skip
    out += _vocab_lines(plan)
    seen: dict[tuple[int, int, int, int], str] = {}
    for lay in plan.layouts:
        key = (lay.world_size, lay.tp, lay.pp, lay.cp)
        if key in seen:
            out.append(f"  {lay.role} grid: same as {seen[key]}")
            continue
        seen[key] = lay.role
        cp_note = ", cp groups split by |" if lay.cp > 1 else ""
        out.append(f"  {lay.role} grid (ranks by tp{cp_note}):")
        out += _grid_lines(lay)
    out += _refit_lines(plan)

    if plan.length is not None:
        out += ["", f"run: {plan.length.describe()}"]
    if plan.batch:
        out += ["", "batch schedule (per training step; mini-batches count prompts)"]
        rows = []
        for b in plan.batch:
            micro = (
                f"budget {b.max_token_len_per_micro_batch} tok, <= {b.max_micro_batches_per_mini_batch} micro"
                if b.use_dynamic_bsz
                else f"{b.micro_batch_size_per_rank} x {b.micro_batches_per_mini_batch}"
            )
            rows.append(
                (b.role, b.prompts_per_step, b.responses_per_step, f"{b.mini_batches_per_step} x {b.mini_batch_prompts}",
                 b.responses_per_mini_batch, b.dp, b.responses_per_mini_batch_per_rank, micro, b.max_seq_len,
                 b.ppo_epochs, b.optimizer_steps_per_training_step, b.optimizer_steps_total,
                 "" if b.even else "uneven!")
            )  # fmt: skip
        out += _table(
            ("role", "prompts", "responses", "mini-batches", "resp/mini", "dp", "resp/rank", "micro x accum",
             "max seq", "epochs", "opt steps/step", "opt steps", ""),
            rows,
        )  # fmt: skip

    if plan.passes is not None:
        sp = plan.passes
        old = {"recompute": "an actor forward pass", "rollout": "the rollout's", "update": "no pass"}
        ref = "none (no KL term)"
        if sp.ref_log_prob:
            ref = "a ref forward pass" + (", in one call with the old log-probs" if sp.fused else "")
        out += [
            "",
            f"log-prob passes per step: old log-probs {old[sp.old_log_prob]} ({sp.reason}); ref log-probs {ref}",
        ]

    for o in plan.optim:
        wsd = (
            f", WSD tail {o.wsd_decay_steps} steps {o.wsd_decay_style}"
            if o.wsd_decay_steps is not None
            else ""
        )
        out += [
            "",
            f"lr schedule {o.role}: {o.optimizer}, lr {o.lr:g} -> min {o.min_lr:g}, warmup {o.warmup_steps} steps "
            f"from {o.lr_warmup_init:g}, {o.decay_style} decay over {o.decay_steps} steps{wsd}; "
            f"weight decay {o.weight_decay:g}; one lr per training step",
        ]
        rows = [
            (row.step, row.scheduler_step, f"{row.lr:.6g}", "" if row.update else "no update")
            for row in o.table
        ]
        keep: set[int] = {0, 1, 2, len(rows) - 3, len(rows) - 2, len(rows) - 1}
        first_update = next((i for i, row in enumerate(o.table) if row.update), 0)
        for offset in (o.warmup_steps - 1, o.warmup_steps):
            keep.add(first_update + offset)
        if o.wsd_decay_steps is not None:
            keep.add(first_update + o.decay_steps - o.wsd_decay_steps)
        lines = _table(("step", "sched", "lr", ""), rows, "    ")
        shown = [lines[0]]
        last = -1
        for i in sorted(k for k in keep if 0 <= k < len(rows)):
            if i > last + 1:
                shown.append(f"    ... ({i - last - 1} rows)")
            shown.append(lines[i + 1])
            last = i
        if last < len(rows) - 1:
            shown.append(f"    ... ({len(rows) - 1 - last} rows)")
        out += shown

    p = plan.profile
    out += [
        "",
        f"profile: tool {p.tool}"
        + (f", {p.mode}, steps {list(p.steps)} -> {p.save_path}" if p.enabled else " (off)"),
    ]
    if p.enabled:
        out += _table(
            ("role", "worker", "ranks"), [(t.role, t.worker, _ranks_text(t.ranks)) for t in p.targets]
        )
        out += _elide([f"    {f}" for f in p.folders], 6, 2)
    out += [f"  note: {n}" for n in p.notes]

    ck = plan.checkpoint
    out += [""]
    if ck.enabled:
        out.append(
            f"checkpoints: steps {_ranks_text(ck.save_steps) if len(ck.save_steps) > 12 else list(ck.save_steps)} "
            f"(every {ck.save_freq} and the last), keep "
            f"{'all' if ck.max_ckpt_to_keep is None else ck.max_ckpt_to_keep}{', async' if ck.async_save else ''}"
        )
        for rc in ck.roles:
            hf = f" + {rc.hf_path_template}" if rc.hf_path_template else ""
            out.append(
                f"  {rc.role}: save {', '.join(rc.save_contents)}; load {', '.join(rc.load_contents)} -> {rc.path_template}{hf}"
            )
        out.append(f"  latest: {ck.latest_file}")
    else:
        out.append("checkpoints: none (trainer.save_freq = 0)")
    out.append(f"  resume ({ck.resume_mode}): {ck.resume}")

    mem = plan.memory
    dev = (
        "not checked (cluster.device_memory_gib: null)"
        if mem.device_memory_gib is None
        else f"{mem.device_memory_gib:g} GiB"
    )
    out += ["", f"memory estimate per device (GiB; device {dev})"]
    out += _table(
        ("role", "pool", "stage", "params", "weights", "grads", "optimizer", "activations", "logits", "total", "offloaded"),
        [
            (m.role, m.pool, m.stage, _fmt_count(m.params_per_device), f"{m.params_gib:.2f}", f"{m.grads_gib:.2f}",
             f"{m.optimizer_gib:.2f}", f"{m.activations_gib:.2f}", f"{m.logits_gib:.2f}", f"{m.total_gib:.2f}",
             ", ".join(m.offloaded) or "-")
            for m in mem.roles
        ],
    )  # fmt: skip
    for pm in mem.pools:
        verdict = "" if pm.fits is None else (" fits" if pm.fits else " DOES NOT FIT")
        out.append(
            f"  {pm.pool}: peak {pm.peak_gib:.2f} GiB during {pm.peak_phase} (rank {pm.rank}){verdict}"
        )
    out += [f"  note: {n}" for n in mem.notes]
    return "\n".join(out) + "\n"
