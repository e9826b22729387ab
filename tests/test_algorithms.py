"""Advantage estimators, KL penalties/controllers and PPO losses against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlconf.config import AdvEstimator, AlgorithmConfig, KLControl, PolicyLossConfig, PolicyLossMode, RLConfig
from rlconf.plan.algorithm import algorithm_plan, policy_loss_options
from rltrain.algorithms import (
    ADV_ESTIMATOR_REGISTRY,
    LOSS_AGG_MODES,
    POLICY_LOSS_REGISTRY,
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_penalty,
    build_kl_controller,
    compute_advantage,
    compute_gae_advantage_return,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_policy_loss,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_value_loss,
    concat_batches,
    entropy_from_logits,
    explained_variance,
    groups_with_spread,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    outcome_to_token_level,
    overlong_penalty,
    rollout_correction,
    select_rows,
)
from rltrain.rollout.batch import rollout_batch

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


def _kl_reward(kl_ctrl: KLControl):
    return algorithm_plan(RLConfig(algorithm=AlgorithmConfig(kl_ctrl=kl_ctrl))).kl_reward


def test_build_kl_controller():
    assert isinstance(build_kl_controller(_kl_reward(KLControl())), FixedKLController)
    ctrl = build_kl_controller(
        _kl_reward(KLControl(type="adaptive", kl_coef=0.2, target_kl=0.05, horizon=50))
    )
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


# ----------------------------------------------------------------------------- registries (issue 23)
def test_every_configurable_name_is_registered():
    # A name the config accepts but no function implements would fail only at the first update of a run.
    assert set(POLICY_LOSS_REGISTRY) == set(PolicyLossMode.__args__)
    assert set(ADV_ESTIMATOR_REGISTRY) == set(AdvEstimator.__args__)
    with pytest.raises(ValueError, match=r"actor\.policy_loss\.loss_mode"):
        compute_policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1),
                            0.2, 0.2, 3.0, "token-mean", "ppo2")  # fmt: skip


def _loss(mode: str, old, logp, adv, mask, low=0.2, high=0.2, agg="token-mean", **options):
    return compute_policy_loss(
        old, logp, adv, mask, low, high, 3.0, agg, mode, policy_loss_options(PolicyLossConfig(**options))
    )


# ------------------------------------------------------------------------------------ loss modes
def test_gspo_hand_computed():
    # Sequence 0: token log-ratios [0.1, 0.3] -> s0 = exp(0.2) = 1.2214 (inside [0.8, 1.3]), A = 1:
    # each token's loss is -s0. Sequence 1: one token, ratio 0.5, A = -1: max(0.5, 0.8) = 0.8 (clipped).
    # seq-mean-token-mean (GSPO's own aggregation, whatever is configured): (-s0 + 0.8) / 2.
    old = torch.zeros(2, 2)
    logp = T([[0.1, 0.3], [math.log(0.5), 0.0]]).requires_grad_()
    adv = T([[1.0, 1.0], [-1.0, -1.0]])
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    s0 = math.exp(0.2)
    loss, metrics = _loss("gspo", old, logp, adv, mask, high=0.3, agg="token-mean")
    close(loss, (-s0 + 0.8) / 2)
    close(metrics["pg_clipfrac"], 1 / 3)
    # Gradient of each token of sequence 0: (1/2 sequences) x (1/2 tokens) x (-A x s0); sequence 1 clipped.
    loss.backward()
    close(logp.grad, [[-s0 / 4, -s0 / 4], [0.0, 0.0]])


@settings(max_examples=30, deadline=None)
@given(
    log_ratios=st.lists(st.floats(-0.15, 0.15, allow_nan=False), min_size=1, max_size=6),
    advs=st.lists(st.floats(-3, 3, allow_nan=False), min_size=6, max_size=6),
)
def test_gspo_equals_vanilla_for_one_token_sequences(log_ratios, advs):
    # With one valid token per sequence the sequence ratio is the token ratio; inside the clip range both
    # losses and their gradients agree (padding columns must not change that).
    n = len(log_ratios)
    old = torch.full((n, 3), -1.0)
    mask = torch.zeros(n, 3)
    mask[:, 0] = 1.0
    adv = T(advs[:n]).unsqueeze(-1).expand(n, 3).contiguous()
    results = []
    for mode in ("vanilla", "gspo"):
        logp = (old + T(log_ratios).unsqueeze(-1)).requires_grad_()
        loss, _ = _loss(mode, old, logp, adv, mask)
        loss.backward()
        results.append((loss.detach(), logp.grad))
    close(results[1][0], results[0][0], atol=1e-6)
    close(results[1][1], results[0][1], atol=1e-6)


def test_gpg_hand_computed():
    # L = -A * logp, token mean; the old log-probs play no part.
    logp = T([[math.log(0.5), math.log(0.25)]]).requires_grad_()
    adv = T([[2.0, 1.0]])
    loss, metrics = _loss("gpg", torch.full((1, 2), -7.0), logp, adv, torch.ones(1, 2))
    close(loss, -(2 * math.log(0.5) + math.log(0.25)) / 2)
    close(metrics["pg_clipfrac"], 0.0)
    loss.backward()
    close(logp.grad, [[-1.0, -0.5]])


def test_clip_cov_hand_computed():
    # On-policy (ratio 1, no PPO clip). logp [-1, -3, -2, -2] (mean -2), A [3, 1, 0, 0] (mean 1):
    # covariance (A - 1)(logp + 2) = [2, 0, 0, 0]; only token 0 is in the band (1, 5) -> detached.
    logp = T([[-1.0, -3.0, -2.0, -2.0]])
    adv = T([[3.0, 1.0, 0.0, 0.0]])
    mask = torch.ones(1, 4)
    x = logp.clone().requires_grad_()
    loss, metrics = _loss("clip-cov", logp.clone(), x, adv, mask, clip_cov_ratio=0.25)
    close(loss, (0.0 - 1.0 + 0.0 + 0.0) / 4)
    close(metrics["pg_clipfrac"], 0.25)
    loss.backward()
    close(x.grad, [[0.0, -0.25, 0.0, 0.0]])
    # A band no token falls in: nothing is detached and the loss is PPO's -mean(A).
    loss, metrics = _loss(
        "clip-cov", logp.clone(), logp.clone(), adv, mask, clip_cov_lb=10.0, clip_cov_ub=20.0
    )
    close(loss, -1.0)
    close(metrics["pg_clipfrac"], 0.0)


def test_kl_cov_hand_computed():
    # Same covariance [2, 0, 0, 0] (it uses the current log-probs); token 0 moved by log-ratio 0.5.
    # k = max(1, int(4 x 0.0002)) = 1 -> token 0 gets + 0.1 x |0.5|; no clipping at all.
    logp = T([[-1.0, -3.0, -2.0, -2.0]]).requires_grad_()
    old = T([[-1.5, -3.0, -2.0, -2.0]])
    adv = T([[3.0, 1.0, 0.0, 0.0]])
    loss, metrics = _loss("kl-cov", old, logp, adv, torch.ones(1, 4), ppo_kl_coef=0.1)
    r0 = math.exp(0.5)
    close(loss, (-3 * r0 + 0.1 * 0.5 - 1.0) / 4)
    close(metrics["pg_clipfrac"], 0.25)
    loss.backward()
    close(logp.grad, [[(-3 * r0 + 0.1) / 4, -0.25, 0.0, 0.0]])


def test_cispo_hand_computed():
    # ratios [1.5, 0.5], A [1, -1], clip [0.8, 1.2] -> weights [1.2, 0.8] (both clipped, stop-gradient).
    # L = -w * A * logp = [-1.2 ln 1.5, 0.8 ln 0.5]; the gradient -w * A / 2 reaches every token.
    logp = torch.log(T([[1.5, 0.5]])).requires_grad_()
    adv = T([[1.0, -1.0]])
    loss, metrics = _loss("cispo", torch.zeros(1, 2), logp, adv, torch.ones(1, 2))
    close(loss, (-1.2 * math.log(1.5) + 0.8 * math.log(0.5)) / 2)
    close(metrics["pg_clipfrac"], 1.0)
    loss.backward()
    close(logp.grad, [[-0.6, 0.4]])


def test_sapo_hand_computed():
    # ratio 1 with A = 1: gate sigmoid(0) x 4 / 1 = 2 -> L = -2, gradient -4 x 1/4 x r = -1 (per token).
    # ratio 2 with A = -1 (tau_neg 1.05): gate sigmoid(1.05) x 4 / 1.05 -> L = +gate; gradient
    # 4 x sigma (1 - sigma) x r with sigma = sigmoid(1.05). Token mean over 2.
    logp = torch.log(T([[1.0, 2.0]])).requires_grad_()
    adv = T([[1.0, -1.0]])
    loss, metrics = _loss("sapo", torch.zeros(1, 2), logp, adv, torch.ones(1, 2), tau_pos=1.0, tau_neg=1.05)
    sig = 1 / (1 + math.exp(-1.05))
    close(loss, (-2.0 + sig * 4 / 1.05) / 2)
    close(metrics["pg_clipfrac"], 0.0)
    loss.backward()
    close(logp.grad, [[-0.5, 4 * sig * (1 - sig) * 2 / 2]])


@settings(max_examples=30, deadline=None)
@given(
    logps=st.lists(st.floats(-8, -0.1, allow_nan=False), min_size=2, max_size=6),
    advs=st.lists(st.floats(-3, 3, allow_nan=False), min_size=6, max_size=6),
    mode=st.sampled_from(["vanilla", "gpg", "cispo", "sapo", "kl-cov"]),
)
def test_on_policy_gradient_is_plain_policy_gradient(logps, advs, mode):
    # At ratio 1 every token-level method reduces to REINFORCE: d loss / d logp_t = -A_t / N (token mean).
    old = T([logps])
    adv = T([advs[: len(logps)]])
    logp = old.clone().requires_grad_()
    loss, _ = _loss(mode, old, logp, adv, torch.ones_like(old))
    loss.backward()
    close(logp.grad, -adv / len(logps), atol=1e-5)


def test_rollout_is_weights_scale_each_token():
    # Weights [2, 0] on the on-policy loss -A: token 1 (rejected) carries nothing, token 0 twice its loss.
    logp = T([[-1.0, -2.0]])
    adv = T([[1.0, 3.0]])
    loss, _ = compute_policy_loss(logp, logp, adv, torch.ones(1, 2), 0.2, 0.2, 3.0, "token-mean",
                                  rollout_is_weights=T([[2.0, 0.0]]))  # fmt: skip
    close(loss, -2.0 / 2)


# ---------------------------------------------------------------------------- more estimators
def test_reinforce_plus_plus_baseline_hand_computed():
    # Group [3, 1, 2] -> minus its mean 2 -> [1, -1, 0]; the lone [4] keeps 4 (no baseline).
    # Valid tokens 1, 1, -1, -1, 0, 4, 4: mean 8/7; whitened with the unbiased std over those 7.
    scores = T([3.0, 1.0, 2.0, 4.0])
    mask = T([[1, 1], [1, 1], [1, 0], [1, 1]])
    adv, ret = compute_reinforce_plus_plus_baseline_outcome_advantage(
        outcome_to_token_level(scores, mask), mask, [0, 0, 0, 1]
    )
    tokens = [1.0, 1.0, -1.0, -1.0, 0.0, 4.0, 4.0]
    mean = sum(tokens) / 7
    std = math.sqrt(sum((t - mean) ** 2 for t in tokens) / 6)
    w = [(v - mean) / std for v in (1.0, -1.0, 0.0, 4.0)]
    close(adv, [[w[0], w[0]], [w[1], w[1]], [w[2], 0.0], [w[3], w[3]]])
    close(ret, adv)


def test_grpo_passk_hand_computed():
    # Group [3, 1, 2]: only the best (3) learns, by 3 - 2 = 1, over the group's std 1.
    # Group [1, 1]: a tie, gain 0. The lone [5]: 0.
    scores = T([3.0, 1.0, 2.0, 1.0, 1.0, 5.0])
    mask = torch.ones(6, 2)
    group = [0, 0, 0, 1, 1, 2]
    adv, _ = compute_grpo_passk_outcome_advantage(
        outcome_to_token_level(scores, mask), mask, group, True, 0.0
    )
    close(adv[:, 0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    # Without the std: group [0, 4, 1] -> the second response gets 4 - 1 = 3.
    scores = T([0.0, 4.0, 1.0])
    adv, _ = compute_grpo_passk_outcome_advantage(
        outcome_to_token_level(scores, torch.ones(3, 2)), torch.ones(3, 2), [7, 7, 7], False
    )
    close(adv, [[0.0, 0.0], [3.0, 3.0], [0.0, 0.0]])


def test_gpg_advantage_hand_computed():
    # Scores [1, 0 | 3]: 2 of 3 non-zero -> alpha = 3/2. Group 0 mean 0.5 -> 1.5 x [0.5, -0.5];
    # the lone 3 has no baseline -> 1.5 x 3.
    scores = T([1.0, 0.0, 3.0])
    mask = T([[1, 1], [1, 1], [1, 0]])
    adv, _ = compute_gpg_outcome_advantage(outcome_to_token_level(scores, mask), mask, [0, 0, 1])
    close(adv, [[0.75, 0.75], [-0.75, -0.75], [4.5, 0.0]])


def test_dr_grpo_is_unnormalised_grpo_with_constant_length_norm():
    # Dr. GRPO = norm_adv_by_std_in_grpo false + seq-mean-token-sum-norm: a longer response does not get a
    # smaller per-token weight. Scores [1, 0] -> A [0.5, -0.5]; lengths 1 and 3 of T = 4; on-policy loss
    # per token -A -> sums [-0.5, 1.5] -> mean 0.5 / 4.
    mask = T([[1, 0, 0, 0], [1, 1, 1, 0]])
    rewards = outcome_to_token_level(T([1.0, 0.0]), mask)
    adv, _ = compute_advantage("grpo", token_level_rewards=rewards, response_mask=mask, group_index=[0, 0],
                               norm_adv_by_std_in_grpo=False)  # fmt: skip
    logp = torch.full((2, 4), -1.0)
    loss, _ = compute_policy_loss(logp, logp, adv, mask, 0.2, 0.2, 3.0, "seq-mean-token-sum-norm")
    close(loss, 0.5 / 4)


# ------------------------------------------------------------------------------ DAPO mechanisms
def test_overlong_penalty_hand_computed():
    # L_max 20, buffer 4, factor 0.5: free up to 16 tokens, then -(L - 16) / 4 x 0.5 down to -0.5 at 20.
    close(overlong_penalty(T([10, 16, 17, 18, 20]), 20, 4, 0.5), [0.0, 0.0, -0.125, -0.25, -0.5])


def test_groups_with_spread_keeps_mixed_groups_and_singletons():
    # Group a: [1, 1] constant -> dropped; b: [0, 1] -> kept; c: [0.5] alone -> kept (as verl).
    keep = groups_with_spread(T([1.0, 1.0, 0.0, 1.0, 0.5]), ["a", "a", "b", "b", "c"])
    assert keep.tolist() == [False, False, True, True, True]


def test_concat_batches_repads_prompts_and_responses():
    # Batch 1: prompt width 2, responses 3; batch 2: prompt width 3, responses 1. Concatenated: prompts
    # left-padded to 3, responses right-padded to 3, groups renumbered, positions count real tokens.
    b1 = rollout_batch(T([[5, 6]]), T([[1, 1]]), T([[7, 8, 9]]), T([[1, 1, 0]]), T([[-0.1, -0.2, 0.0]]))
    b1 |= {"scores": T([1.0]), "group_index": T([0])}
    b2 = rollout_batch(T([[0, 3, 4]]), T([[0, 1, 1]]), T([[2]]), T([[1]]), T([[-0.3]]))
    b2 |= {"scores": T([0.0]), "group_index": T([0])}
    out = concat_batches([b1, b2], pad_token_id=0)
    assert out["input_ids"].tolist() == [[0, 5, 6, 7, 8, 9], [0, 3, 4, 2, 0, 0]]
    assert out["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0]]
    assert out["position_ids"].tolist() == [[0, 0, 1, 2, 3, 3], [0, 0, 1, 2, 2, 2]]
    assert out["responses"].tolist() == [[7, 8, 9], [2, 0, 0]]
    assert out["response_mask"].tolist() == [[1, 1, 0], [1, 0, 0]]
    close(out["rollout_log_probs"], [[-0.1, -0.2, 0.0], [-0.3, 0.0, 0.0]])
    assert out["group_index"].tolist() == [0, 1]
    assert select_rows(out, slice(1, 2))["scores"].tolist() == [0.0]


def test_rollout_correction_hand_computed():
    # Token log-ratios (train - rollout) [ln 3, ln 0.5 | ln 1.5, pad]; threshold 2.
    train = torch.log(T([[3.0, 0.5], [1.5, 1.0]]))
    rollout = torch.zeros(2, 2)
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    # token IS: min(rho, 2) = [2, 0.5 | 1.5, 0]; nothing rejected, the mask is unchanged.
    rc = rollout_correction(train, rollout, mask, "token", 2.0, None, 2.0)
    close(rc.weights, [[2.0, 0.5], [1.5, 0.0]])
    close(rc.accepted, mask)
    assert rc.metrics["rollout_corr/rejected_fraction"] == 0.0
    assert rc.metrics["rollout_corr/kl"] == pytest.approx(-math.log(3 * 0.5 * 1.5) / 3, abs=1e-6)
    # sequence IS: rho_seq = 1.5 and 1.5 -> 1.5 on every valid token.
    rc = rollout_correction(train, rollout, mask, "sequence", 2.0, None, 2.0)
    close(rc.weights, [[1.5, 1.5], [1.5, 0.0]])
    # token RS: ratio 3 is outside [0.5, 2] -> rejected: it leaves the mask (and has weight 0).
    rc = rollout_correction(train, rollout, mask, None, 2.0, "token", 2.0)
    close(rc.weights, [[0.0, 1.0], [1.0, 0.0]])
    close(rc.accepted, [[0.0, 1.0], [1.0, 0.0]])
    assert rc.metrics["rollout_corr/rejected_fraction"] == pytest.approx(1 / 3)
    # sequence RS at bound 1.4: both sequences (1.5) are rejected.
    rc = rollout_correction(train, rollout, mask, None, 2.0, "sequence", 1.4)
    close(rc.weights, torch.zeros(2, 2))
    close(rc.accepted, torch.zeros(2, 2))


# ------------------------------------------------------------------ masked spans (multi-turn observations)
# A multi-turn response interleaves the model's tokens with a tool's observation tokens, which the
# response_mask leaves out. Every estimator and loss must treat those interior positions as absent: the
# result on the model's tokens equals the result on the response with the observation columns cut out.
_INTERIOR_MASK = T(
    [[1.0, 1.0, 0.0, 0.0, 1.0, 1.0], [1.0, 0.0, 1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]]
)


def _compact(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's valid entries moved left (observation columns cut out), right-padded with 0."""
    out = torch.zeros_like(x)
    out_mask = torch.zeros_like(mask)
    for i in range(x.shape[0]):
        vals = x[i][mask[i].bool()]
        out[i, : vals.numel()] = vals
        out_mask[i, : vals.numel()] = 1
    return out, out_mask


def _observation_junk(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 5


def test_reinforce_plus_plus_return_carries_through_observation_tokens():
    # gamma 0.5, rewards [0, (obs), 1]: the return of token 0 is 0.5 * 1 (the next valid token's return),
    # not 0 (the old restart after a masked position).
    rewards = T([[0.0, 0.0, 1.0]])
    mask = T([[1.0, 0.0, 1.0]])
    _, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    close(ret, [[0.5, 0.0, 1.0]])


@pytest.mark.parametrize("estimator", sorted(ADV_ESTIMATOR_REGISTRY))
def test_every_estimator_ignores_interior_masked_tokens(estimator):
    mask = _INTERIOR_MASK
    scores = T([1.0, 0.0, 0.5])
    rewards = outcome_to_token_level(scores, mask)
    # A per-token reward on the model's own tokens too (a KL penalty), so return-to-go estimators see
    # more than one reward per row; observation columns carry junk that must not leak into anything.
    rewards = rewards + 0.1 * mask * torch.arange(6.0)
    values = _observation_junk(mask.shape, 0) * (1 - mask) + mask * torch.linspace(-1, 1, 6)
    kwargs = dict(group_index=[0, 0, 0], gamma=0.7, lam=0.9)
    adv, ret = compute_advantage(
        estimator, token_level_rewards=rewards, response_mask=mask, values=values, **kwargs
    )
    c_rewards, c_mask = _compact(rewards, mask)
    c_values, _ = _compact(values, mask)
    c_adv, c_ret = compute_advantage(
        estimator, token_level_rewards=c_rewards, response_mask=c_mask, values=c_values, **kwargs
    )
    close(_compact(adv, mask)[0], c_adv)
    close(_compact(ret, mask)[0], c_ret)
    close(adv * (1 - mask), torch.zeros_like(adv))


@pytest.mark.parametrize("agg_mode", LOSS_AGG_MODES)
def test_seq_mean_modes_leave_out_rows_without_valid_tokens(agg_mode):
    loss = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # The all-masked third row changes nothing: the same value as the batch of the first two rows.
    close(agg_loss(loss, mask, agg_mode), agg_loss(loss[:2], mask[:2], agg_mode))
    expected = {"token-mean": 7 / 3, "seq-mean-token-sum": 3.5, "seq-mean-token-mean": 2.75,
                "seq-mean-token-sum-norm": 3.5 / 3}  # fmt: skip
    close(agg_loss(loss, mask, agg_mode), expected[agg_mode])


@pytest.mark.parametrize("agg_mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_mode", sorted(POLICY_LOSS_REGISTRY))
def test_every_policy_loss_gives_observation_tokens_no_gradient(loss_mode, agg_mode):
    mask = _INTERIOR_MASK
    old = -torch.rand(mask.shape, generator=torch.Generator().manual_seed(1)) - 0.1
    logp = (old + 0.3 * _observation_junk(mask.shape, 2).tanh()).requires_grad_(True)
    adv = _observation_junk(mask.shape, 3).tanh()
    # Covariance bands wide enough that clip-cov / kl-cov select tokens at all.
    options = PolicyLossConfig(loss_mode=loss_mode, clip_cov_ratio=0.3, clip_cov_lb=-10.0, clip_cov_ub=10.0,
                               kl_cov_ratio=0.3)  # fmt: skip
    torch.manual_seed(0)
    loss, _ = compute_policy_loss(
        old, logp, adv, mask, 0.2, 0.28, 3.0, agg_mode, loss_mode, policy_loss_options(options)
    )
    loss.backward()
    assert logp.grad is not None
    assert torch.count_nonzero(logp.grad * mask) > 0  # the model's own tokens do learn
    assert torch.count_nonzero(logp.grad * (1 - mask)) == 0  # observation tokens never do
    # The same loss as on the response with the observation columns cut out (T kept: -sum-norm divides by it).
    c_mask = _compact(mask, mask)[1]
    c_logp = _compact(logp.detach(), mask)[0]
    torch.manual_seed(0)
    c_loss, _ = compute_policy_loss(
        _compact(old, mask)[0],
        c_logp,
        _compact(adv, mask)[0],
        c_mask,
        0.2,
        0.28,
        3.0,
        agg_mode,
        loss_mode,
        policy_loss_options(options),
    )
    close(loss.detach(), c_loss)


@pytest.mark.parametrize("agg_mode", LOSS_AGG_MODES)
def test_value_loss_ignores_observation_tokens(agg_mode):
    mask = _INTERIOR_MASK
    vpreds = _observation_junk(mask.shape, 4).requires_grad_(True)
    old_values, returns = _observation_junk(mask.shape, 5), _observation_junk(mask.shape, 6)
    loss, _ = compute_value_loss(vpreds, old_values, returns, mask, 0.5, agg_mode)
    loss.backward()
    assert torch.count_nonzero(vpreds.grad * (1 - mask)) == 0
    c_loss, _ = compute_value_loss(
        _compact(vpreds.detach(), mask)[0], _compact(old_values, mask)[0], _compact(returns, mask)[0],
        _compact(mask, mask)[1], 0.5, agg_mode,
    )  # fmt: skip
    close(loss.detach(), c_loss)


def test_gpu_dapo_preset_keeps_groups_whose_scores_vary_on_a_random_policy():
    """qwen2.5-0.5b-dapo on the random-init shape: with numeric_match 2 of 64 groups varied and the step
    stopped at its generation-batch bound. Its reward gives partial credit, so a random policy's groups vary
    (dynamic sampling keeps them), and the bound is off, as in verl."""
    import random

    from presets import get_preset
    from rltrain.data import synthetic_sample
    from rltrain.rewards import digit_match, numeric_match

    c = get_preset("qwen2.5-0.5b-dapo")
    assert c.algorithm.filter_groups.enable and c.algorithm.filter_groups.max_num_gen_batches == 0
    assert c.reward.function == "digit_match"
    rng = random.Random(0)

    def varying(score) -> int:
        n = 0
        for i in range(64):
            prompt, answer = synthetic_sample(c.data.synthetic_task, 0, i)
            scores = {score("".join(rng.choice("0123456789 +=") for _ in range(8)), answer, prompt)
                      for _ in range(c.rollout.n)}  # fmt: skip
            n += len(scores) > 1
        return n

    assert varying(digit_match) >= 32 > 4 >= varying(numeric_match)
