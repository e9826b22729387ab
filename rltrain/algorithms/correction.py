"""Rollout correction: truncated importance weights and rejection sampling of the policy loss against the
rollout engine's log-probs (verl's algorithm.rollout_correction)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from rltrain.algorithms.core import masked_mean


@dataclass(frozen=True)
class RolloutCorrectionResult:
    """What `rollout_correction` gives the update: per-token loss weights, the loss mask left after
    rejection sampling, and the metrics of the step."""

    weights: Tensor
    """(B, T) truncated importance weights (1 without rollout_is), 0 on padding and on rejected tokens."""
    accepted: Tensor
    """(B, T) response_mask without the rejected tokens (its dtype): the mask of every loss of the update
    and of the advantages' normalisation, so that means are over accepted tokens."""
    metrics: dict[str, float]
    """rollout_corr/*: is_weight_mean / is_weight_max (over accepted tokens), rejected_fraction (of the
    valid tokens), kl = mean(rollout_log_prob - log_prob) and logprob_abs_diff_mean (unclamped, over the
    valid tokens)."""


def rollout_correction(
    log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    rollout_is: str | None,
    is_threshold: float,
    rollout_rs: str | None,
    rs_threshold: float,
) -> RolloutCorrectionResult:
    """Correct the policy loss for sampling with the rollout engine's policy (log-probs `rollout_log_prob`)
    instead of the trainer's (`log_prob`, the old log-probs of the step): truncated importance sampling
    (Espeholt et al. 2018) and rejection sampling (verl's algorithm.rollout_correction).

        log rho_t = log pi_train - log pi_rollout per valid token
        log rho_seq = sum_t log rho_t over the response (unclamped)
        IS (rollout_is):  w_t = min(exp(clamp(log rho_t, -20, 20)), is_threshold)       (token)
                          w_t = min(exp(clamp(log rho_seq, -20, 20)), is_threshold)     (sequence)
        RS (rollout_rs):  token t is rejected when |log rho_t| > log rs_threshold (token), every token of
                          the response when |log rho_seq| > log rs_threshold (sequence)
    The clamp of the sequence weight is on the summed log-ratio (rho_seq = prod_t rho_t, as verl): clamping
    each token first would change the product once one token's |log rho| > 20. Rejection compares the exact
    log-ratios (no exponential is taken, so nothing can overflow); verl's `seq_*` rejection sums clamped
    token log-ratios, which differs only past |log rho_t| > 20.

    Rejected tokens leave the loss: `accepted` is the response mask without them, and the update uses it
    as its loss mask, so every aggregation is a mean over accepted tokens (or responses), the usual
    rejection-sampling estimator, as verl (which replaces the batch's response_mask). Their weights are 0
    too.
    """
    mask = response_mask.to(torch.float32)
    with torch.no_grad():
        # where, not a product: padding may hold anything (0 x inf would be NaN).
        log_rho = torch.where(mask > 0, log_prob.float() - rollout_log_prob.float(), torch.zeros_like(mask))
        log_rho_seq = log_rho.sum(-1, keepdim=True).expand_as(log_rho)
        keep = mask.clone()
        if rollout_rs is not None:
            per = log_rho if rollout_rs == "token" else log_rho_seq
            keep = keep * (per.abs() <= math.log(rs_threshold)).to(keep.dtype)
        weights = keep.clone()
        if rollout_is is not None:
            per = log_rho if rollout_is == "token" else log_rho_seq
            weights = weights * torch.clamp(torch.exp(torch.clamp(per, -20.0, 20.0)), max=is_threshold)
        n = float(mask.sum())
        metrics = {
            "rollout_corr/is_weight_mean": float(masked_mean(weights, keep)),
            "rollout_corr/is_weight_max": float((weights * keep).max()) if n else 0.0,
            "rollout_corr/rejected_fraction": float(1.0 - keep.sum() / max(n, 1.0)),
            "rollout_corr/kl": float(masked_mean(-log_rho, mask)),
            "rollout_corr/logprob_abs_diff_mean": float(masked_mean(log_rho.abs(), mask)),
        }
    accepted = response_mask * keep.to(response_mask.dtype)
    return RolloutCorrectionResult(weights, accepted, metrics)
