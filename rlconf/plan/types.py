"""The plan's dataclasses (what `compile_plan` returns; plan.json is their JSON form) and its limits."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TypeVar

from rlconf.config import ROLES, ModelArch
from rlconf.lora import LoraPlan
from rlconf.plan.algorithm import AlgorithmPlan
from rlconf.plan.roles import ROLE_TABLE, role_spec
from rlconf.plan.run import DataPlan, RewardPlan, RolloutPlan, RunPlan, TokenizerPlan
from rlconf.profile_vocab import NpuProfileOptions, NsysProfileOptions, TorchProfileOptions
from rlconf.run_length import RunLength

PLAN_VERSION = 1
GIB = 2**30
MEGATRON_ORDER = "tp-cp-ep-dp-pp"
"""megatron-core's default rank order: tp varies fastest, pp slowest."""
VOCAB_DIVISIBLE_BY = 128
"""megatron pads the vocabulary to a multiple of this x tp (make_vocab_size_divisible_by)."""
DTYPE_BYTES: Mapping[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}

WORKER_ROLES: tuple[str, ...] = tuple(r.name for r in ROLE_TABLE)
"""Worker roles in the order the plan lists them."""
CONTROLLER = "controller"
"""Where the rule-based reward runs when no reward model is enabled (one process, rank 0)."""
# Which worker role executes each profiled role (rlconf.config.ROLES).
PROFILE_ROLE_WORKER: Mapping[str, str] = {p: next(r.name for r in ROLE_TABLE if p in r.passes) for p in ROLES}


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
    params_trainable: int = -1
    """Parameters the optimizer updates: params_total, or the LoRA adapters' count with actor.lora (the
    base weights stay frozen); compile_plan always sets it."""


@dataclass(frozen=True)
class Pool:
    """A set of devices; the roles in it share one worker process per device."""

    name: str
    """actor_pool, rollout_pool, critic_pool or reward_model_pool."""
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
    size_bytes: int = 0
    """Estimated bytes of one checkpoint, every role (rlconf.plan.checkpoint_size); the free space each save
    needs."""


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
    stage_totals_gib: tuple[float, ...] = ()
    """The role's own peak (`total_gib`'s sum) on each pipeline stage, stage 0 first: uneven stages
    (num_layers_in_first/last_pipeline_stage, account_for_*) differ."""


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
    rollout_is: str | None = None
    """Importance weights pi_old / pi_rollout on the loss (token | sequence | None):
    algorithm.rollout_correction.rollout_is, or token when the run is off-policy and sets no correction."""
    rollout_rs: str | None = None
    """Rejection sampling by pi_old / pi_rollout (algorithm.rollout_correction.rollout_rs)."""
    off_policy_steps: int = 0
    """How many steps generation may run ahead of the update (algorithm.off_policy_steps): the batch of
    step s is generated with the weights after step s - 1 - off_policy_steps or later."""
    ref_from: str = "ref"
    """Where the ref log-probs come from: ref (the reference policy's own engine, a copy of the initial
    weights) or adapters-off (actor.lora: the actor's engine with its adapters disabled is the base model,
    so there is no ref worker and no second copy of the weights)."""


@dataclass(frozen=True)
class RolloutRefit:
    """How the rollout engine gets the actor's weights before each generation (rltrain/rollout/reshard.py)."""

    mode: str
    """zero-copy: the embedded engine generates on the actor's own weights (same layout); reshard: the
    actor's weights are gathered / split into the rollout layout on the same devices; vllm: loaded into
    the vLLM engine (HF names, in buckets); push: sent after every update from the trainer to the separate
    rollout pool's own model (rltrain/rollout/push.py), in buckets, with a version and checksums."""
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
    push_gib: float = 0.0
    """mode push: bytes of one weight push (the whole model in params_dtype, sent once per update)."""
    senders: int = 0
    """mode push: trainer ranks that send (one per pipeline stage; each stage streams its own layers)."""


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
    run: RunPlan
    """Names, folder, length, seed, validation, divergence guard, cluster and logging."""
    rollout: RolloutPlan
    """The rollout's sampling and engine settings and the multi-turn tools."""
    data: DataPlan
    """The prompts: files or synthetic task, keys, batch sizes, truncation, order."""
    reward: RewardPlan
    """The rule reward and its shaping."""
    tokenizer: TokenizerPlan
    """The tokenizer's folder, resolved."""
    algorithm: AlgorithmPlan
    """Losses, advantages, KL-in-reward, dynamic sampling and rollout-correction thresholds
    (rlconf/plan/algorithm.py)."""
    refit: RolloutRefit | None = None
    """How the rollout gets the actor's weights (always set by compile_plan)."""
    length: RunLength | None = None
    """The run's training steps and their source: trainer.total_steps, or trainer.total_epochs x batches
    per epoch (always set by compile_plan; config.trainer.total_steps holds the same number)."""
    passes: StepPasses | None = None
    """The log-prob passes of each training step (always set by compile_plan)."""
    lora: LoraPlan | None = None
    """The policy's LoRA adapters (actor.lora; None: full fine-tuning)."""
    engines: tuple[EngineSettings, ...] = ()
    """The resolved engine settings of every megatron role (always set by compile_plan; rlconf.plan.engine)."""

    def layout(self, role: str) -> RoleLayout:
        return by_role(self.layouts, role)

    def placement(self, role: str) -> Placement:
        return by_role(self.resources.placements, role)

    def batch_plan(self, role: str) -> BatchPlan:
        return by_role(self.batch, role)

    def optim_plan(self, role: str) -> OptimPlan:
        return by_role(self.optim, role)

    def model(self, name: str) -> ModelSpec:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    def engine(self, role: str) -> EnginePlan:
        """What the megatron engine of `role` (actor, ref, critic, reward_model, a separate rollout) is built
        from."""
        return engine_plan(self, role)


_T = TypeVar("_T")


def by_role(items: tuple[_T, ...], role: str) -> _T:
    for item in items:
        if item.role == role:  # type: ignore[attr-defined]
            return item
    raise KeyError(f"role {role!r} is not in this plan")


# ============================================================================================ engines
ENGINE_ROLES: tuple[str, ...] = ("actor", "ref", "critic", "reward_model", "rollout")
"""Roles with a megatron engine of their own."""


@dataclass(frozen=True)
class Recompute:
    """Activation recomputation (megatron's recompute_* TransformerConfig fields)."""

    granularity: str | None
    """full, selective, or None (no recomputation)."""
    method: str | None
    """full only: uniform or block (recompute_method, uniform when not set); None otherwise."""
    num_layers: int | None
    """full only: recompute_num_layers (1 when not set); None otherwise."""
    modules: tuple[str, ...]
    """selective only: the recomputed modules; empty otherwise."""


@dataclass(frozen=True)
class TransformerSettings:
    """The TransformerConfig values that come neither from the architecture nor from the layout."""

    params_dtype: str
    """float32, bfloat16 or float16 (model.params_dtype): parameters, activations and pipeline messages."""
    attention_backend: str
    """model.attention_backend."""
    init_method_std: float
    """Std of the random initialisation (model.init_method_std)."""
    moe_grouped_gemm: bool
    """Routed experts run as one grouped GEMM per layer (model.moe_grouped_gemm)."""
    attention_dropout: float
    hidden_dropout: float
    recompute: Recompute
    num_layers_in_first_pipeline_stage: int | None
    """Uneven pipeline split (None: even)."""
    num_layers_in_last_pipeline_stage: int | None
    account_for_embedding_in_pipeline_split: bool
    account_for_loss_in_pipeline_split: bool


@dataclass(frozen=True)
class MoeSettings:
    """MoE TransformerConfig values resolved against the architecture (MoE models only)."""

    aux_loss_coeff: float
    """Load-balancing loss coefficient: override_transformer_config.moe_aux_loss_coeff, or the
    architecture's (config.json's router_aux_loss_coef)."""
    z_loss_coeff: float | None
    """Router z-loss coefficient (None: off)."""
    router_dtype: str | None
    """model.moe_router_dtype: fp32 / fp64 routing (None: the model family's own)."""
    ffn_hidden_size: int
    """Routed expert FFN size: the architecture's moe_ffn_hidden_size, or its ffn_hidden_size."""


@dataclass(frozen=True)
class DdpSettings:
    """megatron DistributedDataParallelConfig and the optimizer's sharding."""

    use_distributed_optimizer: bool
    grad_reduce_in_fp32: bool
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    """Effective: configured and use_distributed_optimizer (megatron needs the distributed optimizer)."""
    bucket_size: int | None
    average_in_collective: bool


@dataclass(frozen=True)
class OffloadSettings:
    """What the engine moves to host memory while other roles use the device."""

    params: bool
    grads: bool
    optimizer: bool


@dataclass(frozen=True)
class EngineSettings:
    """One megatron role's resolved engine settings (its megatron section and the model section's)."""

    role: str
    """actor, ref, critic, reward_model or rollout (a separate rollout: the actor's settings, no offload)."""
    transformer: TransformerSettings
    moe: MoeSettings | None
    """None for a dense model."""
    ddp: DdpSettings
    offload: OffloadSettings
    seed: int
    """The base of the engine's weight-init, dropout and shuffle streams (megatron.seed, or trainer.seed)."""
    dist_checkpointing_path: str | None
    """Initial weights from this megatron dist checkpoint (use_dist_checkpointing); None: HF or random."""
    tokenizer_path: str | None
    """Folder of the run's tokenizer (model.tokenizer_path, or model.path); None: the char tokenizer."""
    forward_micro_batch_size: int
    """Rows per forward micro-batch of log-prob / value / reward passes (the sampler's too)."""
    forward_use_dynamic_bsz: bool
    forward_max_token_len: int | None
    """With forward_use_dynamic_bsz: the token budget of a forward micro-batch."""
    fused_kernels: bool
    """torch.compile'd fused kernels for SwiGLU, log-prob / entropy, sampling and RoPE (`fused_kernels`)."""
    fused_kernels_setting: str
    """model.fused_kernels as written (auto, compiled or eager): why `fused_kernels` is what it is."""
    remove_padding: bool
    """Packed (THD) micro-batches in this engine's log-prob / value / reward and update passes: a
    micro-batch's rows are one sequence without padding, attention restricted to each row
    (rltrain/megatron/packing.py); False: rows padded to the micro-batch's longest."""
    remove_padding_reason: str
    """Why `remove_padding` is what it is (model.use_remove_padding as written, or what rules packing out)."""


@dataclass(frozen=True)
class EnginePlan:
    """Everything one megatron role's engine is built from (rltrain.megatron.engine): the plan's own model,
    layout, engine settings, batch schedule and lr table of that role, gathered by `TrainerPlan.engine(role)`.
    The engine builds TransformerConfig, process groups, GPTModel, DDP, optimizer, lr and batch iteration
    from it and nothing else."""

    role: str
    """actor, ref, critic, reward_model or rollout."""
    model: ModelSpec
    """Architecture, head (lm / value) and the folder the weights load from."""
    layout: RoleLayout
    """Parallel sizes (tp, pp, vpp, cp, ep, etp), sequence parallel and the padded vocabulary."""
    settings: EngineSettings
    device: str
    batch: BatchPlan | None
    """The update's batch schedule (trained roles: actor, critic)."""
    optim: OptimPlan | None
    """Optimizer settings and the lr of every training step (trained roles)."""
    lora: LoraPlan | None = None
    """LoRA adapters on this engine's linears (the actor with actor.lora), base weights frozen."""

    @property
    def trainable(self) -> bool:
        return self.optim is not None

    @property
    def forward_micro_batch_size(self) -> int:
        return self.settings.forward_micro_batch_size

    @property
    def forward_use_dynamic_bsz(self) -> bool:
        return self.settings.forward_use_dynamic_bsz

    @property
    def forward_max_token_len(self) -> int | None:
        return self.settings.forward_max_token_len

    @property
    def fused_kernels(self) -> bool:
        return self.settings.fused_kernels

    @property
    def remove_padding(self) -> bool:
        return self.settings.remove_padding

    def frozen(self, role: str) -> EnginePlan:
        """The same engine without optimizer and update (a reference policy built on this layout)."""
        return replace(self, role=role, batch=None, optim=None)


def engine_plan(plan: TrainerPlan, role: str) -> EnginePlan:
    """The gathered engine view of `role` (`TrainerPlan.engine`)."""
    if role not in ENGINE_ROLES or role not in plan.roles:
        raise KeyError(f"role {role!r} has no engine in this plan (roles: {', '.join(plan.roles)})")
    if role == "rollout" and plan.placement("rollout").pool == plan.placement("actor").pool:
        raise KeyError("the colocated rollout generates on the actor's engine; it has no engine of its own")
    trained = role_spec(role).trained
    return EnginePlan(
        role=role,
        model=next(m for m in plan.models if role in m.used_by),
        layout=plan.layout(role),
        settings=next(s for s in plan.engines if s.role == role),
        device=plan.resources.device,
        batch=plan.batch_plan(role) if trained else None,
        optim=plan.optim_plan(role) if trained else None,
        lora=plan.lora if role == "actor" else None,
    )
