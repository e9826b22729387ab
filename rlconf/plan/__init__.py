"""The trainer plan: the single, inspectable answer to "what will this run do".

`compile_plan(config)` turns an `RLConfig` into a `TrainerPlan`, a tree of frozen dataclasses:
which devices each role gets, every rank's place in its parallel grid, the batch schedule, the learning
rate of every training step, the profiler's output folders, the checkpoint steps and paths, and an
estimate of the memory each device needs. Workers read the plan, never the raw config: the controller
compiles it once, writes `plan.json` (`plan_to_dict`) and hands the plan to every worker.

Design choices
- Pure: standard library only (`rlconf` never imports torch, ray or megatron). The only input besides the
  config is `config.json` of `model.path` (and of `critic.model_path` / `reward.reward_model.path` when
  set), read to learn the architecture.
- Resolved values only: the plan holds no copy of the config. Every value a worker reads is a field of a
  plan part with its "None means X" decided here: `engines` (EngineSettings: TransformerConfig, MoE, DDP,
  offload and seed settings of each megatron role), `algorithm` (losses, advantages, KL, dynamic sampling),
  `run` (names, seed, length, validation, cluster, logging), `rollout` (sampling, engine and tool
  settings), `data`, `reward`, `tokenizer`, next to the layouts, batches, lr tables, checkpoints and memory.
  `sequence_parallel` is off at tp = 1 (megatron switches it off), the expert tp is the tp size when None,
  lr warm-up / decay steps are numbers, seeds left None hold `trainer.seed` (rlconf.seeding), and with
  `trainer.total_epochs` the run length is the steps it derives (rlconf.run_length). The run folder keeps
  the user's own config as config.yaml (rlconf.run_config).
- Conventions: ranks are 0-based within a role's world (= the process index inside its device pool);
  layers are 0-based; steps are 1-based training steps (step N is the N-th step of the run, across
  resumes); memory is in GiB (2**30 bytes).
- Failure: one checker. Compiling starts with `rlconf.validate.check_config` (its filesystem rules
  excepted) and raises its errors as they are: a config that `rlconf validate` refuses is refused here with
  the same paths, rule names and fixes, and one it passes compiles, apart from what only the plan can
  know. Those checks stay here, under the validator's rule names, and `rlconf validate` reaches them by
  compiling the plan: a config.json's architecture (read errors `model-config-json`, unsupported models
  `model-unsupported`, heads, query groups and layers against tp / pp, expert layouts), the prompt files
  that `trainer.total_epochs` counts, and the memory estimate exceeding `cluster.device_memory_gib` (rule
  `memory-exceeds-device`, whose fix lists concrete changes with the estimate each would give).
  Nothing but `ConfigError` is raised. Mini-batches that do not split evenly over dp (possible with
  dynamic batch sizes) are planned with the largest share a rank gets (`BatchPlan.even` is false).

Modules: `types` (the plan's dataclasses and limits), `engine` (each megatron engine's settings resolved from the
config), `small` (small plans for engines built outside a run), `compile` (checks, models, pools, grids, batches,
lr table, profile, checkpoints), `memory` (the estimate), `assemble` (parts + memory -> TrainerPlan),
`advice` (the memory check and its fixes, re-compiling variants), `render` (text), `diff` (JSON and
plan diffs), `roles` (the role table and the cross-section facts the validator checks too).
`compile_plan` (here) is assemble + memory check. The names below are loaded on first use, so that
`rlconf.plan.roles` imports without the compiler (rlconf.validate imports it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlconf.config import RLConfig
    from rlconf.plan.types import TrainerPlan

# Each public name and the module that defines it (the plan's limits are enforced by the checker, rule
# plan-limits, and live with it).
_HOMES: dict[str, str] = {
    **dict.fromkeys(("lr_at",), "compile"),
    **dict.fromkeys(
        (
            "ENGINE_ROLES", "DdpSettings", "EnginePlan", "EngineSettings", "MoeSettings", "OffloadSettings",
            "Recompute", "TransformerSettings",
        ),
        "types",
    ),
    **dict.fromkeys(("small_plan", "export_engine"), "small"),
    **dict.fromkeys(("rollout_resharded", "rollout_tp"), "roles"),
    **dict.fromkeys(("MISSING", "diff_plans", "plan_to_dict"), "diff"),
    **dict.fromkeys(("REFIT_BUCKET_MIB", "REFIT_BYTES_PER_S"), "memory"),
    **dict.fromkeys(("format_plan",), "render"),
    **dict.fromkeys(("MAX_DEVICES", "MAX_INT", "MAX_TOTAL_STEPS"), "rlconf.validate"),
    **dict.fromkeys(
        (
            "CONTROLLER", "DTYPE_BYTES", "GIB", "MEGATRON_ORDER", "PLAN_VERSION",
            "PROFILE_ROLE_WORKER", "VOCAB_DIVISIBLE_BY", "WORKER_ROLES", "BatchPlan", "CheckpointPlan",
            "CheckpointSave", "LayerChunk", "LrRow", "MemoryPart", "MemoryPlan", "ModelSpec",
            "OptimPlan", "PhaseMemory", "Placement", "Pool", "PoolMemory", "ProfilePlan", "ProfileTarget",
            "RankCoord", "Resources", "RoleCheckpoint", "RoleLayout", "RoleMemory", "RolePath", "RolloutRefit",
            "StageLayers", "StepPasses", "TrainerPlan",
        ),
        "types",
    ),
}  # fmt: skip


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(home if home.startswith("rlconf.") else f"{__name__}.{home}")
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))


# ========================================================================================= entry points
def compile_plan(config: RLConfig) -> TrainerPlan:
    """Derive the trainer plan of a config; raises ConfigError, and nothing else, when rlconf.validate
    finds an error in it, when it cannot be planned (a config.json it reads) or when its memory estimate
    exceeds cluster.device_memory_gib."""
    from rlconf.plan.advice import check_memory
    from rlconf.plan.assemble import compile_parts

    plan = compile_parts(config)
    check_memory(config, plan)
    return plan


__all__ = sorted([*_HOMES, "compile_plan"])
