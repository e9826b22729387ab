"""The divergence guard's bookkeeping (rltrain/guard.py): which quantity is named, what counts as a bad
step (token positions only), and the count of bad steps in a row toward trainer.max_bad_steps."""

from __future__ import annotations

import math

import torch

from rltrain.guard import DIVERGED_EXIT, DivergenceGuard, bad_update, first_bad


def test_first_bad_names_the_first_non_finite_quantity_on_tokens_only():
    mask = torch.tensor([[1, 1, 0]])
    padded = torch.tensor([[0.1, 0.2, float("nan")]])  # NaN on a padding position: not a token
    assert first_bad([("rewards", torch.tensor([1.0]), None), ("old_log_probs", padded, mask)]) is None
    inf_token = torch.tensor([[0.1, float("-inf"), 0.0]])
    nan_reward = torch.tensor([float("nan")])
    assert first_bad([("rewards", torch.tensor([1.0]), None), ("ref_log_probs", inf_token, mask),
                      ("advantages", inf_token, mask)]) == "ref_log_probs"  # fmt: skip
    assert first_bad([("rewards", nan_reward, None), ("ref_log_probs", inf_token, mask)]) == "rewards"
    assert first_bad([("critic/values", None, mask)]) is None  # a quantity this step does not have


def test_bad_update_reads_the_loss_grad_norm_and_skipped_steps():
    ok = {"actor/loss": 0.1, "actor/grad_norm": 1.0, "actor/skipped_updates": 0.0}
    assert bad_update(ok) is None
    assert bad_update({**ok, "actor/loss": float("nan"), "actor/grad_norm": math.inf}) == "actor/loss"
    assert bad_update({**ok, "actor/grad_norm": math.inf}) == "actor/grad_norm"
    assert bad_update({**ok, "critic/vf_loss": math.nan}) == "critic/vf_loss"  # the critic updates first
    # One mini-batch of several skipped: the mean norm may still be finite; the skip names the norm.
    assert bad_update({**ok, "actor/skipped_updates": 1.0}) == "actor/grad_norm"


def test_bad_steps_in_a_row_stop_the_run_and_a_finite_step_resets_the_count():
    guard = DivergenceGuard(max_bad_steps=3)
    assert guard.record(1, None) == {"guard/bad_step": 0}
    assert guard.record(2, "advantages")["guard/bad_steps_in_a_row"] == 1
    assert guard.record(3, "actor/grad_norm")["guard/bad_steps_in_a_row"] == 2
    assert not guard.diverged
    guard.record(4, None)  # recovered: the count starts again
    assert guard.in_a_row == 0
    for step, cause in ((5, "rollout/log_probs"), (6, "actor/loss"), (7, "advantages")):
        metrics = guard.record(step, cause)
    assert metrics == {"guard/bad_step": 1, "guard/cause": "advantages", "guard/bad_steps_in_a_row": 3}
    assert guard.diverged
    line = str(guard.error(7, 4))
    assert "\n" not in line
    assert line.startswith(
        "diverged: rollout/log_probs is not finite at step 5 (3 bad steps in a row up to step 7"
    )
    assert "global_step_4" in line and "trainer.max_bad_steps = 3" in line
    assert "no checkpoint was written" in str(guard.error(7, None))
    assert DIVERGED_EXIT not in (0, 1, 2, 130, 143)
