"""The step's algorithm pieces (rltrain.algorithms.step: rollout correction, KL-in-reward, advantages) driven
by the plan's AlgorithmPlan, against the numbers the controller's own code gave before the algorithm layer
took them over (recorded from that code on this fixed synthetic batch), and the plan's resolution of the
actor's "None means clip_ratio" clip bounds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlconf.config import ActorConfig, AlgorithmConfig, KLControl, RLConfig, RolloutCorrection
from rlconf.plan.algorithm import algorithm_plan
from rlconf.plan.types import StepPasses
from rltrain.algorithms import (
    StepBatch,
    apply_rollout_correction,
    build_kl_controller,
    rewards_and_advantages,
)

B, T = 6, 5
MASK = torch.tensor(
    [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
)
SCORES = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.25])
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1])


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    old = -torch.rand(B, T, generator=g) - 0.1
    ref = old + 0.2 * torch.randn(B, T, generator=g)
    rollout = old + 0.5 * torch.randn(B, T, generator=g)
    values = torch.randn(B, T, generator=g)
    return {"old": old, "ref": ref, "rollout": rollout, "values": values}


def _plan(estimator: str, use_kl: bool):
    algorithm = AlgorithmConfig(
        adv_estimator=estimator,
        gamma=0.9,
        lam=0.95,
        use_kl_in_reward=use_kl,
        kl_penalty="low_var_kl",
        kl_ctrl=KLControl(type="adaptive", kl_coef=0.05, target_kl=0.01, horizon=100),
        rollout_correction=RolloutCorrection(rollout_is_threshold=2.0, rollout_rs_threshold=1.5),
    )
    return algorithm_plan(RLConfig(algorithm=algorithm))


def _passes(rs: str | None) -> StepPasses:
    return StepPasses(actor_on_policy=False, old_log_prob="recompute", ref_log_prob=True, fused=False,
                      reason="test", rollout_is="token" if rs else None, rollout_rs=rs)  # fmt: skip


# Recorded from the controller's code before the move (rltrain/controller.py at 1990ed2).
RECORDED = {
    "grpo": (
        0.050600000000000006,
        [
            [0.996562123298645, 0.996562123298645, 0.996562123298645, 0.0, 0.0],
            [
                -1.0033986568450928,
                -1.0033986568450928,
                -1.0033986568450928,
                -1.0033986568450928,
                -1.0033986568450928,
            ],
            [0.006836623419076204, 0.0, 0.0, 0.0, 0.0],
            [1.1213536262512207, 1.1213536262512207, 1.1213536262512207, 1.1213536262512207, 0.0],
            [-0.7992575168609619, -0.7992575168609619, -0.0, -0.0, -0.0],
            [
                -0.3220960199832916,
                -0.3220960199832916,
                -0.3220960199832916,
                -0.3220960199832916,
                -0.3220960199832916,
            ],
        ],
        [
            [0.996562123298645, 0.996562123298645, 0.996562123298645, 0.0, 0.0],
            [
                -1.0033986568450928,
                -1.0033986568450928,
                -1.0033986568450928,
                -1.0033986568450928,
                -1.0033986568450928,
            ],
            [0.006836623419076204, 0.0, 0.0, 0.0, 0.0],
            [1.1213536262512207, 1.1213536262512207, 1.1213536262512207, 1.1213536262512207, 0.0],
            [-0.7992575168609619, -0.7992575168609619, -0.0, -0.0, -0.0],
            [
                -0.3220960199832916,
                -0.3220960199832916,
                -0.3220960199832916,
                -0.3220960199832916,
                -0.3220960199832916,
            ],
        ],
    ),
    "gae": (
        0.050600000000000006,
        [
            [-0.2479122281074524, 0.0, -0.7567209005355835, -0.0, -0.0],
            [0.16383998095989227, -0.9472764730453491, -0.39565834403038025, -0.0, -0.0],
            [-0.0, -0.0, -0.0, -0.0, -0.0],
            [2.381608009338379, -0.0412122942507267, -0.7009009718894958, 0.9692813158035278, -0.0],
            [0.0, -0.4250483214855194, -0.0, -0.0, -0.0],
            [-0.0, 0.0, -0.0, -0.0, -0.0],
        ],
        [
            [0.7623453140258789, 0.9144548177719116, 0.999993085861206, 0.0, 0.0],
            [
                0.09473472833633423,
                0.08810341358184814,
                0.09717202186584473,
                0.022447943687438965,
                -0.002175450325012207,
            ],
            [0.4982077479362488, -0.0, -0.0, -0.0, -0.0],
            [0.688628077507019, 0.777722954750061, 0.8520709872245789, 0.9999821782112122, 0.0],
            [0.0018273591995239258, -0.0006764419376850128, 0.0, -0.0, 0.0],
            [
                0.2157379686832428,
                0.26962363719940186,
                0.2739088535308838,
                0.24076569080352783,
                0.24997949600219727,
            ],
        ],
    ),
    "rloo": (
        0.05,
        [
            [0.75, 0.75, 0.75, 0.0, 0.0],
            [-0.0, -0.0, -0.0, -0.0, -0.0],
            [0.0, 0.0, 0.0, 0.0, 0.0],
            [0.875, 0.875, 0.875, 0.875, 0.0],
            [-0.0, -0.0, -0.0, -0.0, -0.0],
            [-0.0, -0.0, -0.0, -0.0, -0.0],
        ],
        [
            [0.75, 0.75, 0.75, 0.0, 0.0],
            [-0.0, -0.0, -0.0, -0.0, -0.0],
            [0.0, 0.0, 0.0, 0.0, 0.0],
            [0.875, 0.875, 0.875, 0.875, 0.0],
            [-0.0, -0.0, -0.0, -0.0, -0.0],
            [-0.0, -0.0, -0.0, -0.0, -0.0],
        ],
    ),
}


@pytest.mark.parametrize(("estimator", "use_kl", "rs"), [("grpo", True, None), ("gae", True, "token"),
                                                         ("rloo", False, "sequence")])  # fmt: skip
def test_step_algorithm_matches_the_recorded_numbers(estimator: str, use_kl: bool, rs: str | None) -> None:
    t = _tensors()
    plan = _plan(estimator, use_kl)
    batch = StepBatch(inputs={"response_mask": MASK}, scores=SCORES, group_index=GROUPS,
                      rollout_log_probs=t["rollout"], old_log_probs=t["old"], ref_log_probs=t["ref"],
                      values=t["values"])  # fmt: skip
    corr = apply_rollout_correction(batch, _passes(rs), plan)
    assert bool(corr) == (rs is not None)
    ctrl = build_kl_controller(plan.kl_reward)
    metrics = rewards_and_advantages(batch, plan, ctrl)
    coef, advantages, returns = RECORDED[estimator]
    assert ctrl.value == pytest.approx(coef, abs=1e-12)
    torch.testing.assert_close(batch.advantages, torch.tensor(advantages), rtol=0, atol=1e-6)
    torch.testing.assert_close(batch.returns, torch.tensor(returns), rtol=0, atol=1e-6)
    if use_kl:
        assert metrics["actor/reward_kl"] == pytest.approx(0.021199382841587067, abs=1e-7)
        assert metrics["actor/kl_coef"] == 0.05
    else:
        assert metrics == {}
    # The update's loss mask: the accepted tokens (rejection sampling), the generated ones otherwise.
    sent = batch.worker_batch("old_log_probs", "advantages", "ref_log_probs", "rollout_is_weights")
    expected_mask = MASK if batch.accepted_mask is None else batch.accepted_mask
    torch.testing.assert_close(sent["response_mask"], expected_mask)
    assert ("rollout_is_weights" in sent) == (rs is not None)
    assert "rollout_log_probs" not in sent and "values" not in sent


def test_rollout_correction_metrics_match_the_recorded_numbers() -> None:
    t = _tensors()
    batch = StepBatch(inputs={"response_mask": MASK}, scores=SCORES, group_index=GROUPS,
                      rollout_log_probs=t["rollout"], old_log_probs=t["old"])  # fmt: skip
    metrics = apply_rollout_correction(batch, _passes("token"), _plan("grpo", False))
    recorded = {
        "rollout_corr/is_weight_mean": 0.9231506586074829,
        "rollout_corr/is_weight_max": 1.20181405544281,
        "rollout_corr/rejected_fraction": 0.5,
        "rollout_corr/kl": 0.06474872678518295,
        "rollout_corr/logprob_abs_diff_mean": 0.36559098958969116,
    }
    assert metrics == pytest.approx(recorded, abs=1e-7)


def test_worker_batch_names_only_worker_quantities() -> None:
    batch = StepBatch(inputs={"response_mask": MASK}, scores=SCORES, group_index=GROUPS)
    with pytest.raises(KeyError, match="scores"):
        batch.worker_batch("scores")
    assert batch.worker_batch() == {"response_mask": MASK}


clip = st.one_of(st.none(), st.floats(min_value=0.0, max_value=10.0, allow_nan=False))


@given(clip_ratio=st.floats(min_value=0.0, max_value=10.0, allow_nan=False), low=clip, high=clip)
def test_loss_plan_resolves_clip_bounds(clip_ratio: float, low: float | None, high: float | None) -> None:
    actor = ActorConfig(clip_ratio=clip_ratio, clip_ratio_low=low, clip_ratio_high=high)
    loss = algorithm_plan(RLConfig(actor=actor)).loss
    assert loss.clip_ratio_low == (clip_ratio if low is None else low)
    assert loss.clip_ratio_high == (clip_ratio if high is None else high)
    assert loss.clip_ratio_c == actor.clip_ratio_c
