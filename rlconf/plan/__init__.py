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

Modules: `types` (the plan's dataclasses and limits), `engine` (what each megatron engine is built from:
EngineSettings, EnginePlan, small_plan), `compile` (checks, models, pools, grids, batches,
lr table, profile, checkpoints), `memory` (the estimate), `assemble` (parts + memory -> TrainerPlan),
`advice` (the memory check and its fixes, re-compiling variants), `render` (text), `diff` (JSON and
plan diffs). `compile_plan` (here) is assemble + memory check.
"""

from __future__ import annotations

from rlconf.config import RLConfig
from rlconf.plan.advice import _check_memory
from rlconf.plan.assemble import _compile
from rlconf.plan.compile import (
    lr_at,
    rollout_resharded,
    rollout_tp,
)
from rlconf.plan.diff import (
    MISSING,
    diff_plans,
    plan_to_dict,
)
from rlconf.plan.engine import (
    ENGINE_ROLES,
    DdpSettings,
    EnginePlan,
    EngineSettings,
    MoeSettings,
    OffloadSettings,
    Recompute,
    TransformerSettings,
    small_plan,
)
from rlconf.plan.memory import (
    REFIT_BUCKET_MIB,
    REFIT_BYTES_PER_S,
)
from rlconf.plan.render import (
    format_plan,
)
from rlconf.plan.types import (
    CONTROLLER,
    DTYPE_BYTES,
    GIB,
    MEGATRON_ORDER,
    PLAN_VERSION,
    PROFILE_ROLE_WORKER,
    VOCAB_DIVISIBLE_BY,
    WORKER_ROLES,
    BatchPlan,
    CheckpointPlan,
    CheckpointSave,
    LayerChunk,
    LrRow,
    MemoryPart,
    MemoryPlan,
    ModelSpec,
    OptimPlan,
    PhaseMemory,
    Placement,
    Pool,
    PoolMemory,
    ProfilePlan,
    ProfileTarget,
    RankCoord,
    Resources,
    RoleCheckpoint,
    RoleLayout,
    RoleMemory,
    RolePath,
    RolloutRefit,
    StageLayers,
    StepPasses,
    TrainerPlan,
)
from rlconf.validate import (  # the plan's limits are enforced by the checker (rule plan-limits)
    MAX_DEVICES,
    MAX_INT,
    MAX_TOTAL_STEPS,
)


# ========================================================================================= entry points
def compile_plan(config: RLConfig) -> TrainerPlan:
    """Derive the trainer plan of a config; raises ConfigError, and nothing else, when rlconf.validate
    finds an error in it, when it cannot be planned (a config.json it reads) or when its memory estimate
    exceeds cluster.device_memory_gib."""
    plan = _compile(config)
    _check_memory(config, plan)
    return plan


__all__ = [
    "CONTROLLER",
    "DTYPE_BYTES",
    "ENGINE_ROLES",
    "GIB",
    "MAX_DEVICES",
    "MAX_INT",
    "MAX_TOTAL_STEPS",
    "MEGATRON_ORDER",
    "MISSING",
    "PLAN_VERSION",
    "PROFILE_ROLE_WORKER",
    "REFIT_BUCKET_MIB",
    "REFIT_BYTES_PER_S",
    "VOCAB_DIVISIBLE_BY",
    "WORKER_ROLES",
    "BatchPlan",
    "CheckpointPlan",
    "CheckpointSave",
    "DdpSettings",
    "EnginePlan",
    "EngineSettings",
    "LayerChunk",
    "LrRow",
    "MemoryPart",
    "MemoryPlan",
    "ModelSpec",
    "MoeSettings",
    "OffloadSettings",
    "OptimPlan",
    "PhaseMemory",
    "Placement",
    "Pool",
    "PoolMemory",
    "ProfilePlan",
    "ProfileTarget",
    "RankCoord",
    "Recompute",
    "Resources",
    "RoleCheckpoint",
    "RoleLayout",
    "RoleMemory",
    "RolePath",
    "RolloutRefit",
    "StageLayers",
    "StepPasses",
    "TrainerPlan",
    "TransformerSettings",
    "compile_plan",
    "diff_plans",
    "format_plan",
    "lr_at",
    "plan_to_dict",
    "rollout_resharded",
    "rollout_tp",
    "small_plan",
]
