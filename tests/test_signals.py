"""SIGTERM and SIGINT stop a real `rltrain tiny-grpo` run cleanly: exit 143 / 130, one line saying what the
run folder holds and how to resume, no traceback, no process of the run left (the job runs in a session of
its own: the trainer, Ray's daemons and workers), and the same command resumes from the last complete
checkpoint. While the run goes, a second run on its folder exits 2 naming it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
FLAGS = ("--trainer.save_freq", "2", "--trainer.val_before_train", "false", "--trainer.test_freq", "0",
         "--logging.plot_reward", "false", "--trainer.max_ckpt_to_keep", "None")  # fmt: skip


def command(out: Path, total_steps: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "rltrain.cli", "tiny-grpo", "--trainer.output_dir", str(out),
            "--trainer.total_steps", str(total_steps), *FLAGS, *flags]  # fmt: skip


def logged_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            steps.append(json.loads(line)["step"])
    return steps


def session(sid: int) -> list[psutil.Process]:
    alive = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
    return alive


def kill_session(sid: int) -> None:
    for proc in session(sid):
        with contextlib.suppress(OSError):
            os.kill(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize(
    ("signum", "code", "group"),
    [(signal.SIGTERM, 143, False), (signal.SIGINT, 130, False), (signal.SIGTERM, 143, True)],
    ids=["SIGTERM", "SIGINT", "SIGTERM-to-the-process-group"],
)
def test_signal_stops_the_run_cleanly_and_the_same_command_resumes(tmp_path, signum, code, group):
    """SIGINT's run saves in the background: a save still being written when the signal comes is committed
    (its step's metrics line is written) or removed, never left half-done. `group`: the signal reaches every
    process of the job, Ray's GCS and raylet too (`timeout`, Slurm's scancel): the run still stops with its
    message and exit code within seconds (it took 21 s while the driver waited for Ray's GCS, which stops
    answering at once but takes ~10 s to exit), instead of waiting for a cluster that is gone."""
    out = tmp_path / "run"
    flags = ("--actor.checkpoint.async_save", "true") if signum == signal.SIGINT else ()
    err_path = tmp_path / "stderr.txt"
    with open(tmp_path / "stdout.txt", "w") as so, open(err_path, "w") as se:
        proc = subprocess.Popen(
            command(out, 300, *flags), stdout=so, stderr=se, env=ENV, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 300
        while len(logged_steps(out)) < 5:
            assert proc.poll() is None, err_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the run did not reach step 5"
            time.sleep(0.2)

        if signum == signal.SIGTERM and not group:  # once: a second run on the folder of a running one
            second = subprocess.run(
                command(out, 300, *flags), capture_output=True, text=True, env=ENV, timeout=300
            )
            assert second.returncode == 2, second.stderr[-3000:]
            assert "run-folder-locked" in second.stderr and f"PID {proc.pid} on host" in second.stderr

        sent = time.monotonic()
        if group:
            os.killpg(proc.pid, signum)
        else:
            os.kill(proc.pid, signum)
        assert proc.wait(timeout=120) == code
        took = time.monotonic() - sent
        if signum == signal.SIGTERM:  # what `timeout`, Slurm and Kubernetes send: stopped within seconds
            # The driver waits at most STOP_RELEASE_TIMEOUT_S (2.5 s) for Ray; the bound leaves four times as
            # much for the rest (settling, exiting), which took 5.4 s once and 7.9 s once while a second test
            # process shared the 2 cores. The regression this guards against took 21 s.
            from rltrain.controller import STOP_RELEASE_TIMEOUT_S

            bound = 5 * STOP_RELEASE_TIMEOUT_S
            assert took < bound, f"the run took {took:.1f} s to stop (bound {bound} s)"
        stderr = err_path.read_text()
        name = signal.Signals(signum).name
        lines = [line for line in stderr.splitlines() if line.startswith(f"stopped by {name}: ")]
        assert len(lines) == 1, stderr[-3000:]
        assert "Traceback" not in stderr, stderr[-3000:]
        resume_step = int(re.search(r"rerun the same command to resume from step (\d+)", lines[0]).group(1))

        # No process of the run is left once it has exited.
        deadline = time.monotonic() + 15
        while session(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not session(proc.pid), [p.cmdline()[:3] for p in session(proc.pid)]
    finally:
        kill_session(proc.pid)
        proc.kill()
        proc.wait()

    # The folder is consistent: the named checkpoint is the newest complete one, no staged save is left, and
    # metrics.jsonl has each step once, up to at least that checkpoint.
    ckpts = out / "checkpoints"
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text().strip() == str(resume_step)
    assert not [p.name for p in ckpts.iterdir() if ".tmp-" in p.name]
    steps = logged_steps(out)
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= resume_step >= 4

    rerun = subprocess.run(
        command(out, resume_step + 2, *flags), capture_output=True, text=True, env=ENV, timeout=300
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"(step {resume_step})" in rerun.stdout and "resumed from" in rerun.stdout
    assert logged_steps(out) == list(range(1, resume_step + 3))


def test_a_stop_whose_release_outlasts_its_bound_drops_the_staged_save(tmp_path, monkeypatch):
    """SIGTERM to the process group while a save is staged: when Ray does not answer within the stop's bound
    (the driver exits right after), the uncommitted staged save is removed, not left for the next start,
    and the committed checkpoints are untouched (flaked once in the full run: the release thread hung in a
    Ray call to dying workers and the driver exited before its own abort)."""
    import threading
    from types import SimpleNamespace

    from rltrain import controller
    from rltrain.checkpoint.registry import CheckpointRegistry

    root = tmp_path / "checkpoints"
    registry = CheckpointRegistry(root, ("actor",))
    (root / "global_step_4" / "actor").mkdir(parents=True)  # a published save stands in place
    (root / "global_step_4" / "actor" / "weights").write_text("kept")
    registry.begin(6)
    assert sorted(p.name.split(".tmp-")[0] for p in root.iterdir()) == ["global_step_4", "global_step_6"]
    hang = threading.Event()
    trainer = SimpleNamespace(ckpt=registry, shutdown=lambda **kw: hang.wait(30), _settle_saves=lambda: None)
    monkeypatch.setattr(controller, "STOP_RELEASE_TIMEOUT_S", 0.3)
    try:
        assert controller._release(trainer, stopping=True, failed=False) is False
        assert [p.name for p in root.iterdir()] == ["global_step_4"]
        assert (root / "global_step_4" / "actor" / "weights").read_text() == "kept"
        assert registry.pending_steps() == []
    finally:
        hang.set()
