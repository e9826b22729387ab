"""The divergence guard of the controller: a step whose rewards, log-probs, values, advantages, loss or
gradient norm are not finite is a bad step. Its update is not applied (the controller skips it when an input
of the update is bad; the engine's `optimizer_step` refuses a step whose loss or gradient norm is not
finite), it is logged with its cause (`guard/cause` in metrics.jsonl and on the step line), and it is not
checkpointed, so the newest checkpoint is always one of a finite step. A checkpoint whose weights are not
finite is never written (the workers check before a save). After `trainer.max_bad_steps` bad steps in a row
the run stops with exit code DIVERGED_EXIT and one line naming the first bad quantity and its step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rltrain.metrics import GUARD_CAUSE_KEY as CAUSE_KEY  # e.g. `advantages`, `actor/grad_norm`

DIVERGED_EXIT = 3
"""Exit code of a run stopped by the divergence guard (0 ok, 1 crash, 2 invalid config, 130 / 143 signals)."""

BAD_KEY = "guard/bad_step"
"""Metric of every step: 1 for a bad step (its update not applied, no checkpoint), 0 otherwise."""
IN_A_ROW_KEY = "guard/bad_steps_in_a_row"

UPDATE_KEYS = ("critic/vf_loss", "critic/grad_norm", "actor/loss", "actor/grad_norm")
"""The update's metrics the guard reads, in the order they are named (the critic updates first)."""
SKIPPED_KEYS = {"critic/skipped_updates": "critic/grad_norm", "actor/skipped_updates": "actor/grad_norm"}
"""Optimizer steps an engine did not apply; the quantity named when no metric shows why (a mini-batch)."""


def _finite(value: torch.Tensor | float, mask: torch.Tensor | None = None) -> bool:
    if isinstance(value, torch.Tensor):
        if mask is not None:  # padding positions hold whatever the pass left there: only tokens count
            value = value[mask.bool()]
        return bool(torch.isfinite(value).all())
    return value == value and value not in (float("inf"), float("-inf"))


def first_bad(
    quantities: Iterable[tuple[str, torch.Tensor | float | None, torch.Tensor | None]],
) -> str | None:
    """The name of the first (name, value, token mask) whose value is not finite; None when all are (a None
    value is a quantity this step does not have)."""
    for name, value, mask in quantities:
        if value is not None and not _finite(value, mask):
            return name
    return None


def bad_update(metrics: Mapping[str, Any]) -> str | None:
    """The first update metric that is not finite (a NaN metric reaches metrics.jsonl as null), else the
    gradient norm of an engine that skipped one of its optimizer steps (one mini-batch of several)."""
    cause = first_bad((k, float(metrics[k]), None) for k in UPDATE_KEYS if metrics.get(k) is not None)
    if cause is None:
        cause = next((name for k, name in SKIPPED_KEYS.items() if metrics.get(k)), None)
    return cause


class DivergedError(Exception):
    """The run had trainer.max_bad_steps bad steps in a row; str() is the one line to print."""


@dataclass
class DivergenceGuard:
    """Counts bad steps in a row (a finite step resets the count; a resumed run starts at 0, since the bad
    steps after its checkpoint were not saved) and remembers the first bad step of the streak."""

    max_bad_steps: int
    in_a_row: int = 0
    first_step: int = 0
    first_cause: str = ""

    def record(self, step: int, cause: str | None) -> dict[str, Any]:
        """Count step `step` (cause None: a finite step); returns its guard metrics."""
        if cause is None:
            self.in_a_row = 0
            return {BAD_KEY: 0}
        if self.in_a_row == 0:
            self.first_step, self.first_cause = step, cause
        self.in_a_row += 1
        return {BAD_KEY: 1, CAUSE_KEY: cause, IN_A_ROW_KEY: self.in_a_row}

    @property
    def diverged(self) -> bool:
        return self.in_a_row >= self.max_bad_steps

    def error(self, step: int, newest_checkpoint: int | None) -> DivergedError:
        kept = (f"the newest checkpoint, global_step_{newest_checkpoint}, is of a finite step"
                if newest_checkpoint else "no checkpoint was written")  # fmt: skip
        return DivergedError(
            f"diverged: {self.first_cause} is not finite at step {self.first_step} ({self.in_a_row} bad steps "
            f"in a row up to step {step}, trainer.max_bad_steps = {self.max_bad_steps}; their updates were not "
            f"applied); {kept}; fix: lower actor.optim.lr, check the model weights, reward and data of step "
            f"{self.first_step}, then rerun the same command to resume"
        )
