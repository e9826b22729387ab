"""The value model on megatron-core: the policy's GPT trunk with a scalar `ValueHead` (PPO with GAE).

`MegatronCritic` is built from the plan (`from_plan`; the reward model is the same class built from the
plan's reward_model role) and shares the engine of the actor (batch layout, micro-batching, schedules; see engine.py).
The value of response token j is read at the position that predicts it (the state before the token), as in
verl. Losses come from rltrain.algorithms.compute_value_loss.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from rltrain import algorithms
from rltrain.megatron.engine import MegatronEngine, MicroBatch

if TYPE_CHECKING:
    from rlconf.plan import EnginePlan, TrainerPlan


class MegatronCritic(MegatronEngine):
    """Value model on this rank (`critic.model_path` or the actor's model, with a fresh value head)."""

    @classmethod
    def from_plan(cls, plan: TrainerPlan, role: str = "critic", init_from: None = None) -> MegatronCritic:
        """The critic (role "critic") or the reward model (role "reward_model": forward only) of a compiled
        plan; the value loss settings come from its effective config."""
        critic = cls.__new__(cls)
        cfg = plan.config
        critic._build_critic(plan.engine(role), cfg.critic.cliprange_value, cfg.actor.loss_agg_mode)
        return critic

    def _build_critic(self, spec: EnginePlan, cliprange_value: float, loss_agg_mode: str) -> None:
        self.cliprange_value = cliprange_value
        self.loss_agg_mode = loss_agg_mode
        self._build(spec, None)

    def _values(self, mb: MicroBatch, out: torch.Tensor) -> torch.Tensor:
        # out [b, L, 1] -> values at the positions predicting each response token [b, R].
        return torch.gather(out.squeeze(-1).float(), 1, mb.gather_index)

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
        n = batch["input_ids"].shape[0]
        names = ["critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean"]
        sums = dict.fromkeys(names, 0.0)
        count = 0
        grad_norms: list[float] = []
        skipped = 0  # optimizer steps the divergence guard did not apply (MegatronEngine.optimizer_step)
        start = time.perf_counter()
        with self._ctx():
            self.reload()
            self.check_equal_rows(n)
            self.train()
            step, lr = self.begin_update(step)
            # The critic always shuffles (CriticConfig has no shuffle switch).
            for _, mbs, totals in self.iter_mini_batches(batch, True, step):

                def loss_fn(mb: MicroBatch, out: torch.Tensor, totals: tuple[float, float] = totals):
                    d = mb.data
                    mask = d["response_mask"].float()
                    vpreds = self._values(mb, out)
                    loss, m = algorithms.compute_value_loss(
                        vpreds,
                        d["values"].float(),
                        d["returns"].float(),
                        mask,
                        self.cliprange_value,
                        self.loss_agg_mode,
                    )
                    extra = {
                        "critic/vf_loss": loss.detach(),
                        "critic/vf_clipfrac": m["vf_clipfrac"],
                        "critic/vpred_mean": algorithms.masked_mean(vpreds.detach(), mask),
                    }
                    return loss * self.micro_batch_weight(
                        d["response_mask"], self.loss_agg_mode, totals
                    ), extra

                self.zero_grad()
                grad_norm, counted, applied = self.optimizer_step_on(mbs, loss_fn, names, sums)
                grad_norms.append(grad_norm)
                skipped += not applied
                count += counted
            self.lr_scheduler.step(1)
        metrics = self.reduce_metrics(sums, count, names)
        metrics["critic/grad_norm"] = sum(grad_norms) / max(len(grad_norms), 1)
        metrics["critic/skipped_updates"] = float(skipped)
        metrics["critic/lr"] = lr
        metrics["timing/critic_update_s"] = time.perf_counter() - start
        return metrics
