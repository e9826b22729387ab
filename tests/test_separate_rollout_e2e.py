"""A separate rollout pool end to end (issue 24): the `rltrain` command on real Ray, real megatron-core
(gloo) and a real weight push between the two worker groups, as a user runs it."""

from __future__ import annotations

import pytest

from tests.test_e2e import comparable, metrics, rltrain

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

SEPARATE = ("--rollout.placement", "separate", "--rollout.num_devices", "1")
# Keys only a separate pool logs (which weights the batch used, the push).
PUSH_KEYS = ("rollout/weight_version", "off_policy/staleness", "rollout/weight_push_gib")


def test_on_policy_separate_rollout_reproduces_the_colocated_run(tmp_path):
    """With off_policy_steps 0 each batch waits for the push of the update before it: same weights, same
    seeds, so every metric (validation included) equals the colocated run's, bit for bit. This holds only if
    every push delivers every tensor exactly."""
    steps = ("--trainer.total_steps", "3", "--trainer.save_freq", "0")
    sep, col = tmp_path / "separate", tmp_path / "colocated"
    result = rltrain("tiny-grpo", *steps, "--cluster.gpus_per_node", "2", *SEPARATE,
                     "--trainer.output_dir", str(sep))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    result = rltrain("tiny-grpo", *steps, "--trainer.output_dir", str(col))
    assert result.returncode == 0, result.stderr[-3000:]
    a, b = metrics(sep), metrics(col)
    assert [r["off_policy/staleness"] for r in a] == [0, 0, 0]
    assert [r["rollout/weight_version"] for r in a] == [0, 1, 2]
    assert all(r["rollout/weight_push_gib"] > 0 for r in a)
    assert [{k: v for k, v in comparable(r).items() if k not in PUSH_KEYS} for r in a] == [
        comparable(r) for r in b
    ]


def test_one_step_off_policy_learns_and_overlaps(tmp_path):
    """The issue's command: generation of step s + 1 runs while step s trains, with the weights after step
    s - 1 (staleness 1), and the tiny task is still learnt (reward of the last 10 steps >= 2x the first 10)."""
    out = tmp_path / "off"
    result = rltrain("tiny-grpo", "--cluster.gpus_per_node", "3", *SEPARATE, "--algorithm.off_policy_steps", "1",
                     "--trainer.total_steps", "80", "--trainer.output_dir", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(out)
    assert rows[0]["off_policy/staleness"] == 0  # the first batch: the initial push, nothing to be ahead of
    assert all(r["off_policy/staleness"] == 1 for r in rows[1:])
    assert all(r["rollout_corr/is_weight_max"] >= 1.0 for r in rows[1:])  # token IS weights (the plan's)
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last >= 2 * first and last > first + 0.1, (first, last)


def test_a_dead_rollout_worker_stops_the_run_and_it_resumes(tmp_path):
    """The rollout worker dies when the push of version 3 reaches it: the run stops (exit 1, no hang) naming
    the role and rank, keeps its last complete checkpoint (step 2), and the same command resumes and ends."""
    out = tmp_path / "run"
    args = ("tiny-grpo", "--cluster.gpus_per_node", "3", *SEPARATE, "--algorithm.off_policy_steps", "1",
            "--trainer.total_steps", "5", "--trainer.save_freq", "2", "--trainer.output_dir", str(out))  # fmt: skip
    import os

    os.environ["RLPLAN_PUSH_FAULT"] = "receiver_dies@3"
    try:
        failed = rltrain(*args, "--rollout.push_timeout_s", "60")
    finally:
        del os.environ["RLPLAN_PUSH_FAULT"]
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "rollout worker rank 0 died" in failed.stderr
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    resumed = rltrain(*args, "--rollout.push_timeout_s", "60")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[2]["rollout/weight_version"] == 2  # resumed: the checkpoint's weights were pushed first
