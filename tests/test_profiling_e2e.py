"""Per-role profiling end to end: the `rltrain` command with the torch profiler on 2 CPU workers.

Each test runs the CLI in its own process, as a user would (real Ray, real megatron-core over gloo, real
torch.profiler traces), for 3 steps of tiny-grpo with step 2 profiled; each run takes ~20 s. Three runs:
discrete mode with every role, continuous mode, and the `profile.roles` filter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

POLICY_ROLES = ("generate_sequences", "actor_compute_log_prob", "actor_update")
# Step 2 of 3 on ranks 0 and 1 of a 2-worker data-parallel run, CPU trace only, no validation rollouts (a
# validation generate in step 2 would add `call_2` folders to generate_sequences and reward_compute).
COMMON = (
    "tiny-grpo",
    "--cluster.gpus_per_node", "2",
    "--actor.ppo_micro_batch_size_per_gpu", "2",
    "--profile.tool", "torch",
    "--profile.steps", "[2]",
    "--profile.ranks", "[0,1]",
    "--profile.torch.activities", "[cpu]",
    "--trainer.total_steps", "3",
    "--trainer.val_before_train", "false",
    "--trainer.test_freq", "0",
)  # fmt: skip


def rltrain(out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    result = subprocess.run(
        [sys.executable, "-m", "rltrain.cli", *COMMON, "--trainer.output_dir", str(out), *flags],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def profile_folders(out: Path) -> set[str]:
    """Profile folders written under out/profile (each holds a meta.json), relative to it."""
    root = out / "profile"
    return {str(p.parent.relative_to(root)) for p in root.rglob("meta.json")}


def plan_folders(out: Path) -> set[str]:
    plan = json.loads((out / "plan.json").read_text())["profile"]
    return {str(Path(f).relative_to(plan["save_path"])) for f in plan["folders"]}


def slices(folder: Path) -> list[dict[str, Any]]:
    """The complete events (`ph: X`) of a folder's Chrome trace."""
    data = json.loads((folder / "trace.json").read_text())
    return [e for e in data["traceEvents"] if e.get("ph") == "X"]


def role_slice(events: list[dict[str, Any]], role: str) -> dict[str, Any]:
    marks = [e for e in events if e["name"] == role and e.get("cat") == "user_annotation"]
    assert len(marks) == 1, (role, len(marks))
    return marks[0]


def assert_summary_printed(out: Path, stdout: str) -> str:
    md = out / "profile" / "profile_summary.md"
    text = md.read_text()
    assert f"profile summary: {md}\n{text}" in stdout  # the path, then the table itself
    assert (out / "profile" / "summary.json").exists()
    return text


def test_discrete_profiles_each_role_call_on_each_rank(tmp_path: Path) -> None:
    out = tmp_path / "discrete"
    result = rltrain(out, "--profile.discrete", "true")
    root = out / "profile"
    expected = {f"step_2/{role}/rank_{r}" for role in POLICY_ROLES for r in (0, 1)}
    expected.add("step_2/reward_compute/rank_0")  # the rule reward runs once, in the controller
    assert profile_folders(out) == expected == plan_folders(out)
    assert sorted(p.name for p in root.iterdir()) == ["profile_summary.md", "step_2", "summary.json"]

    for rel in expected:
        folder = root / rel
        _, role, rank = rel.split("/")
        meta = json.loads((folder / "meta.json").read_text())
        assert (meta["role"], meta["step"], f"rank_{meta['rank']}") == (role, 2, rank)
        assert meta["status"] == "ok" and meta["call"] == 1 and meta["wall_s"] > 0
        assert meta["worker"] == ("controller" if role == "reward_compute" else "actor")
        events = slices(folder)
        mark = role_slice(events, role)
        assert mark["dur"] > 0
        ops = [e for e in events if e.get("cat") == "cpu_op"]
        # The trace is this call and nothing else: every operator lies inside the role's range.
        assert all(mark["ts"] <= e["ts"] and e["ts"] + e["dur"] <= mark["ts"] + mark["dur"] + 1 for e in ops)
        names = {e["name"] for e in events}
        assert not (names & (set(POLICY_ROLES) - {role}))  # no other role's range
        if role == "reward_compute":
            continue  # a Python rule: the range, no torch operators
        assert "aten::mm" in names  # the model ran inside the call
        trains = "Optimizer.step#AdamW.step" in names or any(n.endswith("Backward0") for n in names)
        assert trains == (role == "actor_update"), role  # backward and optimizer only in the update

    text = assert_summary_printed(out, result.stdout)
    assert "## Step 2" in text and "## Step 1" not in text and "## Step 3" not in text
    assert "| role | rank 0 | rank 1 | max |" in text
    for role in (*POLICY_ROLES, "reward_compute"):
        assert f"| {role} |" in text or f"| **{role}** (slowest) |" in text, role


def test_continuous_profiles_one_step_per_policy_rank(tmp_path: Path) -> None:
    out = tmp_path / "continuous"
    result = rltrain(out, "--profile.discrete", "false")
    expected = {"step_2/e2e/rank_0", "step_2/e2e/rank_1"}
    assert profile_folders(out) == expected == plan_folders(out)
    for rel in expected:
        folder = out / "profile" / rel
        meta = json.loads((folder / "meta.json").read_text())
        assert meta["role"] == "e2e" and meta["status"] == "ok" and meta["mode"] == "continuous"
        assert [c["role"] for c in meta["calls"]] == list(POLICY_ROLES)  # in the order the step calls them
        events = slices(folder)
        marks = [role_slice(events, role) for role in POLICY_ROLES]
        assert [m["ts"] for m in marks] == sorted(m["ts"] for m in marks)
        assert meta["wall_s"] >= sum(c["wall_s"] for c in meta["calls"])
    assert "| e2e |" in assert_summary_printed(out, result.stdout)


def test_roles_filter_profiles_only_the_listed_roles(tmp_path: Path) -> None:
    out = tmp_path / "roles"
    result = rltrain(out, "--profile.discrete", "true", "--profile.roles", "[actor_update]")
    expected = {"step_2/actor_update/rank_0", "step_2/actor_update/rank_1"}
    assert profile_folders(out) == expected == plan_folders(out)
    for rel in expected:
        events = slices(out / "profile" / rel)
        role_slice(events, "actor_update")
        assert not ({e["name"] for e in events} & {"generate_sequences", "actor_compute_log_prob"})
    text = assert_summary_printed(out, result.stdout)
    assert "generate_sequences" not in text and "reward_compute" not in text
