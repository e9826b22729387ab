"""Every loss and estimator of rltrain/algorithms/ against an independent reference of its paper formula.

Each reference below is written plainly from the formula (loops over rows and tokens, float64, no code
shared with rltrain.algorithms) and compared with the implementation (float32) on random inputs with the
awkward cases real batches have: ragged masks, interior gaps (tool observations), junk on masked positions,
singleton groups, and extreme ratios (|log rho| > 20 for some tokens). Tolerances come from float32 and the
size of the reductions (tests/tolerance.py). The second half pins each definition where rlplan chose
between two readings (issue 30) against a value computed by hand on a tiny example.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from presets import get_preset
from rlconf.config import PolicyLossConfig
from rlconf.fields import replace_paths
from rlconf.plan.algorithm import policy_loss_options
from rlconf.validate import check_config
from rlconf.verl.report import format_report
from rlconf.verl.translate import translate
from rltrain.algorithms import (
    LOSS_AGG_MODES,
    agg_loss,
    compute_advantage,
    compute_policy_loss,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    rollout_correction,
)
from tests.tolerance import tolerance

SEEDS = range(12)
F32 = torch.float32


# ------------------------------------------------------------------------------------------ inputs
def _draw(seed: int, extreme: bool = True) -> dict[str, torch.Tensor]:
    """A random batch: ragged rows with interior gaps (one row may be empty), junk on masked positions,
    groups with singletons, and (extreme) some tokens whose log-ratio is beyond +-20."""
    g = torch.Generator().manual_seed(seed)
    b = int(torch.randint(3, 7, (1,), generator=g))
    t = int(torch.randint(2, 9, (1,), generator=g))
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    mask = (torch.rand(b, t, generator=g) < 0.75).float() * (torch.arange(t) < lengths[:, None]).float()
    mask[0, 0] = 1.0  # at least one valid token in the batch
    junk = torch.randn(b, t, generator=g) * 7 * (1 - mask)
    old = -(torch.rand(b, t, generator=g) * 3 + 0.05)
    delta = torch.randn(b, t, generator=g) * 0.3
    if extreme:
        far = torch.rand(b, t, generator=g) < 0.15
        sign = torch.where(torch.rand(b, t, generator=g) < 0.5, -1.0, 1.0)
        delta = torch.where(far, sign * (20.5 + 10 * torch.rand(b, t, generator=g)), delta)
    logp = old + delta
    return {
        "mask": mask,
        "old": old + junk,
        "logp": logp,
        "adv": torch.randn(b, t, generator=g) + junk,
        "rewards": torch.randn(b, t, generator=g) * mask + junk,
        "values": torch.randn(b, t, generator=g) + junk,
        "group": torch.randint(0, 3, (b,), generator=g),
        # Rejection sampling's accepted tokens: a subset of the mask.
        "accepted": mask * (torch.rand(b, t, generator=g) < 0.7).float(),
    }


def _valid(mask: torch.Tensor, i: int) -> list[int]:
    return [t for t in range(mask.shape[1]) if mask[i, t] > 0]


def _check(
    actual: torch.Tensor, expected: torch.Tensor, reduction: int, magnitude: float | None = None
) -> None:
    """fp32 implementation vs fp64 reference: float32 rounding through `reduction` terms, relative to
    `magnitude` (the largest term summed; by default the largest reference value)."""
    expected = expected.double()
    if magnitude is None:
        magnitude = float(expected.abs().max()) if expected.numel() else 1.0
    tol = tolerance(F32, reduction, magnitude=magnitude or 1.0)
    torch.testing.assert_close(actual.double(), expected, **tol)


# ---------------------------------------------------------------------------------- references
def ref_whiten(values: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """(v - mean) / sqrt(var + 1e-8) with the unbiased variance (0 for a single value)."""
    xs = list(values.values())
    n = len(xs)
    mean = sum(xs) / n if n else 0.0
    var = sum((x - mean) ** 2 for x in xs) / (n - 1) if n > 1 else 0.0
    return {k: (v - mean) / math.sqrt(var + 1e-8) for k, v in values.items()}


def ref_scores(rewards: torch.Tensor, mask: torch.Tensor) -> list[float]:
    return [sum(float(rewards[i, t]) for t in _valid(mask, i)) for i in range(mask.shape[0])]


def ref_groups(group: torch.Tensor) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, gid in enumerate(group.tolist()):
        out.setdefault(gid, []).append(i)
    return out


def _broadcast(per_row: list[float], keep: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(keep.shape, dtype=torch.float64)
    for i in range(keep.shape[0]):
        for t in _valid(keep, i):
            out[i, t] = per_row[i]
    return out


def ref_grpo(rewards, mask, group, keep, norm: bool, eps: float = 1e-6) -> torch.Tensor:
    """Shao et al. 2024: A_i = (s_i - mean_g) / (std_g + eps), std unbiased; a lone response gets 0."""
    s = ref_scores(rewards, mask)
    adv = [0.0] * len(s)
    for rows in ref_groups(group).values():
        if len(rows) < 2:
            continue
        mean = sum(s[i] for i in rows) / len(rows)
        std = math.sqrt(sum((s[i] - mean) ** 2 for i in rows) / (len(rows) - 1))
        for i in rows:
            adv[i] = (s[i] - mean) / (std + eps) if norm else s[i] - mean
    return _broadcast(adv, keep)


def ref_rloo(rewards, mask, group, keep) -> torch.Tensor:
    """Ahmadian et al. 2024: A_i = s_i - mean of the other responses of its group."""
    s = ref_scores(rewards, mask)
    adv = [0.0] * len(s)
    for rows in ref_groups(group).values():
        for i in rows:
            others = [s[j] for j in rows if j != i]
            adv[i] = s[i] - sum(others) / len(others) if others else 0.0
    return _broadcast(adv, keep)


def ref_reinforce_pp(rewards, mask, keep, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Hu 2025: G_t = r_t + gamma G_next over the response's own tokens; A = whiten(G) over kept tokens."""
    ret = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        running = 0.0
        for t in reversed(_valid(mask, i)):
            running = float(rewards[i, t]) + gamma * running
            ret[i, t] = running
    w = ref_whiten({(i, t): float(ret[i, t]) for i in range(mask.shape[0]) for t in _valid(keep, i)})
    adv = torch.zeros_like(ret)
    for (i, t), v in w.items():
        adv[i, t] = v
    return adv, ret


def ref_reinforce_pp_baseline(rewards, mask, group, keep) -> torch.Tensor:
    """s_i minus its group's mean (a lone response keeps s_i), broadcast and whitened over kept tokens."""
    s = ref_scores(rewards, mask)
    b = list(s)
    for rows in ref_groups(group).values():
        if len(rows) > 1:
            mean = sum(s[i] for i in rows) / len(rows)
            for i in rows:
                b[i] = s[i] - mean
    w = ref_whiten({(i, t): b[i] for i in range(mask.shape[0]) for t in _valid(keep, i)})
    adv = torch.zeros(mask.shape, dtype=torch.float64)
    for (i, t), v in w.items():
        adv[i, t] = v
    return adv


def ref_gae(rewards, values, mask, keep, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Schulman et al. 2016 over each response's own tokens: delta_t = r_t + gamma V_next - V_t,
    A_t = delta_t + gamma lam A_next (V_next, A_next of the next valid token, 0 after the last);
    returns = A + V; advantages whitened over the kept tokens."""
    adv = torch.zeros(mask.shape, dtype=torch.float64)
    ret = torch.zeros_like(adv)
    for i in range(mask.shape[0]):
        v_next, a_next = 0.0, 0.0
        for t in reversed(_valid(mask, i)):
            v = float(values[i, t])
            a_next = float(rewards[i, t]) + gamma * v_next - v + gamma * lam * a_next
            v_next = v
            adv[i, t] = a_next
            ret[i, t] = a_next + v
    w = ref_whiten({(i, t): float(adv[i, t]) for i in range(mask.shape[0]) for t in _valid(keep, i)})
    out = torch.zeros_like(adv)
    for (i, t), v in w.items():
        out[i, t] = v
    return out, ret


def ref_passk(rewards, mask, group, keep, norm: bool, eps: float = 1e-6) -> torch.Tensor:
    """Pass@k: the best response of a group gets (s_max - s_second) / (std_g + eps); all others 0."""
    s = ref_scores(rewards, mask)
    adv = [0.0] * len(s)
    for rows in ref_groups(group).values():
        if len(rows) < 2:
            continue
        ordered = sorted(rows, key=lambda i: -s[i])
        gain = s[ordered[0]] - s[ordered[1]]
        if norm and gain > 0:
            mean = sum(s[i] for i in rows) / len(rows)
            gain /= math.sqrt(sum((s[i] - mean) ** 2 for i in rows) / (len(rows) - 1)) + eps
        adv[ordered[0]] = gain
    return _broadcast(adv, keep)


def ref_gpg(rewards, mask, group, keep) -> torch.Tensor:
    """Chu et al. 2025: alpha = B / #(s != 0); A_i = alpha (s_i - mean_g) (a lone response: mean 0)."""
    s = ref_scores(rewards, mask)
    alpha = len(s) / max(sum(1 for x in s if x != 0.0), 1)
    adv = [0.0] * len(s)
    for rows in ref_groups(group).values():
        mean = sum(s[i] for i in rows) / len(rows) if len(rows) > 1 else 0.0
        for i in rows:
            adv[i] = alpha * (s[i] - mean)
    return _broadcast(adv, keep)


# -------------------------------------------------------------------------------- advantages
@pytest.mark.parametrize("with_rejection", [False, True], ids=["all-tokens", "rejection-sampling"])
@pytest.mark.parametrize("seed", SEEDS)
def test_advantage_estimators_match_their_papers(seed, with_rejection):
    x = _draw(seed)
    mask, rewards, group = x["mask"], x["rewards"], x["group"]
    keep = x["accepted"] if with_rejection else mask
    accepted = x["accepted"] if with_rejection else None
    n = int(mask.sum())
    common = dict(token_level_rewards=rewards, response_mask=mask, group_index=group, accepted_mask=accepted)

    def run(name: str, **kw) -> tuple[torch.Tensor, torch.Tensor]:
        return compute_advantage(name, **common, **kw)

    for norm in (True, False):
        adv, ret = run("grpo", norm_adv_by_std_in_grpo=norm)
        _check(adv, ref_grpo(rewards, mask, group, keep, norm), n)
        _check(ret, adv, 1)
        adv, _ = run("grpo_passk", norm_adv_by_std_in_grpo=norm)
        _check(adv, ref_passk(rewards, mask, group, keep, norm), n)
    _check(run("rloo")[0], ref_rloo(rewards, mask, group, keep), n)
    _check(run("gpg")[0], ref_gpg(rewards, mask, group, keep), n)
    _check(run("reinforce_plus_plus_baseline")[0], ref_reinforce_pp_baseline(rewards, mask, group, keep), n)
    adv, ret = run("reinforce_plus_plus", gamma=0.9)
    ref_adv, ref_ret = ref_reinforce_pp(rewards, mask, keep, 0.9)
    _check(adv, ref_adv, n)
    _check(ret, ref_ret, n)
    adv, ret = run("gae", values=x["values"], gamma=0.95, lam=0.8)
    ref_adv, ref_ret = ref_gae(rewards, x["values"], mask, keep, 0.95, 0.8)
    _check(adv, ref_adv, n)
    _check(ret, ref_ret, n)


# ------------------------------------------------------------------------------ KL and entropy
def ref_kl(lp: float, ref: float, kind: str) -> float:
    """Schulman's estimators of KL(pi || pi_ref) from one sample: k1 = d, |d|, k2 = d^2 / 2 with
    d = log pi - log pi_ref; k3 = e^u - u - 1 with u = -d clamped to +-20, the result to +-10."""
    d = lp - ref
    if kind == "kl":
        return d
    if kind == "abs":
        return abs(d)
    if kind == "mse":
        return 0.5 * d * d
    u = min(max(-d, -20.0), 20.0)
    return min(max(math.exp(u) - u - 1.0, -10.0), 10.0)


@pytest.mark.parametrize("kind", ["kl", "abs", "mse", "low_var_kl"])
@pytest.mark.parametrize("seed", SEEDS)
def test_kl_estimators_match_their_formulas(seed, kind):
    x = _draw(seed)
    lp, ref = x["logp"], x["old"]
    expected = torch.tensor(
        [
            [ref_kl(float(lp[i, t]), float(ref[i, t]), kind) for t in range(lp.shape[1])]
            for i in range(lp.shape[0])
        ],
        dtype=torch.float64,
    )
    _check(kl_penalty(lp, ref, kind), expected, 4)


@pytest.mark.parametrize("seed", SEEDS)
def test_entropy_and_log_probs_match_softmax_by_hand(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, 7, generator=g) * 3
    logits[0, 0, 2] = 60.0  # a near one-hot distribution
    logits[1, 1] = -40.0 * torch.rand(7, generator=g)
    labels = torch.randint(0, 7, (3, 5), generator=g)
    ent = torch.zeros(3, 5, dtype=torch.float64)
    logp = torch.zeros(3, 5, dtype=torch.float64)
    for i in range(3):
        for t in range(5):
            z = [float(v) for v in logits[i, t]]
            top = max(z)
            log_norm = top + math.log(sum(math.exp(v - top) for v in z))
            p = [math.exp(v - log_norm) for v in z]
            ent[i, t] = -sum(pk * (zk - log_norm) for pk, zk in zip(p, z, strict=True) if pk > 0)
            logp[i, t] = z[int(labels[i, t])] - log_norm
    # H = logsumexp(z) - sum p z cancels two numbers of the size of the largest logit.
    tol = tolerance(F32, 7, magnitude=float(logits.abs().max()))
    torch.testing.assert_close(entropy_from_logits(logits).double(), ent, **tol)
    torch.testing.assert_close(logprobs_from_logits(logits, labels).double(), logp, **tol)


# ------------------------------------------------------------------------------ policy losses
def ref_agg(per_token: dict[tuple[int, int], torch.Tensor], mask: torch.Tensor, mode: str) -> torch.Tensor:
    """The four aggregations over the valid tokens (rows without one are left out of the seq means):
    token-mean sum / n; seq-mean-token-sum (1/G) sum_i sum_t; seq-mean-token-mean (1/G) sum_i (1/|y_i|)
    sum_t; seq-mean-token-sum-norm (1/G) sum_i sum_t / T (Dr. GRPO, T = the batch's response width)."""
    rows = [i for i in range(mask.shape[0]) if _valid(mask, i)]
    if mode == "token-mean":
        return sum(per_token.values()) / len(per_token)
    sums = {i: sum(per_token[(i, t)] for t in _valid(mask, i)) for i in rows}
    if mode == "seq-mean-token-sum":
        return sum(sums.values()) / len(rows)
    if mode == "seq-mean-token-mean":
        return sum(sums[i] / len(_valid(mask, i)) for i in rows) / len(rows)
    assert mode == "seq-mean-token-sum-norm"
    return sum(sums.values()) / len(rows) / mask.shape[1]


def _clamp20(x: torch.Tensor) -> torch.Tensor:
    return torch.clamp(x, -20.0, 20.0)


def ref_policy_losses(mode: str, old, lp, adv, mask, lo, hi, c, opts: PolicyLossConfig):
    """Per-token losses {(i, t): scalar} of `mode` from its paper's formula (lp: float64 leaf, so the
    reference's gradient comes from the same formula), plus the tokens Clip-Cov / KL-Cov pick."""
    tokens = [(i, t) for i in range(mask.shape[0]) for t in _valid(mask, i)]
    out: dict[tuple[int, int], torch.Tensor] = {}
    if mode == "gspo":
        for i in {i for i, _ in tokens}:
            ts = _valid(mask, i)
            seq = sum(float(lp[i, t].detach() - old[i, t]) for t in ts) / len(ts)  # log s_i (detached)
            for t in ts:
                # GSPO-token: s_it has the value s_i and the gradient s_i grad log pi_t; log s capped at 10.
                s = torch.exp(torch.clamp(lp[i, t] - lp[i, t].detach() + seq, max=10.0))
                a = float(adv[i, t])
                out[(i, t)] = torch.maximum(-a * s, -a * torch.clamp(s, 1 - lo, 1 + hi))
        return out
    valid_adv = [float(adv[k]) for k in tokens]
    valid_lp = [float(lp[k].detach()) for k in tokens]
    mean_a, mean_lp = sum(valid_adv) / len(tokens), sum(valid_lp) / len(tokens)
    cov = {k: (float(adv[k]) - mean_a) * (float(lp[k].detach()) - mean_lp) for k in tokens}
    top = set(sorted(tokens, key=lambda k: -cov[k])[: max(1, int(len(tokens) * opts.kl_cov_ratio))])
    for k in tokens:
        a = float(adv[k])
        log_r = _clamp20(lp[k] - float(old[k]))
        r = torch.exp(log_r)
        if mode == "vanilla":
            l1, l2 = -a * r, -a * torch.clamp(r, 1 - lo, 1 + hi)
            loss = torch.maximum(l1, l2)
            out[k] = torch.minimum(loss, torch.tensor(-a * c, dtype=torch.float64)) if a < 0 else loss
        elif mode == "gpg":
            out[k] = -a * lp[k]
        elif mode == "cispo":
            out[k] = -float(torch.clamp(r.detach(), 1 - lo, 1 + hi)) * a * lp[k]
        elif mode == "sapo":
            tau = opts.tau_pos if a > 0 else opts.tau_neg
            out[k] = -torch.sigmoid(tau * (r - 1)) * 4 / tau * a
        elif mode == "clip-cov":
            l1, l2 = -a * r, -a * torch.clamp(r, 1 - lo, 1 + hi)
            # With clip_cov_ratio 1 every candidate (unclipped, covariance inside the band) is detached.
            candidate = (
                not float(l2.detach()) > float(l1.detach()) and opts.clip_cov_lb < cov[k] < opts.clip_cov_ub
            )
            out[k] = torch.maximum(l1, l2) * (0.0 if candidate else 1.0)
        elif mode == "kl-cov":
            out[k] = -a * r + (opts.ppo_kl_coef * log_r.abs() if k in top else 0.0)
    return out


_AGG_OF_MODE = {"gspo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean"}
_MODES = ["vanilla", "gspo", "gpg", "cispo", "sapo", "clip-cov", "kl-cov"]


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("mode", _MODES)
@pytest.mark.parametrize("seed", SEEDS)
def test_policy_losses_and_gradients_match_their_papers(seed, mode, agg):
    x = _draw(seed)
    mask, old, adv = x["mask"], x["old"], x["adv"]
    # kl-cov penalises the top 30 % by covariance; clip-cov detaches every candidate of the band (ratio 1).
    opts = PolicyLossConfig(loss_mode=mode, clip_cov_ratio=1.0, clip_cov_lb=-0.3, clip_cov_ub=0.6, kl_cov_ratio=0.3,
                            ppo_kl_coef=0.5, tau_pos=1.0, tau_neg=1.05)  # fmt: skip
    lo, hi, c = 0.2, 0.28, 3.0
    lp = x["logp"].clone().requires_grad_(True)
    loss, _ = compute_policy_loss(old, lp, adv, mask, lo, hi, c, agg, mode, policy_loss_options(opts))
    loss.backward()
    lp64 = x["logp"].double().requires_grad_(True)
    per_token = ref_policy_losses(mode, old.double(), lp64, adv.double(), mask, lo, hi, c, opts)
    expected = ref_agg(per_token, mask, _AGG_OF_MODE.get(mode, agg))
    expected.backward()
    n = int(mask.sum())
    # The reduction's rounding is relative to the largest term (a ratio of e^20 next to ordinary ones).
    scale = max(float(v.detach().abs()) for v in per_token.values()) or 1.0
    tol = tolerance(F32, n, magnitude=scale)
    torch.testing.assert_close(loss.double(), expected.detach(), **tol)
    grad_tol = tolerance(F32, n, magnitude=float(lp64.grad.abs().max()) or 1.0)
    torch.testing.assert_close(lp.grad.double(), lp64.grad, **grad_tol)
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", SEEDS)
def test_loss_agg_modes_match_their_formulas(seed, agg):
    x = _draw(seed, extreme=False)
    values = x["adv"]
    per_token = {(i, t): torch.tensor(float(values[i, t]), dtype=torch.float64)
                 for i in range(values.shape[0]) for t in _valid(x["mask"], i)}  # fmt: skip
    largest = max(float(v.abs()) for v in per_token.values())
    _check(
        agg_loss(values, x["mask"], agg), ref_agg(per_token, x["mask"], agg), int(x["mask"].sum()), largest
    )


# -------------------------------------------------------------------------- rollout correction
def ref_rollout_correction(lp, rollout, mask, rollout_is, is_thr, rollout_rs, rs_thr):
    """Truncated IS and rejection sampling from the formulas: rho_t = pi_train / pi_rollout,
    rho_seq = prod_t rho_t; IS w = min(rho, is_thr) with log rho clamped to +-20 (the sequence's summed
    log-ratio, not each token's); RS rejects |log rho| > log rs_thr (exact); rejected tokens leave the mask."""
    b, t_len = mask.shape
    weights = torch.zeros(b, t_len, dtype=torch.float64)
    accepted = torch.zeros(b, t_len, dtype=torch.float64)
    for i in range(b):
        ts = _valid(mask, i)
        log_rho = {t: float(lp[i, t]) - float(rollout[i, t]) for t in ts}
        log_seq = sum(log_rho.values())
        for t in ts:
            stat = log_rho[t] if rollout_rs == "token" else log_seq
            if rollout_rs is not None and abs(stat) > math.log(rs_thr):
                continue
            accepted[i, t] = 1.0
            if rollout_is is None:
                weights[i, t] = 1.0
            else:
                log_w = log_rho[t] if rollout_is == "token" else log_seq
                weights[i, t] = min(math.exp(min(max(log_w, -20.0), 20.0)), is_thr)
    return weights, accepted


@pytest.mark.parametrize("rs", [None, "token", "sequence"])
@pytest.mark.parametrize("is_", [None, "token", "sequence"])
@pytest.mark.parametrize("seed", SEEDS)
def test_rollout_correction_matches_the_formulas(seed, is_, rs):
    x = _draw(seed)
    # The rollout's log-probs: the trainer's with noise, and far off (|log rho| > 20) on some tokens.
    lp, rollout, mask = x["old"], x["logp"], x["mask"]
    # A small sequence bound rejects some responses and keeps others.
    rs_thr = 1.6 if rs == "token" else 3.0
    rc = rollout_correction(lp, rollout, mask, is_, 2.0, rs, rs_thr)
    w, acc = ref_rollout_correction(lp, rollout, mask, is_, 2.0, rs, rs_thr)
    _check(rc.weights, w, int(mask.sum()))
    assert torch.equal(rc.accepted.double(), acc)
    valid = [(i, t) for i in range(mask.shape[0]) for t in _valid(mask, i)]
    kl = sum(float(rollout[k]) - float(lp[k]) for k in valid) / len(valid)
    assert rc.metrics["rollout_corr/kl"] == pytest.approx(kl, rel=1e-5, abs=1e-5)
    assert rc.metrics["rollout_corr/rejected_fraction"] == pytest.approx(1 - float(acc.sum()) / len(valid))


@settings(max_examples=40, deadline=None)
@given(
    log_rho=st.lists(st.floats(-40, 40, allow_nan=False), min_size=1, max_size=6),
    rs=st.sampled_from([None, "token", "sequence"]),
    is_=st.sampled_from([None, "token", "sequence"]),
)
def test_rollout_correction_invariants(log_rho, rs, is_):
    # Accepted tokens are a subset of the mask, weights vanish off it, lie in [0, threshold], and the
    # sequence weight does not depend on the order of the tokens (a product).
    lp = torch.tensor([[*log_rho, 0.0]])
    mask = torch.tensor([[1.0] * len(log_rho) + [0.0]])
    rc = rollout_correction(lp, torch.zeros_like(lp), mask, is_, 2.0, rs, 3.0)
    assert ((rc.accepted <= mask) & (rc.weights * (1 - rc.accepted) == 0)).all()
    assert ((rc.weights >= 0) & (rc.weights <= 2.0)).all()
    total = math.fsum(float(v) for v in lp[0, :-1])
    # (Another summation order may move a sum that sits on the rejection bound across it.)
    assume(rs != "sequence" or abs(abs(total) - math.log(3.0)) > 1e-3)
    flipped = rollout_correction(
        lp[:, :-1].flip(-1), torch.zeros(1, len(log_rho)), mask[:, :-1], is_, 2.0, rs, 3.0
    )
    if is_ != "token" and rs != "token":
        # Sums of another order differ by float32 rounding of the largest term; exp turns that into a ratio.
        rel = tolerance(F32, len(log_rho), magnitude=max(abs(v) for v in log_rho) + 1.0)["atol"]
        torch.testing.assert_close(flipped.weights, rc.weights[:, :-1].flip(-1), rtol=rel, atol=0.0)


# =========================================================================== pinned definitions (issue 30)
T = torch.tensor


def test_sapo_aggregates_seq_mean_token_mean_whatever_is_configured():
    # Row 0: two tokens at ratio 1 with A = 1: each -sigmoid(0) 4 / 1 = -2 -> row mean -2.
    # Row 1: one token at ratio 1 with A = -1 (tau_neg 1.05): +sigmoid(0) 4 / 1.05 = 1.904762.
    # The paper's (1/G) sum_i (1/|y_i|) sum_t: (-2 + 1.904762) / 2 = -0.047619; a token mean would be
    # (-2 - 2 + 1.904762) / 3 = -0.698413.
    old = torch.zeros(2, 2)
    adv = T([[1.0, 1.0], [-1.0, 0.0]])
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    opts = PolicyLossConfig(loss_mode="sapo", tau_pos=1.0, tau_neg=1.05)
    for agg in LOSS_AGG_MODES:
        loss, _ = compute_policy_loss(
            old, old, adv, mask, 0.2, 0.2, 3.0, agg, "sapo", policy_loss_options(opts)
        )
        assert float(loss) == pytest.approx((-2 + 2 / 1.05) / 2, abs=1e-6), agg


def test_rejected_tokens_leave_the_mean():
    # Token log-ratios [0, ln 3 | 0]: token RS at 2 rejects the ln 3 token. On-policy loss -A per token with
    # A = [1, 5 | 3]: the mean over the two accepted tokens is -(1 + 3) / 2 = -2; keeping the rejected token
    # in the denominator (weight 0) would give -(1 + 3) / 3.
    lp = torch.log(T([[1.0, 3.0], [1.0, 1.0]]))
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    rc = rollout_correction(lp, torch.zeros(2, 2), mask, None, 2.0, "token", 2.0)
    assert rc.accepted.tolist() == [[1.0, 0.0], [1.0, 0.0]]
    adv = T([[1.0, 5.0], [3.0, 0.0]])
    logp = torch.zeros(2, 2)
    loss, _ = compute_policy_loss(logp, logp, adv, rc.accepted, 0.2, 0.2, 3.0, "token-mean",
                                  rollout_is_weights=rc.weights)  # fmt: skip
    assert float(loss) == pytest.approx(-2.0)
    # seq-mean-token-mean: row means -1 and -3 -> -2; a fully rejected row would leave the mean too.
    loss, _ = compute_policy_loss(logp, logp, adv, rc.accepted, 0.2, 0.2, 3.0, "seq-mean-token-mean",
                                  rollout_is_weights=rc.weights)  # fmt: skip
    assert float(loss) == pytest.approx(-2.0)


def test_rejected_tokens_leave_the_advantage_whitening_but_not_the_group_baseline():
    # Scores [1, 0, 2] in one group, each on the response's one token; the third response is rejected.
    # GRPO keeps it in the baseline (it was sampled): mean 1, std 1 -> A = [0, -1, (0: rejected)].
    mask = torch.ones(3, 1)
    rewards = T([[1.0], [0.0], [2.0]])
    accepted = T([[1.0], [1.0], [0.0]])
    adv, _ = compute_advantage("grpo", token_level_rewards=rewards, response_mask=mask, group_index=[0, 0, 0],
                               accepted_mask=accepted, epsilon=0.0)  # fmt: skip
    torch.testing.assert_close(adv, T([[0.0], [-1.0], [0.0]]))
    # REINFORCE++ (gamma 1): returns [1, 0, 2]; whitened over the accepted [1, 0] only: mean 0.5, unbiased
    # std sqrt(0.5) -> [0.5, -0.5] / sqrt(0.5 + 1e-8); the rejected token gets 0.
    adv, ret = compute_advantage("reinforce_plus_plus", token_level_rewards=rewards, response_mask=mask,
                                 gamma=1.0, accepted_mask=accepted)  # fmt: skip
    s = math.sqrt(0.5 + 1e-8)
    torch.testing.assert_close(adv, T([[0.5 / s], [-0.5 / s], [0.0]]))
    torch.testing.assert_close(ret, rewards)


def test_reinforce_pp_return_reaches_past_a_rejected_last_token():
    # One response [token 0, token 1], reward 1 on token 1, which is rejected: the return of token 0 is
    # still 1 (gamma 1) -- the reward happened; only the loss leaves token 1 out.
    _, ret = compute_advantage("reinforce_plus_plus", token_level_rewards=T([[0.0, 1.0], [0.0, 0.0]]),
                               response_mask=torch.ones(2, 2), gamma=1.0,
                               accepted_mask=T([[1.0, 0.0], [1.0, 1.0]]))  # fmt: skip
    assert ret[0].tolist() == [1.0, 1.0]


def test_sequence_is_weight_clamps_the_summed_log_ratio():
    # Token log-ratios [-25, 10]: rho_seq = e^-15 (clamping each token first would give e^(-20 + 10)).
    # [-30, 5]: the sum -25 is clamped to -20. [25, -24]: e^1 = 2.718 -> truncated at 2.
    lp = T([[-25.0, 10.0], [-30.0, 5.0], [25.0, -24.0]])
    rc = rollout_correction(lp, torch.zeros(3, 2), torch.ones(3, 2), "sequence", 2.0, None, 2.0)
    expected = T([[math.exp(-15)] * 2, [math.exp(-20)] * 2, [2.0, 2.0]])
    torch.testing.assert_close(rc.weights, expected, rtol=1e-6, atol=0.0)


def test_sequence_rejection_uses_the_exact_sum():
    # [25, -24.9] sums to 0.1: accepted at bound 2 (ln 2 = 0.69); summing clamped tokens (20 - 20) would
    # accept too. [25, -20.5] sums to 4.5: rejected (clamped tokens would sum to -0.5 and accept it).
    lp = T([[25.0, -24.9], [25.0, -20.5]])
    rc = rollout_correction(lp, torch.zeros(2, 2), torch.ones(2, 2), None, 2.0, "sequence", 2.0)
    assert rc.accepted.tolist() == [[1.0, 1.0], [0.0, 0.0]]


def test_rollout_corr_kl_is_unclamped():
    # Log-ratios [30, 0]: KL(rollout || train) ~ mean(log pi_rollout - log pi_train) = -15 (not -10).
    rc = rollout_correction(T([[30.0, 0.0]]), torch.zeros(1, 2), torch.ones(1, 2), "token", 2.0, None, 2.0)
    assert rc.metrics["rollout_corr/kl"] == pytest.approx(-15.0)
    assert rc.metrics["rollout_corr/logprob_abs_diff_mean"] == pytest.approx(15.0)


def test_seq_mean_token_sum_norm_is_dr_grpo_mean_over_responses():
    # Sums 3 and 4 over T = 3: Dr. GRPO's (1/G) sum_i sum_t / T = 3.5 / 3; verl's sum / T would be 7 / 3.
    loss = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert float(agg_loss(loss, mask, "seq-mean-token-sum-norm")) == pytest.approx(3.5 / 3)


def test_clip_cov_clamps_the_log_ratio_at_20():
    # One token at log-ratio 25 with A = -1, outside the covariance band (nothing detached): PPO picks
    # -A r (larger than -A (1 + eps)), r = e^20 after the clamp; no gradient passes the clamp.
    old = T([[0.0, 0.0]])
    lp = T([[25.0, 0.0]], requires_grad=True)
    adv = T([[-1.0, 1.0]])
    opts = PolicyLossConfig(loss_mode="clip-cov", clip_cov_lb=100.0, clip_cov_ub=200.0)
    loss, _ = compute_policy_loss(
        old, lp, adv, torch.ones(1, 2), 0.2, 0.2, 3.0, "token-mean", "clip-cov", policy_loss_options(opts)
    )
    assert float(loss.detach()) == pytest.approx((math.exp(20) - 1.0) / 2, rel=1e-6)
    loss.backward()
    assert lp.grad.tolist() == [[0.0, -0.5]]


def test_kl_cov_penalty_and_ppo_kl_metric():
    # Log-ratios [25, 0.5, -0.3], A = [1, -1, 0]: covariances (A - 0) x (log pi - 8.4) = [16.6, 7.9, 0], so
    # the top 1 (kl_cov_ratio 0.34 of 3 tokens) is the first, penalised by 0.1 x |log-ratio| clamped to 20
    # (verl: 0.1 x 25). Losses [-e^20 + 2, e^0.5, 0], token mean. ppo_kl is mean(old - new) over the clamped
    # log-ratios, -(20 + 0.5 - 0.3) / 3, the k1 estimate every mode reports (verl's KL-Cov reports mean
    # |log-ratio| unclamped, (25 + 0.5 + 0.3) / 3 = 8.6).
    old = torch.zeros(1, 3)
    lp = T([[25.0, 0.5, -0.3]])
    adv = T([[1.0, -1.0, 0.0]])
    opts = PolicyLossConfig(loss_mode="kl-cov", kl_cov_ratio=0.34, ppo_kl_coef=0.1)
    loss, metrics = compute_policy_loss(
        old, lp, adv, torch.ones(1, 3), 0.2, 0.2, 3.0, "token-mean", "kl-cov", policy_loss_options(opts)
    )
    assert float(loss) == pytest.approx((-math.exp(20) + 2.0 + math.exp(0.5)) / 3, rel=1e-6)
    assert float(metrics["ppo_kl"]) == pytest.approx(-20.2 / 3, rel=1e-6)
    assert float(metrics["pg_clipfrac"]) == pytest.approx(1 / 3)


# ------------------------------------------------------------------------------- where users see it
@pytest.mark.parametrize("mode", ["gspo", "sapo"])
def test_validate_warns_when_sapo_or_gspo_meet_another_aggregation(mode):
    base = replace_paths(get_preset("tiny-grpo"), {"actor.policy_loss.loss_mode": mode})
    for agg in LOSS_AGG_MODES:
        issues = check_config(replace_paths(base, {"actor.loss_agg_mode": agg}))
        warned = [i for i in issues if i.rule == "policy-loss" and i.path == "actor.loss_agg_mode"]
        if agg == "seq-mean-token-mean":
            assert not warned
        else:
            (w,) = warned
            assert w.severity == "warning" and "seq-mean-token-mean" in w.message and agg in w.message
            assert "set actor.loss_agg_mode: seq-mean-token-mean" in w.fix
    # Other loss modes aggregate as configured: no warning.
    assert not [i for i in check_config(get_preset("tiny-grpo")) if i.path == "actor.loss_agg_mode"]


def test_import_verl_warns_that_seq_mean_token_sum_norm_changes_the_gradient_scale():
    overrides = ["algorithm.adv_estimator=grpo", "trainer.n_gpus_per_node=1", "data.train_batch_size=8",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=2",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]  # fmt: skip
    tr = translate(None, [*overrides, "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm"])
    (w,) = [i for i in tr.warnings if i.path == "actor.loss_agg_mode"]
    assert "ppo_micro_batch_size_per_gpu = 2" in w.message and "1/G" in w.message and "clip_grad" in w.fix
    assert "runs in both, but the numbers differ" in format_report(tr)
    # The same import with another mode means the same numbers: no warning.
    tr = translate(None, [*overrides, "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"])
    assert not [i for i in tr.warnings if i.path == "actor.loss_agg_mode"]
