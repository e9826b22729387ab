"""The pure math of PPO/GRPO and their variants: advantage estimators and policy losses (each a registry of
name -> function, so `algorithm.adv_estimator` and `actor.policy_loss.loss_mode` pick one by name), KL
penalties and controllers, value loss, DAPO's overlong penalty and group filter, rollout correction.

Every function here is a small torch function on (batch, response_length) tensors with no state beyond its
arguments (the KL controllers hold one float), so that the Megatron engine and the controller share one
tested definition. Shapes: `B` responses, `T` response tokens; `response_mask` is 1 on generated tokens and
0 on padding. Formulas follow the common PPO/GRPO implementations (verl, TRL, OpenRLHF) and are given in
each docstring.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlconf.config import AdvEstimator, KLControl, PolicyLossConfig, PolicyLossMode

ADV_ESTIMATORS: tuple[str, ...] = AdvEstimator.__args__
POLICY_LOSS_MODES: tuple[str, ...] = PolicyLossMode.__args__
KL_KINDS: tuple[str, ...] = ("kl", "abs", "mse", "low_var_kl")
LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


# ------------------------------------------------------------------------------------------ helpers
def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(values * mask) over `dim` (all elements when None)."""
    prod = values * mask
    return prod.sum() if dim is None else prod.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(values * mask) / sum(mask) over `dim` (all elements when None); 0 where the mask is empty."""
    denom = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / denom.clamp_min(1e-8)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the masked elements: sum(mask * (v - mean)^2) / (n - 1) (unbiased) or / n.

    With n <= 1 valid element the unbiased variance is undefined and 0 is returned.
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        var = torch.where(n > 1, var * n / (n - 1).clamp_min(1e-8), torch.zeros_like(var))
    return var


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """(values - mean) / sqrt(var + 1e-8) with mean and unbiased var over the masked elements.

    With shift_mean false the mean is added back (only the scale changes). Positions outside the mask are
    transformed by the same formula; callers mask them.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: H = logsumexp(z) - sum(softmax(z) * z)."""
    pd = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (pd * logits).sum(-1)


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """log softmax(logits)[..., label]: the log-probability of each label, shape of `labels`."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def outcome_to_token_level(scores: Tensor, response_mask: Tensor) -> Tensor:
    """Place one scalar reward per response on its last valid token (zeros elsewhere), shape (B, T).

    This is how rule-based rewards enter token-level estimators (GAE, REINFORCE++) and the KL penalty.
    """
    mask = response_mask.to(scores.dtype if scores.is_floating_point() else torch.float32)
    out = torch.zeros_like(mask)
    lengths = response_mask.long().sum(-1)
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    # Index of the last 1 in each row (works for interior zeros too).
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(response_mask.bool(), positions, torch.full_like(positions, -1)).max(-1).values
    out[rows, last[rows]] = scores.to(out.dtype)[rows]
    return out


def _group_ids(group_index: Tensor | Sequence[Any], n: int, device: torch.device) -> Tensor:
    """Dense int ids 0..G-1 for any 1-D int tensor or sequence of hashables (e.g. uid strings)."""
    if isinstance(group_index, Tensor):
        if group_index.dim() != 1:
            raise ValueError(f"group_index must be 1-D, got shape {tuple(group_index.shape)}")
        keys = group_index.tolist()
    else:
        keys = list(group_index)
    if len(keys) != n:
        raise ValueError(f"group_index has {len(keys)} entries for {n} responses")
    dense: dict[Any, int] = {}
    return torch.tensor([dense.setdefault(k, len(dense)) for k in keys], dtype=torch.long, device=device)


# --------------------------------------------------------------------------------------- advantages
def _kept(mask: Tensor, accepted_mask: Tensor | None) -> Tensor:
    """The tokens that stay in the loss: `mask` without those rejection sampling removed (`accepted_mask`,
    algorithm.rollout_correction.rollout_rs); all of `mask` when None."""
    return mask if accepted_mask is None else mask * accepted_mask.to(mask.dtype)


def _group_scores(
    token_level_rewards: Tensor, mask: Tensor, group_index: Tensor | Sequence[Any]
) -> tuple[Tensor, Tensor, Tensor]:
    """Outcome score per response (sum of its token rewards), its group id, and each group's size."""
    scores = (token_level_rewards * mask).sum(-1)
    ids = _group_ids(group_index, scores.shape[0], scores.device)
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


# ----------------------------------------------------------------------------------------------- KL
def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from log-probs of the sampled tokens (Schulman's k1/k2/k3).

    kl:          log_prob - ref_log_prob                                   (k1, unbiased)
    abs:         |log_prob - ref_log_prob|
    mse:         0.5 * (log_prob - ref_log_prob)^2                          (k2)
    low_var_kl:  exp(d) - d - 1 with d = ref_log_prob - log_prob            (k3, unbiased, >= 0)
                 d clamped to [-20, 20] against overflow, the result to [-10, 10]
    """
    diff = log_prob - ref_log_prob
    if kind == "kl":
        return diff
    if kind == "abs":
        return diff.abs()
    if kind == "mse":
        return 0.5 * diff.square()
    if kind == "low_var_kl":
        d = torch.clamp(-diff, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(d) - d - 1, min=-10.0, max=10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; choose one of {', '.join(KL_KINDS)}")


def apply_kl_penalty(
    token_level_scores: Tensor,
    log_prob: Tensor,
    ref_log_prob: Tensor,
    response_mask: Tensor,
    kl_coef: float,
    kind: str,
) -> tuple[Tensor, float]:
    """KL-in-reward: r_t = score_t - kl_coef * kl_t on valid tokens (kl_t from `kl_penalty`, 0 on padding).

    Returns (token_level_rewards, mean_kl) where mean_kl is the batch mean of each response's token-mean KL,
    the quantity an adaptive controller steers.
    """
    mask = response_mask.to(log_prob.dtype)
    kld = kl_penalty(log_prob, ref_log_prob, kind) * mask
    rewards = token_level_scores - kl_coef * kld
    per_seq = masked_mean(kld, mask, dim=-1)
    return rewards, float(per_seq.mean()) if per_seq.numel() else 0.0


class FixedKLController:
    """Constant KL coefficient (`algorithm.kl_ctrl.type = fixed`)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict[str, Any]:
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Checks the type only: a fixed coefficient is configuration, so the config's value wins on resume."""
        if state["type"] != "fixed":
            raise ValueError(f"cannot load a {state['type']!r} KL controller state into a fixed controller")


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019), steering the measured KL towards `target_kl`.

    e = clip(current_kl / target_kl - 1, -0.2, 0.2)
    beta <- beta * (1 + e * n_steps / horizon)
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError("adaptive KL control needs target_kl > 0 and horizon > 0")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"type": "adaptive", "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the adapted coefficient (target and horizon come from the config)."""
        if state["type"] != "adaptive":
            raise ValueError(
                f"cannot load a {state['type']!r} KL controller state into an adaptive controller"
            )
        self.value = float(state["value"])


def build_kl_controller(cfg: KLControl) -> FixedKLController | AdaptiveKLController:
    """The controller described by `algorithm.kl_ctrl`."""
    if cfg.type == "fixed":
        return FixedKLController(cfg.kl_coef)
    if cfg.type == "adaptive":
        return AdaptiveKLController(cfg.kl_coef, cfg.target_kl, cfg.horizon)
    raise ValueError(f"unknown algorithm.kl_ctrl.type {cfg.type!r}; choose fixed or adaptive")


# ------------------------------------------------------------------------------------------- losses
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
    options of `actor.policy_loss`."""

    old_log_prob: Tensor
    log_prob: Tensor
    advantages: Tensor
    mask: Tensor
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    options: PolicyLossConfig


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
    options: PolicyLossConfig | None = None,
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
        options if options is not None else PolicyLossConfig(),
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


# ------------------------------------------------------------------------------- DAPO: rewards, groups
def overlong_penalty(
    response_lengths: Tensor, max_response_length: int, buffer_len: int, penalty_factor: float
) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025) per response of L tokens:

        penalty = min(0, (L_max - L_buffer - L) / L_buffer) * penalty_factor
    0 up to L_max - L_buffer tokens, then falling linearly to -penalty_factor at L_max."""
    lengths = response_lengths.to(torch.float32)
    return torch.clamp((max_response_length - buffer_len - lengths) / buffer_len, max=0.0) * penalty_factor


def groups_with_spread(metric: Tensor, group_index: Tensor | Sequence[Any]) -> Tensor:
    """DAPO dynamic sampling: a bool per response, true where its prompt group's `metric` is not constant
    (those groups carry a learning signal; all-correct or all-wrong groups have advantage 0). A group of one
    response is kept, as in verl."""
    ids = _group_ids(group_index, metric.shape[0], metric.device)
    n = int(ids.max()) + 1 if ids.numel() else 0
    lo = torch.full((n,), math.inf, dtype=metric.dtype, device=metric.device).scatter_reduce(
        0, ids, metric, "amin"
    )
    hi = torch.full((n,), -math.inf, dtype=metric.dtype, device=metric.device).scatter_reduce(
        0, ids, metric, "amax"
    )
    counts = torch.zeros(n, dtype=torch.long, device=metric.device).index_add_(0, ids, torch.ones_like(ids))
    return ((hi > lo) | (counts == 1))[ids]


# Row-aligned keys of the rollout layout (rltrain.rollout.batch): [B, P + N] sequences split into a
# left-padded prompt and a right-padded response, and [B, N] response tensors.
_SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids")


def concat_batches(batches: Sequence[dict[str, Tensor]], pad_token_id: int) -> dict[str, Tensor]:
    """Concatenate rollout batches row-wise whatever their prompt (P) and response (N) widths: prompts are
    left-padded to the widest P, responses right-padded to the widest N (pad_token_id in ids, 0 in masks
    and log-probs), position_ids recomputed from the attention mask as the rollout builds them. A
    `group_index` is offset per batch so that groups of different batches stay distinct. Other keys are
    concatenated along rows (1-D) or right-padded with 0 (2-D, [B, N])."""
    if not batches:
        raise ValueError("concat_batches needs at least one batch")
    resp_width = max(b["responses"].shape[1] for b in batches)
    prompt_width = max(b["input_ids"].shape[1] - b["responses"].shape[1] for b in batches)
    out: dict[str, list[Tensor]] = {k: [] for k in batches[0]}
    offset = 0
    for b in batches:
        n = b["responses"].shape[1]
        p = b["input_ids"].shape[1] - n
        for key, value in b.items():
            if key == "position_ids":
                continue
            if key == "group_index":
                out[key].append(value + offset)
            elif key in _SEQUENCE_KEYS or (value.dim() > 2 and value.shape[1] == p + n):
                # Token-aligned keys; [B, P + N, ...] ones (the recorded expert routing) pad with -1.
                pad = pad_token_id if key == "input_ids" else 0 if key in _SEQUENCE_KEYS else -1
                trailing = [0, 0] * (value.dim() - 2)
                prompt = torch.nn.functional.pad(value[:, :p], (*trailing, prompt_width - p, 0), value=pad)
                resp = torch.nn.functional.pad(value[:, p:], (*trailing, 0, resp_width - n), value=pad)
                out[key].append(torch.cat([prompt, resp], 1))
            elif value.dim() == 2:
                pad = pad_token_id if key == "responses" else 0
                out[key].append(torch.nn.functional.pad(value, (0, resp_width - value.shape[1]), value=pad))
            else:
                out[key].append(value)
        if "group_index" in b and b["group_index"].numel():
            offset += int(b["group_index"].max()) + 1
    merged = {k: torch.cat(v, 0) for k, v in out.items() if v}
    if "position_ids" in batches[0]:
        merged["position_ids"] = (merged["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return merged


def select_rows(batch: dict[str, Tensor], rows: Tensor | slice) -> dict[str, Tensor]:
    """The rows `rows` (bool mask, indices or a slice) of every tensor of a row-aligned batch."""
    return {k: v[rows] for k, v in batch.items()}


# ------------------------------------------------------------------------------------ rollout correction
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
