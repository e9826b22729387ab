"""The value model on megatron-core: the policy's GPT trunk with a scalar `ValueHead` (PPO with GAE).

`MegatronCritic` is built from the plan (`from_plan`; the reward model is the same class built from the
plan's reward_model role) and shares the engine of the actor (batch layout, micro-batching, schedules; see engine.py).
The value of response token j is read at the position that predicts it (the state before the token), as in
verl. Losses come from rltrain.algorithms.compute_value_loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rltrain import algorithms
from rltrain.megatron.engine import MicroBatch
from rltrain.megatron.update import LossFn, TrainedEngine

if TYPE_CHECKING:
    from rlconf.plan import EnginePlan, TrainerPlan
    from rlconf.plan.algorithm import LossPlan


class MegatronCritic(TrainedEngine):
    """Value model on this rank (`critic.model_path` or the actor's model, with a fresh value head)."""

    @classmethod
    def from_plan(cls, plan: TrainerPlan, role: str = "critic", init_from: None = None) -> MegatronCritic:
        """The critic (role "critic") or the reward model (role "reward_model": forward only) of a compiled
        plan; the value loss settings come from the plan's LossPlan (value_clip, loss_agg_mode)."""
        critic = cls.__new__(cls)
        critic._build_critic(plan.engine(role), plan.algorithm.loss)
        return critic

    def _build_critic(self, spec: EnginePlan, loss: LossPlan) -> None:
        self.loss = loss
        self._build(spec, None)

    def _values(self, mb: MicroBatch, out: torch.Tensor) -> torch.Tensor:
        # out [b, L, 1] (packed: [1, T, 1]) -> values at the positions predicting each response token [b, R].
        return out.reshape(-1).float()[mb.flat_index()]

    def compute_values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Values [B, R] of the response positions (0 on padding), in the batch's row order (the plan's
        forward micro-batches: rows, or a token budget)."""
        with self._ctx():
            self.eval()
            mbs = self.forward_micro_batches(batch)

            def loss_fn(mb: MicroBatch, out: torch.Tensor):
                values = self._values(mb, out) * mb.data["response_mask"].float()
                return values.new_zeros(()), {"values": values}

            outputs = self.run_schedule(mbs, loss_fn, forward_only=True)
            return self.rows_in_order(mbs, outputs, "values", (batch["responses"].shape[1],))

    def update_critic(self, batch: dict[str, torch.Tensor], step: int | None = None) -> dict[str, float]:
        """Clipped value regression on `returns` (needs `values` from compute_values and `returns` [B, R]).

        ppo_epochs x mini-batches x micro-batches as the plan's BatchPlan schedules them, one optimizer step
        per mini-batch, at the lr of the plan's table for training step `step`. The loss is aggregated over each whole mini-batch across DP ranks, as in
        `MegatronActor.update_policy`. Returns critic/vf_loss, critic/vf_clipfrac, critic/vpred_mean,
        critic/grad_norm, critic/lr. `step` (the training step) keys the update's dropout and shuffle
        streams (`seed_update`; None outside a run).
        """
        names = ["critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean"]
        agg = self.loss.loss_agg_mode

        def loss_for(totals: tuple[float, float]) -> LossFn:
            def loss_fn(mb: MicroBatch, out: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
                d = mb.data
                mask = d["response_mask"].float()
                vpreds = self._values(mb, out)
                loss, m = algorithms.compute_value_loss(
                    vpreds, d["values"].float(), d["returns"].float(), mask, self.loss.value_clip, agg
                )
                extra = {
                    "critic/vf_loss": loss.detach(),
                    "critic/vf_clipfrac": m["vf_clipfrac"],
                    "critic/vpred_mean": algorithms.masked_mean(vpreds.detach(), mask),
                }
                return loss * self.micro_batch_weight(d["response_mask"], agg, totals), extra

            return loss_fn

        # The critic always shuffles (CriticConfig has no shuffle switch).
        result = self.run_update(batch, step, prefix="critic", names=names, shuffle=True, loss_for=loss_for)
        metrics = result.metrics
        metrics["timing/critic_update_s"] = result.seconds
        return metrics
