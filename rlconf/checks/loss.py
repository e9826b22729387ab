"""Rules of the loss options: policy-loss modes, filter groups, the overlong buffer and rollout correction.

Each rule registers itself in rlconf.rules with `@rule(name, fields...)` when this module is imported
(rlconf.validate imports every check module, in the order the docs list the rules).
"""

from __future__ import annotations

from collections.abc import Iterator

from rlconf.config import (
    RLConfig,
)
from rlconf.errors import Issue, error, warning
from rlconf.rules import rule


@rule("policy-loss", "actor.policy_loss.*", "actor.loss_agg_mode")
def policy_loss_options(c: RLConfig) -> Iterator[Issue]:
    """The options of actor.policy_loss are in range: ratios in (0, 1], clip_cov_lb < clip_cov_ub,
    ppo_kl_coef >= 0, SAPO temperatures > 0. GSPO and SAPO aggregate their policy term seq-mean-token-mean
    (their papers' objectives, as verl): another actor.loss_agg_mode is a warning (it still aggregates the
    entropy and KL terms)."""
    pl = c.actor.policy_loss
    if pl.loss_mode in ("gspo", "sapo") and c.actor.loss_agg_mode != "seq-mean-token-mean":
        yield warning("actor.loss_agg_mode", f"{pl.loss_mode} aggregates its policy loss seq-mean-token-mean "
                      f"(its paper's objective, as verl); {c.actor.loss_agg_mode} applies to the entropy and "
                      "KL terms only", "set actor.loss_agg_mode: seq-mean-token-mean", "policy-loss")  # fmt: skip
    for name in ("clip_cov_ratio", "kl_cov_ratio"):
        v = getattr(pl, name)
        if not 0 < v <= 1:
            yield error(f"actor.policy_loss.{name}", f"a fraction of tokens must be in (0, 1], got {v}",
                        "use e.g. 0.0002 (the paper's value)", "policy-loss")  # fmt: skip
    if pl.clip_cov_lb >= pl.clip_cov_ub:
        yield error("actor.policy_loss.clip_cov_lb",
                    f"the covariance band ({pl.clip_cov_lb}, {pl.clip_cov_ub}) is empty",
                    "set clip_cov_lb < clip_cov_ub (the paper uses 1 and 5)", "policy-loss")  # fmt: skip
    if pl.ppo_kl_coef < 0:
        yield error("actor.policy_loss.ppo_kl_coef", f"must be >= 0, got {pl.ppo_kl_coef}", "use e.g. 0.1",
                    "policy-loss")  # fmt: skip
    for name in ("tau_pos", "tau_neg"):
        if getattr(pl, name) <= 0:
            yield error(f"actor.policy_loss.{name}", f"a gate temperature must be > 0, got {getattr(pl, name)}",
                        "use the SAPO paper's tau_pos 1.0, tau_neg 1.05", "policy-loss")  # fmt: skip


@rule("filter-groups", "algorithm.filter_groups.*", "rollout.n")
def filter_groups(c: RLConfig) -> Iterator[Issue]:
    """DAPO dynamic sampling: max_num_gen_batches >= 0, and groups of >= 2 responses to compare."""
    fg = c.algorithm.filter_groups
    if fg.max_num_gen_batches < 0:
        yield error("algorithm.filter_groups.max_num_gen_batches", f"must be >= 0, got {fg.max_num_gen_batches}",
                    "use 0 for no bound, or e.g. 10", "filter-groups")  # fmt: skip
    if fg.enable and c.rollout.n < 2:
        yield warning("algorithm.filter_groups.enable",
                      "with rollout.n = 1 every group has one response and is kept: the filter does nothing",
                      "set rollout.n >= 2, or algorithm.filter_groups.enable: false", "filter-groups")  # fmt: skip


@rule("overlong-buffer", "reward.overlong_buffer.*", "rollout.max_response_length")
def overlong_buffer(c: RLConfig) -> Iterator[Issue]:
    """The overlong buffer fits in the response length and its penalty factor is >= 0."""
    ob = c.reward.overlong_buffer
    if ob.enable and not 0 < ob.len <= c.rollout.max_response_length:
        yield error("reward.overlong_buffer.len",
                    f"the buffer must be 1..rollout.max_response_length = {c.rollout.max_response_length} tokens, "
                    f"got {ob.len}",
                    f"set reward.overlong_buffer.len to e.g. {max(c.rollout.max_response_length // 4, 1)} "
                    "(DAPO: 4096 of 20480)", "overlong-buffer")  # fmt: skip
    if ob.penalty_factor < 0:
        yield error("reward.overlong_buffer.penalty_factor", f"must be >= 0, got {ob.penalty_factor}",
                    "use 1.0 (DAPO)", "overlong-buffer")  # fmt: skip


@rule("rollout-correction", "algorithm.rollout_correction.*")
def rollout_correction(c: RLConfig) -> Iterator[Issue]:
    """Truncation and rejection thresholds of rollout correction are > 1."""
    rc = c.algorithm.rollout_correction
    for name in ("rollout_is_threshold", "rollout_rs_threshold"):
        v = getattr(rc, name)
        if v <= 1:
            yield error(f"algorithm.rollout_correction.{name}", f"a ratio bound must be > 1, got {v}",
                        "use e.g. 2.0", "rollout-correction")  # fmt: skip
