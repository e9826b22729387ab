"""The algorithm of one training step between the passes the controller runs: the batch that flows between
them (`StepBatch`, one name per quantity), the sampler-gap metrics of the old log-prob pass, the rollout
correction, and rewards (KL penalty) -> advantages, each driven by the plan's `AlgorithmPlan` and
`StepPasses`. rltrain.controller.Trainer.train_step only orders the passes and moves data."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from rlconf.plan.algorithm import AlgorithmPlan
from rlconf.plan.types import StepPasses
from rltrain.algorithms.advantages import compute_advantage
from rltrain.algorithms.core import masked_mean, outcome_to_token_level
from rltrain.algorithms.correction import rollout_correction
from rltrain.algorithms.kl import AdaptiveKLController, FixedKLController, apply_kl_penalty

# The StepBatch quantities that travel to workers, under these batch keys (the workers' names).
WORKER_KEYS = (
    "old_log_probs",
    "rollout_log_probs",
    "ref_log_probs",
    "values",
    "advantages",
    "returns",
    "rollout_is_weights",
)


@dataclass
class StepBatch:
    """The batch of one training step, filled pass by pass (B responses, T response tokens). Every
    quantity has one name here and the same name in the batches workers receive (`worker_batch`)."""

    inputs: dict[str, Tensor]
    """The model's inputs as generated (input_ids, attention_mask, position_ids, responses, response_mask
    and what the rollout records for the passes, e.g. expert routing): every worker pass reads them."""
    scores: Tensor
    """(B,) the reward of each response (rule, reward model, overlong penalty)."""
    group_index: Tensor
    """(B,) the prompt (group) of each response."""
    rollout_log_probs: Tensor | None = None
    """(B, T) the sampler's log-probs of the generated tokens."""
    old_log_probs: Tensor | None = None
    """(B, T) the PPO ratio's old log-probs (StepPasses.old_log_prob says where from; None: the update's
    own)."""
    entropy: Tensor | None = None
    """(B, T) the old policy's entropy (from the old log-prob pass)."""
    ref_log_probs: Tensor | None = None
    """(B, T) the reference policy's log-probs (KL loss, KL-in-reward)."""
    values: Tensor | None = None
    """(B, T) the critic's values."""
    advantages: Tensor | None = None
    """(B, T) the estimator's advantages."""
    returns: Tensor | None = None
    """(B, T) the estimator's returns (the critic's targets)."""
    rollout_is_weights: Tensor | None = None
    """(B, T) rollout-correction weights on the policy loss (0 on rejected tokens)."""
    accepted_mask: Tensor | None = None
    """(B, T) response_mask without the tokens rejection sampling removed (set when a correction ran): the
    advantages' normalisation mask and every loss's mask in the update."""

    @classmethod
    def from_rollout(cls, batch: dict[str, Tensor], controller_keys: Iterable[str]) -> StepBatch:
        """The step's batch from a generated one: `controller_keys` (rewards, groups, rollout statistics)
        stay with the controller; the rest are the model's inputs."""
        keys = set(controller_keys)
        return cls(
            inputs={k: v for k, v in batch.items() if k not in keys},
            scores=batch["scores"],
            group_index=batch["group_index"],
            rollout_log_probs=batch.get("rollout_log_probs"),
        )

    @property
    def response_mask(self) -> Tensor:
        """(B, T) 1 on generated tokens (as sampled, before rejection sampling)."""
        return self.inputs["response_mask"]

    def worker_batch(self, *names: str) -> dict[str, Tensor]:
        """What a worker call receives: the model's inputs and the named quantities that are set, under their
        names (WORKER_KEYS); with `accepted_mask` set, `response_mask` is the accepted mask (the loss mask)."""
        out = dict(self.inputs)
        for name in names:
            if name not in WORKER_KEYS:
                raise KeyError(f"{name!r} is not a worker quantity ({', '.join(WORKER_KEYS)})")
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if names and self.accepted_mask is not None:
            out["response_mask"] = self.accepted_mask
        return out

    def guarded(self) -> list[tuple[str, Tensor | None, Tensor | None]]:
        """The inputs of the advantages and updates the divergence guard checks (rltrain.guard.first_bad)."""
        mask = self.response_mask
        return [
            ("rewards", self.scores, None),
            ("rollout/log_probs", self.rollout_log_probs, mask),
            ("old_log_probs", self.old_log_probs, mask),
            ("ref_log_probs", self.ref_log_probs, mask),
            ("critic/values", self.values, mask),
        ]


def old_log_prob_metrics(batch: StepBatch) -> dict[str, float]:
    """After a recomputed old log-prob pass: the largest |rollout - old| log-prob gap over valid tokens
    (rollout/logprob_diff_max: the sampler ran the weights being trained, so a gap means stale weights or
    a numerics problem) and the old policy's token-mean entropy (actor/entropy_rollout)."""
    assert batch.old_log_probs is not None and batch.rollout_log_probs is not None
    mask = batch.response_mask
    gap = (batch.rollout_log_probs - batch.old_log_probs).abs()
    out = {"rollout/logprob_diff_max": (gap * mask).max().item()}
    if batch.entropy is not None:
        out["actor/entropy_rollout"] = masked_mean(batch.entropy, mask).item()
    return out


def apply_rollout_correction(batch: StepBatch, passes: StepPasses, plan: AlgorithmPlan) -> dict[str, float]:
    """The plan's rollout correction (StepPasses.rollout_is / rollout_rs, AlgorithmPlan thresholds) on a
    recomputed old log-prob: sets `rollout_is_weights` and `accepted_mask`; returns rollout_corr/* metrics
    (none when the plan sets no correction)."""
    if passes.rollout_is is None and passes.rollout_rs is None:
        return {}
    assert batch.old_log_probs is not None and batch.rollout_log_probs is not None
    correction = rollout_correction(
        batch.old_log_probs,
        batch.rollout_log_probs,
        batch.response_mask,
        passes.rollout_is,
        plan.rollout_is_threshold,
        passes.rollout_rs,
        plan.rollout_rs_threshold,
    )
    batch.rollout_is_weights = correction.weights
    batch.accepted_mask = correction.accepted
    return correction.metrics


def rewards_and_advantages(
    batch: StepBatch, plan: AlgorithmPlan, kl_ctrl: FixedKLController | AdaptiveKLController
) -> dict[str, Any]:
    """Token rewards (the score on each response's last token, minus the KL penalty with KL-in-reward; the
    controller then adapts to the measured KL), then the plan's advantage estimator: sets `advantages` and
    `returns`; returns actor/reward_kl and actor/kl_coef with KL-in-reward. The KL penalty, the values and
    the advantages see the whole response; `accepted_mask` only leaves rejected tokens out of the
    estimator's normalisation."""
    mask = batch.response_mask
    rewards = outcome_to_token_level(batch.scores, mask)
    metrics: dict[str, Any] = {}
    kl_plan = plan.kl_reward
    if kl_plan.enabled:
        assert batch.old_log_probs is not None and batch.ref_log_probs is not None
        rewards, kl = apply_kl_penalty(
            rewards, batch.old_log_probs, batch.ref_log_probs, mask, kl_ctrl.value, kl_plan.kind
        )
        metrics["actor/reward_kl"], metrics["actor/kl_coef"] = float(kl), kl_ctrl.value
        kl_ctrl.update(float(kl), n_steps=int(mask.shape[0]))
    adv = plan.advantage
    batch.advantages, batch.returns = compute_advantage(
        adv.estimator,
        token_level_rewards=rewards,
        response_mask=mask,
        group_index=batch.group_index,
        values=batch.values,
        gamma=adv.gamma,
        lam=adv.lam,
        norm_adv_by_std_in_grpo=adv.norm_adv_by_std_in_grpo,
        accepted_mask=batch.accepted_mask,
    )
    return metrics


def filter_metric(batch: dict[str, Tensor], metric: str) -> Tensor:
    """DAPO dynamic sampling's per-response metric (FilterGroupsPlan.metric): seq_reward is the score after
    the overlong penalty, score the reward function's own (the overlong penalty taken back out)."""
    if metric == "seq_reward":
        return batch["scores"]
    return batch["scores"] - batch.get("overlong_penalty", 0.0)
