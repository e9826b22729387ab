"""Assembling the plan: the parts of `compile` and the memory estimate of `memory` in one TrainerPlan."""

from __future__ import annotations

from dataclasses import replace

from rlconf.config import (
    MegatronConfig,
    RLConfig,
)
from rlconf.errors import ConfigError, error
from rlconf.lora import resolve as resolve_lora
from rlconf.plan.compile import (
    _batch_plans,
    _checkpoint,
    _layouts,
    _Models,
    _optim_plans,
    _present_roles,
    _profile,
    _resolve_models,
    _resolved_optim,
    _resources,
    _step_passes,
)
from rlconf.plan.engine import engine_settings
from rlconf.plan.memory import _memory, _rollout_refit
from rlconf.plan.types import PLAN_VERSION, TrainerPlan
from rlconf.run_length import run_length, with_run_length
from rlconf.seeding import resolve_seed
from rlconf.validate import check_config


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


def _compile(config: RLConfig, check: bool = True) -> TrainerPlan:
    """The plan of `config`. `check=False` only for `plan_of_sections` (engines built outside a run)."""
    if not isinstance(config, RLConfig):
        raise ConfigError(
            [error("", f"expected an RLConfig, got {type(config).__name__}", "load the config first", "plan")]
        )
    # The one checker: what depends on the config alone is rlconf.validate's, with the rule names and fixes
    # `rlconf validate` reports (its filesystem rules excepted: a plan is also compiled where the run's
    # files do not live). What follows checks only what the plan reads (config.json, prompt files to
    # count) or derives.
    if check and (errors := [i for i in check_config(config) if i.severity == "error"]):
        raise ConfigError(errors)
    # trainer.total_epochs becomes a step count here, once: every table below and the workers read it.
    length = run_length(config)
    config = with_run_length(config, length)
    roles = _present_roles(config)
    models = _resolve_models(config, roles)
    lora = resolve_lora(config, models.policy.arch)
    if lora is not None:
        models = replace(models, policy=replace(models.policy, params_trainable=lora.params))
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
        checkpoint=_checkpoint(config, roles, models, layouts),
        memory=_memory(config, resources, layouts, models, batches, lora),
        config=_effective_config(config, models, roles),
        refit=_rollout_refit(config, layouts, models),
        length=length,
        passes=_step_passes(config, roles, batches),
        lora=lora,
        engines=engine_settings(config, roles, models.all()),
    )


def plan_of_sections(config: RLConfig) -> TrainerPlan:
    """The plan of one engine built outside a run from config sections (rlconf.plan.engine
    `small_plan`: tests, benches, tools). Its batch fields size that engine's forward and backward
    passes, not a run's step (a critic fixture may take a micro-batch larger than its mini-batch), so the
    run-level rules of rlconf.validate are not applied; a user's config never takes this path
    (`compile_plan`, `rlconf validate` and `rltrain` all check it)."""
    return _compile(config, check=False)
