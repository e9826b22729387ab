"""The divergence guard end to end (rltrain/guard.py): a real `rltrain tiny-grpo` run whose reward function
returns a huge finite reward (3e38, the float32 limit: the group mean overflows, every advantage is NaN) at
steps 3 and 4, with a checkpoint every step and only one kept. The bad steps' updates are not applied and
they are not checkpointed: the run stops with exit code 3 and one line naming the first bad quantity and
step, the newest finite checkpoint (step 2) is the one left, and the same command (the reward fixed) resumes
from it exactly as an uninterrupted run goes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rltrain.guard import DIVERGED_EXIT

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

REWARD_MODULE = '''
"""A reward that returns 3e38 for calls [start, stop) of this process (RLPLAN_TEST_HUGE_REWARD=start,stop)."""
import os

from rltrain.rewards import REWARD_FUNCTIONS

_calls = 0


def score(response, ground_truth, prompt):
    global _calls
    window = os.environ.get("RLPLAN_TEST_HUGE_REWARD")
    call, _calls = _calls, _calls + 1
    if window:
        start, stop = map(int, window.split(","))
        if start <= call < stop:
            return 3e38
    return REWARD_FUNCTIONS["digit_match"](response, ground_truth, prompt)
'''
CALLS_PER_STEP = 8 * 8  # tiny-grpo: 8 prompts x 8 responses, no validation
NOT_REPRODUCIBLE = ("timing/", "perf/")


def rltrain(out: Path, modules: Path, total_steps: int, huge: str | None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled",
           "PYTHONPATH": os.pathsep.join([str(modules), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    env.pop("RLPLAN_TEST_HUGE_REWARD", None)
    if huge:
        env["RLPLAN_TEST_HUGE_REWARD"] = huge
    flags = ["--trainer.output_dir", str(out), "--trainer.total_steps", str(total_steps),
             "--trainer.save_freq", "1", "--trainer.max_ckpt_to_keep", "1", "--trainer.max_bad_steps", "2",
             "--trainer.val_before_train", "false", "--trainer.test_freq", "0", "--logging.plot_reward", "false",
             "--reward.function", "huge_reward:score"]  # fmt: skip
    return subprocess.run([sys.executable, "-m", "rltrain.cli", "tiny-grpo", *flags], capture_output=True,
                          text=True, timeout=600, env=env)  # fmt: skip


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(NOT_REPRODUCIBLE)}


def test_a_diverging_run_stops_keeps_the_last_finite_checkpoint_and_resumes_exactly(tmp_path):
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "huge_reward.py").write_text(REWARD_MODULE)
    out, straight = tmp_path / "run", tmp_path / "straight"

    bad = rltrain(out, modules, 6, f"{2 * CALLS_PER_STEP},{4 * CALLS_PER_STEP}")  # steps 3 and 4
    assert bad.returncode == DIVERGED_EXIT, bad.stderr[-3000:]
    assert "Traceback" not in bad.stderr, bad.stderr[-3000:]
    lines = [line for line in bad.stderr.splitlines() if "diverged" in line]
    assert len(lines) == 1, bad.stderr[-3000:]
    assert "diverged: advantages is not finite at step 3 (2 bad steps in a row up to step 4" in lines[0]
    assert "global_step_2" in lines[0]
    logged = rows(out)
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    assert [r["guard/bad_step"] for r in logged] == [0, 0, 1, 1]
    assert [r.get("guard/cause") for r in logged] == [None, None, "advantages", "advantages"]
    assert "actor/loss" not in logged[2] and "actor/loss" in logged[1]  # no update ran at a bad step
    assert "bad step: advantages not finite, update not applied" in bad.stdout
    ckpts = out / "checkpoints"
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert sorted(p.name for p in ckpts.glob("global_step_*")) == ["global_step_2"]

    # The reward fixed, the same command resumes from step 2 and goes as an uninterrupted run does.
    again = rltrain(out, modules, 6, None)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(step 2)" in again.stdout and "resumed from" in again.stdout
    ref = rltrain(straight, modules, 6, None)
    assert ref.returncode == 0, ref.stderr[-3000:]
    got, want = [comparable(r) for r in rows(out)], [comparable(r) for r in rows(straight)]
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert got == want


def test_a_model_folder_with_a_nan_norm_weight_stops_without_writing_a_checkpoint(tmp_path):
    """The issue's second case: an HF folder (exported by a 1-step run) with one NaN in model.norm.weight
    trained to exit 0 writing NaN checkpoints. Now every step is bad from step 1 (the rollout's log-probs),
    nothing is checkpointed, and the run stops with exit 3 naming rollout/log_probs at step 1."""
    import shutil

    from safetensors.torch import load_file, save_file

    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    common = ["--trainer.val_before_train", "false", "--trainer.test_freq", "0", "--logging.plot_reward", "false",
              "--trainer.save_freq", "1"]  # fmt: skip
    export = subprocess.run([sys.executable, "-m", "rltrain.cli", "tiny-grpo", "--trainer.total_steps", "1",
                             "--trainer.output_dir", str(tmp_path / "export"), *common,
                             "--actor.checkpoint.save_contents", "[model, optimizer, extra, hf_model]"],
                            capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert export.returncode == 0, export.stderr[-3000:]
    folder = tmp_path / "nan-model"
    shutil.copytree(tmp_path / "export" / "checkpoints" / "global_step_1" / "actor" / "huggingface", folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"][0] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})

    out = tmp_path / "run"
    run = subprocess.run([sys.executable, "-m", "rltrain.cli", "tiny-grpo", "--model.path", str(folder),
                          "--trainer.total_steps", "4", "--trainer.max_bad_steps", "2", "--trainer.output_dir",
                          str(out), *common], capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert run.returncode == DIVERGED_EXIT, run.stderr[-3000:]
    lines = [line for line in run.stderr.splitlines() if "diverged" in line]
    assert len(lines) == 1 and "rollout/log_probs is not finite at step 1" in lines[0], run.stderr[-3000:]
    assert "no checkpoint was written" in lines[0]
    assert [r["guard/cause"] for r in rows(out)] == ["rollout/log_probs", "rollout/log_probs"]
    assert not list(out.glob("checkpoints/global_step_*"))
