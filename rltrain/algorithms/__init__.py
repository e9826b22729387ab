"""The algorithm layer: the pure math of PPO/GRPO and their variants, driven by the plan's AlgorithmPlan.

- core: masked reductions, entropy / log-probs from logits, outcome rewards on the last token.
- advantages: the advantage estimators (a registry; AdvantagePlan.estimator picks one).
- kl: KL estimators, the KL-in-reward penalty and its controllers (KLRewardPlan).
- losses: loss aggregation, the policy losses (a registry; LossPlan.loss_mode picks one), the value loss.
- batches: DAPO's overlong penalty and group filter, concatenating and selecting rollout rows.
- correction: rollout correction (truncated importance weights, rejection sampling).
- step: the batch of one training step (StepBatch) and the algorithm between its passes.

Every function is a small torch function on (batch, response_length) tensors with no state beyond its
arguments (the KL controllers hold one float), so that the Megatron engine and the controller share one
tested definition. Shapes: `B` responses, `T` response tokens; `response_mask` is 1 on generated tokens and
0 on padding. Everything is re-exported here (`from rltrain import algorithms`).
"""

from __future__ import annotations

from rlconf.vocab import ADV_ESTIMATORS, KL_KINDS, LOSS_AGG_MODES, POLICY_LOSS_MODES
from rltrain.algorithms.advantages import (
    ADV_ESTIMATOR_REGISTRY,
    AdvantageEstimator,
    AdvantageFn,
    AdvantageInputs,
    compute_advantage,
    compute_gae_advantage_return,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    register_adv_estimator,
)
from rltrain.algorithms.batches import (
    concat_batches,
    groups_with_spread,
    overlong_penalty,
    select_rows,
)
from rltrain.algorithms.core import (
    entropy_from_logits,
    group_ids,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    outcome_to_token_level,
)
from rltrain.algorithms.correction import (
    RolloutCorrectionResult,
    rollout_correction,
)
from rltrain.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
    kl_penalty,
)
from rltrain.algorithms.losses import (
    POLICY_LOSS_REGISTRY,
    PolicyLoss,
    PolicyLossFn,
    PolicyLossInputs,
    agg_loss,
    compute_policy_loss,
    compute_value_loss,
    explained_variance,
    policy_loss_agg_mode,
    register_policy_loss,
)
from rltrain.algorithms.step import (
    WORKER_KEYS,
    StepBatch,
    apply_rollout_correction,
    filter_metric,
    old_log_prob_metrics,
    rewards_and_advantages,
)

__all__ = [
    "ADV_ESTIMATORS",
    "ADV_ESTIMATOR_REGISTRY",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "POLICY_LOSS_MODES",
    "POLICY_LOSS_REGISTRY",
    "WORKER_KEYS",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "AdvantageFn",
    "AdvantageInputs",
    "FixedKLController",
    "PolicyLoss",
    "PolicyLossFn",
    "PolicyLossInputs",
    "RolloutCorrectionResult",
    "StepBatch",
    "agg_loss",
    "apply_kl_penalty",
    "apply_rollout_correction",
    "build_kl_controller",
    "compute_advantage",
    "compute_gae_advantage_return",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_policy_loss",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_value_loss",
    "concat_batches",
    "entropy_from_logits",
    "explained_variance",
    "filter_metric",
    "group_ids",
    "groups_with_spread",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "old_log_prob_metrics",
    "outcome_to_token_level",
    "overlong_penalty",
    "policy_loss_agg_mode",
    "register_adv_estimator",
    "register_policy_loss",
    "rewards_and_advantages",
    "rollout_correction",
    "select_rows",
]
