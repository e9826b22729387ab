"""Leaf names of the algorithm vocabulary: the advantage estimators, policy-loss modes, KL estimators and
loss aggregations the config may name. The plan carries them verbatim and rltrain's algorithm layer
registers exactly these, so they live here, outside the config sections; rlconf.config re-exports them."""

from __future__ import annotations

from typing import Literal

AdvEstimator = Literal[
    "gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "grpo_passk", "gpg"
]
PolicyLossMode = Literal["vanilla", "gspo", "gpg", "clip-cov", "kl-cov", "cispo", "sapo"]
KLKind = Literal["kl", "abs", "mse", "low_var_kl"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

ADV_ESTIMATORS: tuple[str, ...] = AdvEstimator.__args__
POLICY_LOSS_MODES: tuple[str, ...] = PolicyLossMode.__args__
KL_KINDS: tuple[str, ...] = KLKind.__args__
LOSS_AGG_MODES: tuple[str, ...] = LossAggMode.__args__

__all__ = [
    "ADV_ESTIMATORS",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "POLICY_LOSS_MODES",
    "AdvEstimator",
    "KLKind",
    "LossAggMode",
    "PolicyLossMode",
]
