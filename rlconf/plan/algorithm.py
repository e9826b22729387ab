"""The algorithm part of the plan: what rltrain's algorithm layer (rltrain/algorithms/) and the step loop
read, resolved once from the config's `algorithm`, `actor` (loss fields), `critic` (value clip) and
`trainer.critic_warmup` (`algorithm_plan`). Every "None means X" of those sections is decided here
(clip_ratio_low / clip_ratio_high None -> clip_ratio), so no reader in rltrain re-derives it. Which
log-prob passes a step runs and which rollout-correction modes apply stay in `StepPasses`; this part
carries the thresholds and the loss / advantage / KL choices.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlconf.config import PolicyLossConfig, RLConfig


@dataclass(frozen=True)
class PolicyLossOptions:
    """The options of the policy-loss modes that have some (actor.policy_loss)."""

    clip_cov_ratio: float
    """clip-cov: fraction of valid tokens whose gradient is detached."""
    clip_cov_lb: float
    """clip-cov: lower bound of the covariance band of candidate tokens."""
    clip_cov_ub: float
    """clip-cov: upper bound of the covariance band of candidate tokens."""
    kl_cov_ratio: float
    """kl-cov: fraction of valid tokens (the highest covariance) that get the |log-ratio| penalty."""
    ppo_kl_coef: float
    """kl-cov: weight of the |log-ratio| penalty on the selected tokens."""
    tau_pos: float
    """sapo: temperature of the soft gate for positive advantages."""
    tau_neg: float
    """sapo: temperature of the soft gate for negative advantages."""


@dataclass(frozen=True)
class LossPlan:
    """The losses of the update: the actor's policy loss with its entropy and KL terms, and the critic's
    clipped value loss."""

    loss_mode: str
    """actor.policy_loss.loss_mode: the registered policy loss (rltrain.algorithms.POLICY_LOSS_REGISTRY)."""
    clip_ratio_low: float
    """Lower PPO clip epsilon (actor.clip_ratio_low, None resolved to actor.clip_ratio)."""
    clip_ratio_high: float
    """Upper PPO clip epsilon (actor.clip_ratio_high, None resolved to actor.clip_ratio)."""
    clip_ratio_c: float
    """Dual-clip bound for negative advantages (actor.clip_ratio_c)."""
    loss_agg_mode: str
    """How per-token losses are aggregated (actor.loss_agg_mode; also the critic's value loss)."""
    entropy_coeff: float
    """Weight of the entropy bonus (0: the entropy is a metric only)."""
    use_kl_loss: bool
    """A KL(actor || ref) term in the actor's loss (actor.use_kl_loss)."""
    kl_loss_coef: float
    """Weight of the KL loss."""
    kl_loss_type: str
    """KL estimator of the loss (kl, abs, mse, low_var_kl)."""
    options: PolicyLossOptions
    """The loss mode's own options."""
    value_clip: float
    """Value clipping range of the critic's loss (critic.cliprange_value)."""
    shuffle: bool
    """Shuffle the actor's responses between mini-batches (actor.shuffle); the critic always shuffles."""


@dataclass(frozen=True)
class AdvantagePlan:
    """How advantages (and returns) are estimated from the token rewards."""

    estimator: str
    """algorithm.adv_estimator: the registered estimator (rltrain.algorithms.ADV_ESTIMATOR_REGISTRY)."""
    gamma: float
    """Discount factor."""
    lam: float
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool
    """GRPO: divide group-relative advantages by the group's std (false: Dr. GRPO)."""


@dataclass(frozen=True)
class KLRewardPlan:
    """The KL penalty in the reward (algorithm.use_kl_in_reward) and its coefficient's controller."""

    enabled: bool
    """Subtract kl_coef x KL(actor || ref) from the token rewards."""
    kind: str
    """KL estimator of the penalty (algorithm.kl_penalty)."""
    controller: str
    """fixed: a constant coefficient; adaptive: steered towards target_kl (algorithm.kl_ctrl.type)."""
    kl_coef: float
    """(Initial) coefficient."""
    target_kl: float
    """Adaptive only: the target KL per token."""
    horizon: int
    """Adaptive only: responses over which the coefficient adapts."""


@dataclass(frozen=True)
class FilterGroupsPlan:
    """DAPO dynamic sampling (algorithm.filter_groups)."""

    enabled: bool
    """Drop prompt groups whose metric has no spread and generate more until the batch is full."""
    metric: str
    """score: the reward function's score; seq_reward: the score after the overlong penalty."""
    max_num_gen_batches: int
    """Most generation batches per step before the step fails; 0: unbounded."""


@dataclass(frozen=True)
class AlgorithmPlan:
    """Everything the algorithm layer and the step loop decide with, resolved."""

    loss: LossPlan
    """The update's losses."""
    advantage: AdvantagePlan
    """The advantage estimator."""
    kl_reward: KLRewardPlan
    """KL-in-reward and its controller."""
    filter_groups: FilterGroupsPlan
    """Dynamic sampling."""
    rollout_is_threshold: float
    """Upper truncation of the rollout-correction importance weights (the mode is StepPasses.rollout_is)."""
    rollout_rs_threshold: float
    """Bound of the rejection-sampling ratio (the mode is StepPasses.rollout_rs)."""
    critic_warmup: int
    """Steps that update only the critic (trainer.critic_warmup): the actor updates from step
    critic_warmup + 1 on."""


def policy_loss_options(p: PolicyLossConfig) -> PolicyLossOptions:
    """The options of `actor.policy_loss` (with no argument given to a loss function: PolicyLossConfig()'s)."""
    return PolicyLossOptions(
        clip_cov_ratio=p.clip_cov_ratio,
        clip_cov_lb=p.clip_cov_lb,
        clip_cov_ub=p.clip_cov_ub,
        kl_cov_ratio=p.kl_cov_ratio,
        ppo_kl_coef=p.ppo_kl_coef,
        tau_pos=p.tau_pos,
        tau_neg=p.tau_neg,
    )


DEFAULT_POLICY_LOSS_OPTIONS = policy_loss_options(PolicyLossConfig())
"""The options of a default `actor.policy_loss` (what a loss function uses when given none)."""


def loss_plan(config: RLConfig) -> LossPlan:
    """The LossPlan of `config`: clip_ratio_low / clip_ratio_high None mean actor.clip_ratio."""
    a = config.actor
    p = a.policy_loss
    return LossPlan(
        loss_mode=p.loss_mode,
        clip_ratio_low=a.clip_ratio if a.clip_ratio_low is None else a.clip_ratio_low,
        clip_ratio_high=a.clip_ratio if a.clip_ratio_high is None else a.clip_ratio_high,
        clip_ratio_c=a.clip_ratio_c,
        loss_agg_mode=a.loss_agg_mode,
        entropy_coeff=a.entropy_coeff,
        use_kl_loss=a.use_kl_loss,
        kl_loss_coef=a.kl_loss_coef,
        kl_loss_type=a.kl_loss_type,
        options=policy_loss_options(p),
        value_clip=config.critic.cliprange_value,
        shuffle=a.shuffle,
    )


def algorithm_plan(config: RLConfig) -> AlgorithmPlan:
    """The AlgorithmPlan of `config`."""
    alg = config.algorithm
    kl, fg, rc = alg.kl_ctrl, alg.filter_groups, alg.rollout_correction
    return AlgorithmPlan(
        loss=loss_plan(config),
        advantage=AdvantagePlan(
            estimator=alg.adv_estimator,
            gamma=alg.gamma,
            lam=alg.lam,
            norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
        ),
        kl_reward=KLRewardPlan(
            enabled=alg.use_kl_in_reward,
            kind=alg.kl_penalty,
            controller=kl.type,
            kl_coef=kl.kl_coef,
            target_kl=kl.target_kl,
            horizon=kl.horizon,
        ),
        filter_groups=FilterGroupsPlan(
            enabled=fg.enable, metric=fg.metric, max_num_gen_batches=fg.max_num_gen_batches
        ),
        rollout_is_threshold=rc.rollout_is_threshold,
        rollout_rs_threshold=rc.rollout_rs_threshold,
        critic_warmup=config.trainer.critic_warmup,
    )


__all__ = [
    "DEFAULT_POLICY_LOSS_OPTIONS",
    "AdvantagePlan",
    "AlgorithmPlan",
    "FilterGroupsPlan",
    "KLRewardPlan",
    "LossPlan",
    "PolicyLossOptions",
    "algorithm_plan",
    "loss_plan",
    "policy_loss_options",
]
