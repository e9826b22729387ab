"""Assembling the plan: the parts of `compile` and the memory estimate of `memory` in one TrainerPlan."""

from __future__ import annotations

from dataclasses import replace

from rlconf.config import (
    RLConfig,
)
from rlconf.errors import ConfigError, error
from rlconf.fields import replace_paths
from rlconf.lora import resolve as resolve_lora
from rlconf.plan.algorithm import algorithm_plan
from rlconf.plan.compile import (
    Models,
    batch_plans,
    checkpoint_plan,
    optim_plans,
    plan_resources,
    profile_plan,
    resolve_models,
    role_layouts,
    step_passes,
)
from rlconf.plan.engine import engine_settings
from rlconf.plan.memory import memory_plan, rollout_refit
from rlconf.plan.roles import present_roles
from rlconf.plan.run import data_plan, reward_plan, rollout_plan, run_plan, tokenizer_plan
from rlconf.plan.types import PLAN_VERSION, TrainerPlan
from rlconf.run_length import run_length, with_run_length
from rlconf.validate import check_config


# ============================================================================================ assembly
def _with_arch(c: RLConfig, models: Models) -> RLConfig:
    """`c` with model.arch the architecture read (config.json of model.path): what the tokenizer and run
    parts check the vocabulary against. Every other resolved value is a field of a plan part."""
    return replace_paths(c, {"model.arch": models.policy.arch})


def compile_parts(config: RLConfig, check: bool = True) -> TrainerPlan:
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
    roles = present_roles(config)
    models = resolve_models(config, roles)
    lora = resolve_lora(config, models.policy.arch)
    if lora is not None:
        models = replace(models, policy=replace(models.policy, params_trainable=lora.params))
    resources = plan_resources(config, roles)
    layouts = role_layouts(config, roles, resources, models)
    batches = batch_plans(config, roles, layouts)
    effective = _with_arch(config, models)
    rollout_tp = next(lay.tp for lay in layouts if lay.role == "rollout")
    return TrainerPlan(
        version=PLAN_VERSION,
        roles=roles,
        models=models.all(),
        resources=resources,
        layouts=layouts,
        batch=batches,
        optim=optim_plans(config, batches),
        profile=profile_plan(config, roles, layouts),
        checkpoint=checkpoint_plan(config, roles, models, layouts),
        memory=memory_plan(config, resources, layouts, models, batches, lora),
        refit=rollout_refit(config, layouts, models),
        length=length,
        passes=step_passes(config, roles, batches),
        lora=lora,
        run=run_plan(effective, length.total_steps),
        rollout=rollout_plan(effective.rollout, rollout_tp, effective.actor.router_replay),
        data=data_plan(effective.data, effective.trainer.seed),
        reward=reward_plan(effective.reward),
        tokenizer=tokenizer_plan(effective.model),
        algorithm=algorithm_plan(config),
        engines=engine_settings(config, roles, models.all()),
    )


def plan_of_sections(config: RLConfig) -> TrainerPlan:
    """The plan of one engine built outside a run from config sections (rlconf.plan.engine
    `small_plan`: tests, benches, tools). Its batch fields size that engine's forward and backward
    passes, not a run's step (a critic fixture may take a micro-batch larger than its mini-batch), so the
    run-level rules of rlconf.validate are not applied; a user's config never takes this path
    (`compile_plan`, `rlconf validate` and `rltrain` all check it)."""
    return compile_parts(config, check=False)
