"""The one update loop of the trained engines (the actor's policy update and the critic's value update):
ppo_epochs x mini-batches x micro-batches as the plan's BatchPlan schedules them, one optimizer step per
mini-batch, the micro-batch metrics averaged over the update. Only the loss differs between the roles: each
passes a function (`TrainedEngine.run_update`) that makes a mini-batch's loss function from its DP-wide totals."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rltrain.megatron.engine import MegatronEngine, MicroBatch, StepOutcome

LossFn = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""A micro-batch's loss: (micro-batch, model output) -> (scaled loss, detached metrics by name)."""


@dataclass(frozen=True)
class UpdateResult:
    """What one update did on this rank."""

    metrics: dict[str, float]
    """The loss metrics (`names`) averaged over micro-batches and ranks, and {prefix}/grad_norm (mean over
    optimizer steps), {prefix}/skipped_updates (steps the divergence guard did not apply), {prefix}/lr."""
    tokens: int
    """Tokens (prompt + response) of every mini-batch of the update on this rank, epochs included."""
    seconds: float
    """Wall time of the update."""


class TrainedEngine(MegatronEngine):
    """A megatron engine that trains (the actor, the critic): the update loop they share."""

    def run_update(
        self,
        batch: dict[str, torch.Tensor],
        step: int | None,
        *,
        prefix: str,
        names: list[str],
        shuffle: bool,
        loss_for: Callable[[tuple[float, float]], LossFn],
        around: contextlib.AbstractContextManager[object] | None = None,
        per_mini_batch: Callable[[list[MicroBatch]], contextlib.AbstractContextManager[object]] | None = None,
    ) -> UpdateResult:
        """One update of this engine on this rank's `batch` at training step `step` (None outside a run: the
        engine's next update; it picks the lr row and keys the dropout and shuffle streams).

        `loss_for(totals)` gives the loss function of a mini-batch whose DP-wide loss totals are `totals`
        (`MegatronEngine.micro_batch_weight`); `names[0]` is the loss the divergence guard checks. `around` is
        entered around the mini-batch loop (e.g. MoE routing statistics), `per_mini_batch(mbs)` around each
        optimizer step (e.g. routing replay). Every DP rank must hold the same number of rows."""
        sums: dict[str, float] = dict.fromkeys(names, 0.0)
        steps: list[StepOutcome] = []  # read back once, after the last step (MegatronEngine.read_steps)
        tokens = 0
        start = time.perf_counter()
        with self._ctx():
            self.reload()
            self.check_equal_rows(batch["input_ids"].shape[0])
            self.train()
            step, lr = self.begin_update(step)
            with around if around is not None else contextlib.nullcontext():
                for mini_batch, mbs, totals in self.iter_mini_batches(batch, shuffle, step):
                    tokens += int(mini_batch["attention_mask"].sum())
                    self.zero_grad()
                    with per_mini_batch(mbs) if per_mini_batch is not None else contextlib.nullcontext():
                        steps.append(self.optimizer_step_on(mbs, loss_for(totals), names))
            assert self.lr_scheduler is not None
            self.lr_scheduler.step(1)
            done = self.read_steps(steps, names, sums)
        metrics = self.reduce_metrics(sums, done.count, names)
        metrics[f"{prefix}/grad_norm"] = sum(done.grad_norms) / max(len(done.grad_norms), 1)
        metrics[f"{prefix}/skipped_updates"] = float(done.skipped)
        metrics[f"{prefix}/lr"] = lr
        return UpdateResult(metrics, tokens, time.perf_counter() - start)


__all__ = ["LossFn", "TrainedEngine", "UpdateResult"]
