"""Cross-field validation: named rules that see the whole config and report every problem at once.

The registry (`Rule`, `RULES`, `rule`, `check_config`) is rlconf.rules; the rules live in rlconf.checks, one
module per concern, and register when imported: this module imports them all, in the order the docs list
the rules, and is the public face of the checker.

This is the one checker of what a run rejects: the data loader's file types, the plan's limits, the seed
range torch and numpy accept, and (with `filesystem=True`) the files a run reads or writes before any
worker starts: prompt files, the resume checkpoint and `trainer.output_dir`. `rlconf validate` and
`rltrain` (with or without --dry-run) run the same rules. Filesystem rules are separate because a config
is also checked where its files do not live (a verl import on a laptop, property tests).
Nothing here imports user code: `reward.function` is only checked for its form.
"""

from __future__ import annotations

# The check modules register their rules when imported; this order is the order of RULES (the docs' order).
# isort: off
import rlconf.checks.values
import rlconf.checks.layout
import rlconf.checks.training
import rlconf.checks.inputs
import rlconf.checks.loss
import rlconf.checks.data
import rlconf.checks.model
import rlconf.checks.run
import rlconf.checks.setup  # noqa: F401

# isort: on
from rlconf.checks.data import PROMPT_FILE_TYPES
from rlconf.checks.limits import MAX_DEVICES, MAX_INT, MAX_TOTAL_STEPS
from rlconf.checks.run import CHECKPOINT_COMPLETE_MARKER, SEED_FIELDS, SEED_LIMIT
from rlconf.config import RLConfig
from rlconf.errors import Issue
from rlconf.plan.model_fit import engine_gap_issues, sliding_window_issue
from rlconf.plan.roles import (
    actor_world,
    model_parallel,
    rollout_tp,
    separate_devices,
    total_devices,
    uses_ref,
)
from rlconf.rules import RULES, SUB_RULES, TYPE_RULE, Rule, RuleFn, rule
from rlconf.run_length import RULE as RUN_LENGTH_RULE
from rlconf.run_length import resolved_or_same


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


__all__ = [
    "CHECKPOINT_COMPLETE_MARKER",
    "MAX_DEVICES",
    "MAX_INT",
    "MAX_TOTAL_STEPS",
    "PROMPT_FILE_TYPES",
    "RULES",
    "SEED_FIELDS",
    "SEED_LIMIT",
    "SUB_RULES",
    "TYPE_RULE",
    "Rule",
    "RuleFn",
    "actor_world",
    "check_config",
    "engine_gap_issues",
    "model_parallel",
    "rollout_tp",
    "rule",
    "separate_devices",
    "sliding_window_issue",
    "total_devices",
    "uses_ref",
]
