"""End to end: the algorithms of issue 23 in real `rltrain` runs (real Ray, real megatron-core over gloo).

DAPO's dynamic sampling must make tiny-dapo learn and show its filter counts in every metrics line; rollout
correction, its bypass mode and the GSPO loss must run through a whole step; a filter that never finds a
group with spread must stop the run with the config error, not spin forever.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

# Keep the short runs short: no validation pass, no checkpoint.
SHORT = ("--trainer.val_before_train", "false", "--trainer.test_freq", "0", "--trainer.save_freq", "0")


def rltrain(
    *args: str, pythonpath: Path | None = None, timeout: int = 900
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "rltrain.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_tiny_dapo_learns_and_logs_its_filter_counts(tmp_path):
    """The issue's done-when: the tiny-dapo preset as shipped (100 steps) doubles its reward, and every step
    says how many groups the filter kept and how many generation batches it took."""
    out = tmp_path / "run"
    result = rltrain("tiny-dapo", "--trainer.output_dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 101))

    def first_last(key: str) -> tuple[float, float]:
        return sum(r[key] for r in rows[:10]) / 10, sum(r[key] for r in rows[-10:]) / 10

    # reward/mean is the shaped reward (score + the overlong penalty, <= 0): it starts below zero, where
    # "2x the first steps" would hold for any run, so its gain is measured against |first|; the reward
    # function's own score (reward/score_mean) starts above zero and must at least double.
    first, last = first_last("reward/mean")
    first_score, last_score = first_last("reward/score_mean")
    print(f"tiny-dapo first / last 10 steps: reward/mean {first:.3f} / {last:.3f}, "
          f"reward/score_mean {first_score:.3f} / {last_score:.3f}")  # fmt: skip
    assert last > 0 and last >= 2 * abs(first), (first, last)
    assert first_score > 0 and last_score >= 2 * first_score, (first_score, last_score)
    want = 8  # tiny-dapo's data.train_batch_size
    for r in rows:
        assert r["filter/kept_groups"] >= want, r  # a step trains only once it has a full batch of groups
        assert 1 <= r["filter/gen_batches"] <= 10, r  # bounded by max_num_gen_batches
    # The filter did work: at least one step needed more than one generation batch.
    assert max(r["filter/gen_batches"] for r in rows) > 1


def test_token_rollout_correction_logs_its_weights(tmp_path):
    """Token-level truncated IS: the rollout_corr/* metrics appear; the embedded rollout samples with the
    weights being trained, so the weights are 1 and nothing is rejected (up to fp32 log-prob noise)."""
    out = tmp_path / "run"
    result = rltrain("tiny-grpo", "--trainer.total_steps", "2", "--trainer.output_dir", str(out), *SHORT,
                     "--algorithm.rollout_correction.rollout_is", "token")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("is_weight_mean", "is_weight_max", "rejected_fraction", "kl", "logprob_abs_diff_mean"):
            assert math.isfinite(r[f"rollout_corr/{key}"]), (key, r)
        # fp32 on CPU: log-prob gaps stay below 1e-4 (test_e2e's logprob_diff_max bound), so |w - 1| < 1e-3.
        assert r["rollout_corr/is_weight_mean"] == pytest.approx(1.0, abs=1e-3), r
        assert r["rollout_corr/rejected_fraction"] == 0.0, r


def test_rejection_sampling_trains_on_the_accepted_tokens_of_an_off_policy_batch(tmp_path):
    """One step off policy (a separate rollout one update behind), token rejection sampling at 1.2: some
    tokens are rejected, and the update still trains on the rest (their mean: rltrain.algorithms and
    tests/test_loss_reference.py pin it)."""
    out = tmp_path / "run"
    result = rltrain("tiny-grpo", "--cluster.gpus_per_node", "3", "--rollout.placement", "separate",
                     "--rollout.num_devices", "1", "--algorithm.off_policy_steps", "1",
                     "--algorithm.rollout_correction.rollout_rs", "token",
                     "--algorithm.rollout_correction.rollout_rs_threshold", "1.2",
                     "--trainer.total_steps", "3", "--trainer.output_dir", str(out), *SHORT)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows[1:]:  # staleness 1: the rollout's policy differs from the trainer's
        assert 0.0 < r["rollout_corr/rejected_fraction"] < 1.0, r
        assert math.isfinite(r["actor/loss"]) and r["actor/grad_norm"] > 0, r


def test_bypass_mode_skips_the_old_log_prob_pass(tmp_path):
    """bypass_mode: the rollout's log-probs are the old policy, so the step has no recomputation pass."""
    out = tmp_path / "run"
    result = rltrain("tiny-grpo", "--trainer.total_steps", "2", "--trainer.output_dir", str(out), *SHORT,
                     "--algorithm.rollout_correction.rollout_is", "token",
                     "--algorithm.rollout_correction.bypass_mode", "true")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert "timing/old_log_prob_s" not in r and "rollout/logprob_diff_max" not in r, r
        assert math.isfinite(r["actor/loss"]) and r["actor/grad_norm"] > 0, r


def test_gspo_loss_mode_trains(tmp_path):
    out = tmp_path / "run"
    result = rltrain("tiny-grpo", "--trainer.total_steps", "2", "--trainer.output_dir", str(out), *SHORT,
                     "--actor.policy_loss.loss_mode", "gspo")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["actor/loss"]) and r["actor/grad_norm"] > 0, r


def test_filter_that_never_keeps_a_group_exits_2(tmp_path):
    """A reward without spread (every response scores the same) leaves DAPO's filter nothing to keep: after
    max_num_gen_batches generation batches the run stops with exit 2 naming that setting and its fix."""
    (tmp_path / "flat_reward_mod.py").write_text(
        "def score(response, ground_truth, prompt):\n    return 0.5\n"
    )
    out = tmp_path / "run"
    result = rltrain("tiny-dapo", "--trainer.total_steps", "2", "--trainer.output_dir", str(out), *SHORT,
                     "--reward.function", "flat_reward_mod:score",
                     "--algorithm.filter_groups.max_num_gen_batches", "2", pythonpath=tmp_path)  # fmt: skip
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert "algorithm.filter_groups.max_num_gen_batches" in result.stderr, result.stderr[-3000:]
    assert "step 1: 2 generation batches gave 0 prompt groups" in result.stderr, result.stderr[-3000:]
    assert "raise max_num_gen_batches" in result.stderr and "Traceback" not in result.stderr
