"""Small plans for engines built outside a run (tests, benchmarks, the checkpoint tools): a plan compiled from a
few config sections, so that every engine is built through a compiled plan like a run's (one build path)."""

from __future__ import annotations

from dataclasses import replace

from rlconf.config import (
    ActorConfig,
    AlgorithmConfig,
    ClusterConfig,
    CriticConfig,
    DataConfig,
    MegatronConfig,
    ModelArch,
    ModelConfig,
    Optim,
    RLConfig,
    RolloutConfig,
    TrainerConfig,
)
from rlconf.lora import LoraPlan
from rlconf.plan.assemble import plan_of_sections
from rlconf.plan.types import EnginePlan, TrainerPlan


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
