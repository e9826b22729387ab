"""KL estimators (k1 / abs / k2 / k3), the KL-in-reward penalty and its coefficient controllers (fixed,
adaptive), built from the plan's `KLRewardPlan`."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlconf.plan.algorithm import KLRewardPlan
from rlconf.vocab import KL_KINDS
from rltrain.algorithms.core import masked_mean


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


def build_kl_controller(plan: KLRewardPlan) -> FixedKLController | AdaptiveKLController:
    """The controller the plan's KL-in-reward part describes (algorithm.kl_ctrl)."""
    if plan.controller == "fixed":
        return FixedKLController(plan.kl_coef)
    if plan.controller == "adaptive":
        return AdaptiveKLController(plan.kl_coef, plan.target_kl, plan.horizon)
    raise ValueError(f"unknown algorithm.kl_ctrl.type {plan.controller!r}; choose fixed or adaptive")
