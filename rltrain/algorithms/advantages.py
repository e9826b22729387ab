"""Advantage estimators (GAE, GRPO, RLOO, REINFORCE++, pass@k GRPO, GPG): each a torch function on (B, T)
tensors, registered by name so that the plan's `AdvantagePlan.estimator` picks one (`compute_advantage`).
Formulas follow the common implementations (verl, TRL, OpenRLHF) and are given in each docstring."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlconf.vocab import ADV_ESTIMATORS
from rltrain.algorithms.core import group_ids, masked_whiten


def _kept(mask: Tensor, accepted_mask: Tensor | None) -> Tensor:
    """The tokens that stay in the loss: `mask` without those rejection sampling removed (`accepted_mask`,
    algorithm.rollout_correction.rollout_rs); all of `mask` when None."""
    return mask if accepted_mask is None else mask * accepted_mask.to(mask.dtype)


def _group_scores(
    token_level_rewards: Tensor, mask: Tensor, group_index: Tensor | Sequence[Any]
) -> tuple[Tensor, Tensor, Tensor]:
    """Outcome score per response (sum of its token rewards), its group id, and each group's size."""
    scores = (token_level_rewards * mask).sum(-1)
    ids = group_ids(group_index, scores.shape[0], scores.device)
    n_groups = int(ids.max()) + 1 if ids.numel() else 0
    counts = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, ids, torch.ones_like(scores)
    )
    return scores, ids, counts


def compute_gae_advantage_return(
    token_level_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float,
    lam: float,
    accepted_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over each response.

    Backwards over valid tokens t (masked tokens are skipped: they neither bootstrap nor accumulate):
        delta_t = r_t + gamma * V_{t+1} - V_t            (V after the last valid token is 0)
        A_t     = delta_t + gamma * lam * A_{t+1}
        returns_t = A_t + V_t                             (computed before whitening)
    The advantages are then whitened over all valid tokens of the batch (masked_whiten) and set to 0 on
    masked positions; returns are 0 there too. Returns (advantages, returns), each (B, T).
    With `accepted_mask` (rejection sampling) the whitening statistics are over the accepted tokens only and
    rejected tokens get advantage 0; the recursion still runs over the trajectory as sampled (a rejected
    token's reward and value still reach the tokens before it; verl's recursion skips them like tool
    observations, so a rejected last token's outcome reward is lost to its whole response there).
    """
    mask = response_mask.to(values.dtype)
    with torch.no_grad():
        next_value = torch.zeros_like(values[:, 0])
        last_gae = torch.zeros_like(values[:, 0])
        advantages = torch.zeros_like(values)
        for t in reversed(range(values.shape[-1])):
            m = mask[:, t]
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            gae = delta + gamma * lam * last_gae
            # On a masked position carry the next valid token's value and advantage through unchanged.
            next_value = values[:, t] * m + (1 - m) * next_value
            last_gae = gae * m + (1 - m) * last_gae
            advantages[:, t] = last_gae
        returns = (advantages + values) * mask
        keep = _kept(mask, accepted_mask)
        advantages = masked_whiten(advantages, keep) * keep
    return advantages, returns


def compute_grpo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    group_index: Tensor | Sequence[Any],
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    accepted_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """GRPO (Shao et al. 2024): group-relative outcome advantage, the same for every token of a response.

        s_i = sum_t r_{i,t}
        A_i = (s_i - mean_g(s)) / (std_g(s) + epsilon)   if norm_adv_by_std_in_grpo (std unbiased)
        A_i =  s_i - mean_g(s)                            otherwise (Dr. GRPO)
    where g is the group (prompt) of response i. A group of one response has no baseline: A = 0.
    Returns (advantages, returns), both A_i broadcast over the valid tokens, (B, T).
    With `accepted_mask` (rejection sampling) a rejected response still counts in its group's mean and
    std (it was sampled; verl the same) and its rejected tokens get 0.
    """
    mask = response_mask.to(token_level_rewards.dtype)
    with torch.no_grad():
        scores, ids, counts = _group_scores(token_level_rewards, mask, group_index)
        mean = torch.zeros_like(counts).index_add_(0, ids, scores) / counts
        dev = scores - mean[ids]
        var = torch.zeros_like(counts).index_add_(0, ids, dev**2) / (counts - 1).clamp_min(1)
        adv = dev / (var.sqrt()[ids] + epsilon) if norm_adv_by_std_in_grpo else dev
        adv = torch.where(counts[ids] > 1, adv, torch.zeros_like(adv))
        adv = adv.unsqueeze(-1) * _kept(mask, accepted_mask)
    return adv, adv


def compute_rloo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    group_index: Tensor | Sequence[Any],
    accepted_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """RLOO (Ahmadian et al. 2024): each response's baseline is the mean score of the others in its group.

        s_i = sum_t r_{i,t};  A_i = s_i - (sum_{j in g, j != i} s_j) / (n_g - 1)
    A group of one response has no baseline: A = 0. Returns (advantages, returns), (B, T).
    `accepted_mask`: as GRPO (rejected responses stay in the baselines; their rejected tokens get 0).
    """
    mask = response_mask.to(token_level_rewards.dtype)
    with torch.no_grad():
        scores, ids, counts = _group_scores(token_level_rewards, mask, group_index)
        sums = torch.zeros_like(counts).index_add_(0, ids, scores)
        n = counts[ids]
        baseline = (sums[ids] - scores) / (n - 1).clamp_min(1)
        adv = torch.where(n > 1, scores - baseline, torch.zeros_like(scores))
        adv = adv.unsqueeze(-1) * _kept(mask, accepted_mask)
    return adv, adv


def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    gamma: float,
    accepted_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025): discounted return-to-go per token, whitened over the batch.

        G_t = r_t + gamma * G_{t'}    over valid tokens t, t' the next valid token after t
        A_t = whiten(G) over valid tokens, 0 on masked positions
    Masked positions inside a response (a tool's observation tokens in a multi-turn rollout) are skipped:
    the return carries through them undiscounted and unchanged, as GAE carries its advantage (verl fixed
    the same restart as a bug). Returns (advantages, returns=G), (B, T).
    `accepted_mask`: as GAE (whitened over the accepted tokens; the return runs over the trajectory).
    """
    mask = response_mask.to(token_level_rewards.dtype)
    with torch.no_grad():
        returns = torch.zeros_like(token_level_rewards)
        running = torch.zeros_like(token_level_rewards[:, 0])
        for t in reversed(range(token_level_rewards.shape[-1])):
            m = mask[:, t]
            running = m * (token_level_rewards[:, t] + gamma * running) + (1 - m) * running
            returns[:, t] = running
        returns = returns * mask
        keep = _kept(mask, accepted_mask)
        advantages = masked_whiten(returns, keep) * keep
    return advantages, returns


def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    group_index: Tensor | Sequence[Any],
    accepted_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with a group baseline (Hu 2025, verl's reinforce_plus_plus_baseline).

        s_i = sum_t r_{i,t};  b_i = s_i - mean_g(s)     (a group of one has mean 0: b_i = s_i)
        A   = whiten(b broadcast over the valid tokens) over all valid tokens of the batch
    Returns (advantages, returns), both A, (B, T). `accepted_mask`: the group means use every response,
    the whitening the accepted tokens only (as verl).
    """
    mask = response_mask.to(token_level_rewards.dtype)
    with torch.no_grad():
        scores, ids, counts = _group_scores(token_level_rewards, mask, group_index)
        mean = torch.zeros_like(counts).index_add_(0, ids, scores) / counts
        mean = torch.where(counts > 1, mean, torch.zeros_like(mean))
        keep = _kept(mask, accepted_mask)
        centred = (scores - mean[ids]).unsqueeze(-1) * keep
        adv = masked_whiten(centred, keep) * keep
    return adv, adv


def compute_grpo_passk_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    group_index: Tensor | Sequence[Any],
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    accepted_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Pass@k GRPO (verl's grpo_passk, after Chen et al. 2025 "Pass@k training"): only the best response of
    each group learns, by how much it beats the runner-up.

        A_best = (s_max - s_second) / (std_g(s) + epsilon)   (no division without norm_adv_by_std_in_grpo)
        A_i    = 0 for every other response, and for a group of one
    Ties for the best go to the first response. Returns (advantages, returns), (B, T).
    """
    mask = response_mask.to(token_level_rewards.dtype)
    with torch.no_grad():
        scores, ids, counts = _group_scores(token_level_rewards, mask, group_index)
        adv = torch.zeros_like(scores)
        for g in range(counts.shape[0]):
            rows = torch.nonzero(ids == g).squeeze(-1)
            if rows.numel() < 2:
                continue
            top, where = torch.topk(scores[rows], 2)
            gain = top[0] - top[1]
            if norm_adv_by_std_in_grpo and gain > 0:  # a tie is 0, never 0 / 0
                gain = gain / (scores[rows].std() + epsilon)
            adv[rows[where[0]]] = gain
        adv = adv.unsqueeze(-1) * _kept(mask, accepted_mask)
    return adv, adv


def compute_gpg_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    group_index: Tensor | Sequence[Any],
    accepted_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """GPG (Chu et al. 2025, "GPG: a simple and strong RL baseline"): group-mean baseline, no std, scaled up
    by the share of responses that carry a non-zero score.

        alpha = B / max(#{i : s_i != 0}, 1);   A_i = alpha * (s_i - mean_g(s))   (a group of one: mean 0)
    Returns (advantages, returns), (B, T).
    """
    mask = response_mask.to(token_level_rewards.dtype)
    with torch.no_grad():
        scores, ids, counts = _group_scores(token_level_rewards, mask, group_index)
        mean = torch.zeros_like(counts).index_add_(0, ids, scores) / counts
        mean = torch.where(counts > 1, mean, torch.zeros_like(mean))
        alpha = scores.shape[0] / max(int(torch.count_nonzero(scores)), 1)
        adv = (alpha * (scores - mean[ids])).unsqueeze(-1) * _kept(mask, accepted_mask)
    return adv, adv


@dataclass(frozen=True)
class AdvantageInputs:
    """Everything an estimator may read; each estimator says which of the optional parts it needs."""

    token_level_rewards: Tensor
    response_mask: Tensor
    values: Tensor | None = None
    group_index: Tensor | Sequence[Any] | None = None
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    epsilon: float = 1e-6
    accepted_mask: Tensor | None = None


AdvantageFn = Callable[[AdvantageInputs], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator: its function and the optional inputs (`values`, `group_index`) it needs."""

    fn: AdvantageFn
    needs: tuple[str, ...]


ADV_ESTIMATOR_REGISTRY: dict[str, AdvantageEstimator] = {}


def register_adv_estimator(name: str, needs: tuple[str, ...] = ()) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register `fn(AdvantageInputs) -> (advantages, returns)` under `algorithm.adv_estimator = name`."""

    def wrap(fn: AdvantageFn) -> AdvantageFn:
        ADV_ESTIMATOR_REGISTRY[name] = AdvantageEstimator(fn, needs)
        return fn

    return wrap


@register_adv_estimator("gae", needs=("values",))
def _gae(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    assert x.values is not None
    return compute_gae_advantage_return(
        x.token_level_rewards, x.values, x.response_mask, x.gamma, x.lam, x.accepted_mask
    )


@register_adv_estimator("grpo", needs=("group_index",))
def _grpo(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    assert x.group_index is not None
    return compute_grpo_outcome_advantage(
        x.token_level_rewards,
        x.response_mask,
        x.group_index,
        x.norm_adv_by_std_in_grpo,
        x.epsilon,
        x.accepted_mask,
    )


@register_adv_estimator("rloo", needs=("group_index",))
def _rloo(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    assert x.group_index is not None
    return compute_rloo_outcome_advantage(
        x.token_level_rewards, x.response_mask, x.group_index, x.accepted_mask
    )


@register_adv_estimator("reinforce_plus_plus")
def _reinforce_pp(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    return compute_reinforce_plus_plus_outcome_advantage(
        x.token_level_rewards, x.response_mask, x.gamma, x.accepted_mask
    )


@register_adv_estimator("reinforce_plus_plus_baseline", needs=("group_index",))
def _reinforce_pp_baseline(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    assert x.group_index is not None
    return compute_reinforce_plus_plus_baseline_outcome_advantage(
        x.token_level_rewards, x.response_mask, x.group_index, x.accepted_mask
    )


@register_adv_estimator("grpo_passk", needs=("group_index",))
def _grpo_passk(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    assert x.group_index is not None
    return compute_grpo_passk_outcome_advantage(
        x.token_level_rewards,
        x.response_mask,
        x.group_index,
        x.norm_adv_by_std_in_grpo,
        x.epsilon,
        x.accepted_mask,
    )


@register_adv_estimator("gpg", needs=("group_index",))
def _gpg(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    assert x.group_index is not None
    return compute_gpg_outcome_advantage(
        x.token_level_rewards, x.response_mask, x.group_index, x.accepted_mask
    )


_NEEDS_HELP = {
    "values": "the critic's values (enable critic.enable)",
    "group_index": "group_index (the prompt of each response)",
}


def compute_advantage(
    estimator: str,
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    values: Tensor | None = None,
    group_index: Tensor | Sequence[Any] | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    accepted_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The estimator registered as `algorithm.adv_estimator` (ADV_ESTIMATOR_REGISTRY).

    gae needs `values` (the critic); the group estimators need `group_index` (the prompt of each response).
    `accepted_mask` (rejection sampling, `RolloutCorrectionResult.accepted`): rejected tokens get advantage
    0 and leave the whitening statistics; outcome scores and return recursions still see the whole response.
    Returns (advantages, returns), each (B, T).
    """
    entry = ADV_ESTIMATOR_REGISTRY.get(estimator)
    if entry is None:
        raise ValueError(
            f"unknown algorithm.adv_estimator {estimator!r}; choose one of {', '.join(ADV_ESTIMATORS)}"
        )
    inputs = AdvantageInputs(
        token_level_rewards,
        response_mask,
        values,
        group_index,
        gamma,
        lam,
        norm_adv_by_std_in_grpo,
        epsilon,
        accepted_mask,
    )
    for need in entry.needs:
        if getattr(inputs, need) is None:
            raise ValueError(f"algorithm.adv_estimator={estimator} needs {_NEEDS_HELP[need]}")
    return entry.fn(inputs)
