"""What one megatron role's engine is built from: the resolved engine settings of each role (`EngineSettings`,
`TrainerPlan.engines`) and the gathered view of one role (`EnginePlan`, `TrainerPlan.engine(role)`).

Every "None means X" of the megatron and model sections is decided here (the MoE load-balancing coefficient
and expert FFN size, recompute defaults, overlap_param_gather only with the distributed optimizer, the seed,
the tokenizer folder, the forward batching, the fused kernels); the layout (tp, pp, vpp, cp, ep, etp,
sequence parallel, padded vocabulary) is the role's RoleLayout. rltrain.megatron builds TransformerConfig,
the process groups, DDP and the optimizer from these values alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from rlconf.config import (
    ActorConfig,
    CriticConfig,
    MegatronConfig,
    ModelArch,
    ModelConfig,
    Optim,
    RLConfig,
)
from rlconf.fields import get_path
from rlconf.plan.roles import megatron_of, role_spec
from rlconf.seeding import resolve_seed

if TYPE_CHECKING:
    from rlconf.lora import LoraPlan
    from rlconf.plan.types import BatchPlan, ModelSpec, OptimPlan, RoleLayout, TrainerPlan

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


# ============================================================================================ resolution
def engine_settings(
    c: RLConfig, roles: tuple[str, ...], models: tuple[ModelSpec, ...]
) -> tuple[EngineSettings, ...]:
    """The resolved engine settings of every megatron role present (compile_plan)."""
    return tuple(
        _settings(c, role, next(m.arch for m in models if role in m.used_by))
        for role in ENGINE_ROLES
        if role in roles
    )


def _settings(c: RLConfig, role: str, arch: ModelArch) -> EngineSettings:
    m = megatron_of(c, role)[1]
    separate_rollout = role == "rollout"
    ov = m.override_transformer_config
    ddp = m.override_ddp_config
    micro, dynamic, budget = forward_batching(c, role)
    tok = c.model.tokenizer_path if c.model.tokenizer_path is not None else c.model.path
    full = ov.recompute_granularity == "full"
    selective = ov.recompute_granularity == "selective"
    return EngineSettings(
        role=role,
        transformer=TransformerSettings(
            params_dtype=c.model.params_dtype,
            attention_backend=c.model.attention_backend,
            init_method_std=c.model.init_method_std,
            moe_grouped_gemm=c.model.moe_grouped_gemm,
            attention_dropout=ov.attention_dropout,
            hidden_dropout=ov.hidden_dropout,
            recompute=Recompute(
                granularity=ov.recompute_granularity,
                method=(ov.recompute_method or "uniform") if full else None,
                num_layers=(ov.recompute_num_layers or 1) if full else None,
                modules=tuple(ov.recompute_modules) if selective else (),
            ),
            # A separate rollout runs the whole model on one pipeline stage.
            num_layers_in_first_pipeline_stage=None
            if separate_rollout
            else m.num_layers_in_first_pipeline_stage,
            num_layers_in_last_pipeline_stage=None
            if separate_rollout
            else m.num_layers_in_last_pipeline_stage,
            account_for_embedding_in_pipeline_split=(
                False if separate_rollout else m.account_for_embedding_in_pipeline_split
            ),
            account_for_loss_in_pipeline_split=False
            if separate_rollout
            else m.account_for_loss_in_pipeline_split,
        ),
        moe=None
        if arch.num_moe_experts is None
        else MoeSettings(
            aux_loss_coeff=arch.moe_aux_loss_coeff
            if ov.moe_aux_loss_coeff is None
            else ov.moe_aux_loss_coeff,
            z_loss_coeff=ov.moe_z_loss_coeff,
            ffn_hidden_size=arch.moe_ffn_hidden_size or arch.ffn_hidden_size,
        ),
        ddp=DdpSettings(
            use_distributed_optimizer=m.use_distributed_optimizer,
            grad_reduce_in_fp32=ddp.grad_reduce_in_fp32,
            overlap_grad_reduce=ddp.overlap_grad_reduce,
            overlap_param_gather=ddp.overlap_param_gather and m.use_distributed_optimizer,
            bucket_size=ddp.bucket_size,
            average_in_collective=ddp.average_in_collective,
        ),
        offload=OffloadSettings(
            params=m.param_offload and not separate_rollout,
            grads=m.grad_offload and not separate_rollout,
            optimizer=m.optimizer_offload and not separate_rollout,
        ),
        seed=resolve_seed(m.seed, c.trainer.seed),
        dist_checkpointing_path=(
            m.dist_checkpointing_path if m.use_dist_checkpointing and not separate_rollout else None
        ),
        tokenizer_path=tok,
        forward_micro_batch_size=micro,
        forward_use_dynamic_bsz=bool(dynamic),
        forward_max_token_len=budget if dynamic else None,
        fused_kernels=fused_kernels(c),
        fused_kernels_setting=c.model.fused_kernels,
    )


def fused_kernels(c: RLConfig) -> bool:
    """Whether the engines run torch.compile'd fused kernels: `model.fused_kernels`, auto = on cuda."""
    if c.model.fused_kernels == "auto":
        return c.cluster.device == "cuda"
    return c.model.fused_kernels == "compiled"


def forward_batching(c: RLConfig, role: str) -> tuple[int, bool, int | None]:
    """(rows per forward micro-batch, token-budget batching on, the token budget) of a megatron role's
    log-prob / value / reward passes: what its engine runs and what the memory estimate sizes (the role
    table's forward_micro_batch and token_budget: the ref cuts by the actor's token budget, as verl)."""
    spec = role_spec(role)
    rows = get_path(c, spec.forward_micro_batch)
    if spec.token_budget is None:
        return rows, False, None
    section = get_path(c, spec.token_budget)
    return rows, section.use_dynamic_bsz, section.ppo_max_token_len_per_gpu


# ============================================================================================ small plans
def small_plan(
    model: ModelConfig,
    device: str,
    world_size: int = 1,
    total_steps: int = 1,
    megatron: MegatronConfig | None = None,
    optim: Optim | None = None,
    arch: ModelArch | None = None,
    actor: ActorConfig | None = None,
    critic: CriticConfig | bool = False,
    rollout_n: int = 1,
) -> TrainerPlan:
    """The plan of one engine built outside a run from config sections (tests, benchmarks, checkpoint tools):
    build the engine with `MegatronEngine.from_plan(plan, role)` like a run does.

    One training step of one mini-batch (data.train_batch_size = the trained role's ppo_mini_batch_size)
    over `total_steps` steps on `world_size` devices; `megatron` / `optim` replace the trained role's own
    sections, `arch` replaces the model's (weights still load from model.path); `critic` (a section, or True
    for the defaults) plans the value model on the same devices. Raises rlconf.errors.ConfigError like any
    plan.
    """
    from rlconf.config import AlgorithmConfig, ClusterConfig, DataConfig, RolloutConfig, TrainerConfig
    from rlconf.plan.assemble import plan_of_sections

    actor = actor if actor is not None else ActorConfig()
    critic_cfg = None
    if critic is not False:
        critic_cfg = critic if isinstance(critic, CriticConfig) else CriticConfig()
        critic_cfg = replace(critic_cfg, enable=True)
        if megatron is not None:
            critic_cfg = replace(critic_cfg, megatron=megatron)
        if optim is not None:
            critic_cfg = replace(critic_cfg, optim=optim)
    else:
        if megatron is not None:
            actor = replace(actor, megatron=megatron)
        if optim is not None:
            actor = replace(actor, optim=optim)
    mini = critic_cfg.ppo_mini_batch_size if critic_cfg is not None else actor.ppo_mini_batch_size
    # The policy's batch must plan too when only the critic is wanted: give it the same mini-batch.
    actor = replace(actor, ppo_mini_batch_size=mini)
    weights = model.path
    if arch is not None:
        model = replace(model, arch=arch, path=None)
    config = RLConfig(
        model=model,
        data=DataConfig(train_batch_size=mini),
        actor=actor,
        critic=critic_cfg if critic_cfg is not None else CriticConfig(),
        rollout=RolloutConfig(n=rollout_n),
        # An estimator the sections make valid (rlconf.validate runs as the plan compiles): grpo needs groups
        # of >= 2 responses, gae a critic. The engines read no estimator.
        algorithm=AlgorithmConfig(adv_estimator="gae" if critic_cfg is not None else "reinforce_plus_plus"),
        trainer=TrainerConfig(total_steps=max(int(total_steps), 1)),
        cluster=ClusterConfig(device=device, gpus_per_node=world_size),
    )
    plan = plan_of_sections(config)
    if arch is not None and weights is not None:
        models = tuple(replace(m, weights=weights) for m in plan.models)
        plan = replace(plan, models=models)
    return plan


def export_engine(
    arch: ModelArch, params_dtype: str, weights: str | None = None, lora: LoraPlan | None = None
) -> EnginePlan:
    """The frozen engine of a saved checkpoint's model for the checkpoint tools (export): one CPU process at
    TP = PP = 1, megatron's local layer spec (sdpa: the parameter names every CPU and non-TE run saves),
    weights from `weights` (an HF folder; None: random init, the checkpoint's load replaces them) and the
    checkpoint's LoRA adapters."""
    model = ModelConfig(path=weights, arch=arch, params_dtype=params_dtype, attention_backend="sdpa")  # type: ignore[arg-type]
    spec = small_plan(model, "cpu", arch=arch).engine("actor").frozen("actor")
    return replace(spec, lora=lora) if lora is not None else spec
