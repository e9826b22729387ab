"""Advantage estimators, KL penalties/controllers and PPO losses against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlconf.config import KLControl
from rltrain.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_penalty,
    build_kl_controller,
    compute_advantage,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_policy_loss,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_value_loss,
    entropy_from_logits,
    explained_variance,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    outcome_to_token_level,
)

T = torch.tensor


def close(a: torch.Tensor, b, atol: float = 1e-5) -> None:
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=atol, rtol=0)


# --------------------------------------------------------------------------------------- helpers
def test_masked_mean_var_whiten():
    values = T([1.0, 2.0, 3.0, 100.0])
    mask = T([1.0, 1.0, 1.0, 0.0])
    # mean of 1, 2, 3 = 2; the 100 is padding.
    close(masked_mean(values, mask), 2.0)
    # squared deviations 1, 0, 1: biased 2/3, unbiased 2/2 = 1.
    close(masked_var(values, mask, unbiased=False), 2 / 3)
    close(masked_var(values, mask), 1.0)
    # (v - 2) / sqrt(1): padding goes through the same formula.
    close(masked_whiten(values, mask), [-1.0, 0.0, 1.0, 98.0])
    close(masked_whiten(values, mask, shift_mean=False), [1.0, 2.0, 3.0, 100.0])
    # Per-row mean along a dim; an all-masked row gives 0 rather than nan.
    close(masked_mean(T([[1.0, 3.0], [5.0, 7.0]]), T([[1.0, 1.0], [0.0, 0.0]]), dim=-1), [2.0, 0.0])


def test_masked_var_single_element_is_zero():
    # Bessel's correction is undefined for one element: 0, not inf/nan.
    close(masked_var(T([5.0, 1.0]), T([1.0, 0.0])), 0.0)
    close(masked_whiten(T([5.0, 1.0]), T([1.0, 0.0]))[0], 0.0)


def test_entropy_and_logprobs_from_logits():
    # Uniform over 4 -> log 4; two equal logits and one -1e9 -> log 2.
    close(entropy_from_logits(torch.zeros(4)), math.log(4))
    close(entropy_from_logits(T([0.0, 0.0, -1e9])), math.log(2))
    # log softmax([0, log 3]) = [log 1/4, log 3/4].
    logits = T([[0.0, math.log(3.0)], [0.0, math.log(3.0)]])
    close(logprobs_from_logits(logits, T([0, 1])), [math.log(0.25), math.log(0.75)])


def test_outcome_to_token_level_places_score_on_last_valid_token():
    mask = T([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    out = outcome_to_token_level(T([2.0, 3.0, 4.0]), mask)
    close(out, [[0.0, 0.0, 2.0], [3.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


# ------------------------------------------------------------------------------------ advantages
def test_gae_hand_computed():
    # gamma = lam = 0.5, rewards [1, 0, 2], values [1, 2, 3]:
    # t=2: delta = 2 + 0 - 3 = -1;            A2 = -1
    # t=1: delta = 0 + 0.5*3 - 2 = -0.5;      A1 = -0.5 + 0.25*(-1) = -0.75
    # t=0: delta = 1 + 0.5*2 - 1 = 1;         A0 = 1 + 0.25*(-0.75) = 0.8125
    # returns = A + V = [1.8125, 1.25, 2]; the 4th token is padding (reward 5, value 9 ignored).
    rewards = T([[1.0, 0.0, 2.0, 5.0]])
    values = T([[1.0, 2.0, 3.0, 9.0]])
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.5, lam=0.5)
    close(ret, [[1.8125, 1.25, 2.0, 0.0]])
    # whiten: mean = -0.3125, deviations [1.125, -0.4375, -0.6875], unbiased var = 1.9296875 / 2.
    std = math.sqrt(1.9296875 / 2)
    close(adv, [[1.125 / std, -0.4375 / std, -0.6875 / std, 0.0]])


def test_gae_gamma_lam_one_is_reward_to_go_minus_value():
    # gamma = lam = 1: A_t = sum_{k>=t} r_k - V_t. Rows: [0,0,1] - [0.5,0.5,0.5] = [0.5,0.5,0.5] and
    # [0,2,pad] - [1,0,pad] = [1,2]. Returns = rewards-to-go: [1,1,1] and [2,2].
    rewards = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = T([[0.5, 0.5, 0.5], [1.0, 0.0, 7.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=1.0)
    close(ret, [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]])
    raw = T([[0.5, 0.5, 0.5], [1.0, 2.0, 0.0]])
    close(adv, masked_whiten(raw, mask) * mask)


def test_grpo_hand_computed():
    # Scores: group 0 = [3, 1, 2] (mean 2, unbiased std 1) -> [1, -1, 0];
    # group 1 = [1, 0] (mean 0.5, std sqrt(0.5)) -> [+-0.5/0.7071]; group 2 = [4] alone -> 0.
    scores = T([3.0, 1.0, 2.0, 1.0, 0.0, 4.0])
    mask = T([[1, 1]] * 5 + [[1, 0]])
    rewards = outcome_to_token_level(scores, mask)
    group = T([0, 0, 0, 1, 1, 2])
    adv, ret = compute_grpo_outcome_advantage(rewards, mask, group, norm_adv_by_std_in_grpo=True, epsilon=0.0)
    s = 0.5 / math.sqrt(0.5)
    expected = [[1.0, 1.0], [-1.0, -1.0], [0.0, 0.0], [s, s], [-s, -s], [0.0, 0.0]]
    close(adv, expected)
    close(ret, expected)
    # Dr. GRPO: no std division -> deviations from the group mean.
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, group, norm_adv_by_std_in_grpo=False)
    close(adv, [[1.0, 1.0], [-1.0, -1.0], [0.0, 0.0], [0.5, 0.5], [-0.5, -0.5], [0.0, 0.0]])


def test_grpo_equal_scores_and_string_groups():
    # Equal scores in a group: zero deviation -> 0 (epsilon keeps 0/0 away). Group ids may be any hashables.
    mask = torch.ones(4, 1)
    rewards = T([[1.0], [1.0], [0.0], [1.0]])
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, ["a", "a", "b", "b"], True)
    s = 0.5 / (math.sqrt(0.5) + 1e-6)
    close(adv, [[0.0], [0.0], [-s], [s]])


@settings(max_examples=40, deadline=None)
@given(
    groups=st.lists(
        st.lists(st.floats(-5, 5, allow_nan=False), min_size=1, max_size=5), min_size=1, max_size=4
    ),
    norm=st.booleans(),
)
def test_grpo_advantages_sum_to_zero_per_group(groups, norm):
    scores = T([s for g in groups for s in g])
    index = T([i for i, g in enumerate(groups) for _ in g])
    mask = torch.ones(len(scores), 3)
    adv, _ = compute_grpo_outcome_advantage(outcome_to_token_level(scores, mask), mask, index, norm)
    for gid in range(len(groups)):
        assert abs(float(adv[index == gid, 0].sum())) < 1e-3


def test_rloo_hand_computed():
    # Group [3, 1, 2]: baselines (1+2)/2, (3+2)/2, (3+1)/2 = 1.5, 2.5, 2 -> [1.5, -1.5, 0]; [4] alone -> 0.
    scores = T([3.0, 1.0, 2.0, 4.0])
    mask = T([[1, 1], [1, 1], [1, 0], [1, 1]])
    adv, ret = compute_rloo_outcome_advantage(outcome_to_token_level(scores, mask), mask, [7, 7, 7, 9])
    close(adv, [[1.5, 1.5], [-1.5, -1.5], [0.0, 0.0], [0.0, 0.0]])
    close(ret, adv)


def test_reinforce_plus_plus_hand_computed():
    # gamma 0.5. Row 0 rewards [0,0,1] -> G = [0.25, 0.5, 1]; row 1 [0,2,pad] -> G = [1, 2, 0].
    # Valid G: 0.25, 0.5, 1, 1, 2 -> mean 0.95, squared deviations sum 1.8, unbiased var 0.45.
    rewards = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    close(ret, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    std = math.sqrt(0.45)
    close(adv, [[-0.7 / std, -0.45 / std, 0.05 / std], [0.05 / std, 1.05 / std, 0.0]])


def test_compute_advantage_dispatch_and_errors():
    rewards = T([[0.0, 1.0], [0.0, 0.0]])
    mask = torch.ones(2, 2)
    values = torch.zeros(2, 2)
    for est, kwargs, fn_out in [
        ("gae", {"values": values}, compute_gae_advantage_return(rewards, values, mask, 1.0, 1.0)),
        ("grpo", {"group_index": [0, 0]}, compute_grpo_outcome_advantage(rewards, mask, [0, 0], True)),
        ("rloo", {"group_index": [0, 0]}, compute_rloo_outcome_advantage(rewards, mask, [0, 0])),
        ("reinforce_plus_plus", {}, compute_reinforce_plus_plus_outcome_advantage(rewards, mask, 1.0)),
    ]:
        adv, ret = compute_advantage(est, token_level_rewards=rewards, response_mask=mask, **kwargs)
        close(adv, fn_out[0])
        close(ret, fn_out[1])
    with pytest.raises(ValueError, match="critic"):
        compute_advantage("gae", token_level_rewards=rewards, response_mask=mask)
    with pytest.raises(ValueError, match="group_index"):
        compute_advantage("grpo", token_level_rewards=rewards, response_mask=mask)
    with pytest.raises(ValueError, match=r"algorithm\.adv_estimator"):
        compute_advantage("ppo", token_level_rewards=rewards, response_mask=mask)


# ---------------------------------------------------------------------------------------------- KL
def test_kl_penalty_kinds_hand_computed():
    logp, ref = T([0.0, -1.0]), T([-1.0, 0.0])  # logp - ref = [1, -1]
    close(kl_penalty(logp, ref, "kl"), [1.0, -1.0])
    close(kl_penalty(logp, ref, "abs"), [1.0, 1.0])
    close(kl_penalty(logp, ref, "mse"), [0.5, 0.5])
    # k3 with d = ref - logp = [-1, 1]: exp(-1) + 1 - 1 = 0.36788, exp(1) - 1 - 1 = 0.71828.
    close(kl_penalty(logp, ref, "low_var_kl"), [math.exp(-1), math.e - 2])
    # d = 30 is clamped to 20 and exp(20) - 21 to the upper bound 10.
    close(kl_penalty(T([0.0]), T([30.0]), "low_var_kl"), [10.0])
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(logp, ref, "full")


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-20, 0, allow_nan=False), min_size=1, max_size=8))
def test_kl_penalty_zero_when_equal(values):
    x = T(values)
    for kind in ("kl", "abs", "mse", "low_var_kl"):
        close(kl_penalty(x, x.clone(), kind), torch.zeros_like(x))


def test_apply_kl_penalty_hand_computed():
    scores = T([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    logp = T([[0.0, 0.0, 0.0], [0.2, 0.1, 9.0]])
    ref = T([[-1.0, 0.0, -0.5], [0.0, 0.1, 0.0]])
    # k1 = [1, 0, 0.5] and [0.2, 0, (pad)]; r = score - 0.1 * k1.
    rewards, mean_kl = apply_kl_penalty(scores, logp, ref, mask, kl_coef=0.1, kind="kl")
    close(rewards, [[-0.1, 0.0, 0.95], [-0.02, 1.0, 0.0]])
    # per-response token means 0.5 and 0.1 -> 0.3.
    assert mean_kl == pytest.approx(0.3)


def test_kl_controllers():
    fixed = FixedKLController(0.05)
    fixed.update(10.0, 100)
    assert fixed.value == 0.05
    # e = clip(0.15/0.1 - 1, -0.2, 0.2) = 0.2 -> beta *= 1 + 0.2 * 10/100 = 1.02.
    ada = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
    ada.update(0.15, 10)
    assert ada.value == pytest.approx(0.102)
    # e = 0.09/0.1 - 1 = -0.1 -> beta *= 0.99.
    ada.update(0.09, 10)
    assert ada.value == pytest.approx(0.102 * 0.99)

    state = ada.state_dict()
    other = AdaptiveKLController(0.5, 0.1, 100)
    other.load_state_dict(state)
    assert other.value == pytest.approx(ada.value)
    # A fixed coefficient is configuration: resume keeps the config's value.
    fixed2 = FixedKLController(0.2)
    fixed2.load_state_dict(fixed.state_dict())
    assert fixed2.value == 0.2
    with pytest.raises(ValueError, match="adaptive"):
        fixed2.load_state_dict(state)
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, 0.0, 100)


def test_build_kl_controller():
    assert isinstance(build_kl_controller(KLControl()), FixedKLController)
    ctrl = build_kl_controller(KLControl(type="adaptive", kl_coef=0.2, target_kl=0.05, horizon=50))
    assert isinstance(ctrl, AdaptiveKLController)
    assert (ctrl.value, ctrl.target, ctrl.horizon) == (0.2, 0.05, 50)


# ------------------------------------------------------------------------------------------ losses
def test_agg_loss_modes_hand_computed():
    loss = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    close(agg_loss(loss, mask, "token-mean"), 7 / 3)  # (1 + 2 + 4) / 3
    close(agg_loss(loss, mask, "seq-mean-token-sum"), 3.5)  # (3 + 4) / 2
    close(agg_loss(loss, mask, "seq-mean-token-mean"), 2.75)  # (1.5 + 4) / 2
    close(agg_loss(loss, mask, "seq-mean-token-sum-norm"), 3.5 / 3)  # mean of sums / T
    with pytest.raises(ValueError, match=r"actor\.loss_agg_mode"):
        agg_loss(loss, mask, "sum")


@settings(max_examples=30, deadline=None)
@given(c=st.floats(-10, 10, allow_nan=False), lengths=st.lists(st.integers(1, 5), min_size=1, max_size=4))
def test_agg_loss_of_constant(c, lengths):
    mask = torch.zeros(len(lengths), 5)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    loss = torch.full_like(mask, c)
    for mode in ("token-mean", "seq-mean-token-mean"):
        close(agg_loss(loss, mask, mode), c, atol=1e-4)


def test_policy_loss_hand_computed():
    # ratios [1.5, 0.9, 0.5, 5] with A = [1, 1, -1, -1], eps 0.2, dual clip c = 3:
    # t0: max(-1.5, -1.2) = -1.2 (clipped); t1: -0.9; t2: max(0.5, 0.8) = 0.8 (clipped), min(3, 0.8) = 0.8;
    # t3: max(5, 1.2) = 5, dual clip min(3, 5) = 3. Mean = (-1.2 - 0.9 + 0.8 + 3) / 4 = 0.425.
    old = torch.zeros(1, 4)
    logp = torch.log(T([[1.5, 0.9, 0.5, 5.0]])).requires_grad_()
    adv = T([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    loss, metrics = compute_policy_loss(old, logp, adv, mask, 0.2, 0.2, 3.0, "token-mean")
    close(loss, 0.425)
    assert set(metrics) == {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"}
    close(metrics["pg_clipfrac"], 0.5)  # t0 and t2
    close(metrics["pg_clipfrac_lower"], 0.25)  # t3
    close(metrics["ppo_kl"], -math.log(1.5 * 0.9 * 0.5 * 5.0) / 4)
    # Only the unclipped t1 carries gradient: d/dlogp (-A * ratio / 4) = -0.9 / 4.
    loss.backward()
    close(logp.grad, [[0.0, -0.225, 0.0, 0.0]])


def test_policy_loss_asymmetric_clip_and_padding():
    # clip_ratio_high 0.28: t0 becomes max(-1.5, -1.28) = -1.28; the padded t1 is ignored.
    old = torch.zeros(1, 2)
    logp = torch.log(T([[1.5, 100.0]]))
    adv = T([[1.0, -5.0]])
    mask = T([[1.0, 0.0]])
    loss, metrics = compute_policy_loss(old, logp, adv, mask, 0.2, 0.28, 3.0, "token-mean")
    close(loss, -1.28)
    close(metrics["pg_clipfrac"], 1.0)
    close(metrics["pg_clipfrac_lower"], 0.0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss(old, logp, adv, mask, 0.2, 0.2, 1.0, "token-mean")


@settings(max_examples=30, deadline=None)
@given(
    logps=st.lists(st.floats(-10, 0, allow_nan=False), min_size=2, max_size=6),
    advs=st.lists(st.floats(-3, 3, allow_nan=False), min_size=6, max_size=6),
)
def test_policy_loss_on_policy_has_no_clipping(logps, advs):
    logp = T([logps])
    adv = T([advs[: len(logps)]])
    mask = torch.ones_like(logp)
    loss, metrics = compute_policy_loss(logp.clone(), logp, adv, mask, 0.2, 0.2, 3.0, "token-mean")
    assert float(metrics["pg_clipfrac"]) == 0.0
    assert float(metrics["pg_clipfrac_lower"]) == 0.0
    assert float(metrics["ppo_kl"]) == 0.0
    close(loss, -float(adv.mean()), atol=1e-5)  # ratio 1: the loss is -mean(A)


def test_value_loss_hand_computed():
    # old 0.5, clip 0.2 -> clipped preds [0.7, 0.7, 0.3]; returns [1, 0, 1]:
    # unclipped sq errors [0, 4, 1], clipped [0.09, 0.49, 0.49]; max [0.09, 4, 1] -> mean 5.09/3, x 0.5.
    vpreds = T([[1.0, 2.0, 0.0]])
    old = T([[0.5, 0.5, 0.5]])
    returns = T([[1.0, 0.0, 1.0]])
    loss, metrics = compute_value_loss(vpreds, old, returns, torch.ones(1, 3), 0.2, "token-mean")
    close(loss, 0.5 * 5.09 / 3)
    assert set(metrics) == {"vf_clipfrac"}
    close(metrics["vf_clipfrac"], 1 / 3)  # only t0 uses the clipped error


def test_explained_variance():
    returns = T([[1.0, 2.0, 3.0]])
    mask = torch.ones(1, 3)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.zeros(1, 3), returns, mask) == pytest.approx(0.0)
    assert math.isnan(explained_variance(returns, torch.ones(1, 3), mask))
