"""kill -9 of a real training job at every point of a checkpoint save, then a rerun that must resume cleanly.

The job is `python -m rltrain.cli tiny-grpo ...` in a session of its own (Ray's daemons and workers, and the
background writer of an async save, are in that session too). `RLPLAN_CHECKPOINT_FAULT=POINT@STEP` (the
test-only hook of rltrain/checkpoint/faults.py) makes the process that reaches POINT SIGKILL the whole job
there, so each point is hit exactly, not by timing luck. After every run the test SIGKILLs whatever is left of the
session and checks that nothing survives.

One output folder, one run per fault: each run resumes from what the previous crash left, so it also checks
that recovery (cleanup of partial folders, choice of the checkpoint, metrics.jsonl without duplicates). The
first five faults hit synchronous saves, the next two asynchronous ones (`--actor.checkpoint.async_save true`),
and a last run without a fault finishes the job. Each run costs ~15-25 s (Ray start, megatron import).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from rltrain.checkpoint import COMPLETE, FAULT_ENV, MANIFEST, CheckpointRegistry

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

COMMON = ("--trainer.save_freq", "1", "--trainer.val_before_train", "false", "--trainer.test_freq", "0",
          "--logging.plot_reward", "false")  # fmt: skip


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    strays: int  # processes of the job's session still alive after it ended (then killed)
    seconds: float  # wall time of the run, clean-up included


def _session(sid: int) -> list[psutil.Process]:
    alive = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except (psutil.Error, OSError):
            continue
    return alive


def _kill_session(sid: int) -> int:
    """SIGKILL every process of session `sid` (the job: trainer, Ray daemons and workers); returns how many
    there were. Fails the test if any survives."""
    found = _session(sid)
    deadline = time.monotonic() + 15
    while (left := _session(sid)) and time.monotonic() < deadline:
        for proc in left:
            with contextlib.suppress(OSError):
                os.kill(proc.pid, signal.SIGKILL)
        time.sleep(0.1)
    assert not _session(sid), f"processes of the killed job survived: {[p.pid for p in _session(sid)]}"
    return len(found)


def rltrain(out: Path, total_steps: int, *flags: str, fault: str | None = None, timeout: int = 300) -> Run:
    """Run the trainer CLI in its own session; stdout / stderr go to files (a pipe held by a stray process
    would keep the test waiting)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    env.pop(FAULT_ENV, None)
    if fault is not None:
        env[FAULT_ENV] = fault
    # Keep every checkpoint unless a run asks for retention (the preset keeps 2), so each fault point
    # finds the checkpoints it is aimed at.
    keep = () if "--trainer.max_ckpt_to_keep" in flags else ("--trainer.max_ckpt_to_keep", "None")
    cmd = [sys.executable, "-m", "rltrain.cli", "tiny-grpo", "--trainer.total_steps", str(total_steps),
           "--trainer.output_dir", str(out), *COMMON, *keep, *flags]  # fmt: skip
    logs = out.parent / f"{out.name}-logs"
    logs.mkdir(exist_ok=True)
    n = len(list(logs.glob("*.out")))
    t0 = time.monotonic()
    stdout_path, stderr_path = logs / f"{n}.out", logs / f"{n}.err"
    with open(stdout_path, "w") as so, open(stderr_path, "w") as se:
        proc = subprocess.Popen(cmd, stdout=so, stderr=se, env=env, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            strays = _kill_session(proc.pid)  # the session id is the leader's pid
            proc.wait()
    seconds = time.monotonic() - t0
    print(f"run {n} ({fault or 'no fault'}): rc {proc.returncode}, {seconds:.1f} s, {strays} processes left")
    return Run(proc.returncode, stdout_path.read_text(), stderr_path.read_text(), strays, seconds)


def steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if line]


def check_metrics(out: Path, ckpts: Path) -> None:
    """metrics.jsonl after a crash: steps 1..k once each, and k reaches every committed checkpoint's step.

    A resumed run logs from the checkpoint's step + 1 on (after dropping lines beyond it): a committed step
    without its line would stay missing for ever, a line beyond it is redone and replaced. So a step's line
    must be written before its checkpoint is committed, and when the kill comes between the two is up to
    the controller."""
    rows = steps(out)
    assert rows == list(range(1, len(rows) + 1)), f"metrics.jsonl steps are not 1..k once each: {rows}"
    committed = max(CheckpointRegistry(ckpts).step_folders(), default=0)
    assert len(rows) >= committed, (
        f"global_step_{committed} is committed but metrics.jsonl stops at step {len(rows)}: a run resumed from "
        f"it never logs step {committed} (the controller must log a step before committing its checkpoint)"
    )


def leftovers(ckpts: Path, kind: str) -> list[Path]:
    return sorted(ckpts.glob(f"global_step_*.{kind}-*"))


def check_published_state(ckpts: Path, latest: int) -> None:
    """What a crash may never break: the latest file names `latest`, that checkpoint is complete and intact,
    and every global_step_N folder is a complete checkpoint (partial saves live only in .tmp-* folders)."""
    reg = CheckpointRegistry(ckpts)
    assert reg.read_latest_file() == latest
    assert reg.check_complete(reg.step_dir(latest), full=True) is None
    for step, folder in reg.step_folders().items():
        assert reg.check_complete(folder, full=True) is None, (
            f"global_step_{step} is published but incomplete"
        )


def killed(run: Run, point: str) -> None:
    assert run.returncode == -signal.SIGKILL, (
        f"expected the job to die by SIGKILL at {point}; rc={run.returncode}\n{run.stderr[-3000:]}"
    )


def resumed(run: Run, ckpts: Path, step: int) -> None:
    assert f"resumed from {ckpts / f'global_step_{step}'} (step {step})" in run.stdout, (
        f"expected a resume from step {step}\nstdout: {run.stdout[-2000:]}\nstderr: {run.stderr[-3000:]}"
    )


def test_kill_9_at_every_save_point_then_resume(tmp_path):
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    t0 = time.monotonic()

    # 1. sync, step 2: the role's files are written, its manifest is not.
    run = rltrain(out, 2, fault="before_manifest@2")
    killed(run, "before_manifest")
    check_published_state(ckpts, latest=1)
    (staged,) = leftovers(ckpts, "tmp")
    assert staged.name.startswith("global_step_2.") and (staged / "actor" / "dist_ckpt").is_dir()
    assert not (staged / "actor" / MANIFEST).exists()
    check_metrics(out, ckpts)

    # 2. sync, step 3: manifests verified, no COMPLETE marker yet. The rerun resumed from step 1 and removed
    # the partial save of step 2 before saving step 2 again.
    run = rltrain(out, 3, fault="before_complete@3")
    killed(run, "before_complete")
    resumed(run, ckpts, 1)
    check_published_state(ckpts, latest=2)
    (staged,) = leftovers(ckpts, "tmp")
    assert staged.name.startswith("global_step_3.") and (staged / "actor" / MANIFEST).is_file()
    assert not (staged / COMPLETE).exists()
    check_metrics(out, ckpts)

    # 3. sync, step 4: COMPLETE written in the staging folder, not yet renamed into place: not published.
    run = rltrain(out, 4, fault="before_rename@4")
    killed(run, "before_rename")
    resumed(run, ckpts, 2)
    check_published_state(ckpts, latest=3)
    (staged,) = leftovers(ckpts, "tmp")
    assert staged.name.startswith("global_step_4.") and (staged / COMPLETE).is_file()
    check_metrics(out, ckpts)

    # 4. sync, step 5: global_step_5 is in place, the latest file still names step 4.
    run = rltrain(out, 5, fault="before_latest@5")
    killed(run, "before_latest")
    resumed(run, ckpts, 3)
    check_published_state(ckpts, latest=4)
    assert (ckpts / "global_step_5" / COMPLETE).is_file() and not leftovers(ckpts, "tmp")
    check_metrics(out, ckpts)

    # 5. sync, step 6 with max_ckpt_to_keep 2: killed while retention deletes step 1. The rerun resumed from
    # step 5, the newest commit, not step 4 that the stale latest file named (and said why).
    run = rltrain(out, 6, "--trainer.max_ckpt_to_keep", "2", fault="during_retention@1")
    killed(run, "during_retention")
    resumed(run, ckpts, 5)
    assert "step 5 was committed after that file was written" in run.stderr
    check_published_state(ckpts, latest=6)
    (trash,) = leftovers(ckpts, "del")
    assert trash.name.startswith("global_step_1.") and not (ckpts / "global_step_1").exists()
    check_metrics(out, ckpts)

    # 6. async, step 7: killed while the background writer writes the dist checkpoint.
    run = rltrain(out, 8, "--actor.checkpoint.async_save", "true", fault="during_async_write@7")
    killed(run, "during_async_write")
    resumed(run, ckpts, 6)
    check_published_state(ckpts, latest=6)
    assert not leftovers(ckpts, "del")
    (staged,) = leftovers(ckpts, "tmp")
    assert staged.name.startswith("global_step_7.") and not (staged / "actor" / MANIFEST).exists()
    check_metrics(out, ckpts)

    # 7. async, step 7 again: the background write finished, killed before its manifest (the save is
    # finalized after step 7 was logged: at the next commit point, or at the start of the save of step 8).
    run = rltrain(out, 9, "--actor.checkpoint.async_save", "true", fault="before_manifest@7")
    killed(run, "before_manifest (async)")
    resumed(run, ckpts, 6)
    check_published_state(ckpts, latest=6)
    staged = next(p for p in leftovers(ckpts, "tmp") if p.name.startswith("global_step_7."))
    assert not (staged / "actor" / MANIFEST).exists()
    assert (staged / "actor" / "dist_ckpt" / "metadata.json").is_file()  # the write itself had finished
    check_metrics(out, ckpts)

    # 8. no fault: the job finishes from step 6; every step is logged exactly once, nothing partial remains.
    run = rltrain(out, 9, "--actor.checkpoint.async_save", "true")
    assert run.returncode == 0, run.stderr[-3000:]
    resumed(run, ckpts, 6)
    assert steps(out) == list(range(1, 10))
    check_published_state(ckpts, latest=9)
    assert not [p for p in ckpts.iterdir() if ".tmp-" in p.name or ".del-" in p.name or ".old-" in p.name]
    assert CheckpointRegistry(ckpts).complete_steps() == [2, 3, 4, 5, 6, 7, 8, 9]
    print(f"8 runs in {time.monotonic() - t0:.0f} s")
