"""Losses of the update: the loss aggregation modes, the policy losses (a registry of name -> per-token
loss, picked by the plan's `LossPlan.loss_mode`) and the clipped value loss."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rlconf.plan.algorithm import DEFAULT_POLICY_LOSS_OPTIONS, PolicyLossOptions
from rlconf.vocab import LOSS_AGG_MODES, POLICY_LOSS_MODES
from rltrain.algorithms.core import masked_mean, masked_var


def agg_loss(loss_mat: Tensor, loss_mask: Tensor, loss_agg_mode: str) -> Tensor:
    """Reduce a (B, T) per-token loss to a scalar (`actor.loss_agg_mode`).

    token-mean:              sum(l * m) / sum(m)                          every token weighs the same
    seq-mean-token-sum:      mean_i sum_t l_it m_it                       longer responses weigh more
    seq-mean-token-mean:     mean_i (sum_t l_it m_it / sum_t m_it)        every response weighs the same
    seq-mean-token-sum-norm: mean_i (sum_t l_it m_it) / T                 Dr. GRPO: constant T = max length
    The seq-mean modes average over the rows i with at least one valid token: a row whose tokens are all
    masked (e.g. a multi-turn row cut off before the model spoke) neither adds loss nor dilutes the mean.
    The mask may have interior zeros (tool observations); only its ones count.

    seq-mean-token-sum-norm is the Dr. GRPO paper's objective (Liu et al. 2025, "Understanding R1-Zero-Like
    Training"): (1/G) sum_i sum_t l_it over a constant length T (the paper's code divides by the generation
    budget). verl's agg_loss drops the 1/G ("turns off seq-dim averaging": sum_i sum_t l_it / T), and its
    trainers then divide by the number of micro-batches, so verl's gradient scale is rlplan's times the rows
    of one micro-batch. rlplan keeps the paper's 1/G because then the gradient scale does not depend on the
    batch size, the micro-batch size or the data-parallel layout (the update is the same however rows are
    split, like every other mode here), and the learning rate carries over when the batch grows.
    `rlconf import-verl` warns when a translated config uses this mode.
    """
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, mask)
    seq_sums = (loss_mat * mask).sum(-1)
    tokens = mask.sum(-1)
    rows = (tokens > 0).to(loss_mat.dtype)
    n_rows = rows.sum().clamp_min(1.0)
    if loss_agg_mode == "seq-mean-token-sum":
        return seq_sums.sum() / n_rows
    if loss_agg_mode == "seq-mean-token-mean":
        return (seq_sums / tokens.clamp_min(1.0) * rows).sum() / n_rows
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return seq_sums.sum() / n_rows / loss_mask.shape[-1]
    raise ValueError(
        f"unknown actor.loss_agg_mode {loss_agg_mode!r}; choose one of {', '.join(LOSS_AGG_MODES)}"
    )


@dataclass(frozen=True)
class PolicyLossInputs:
    """What every policy loss reads: (B, T) tensors, a float response mask, the clip ranges and the
    options of the plan's `LossPlan.options`."""

    old_log_prob: Tensor
    log_prob: Tensor
    advantages: Tensor
    mask: Tensor
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    options: PolicyLossOptions


PolicyLossFn = Callable[[PolicyLossInputs], tuple[Tensor, dict[str, Tensor]]]


@dataclass(frozen=True)
class PolicyLoss:
    """A registered loss: `fn(inputs) -> (per-token loss (B, T), metrics)`; `loss_agg_mode` overrides the
    configured aggregation when the method defines its own (GSPO, SAPO: seq-mean-token-mean, their papers'
    objectives, as verl)."""

    fn: PolicyLossFn
    loss_agg_mode: str | None = None


POLICY_LOSS_REGISTRY: dict[str, PolicyLoss] = {}


def register_policy_loss(
    name: str, loss_agg_mode: str | None = None
) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register a per-token policy loss under `actor.policy_loss.loss_mode = name`."""

    def wrap(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSS_REGISTRY[name] = PolicyLoss(fn, loss_agg_mode)
        return fn

    return wrap


def policy_loss_agg_mode(loss_mode: str, loss_agg_mode: str) -> str:
    """The aggregation the loss of `loss_mode` uses (the configured one unless the method fixes its own);
    the engine weights micro-batches with it."""
    entry = POLICY_LOSS_REGISTRY.get(loss_mode)
    return entry.loss_agg_mode if entry is not None and entry.loss_agg_mode else loss_agg_mode


def _log_ratio(x: PolicyLossInputs) -> Tensor:
    # Clamped against overflow of exp on a stale or corrupt old log-prob (verl clamps the same in vanilla,
    # CISPO and SAPO; rlplan also in Clip-Cov and KL-Cov, see those). Outside [-20, 20] the clamp passes
    # no gradient: a token whose probability moved e^20-fold since the old policy does not steer the update.
    return torch.clamp(x.log_prob - x.old_log_prob, min=-20.0, max=20.0)


@register_policy_loss("vanilla")
def _vanilla_loss(x: PolicyLossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clip (Schulman et al. 2017) with dual clip (Ye et al. 2020); see compute_policy_loss."""
    if x.clip_ratio_c <= 1.0:
        raise ValueError(f"actor.clip_ratio_c must be > 1 for dual clip, got {x.clip_ratio_c}")
    log_ratio = _log_ratio(x)
    ratio = torch.exp(log_ratio)
    adv, mask = x.advantages, x.mask
    losses1 = -adv * ratio
    losses2 = -adv * torch.clamp(ratio, 1.0 - x.clip_ratio_low, 1.0 + x.clip_ratio_high)
    clipped = torch.maximum(losses1, losses2)
    losses3 = -adv * x.clip_ratio_c
    negative = adv < 0
    pg_losses = torch.where(negative, torch.minimum(losses3, clipped), clipped)
    return pg_losses, {
        "pg_clipfrac": masked_mean(torch.gt(losses2, losses1).to(mask.dtype), mask),
        "ppo_kl": masked_mean(-log_ratio, mask),
        "pg_clipfrac_lower": masked_mean((torch.gt(clipped, losses3) & negative).to(mask.dtype), mask),
    }


@register_policy_loss("gspo", loss_agg_mode="seq-mean-token-mean")
def _gspo_loss(x: PolicyLossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025): one importance ratio per sequence, the geometric mean of its token ratios,

        s_i = exp(mean_t (log_prob - old_log_prob))      (length-normalised sequence ratio)
        L_it = max(-A * s_it, -A * clip(s_it, 1 - clip_ratio_low, 1 + clip_ratio_high))
    in the token-level form of the paper (GSPO-token): s_it = sg(s_i) * pi_t / sg(pi_t) has the value s_i
    and the gradient s_i * grad log pi_t, so each token's gradient is weighted by its sequence's ratio.
    Aggregated seq-mean-token-mean (the paper's objective; verl does the same whatever loss_agg_mode says).
    """
    log_ratio = x.log_prob - x.old_log_prob
    seq_log_ratio = masked_mean(log_ratio, x.mask, dim=-1)
    log_s = x.log_prob - x.log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    s = torch.exp(torch.clamp(log_s, max=10.0))
    losses1 = -x.advantages * s
    losses2 = -x.advantages * torch.clamp(s, 1.0 - x.clip_ratio_low, 1.0 + x.clip_ratio_high)
    return torch.maximum(losses1, losses2), {
        "pg_clipfrac": masked_mean(torch.gt(losses2, losses1).to(x.mask.dtype), x.mask),
        "ppo_kl": masked_mean(-log_ratio, x.mask),
    }


@register_policy_loss("gpg")
def _gpg_loss(x: PolicyLossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """GPG (Chu et al. 2025): the plain policy gradient L_t = -A_t * log pi_t, no ratio and no clip (pair
    it with algorithm.adv_estimator = gpg)."""
    return -x.advantages * x.log_prob, {"ppo_kl": masked_mean(x.old_log_prob - x.log_prob, x.mask)}


def _covariance(x: PolicyLossInputs) -> Tensor:
    """Per-token (A - mean A) * (log pi - mean log pi) over the valid tokens (detached): the centred
    covariance term of Cui et al. 2025, large where a confident token gets a large advantage."""
    logp = x.log_prob.detach()
    return (x.advantages - masked_mean(x.advantages, x.mask)) * (logp - masked_mean(logp, x.mask))


@register_policy_loss("clip-cov")
def _clip_cov_loss(x: PolicyLossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs"): PPO clip, and among the
    valid tokens that PPO did not clip and whose covariance lies in (clip_cov_lb, clip_cov_ub), a random
    max(1, int(clip_cov_ratio x valid tokens)) have their loss (and so their gradient) set to 0.
    pg_clipfrac is the fraction of tokens detached that way.

    Differs from verl only where |log pi - log pi_old| > 20: the ratio uses the clamped log-ratio of
    `_log_ratio` (verl's Clip-Cov does not clamp). There verl's loss is e^20 |A| or more (inf past 88 in
    fp32, a NaN step) and a negative-advantage token's gradient drowns the batch; rlplan's is -A e^(+-20)
    with no gradient through the ratio. The paper states no bound; such a ratio only comes from a stale or
    corrupt old log-prob."""
    log_ratio = _log_ratio(x)
    ratio = torch.exp(log_ratio)
    opts, mask = x.options, x.mask
    losses1 = -x.advantages * ratio
    losses2 = -x.advantages * torch.clamp(ratio, 1.0 - x.clip_ratio_low, 1.0 + x.clip_ratio_high)
    with torch.no_grad():
        valid = mask > 0
        cov = _covariance(x)
        candidates = valid & ~(losses2 > losses1) & (cov > opts.clip_cov_lb) & (cov < opts.clip_cov_ub)
        picked = torch.nonzero(candidates)
        n_clip = max(int(opts.clip_cov_ratio * float(mask.sum())), 1)
        picked = picked[torch.randperm(picked.shape[0], device=picked.device)[:n_clip]]
        keep = torch.ones_like(mask)
        keep[picked[:, 0], picked[:, 1]] = 0.0
    return torch.maximum(losses1, losses2) * keep, {
        "pg_clipfrac": masked_mean((keep == 0).to(mask.dtype), mask),
        "ppo_kl": masked_mean(-log_ratio, mask),
    }


@register_policy_loss("kl-cov")
def _kl_cov_loss(x: PolicyLossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov (Cui et al. 2025): no clip; the max(1, int(kl_cov_ratio x valid tokens)) valid tokens of
    highest covariance get a penalty ppo_kl_coef x |log pi - log pi_old| added to -A * ratio.
    pg_clipfrac is the fraction of tokens penalised.

    Two differences from verl, both documented in docs/migrating-from-verl.md: the ratio and the penalty
    use the log-ratio clamped to [-20, 20] (`_log_ratio`; verl does not clamp; equal wherever
    |log-ratio| <= 20), and the ppo_kl metric is mean(log pi_old - log pi) over valid tokens (clamped as
    the ratio), the same k1 estimate every loss mode reports, so that runs of different modes compare on one
    chart (verl's KL-Cov alone reports the unclamped mean |log pi - log pi_old| as ppo_kl)."""
    log_ratio = _log_ratio(x)
    ratio = torch.exp(log_ratio)
    opts, mask = x.options, x.mask
    with torch.no_grad():
        valid = (mask > 0).reshape(-1)
        cov = _covariance(x).reshape(-1)
        n_valid = int(valid.sum())
        penalised = torch.zeros_like(cov)
        if n_valid:
            k = max(1, int(n_valid * opts.kl_cov_ratio))
            top = torch.topk(torch.where(valid, cov, torch.full_like(cov, -math.inf)), k).indices
            penalised[top] = 1.0
        penalised = penalised.reshape(mask.shape)
    pg_losses = -x.advantages * ratio + penalised * opts.ppo_kl_coef * log_ratio.abs()
    return pg_losses, {
        "pg_clipfrac": masked_mean(penalised, mask),
        "ppo_kl": masked_mean(-log_ratio, mask),
    }


@register_policy_loss("cispo")
def _cispo_loss(x: PolicyLossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, 2025): clip the importance weight, not the update, and keep every token's gradient:

        L_t = -sg(clip(ratio_t, 1 - clip_ratio_low, 1 + clip_ratio_high)) * A_t * log pi_t
    (MiniMax set no lower bound: clip_ratio_low = 1). pg_clipfrac: tokens whose weight was clipped."""
    log_ratio = _log_ratio(x)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - x.clip_ratio_low, 1.0 + x.clip_ratio_high).detach()
    clipped = (ratio.detach() != weight).to(x.mask.dtype)
    return -weight * x.advantages * x.log_prob, {
        "pg_clipfrac": masked_mean(clipped, x.mask),
        "ppo_kl": masked_mean(-log_ratio, x.mask),
    }


@register_policy_loss("sapo", loss_agg_mode="seq-mean-token-mean")
def _sapo_loss(x: PolicyLossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization"): a smooth gate instead of a hard clip,

        f(r) = sigmoid(tau * (r - 1)) * 4 / tau,   tau = tau_pos if A > 0 else tau_neg
        L_t  = -f(ratio_t) * A_t                      (log-ratio clamped to [-20, 20], as verl)
    f'(1) = 1, so on-policy the gradient is the plain -A * grad log pi; far from r = 1 the gradient fades
    smoothly (faster for larger tau). No token is clipped (pg_clipfrac 0).
    Aggregated seq-mean-token-mean whatever actor.loss_agg_mode says: the paper's objective is
    (1/G) sum_i (1/|y_i|) sum_t L_it, and verl forces the same (`rlconf validate` warns when
    actor.loss_agg_mode names another mode; it still aggregates the entropy and KL terms)."""
    log_ratio = _log_ratio(x)
    ratio = torch.exp(log_ratio)
    tau = torch.where(
        x.advantages > 0,
        torch.full_like(ratio, x.options.tau_pos),
        torch.full_like(ratio, x.options.tau_neg),
    )
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    return -gate * x.advantages, {"ppo_kl": masked_mean(-log_ratio, x.mask)}


def compute_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    loss_agg_mode: str,
    loss_mode: str = "vanilla",
    options: PolicyLossOptions | None = None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss registered as `loss_mode` (POLICY_LOSS_REGISTRY), aggregated into a scalar.

    vanilla is the PPO clipped surrogate with dual clip (Ye et al. 2020) for negative advantages:
        ratio = exp(log_prob - old_log_prob)          (log-ratio clamped to [-20, 20])
        L1 = -A * ratio;  L2 = -A * clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
        L  = max(L1, L2)                              (the pessimistic PPO bound)
        if A < 0: L = min(L, -A * clip_ratio_c)       (dual clip: bound the loss of a huge ratio)
    The other modes are documented on their functions. With `rollout_is_weights` (rollout correction,
    detached, 0 on rejected tokens) every token's loss is multiplied by its weight; with rejection sampling
    `response_mask` is the accepted mask (`rollout_correction`), so the mean is over accepted tokens. Then
        loss = agg_loss(L, response_mask, policy_loss_agg_mode(loss_mode, loss_agg_mode))
    Metrics (detached scalars over valid tokens): pg_clipfrac (the mode's clip / detach / penalty
    fraction), ppo_kl = mean[old_log_prob - log_prob], pg_clipfrac_lower (dual clip; 0 for other modes).
    """
    entry = POLICY_LOSS_REGISTRY.get(loss_mode)
    if entry is None:
        raise ValueError(
            f"unknown actor.policy_loss.loss_mode {loss_mode!r}; choose one of {', '.join(POLICY_LOSS_MODES)}"
        )
    mask = response_mask.to(log_prob.dtype)
    inputs = PolicyLossInputs(
        old_log_prob,
        log_prob,
        advantages,
        mask,
        clip_ratio_low,
        clip_ratio_high,
        clip_ratio_c,
        options if options is not None else DEFAULT_POLICY_LOSS_OPTIONS,
    )
    pg_losses, mode_metrics = entry.fn(inputs)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()
    loss = agg_loss(pg_losses, mask, entry.loss_agg_mode or loss_agg_mode)
    zero = torch.zeros((), dtype=mask.dtype, device=mask.device)
    metrics = {k: mode_metrics.get(k, zero).detach() for k in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")}
    return loss, metrics


def compute_value_loss(
    vpreds: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    loss_agg_mode: str,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss (PPO2 style, `critic.cliprange_value`).

        V_clip = clip(vpreds, old_values - c, old_values + c)
        loss   = 0.5 * agg_loss(max((vpreds - R)^2, (V_clip - R)^2), response_mask, loss_agg_mode)
    Metric: vf_clipfrac = mean over valid tokens of [(V_clip - R)^2 > (vpreds - R)^2].
    """
    mask = response_mask.to(vpreds.dtype)
    clipped_preds = torch.clamp(vpreds, old_values - cliprange_value, old_values + cliprange_value)
    losses1 = (vpreds - returns).square()
    losses2 = (clipped_preds - returns).square()
    loss = 0.5 * agg_loss(torch.maximum(losses1, losses2), mask, loss_agg_mode)
    vf_clipfrac = masked_mean(torch.gt(losses2, losses1).to(mask.dtype), mask)
    return loss, {"vf_clipfrac": vf_clipfrac.detach()}


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over valid tokens (a critic-quality metric); nan if Var = 0."""
    var_r = masked_var(returns, mask)
    if float(var_r) == 0.0:
        return math.nan
    return float(1.0 - masked_var(returns - values, mask) / var_r)
