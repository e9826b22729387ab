"""The run folder: one run at a time (a lock held by a real second process), the config history (a changed
config refused with old -> new, accepted and recorded, config.yaml never rewritten), and finished runs that
exit 0 before Ray starts. Checkpoints here are real registry commits of small files (no megatron)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from presets import get_preset
from rlconf.errors import ConfigError
from rlconf.fields import replace_paths
from rlconf.plan import compile_plan
from rlconf.run_config import ConfigDocument
from rltrain import checkpoint as ck
from rltrain.runfolder import HISTORY_FILE, LOCK_FILE, RunFolder, RunLock, read_history, recorded_config

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
HOLD = (
    "import sys, time\n"
    "from rltrain.runfolder import RunLock\n"
    "RunLock.acquire(sys.argv[1])\n"
    "print('locked', flush=True)\n"
    "time.sleep(600)\n"
)


def tiny(out: Path, **updates):
    """(config document, plan) of tiny-grpo in `out`; updates by dotted path with `__` for dots."""
    config = replace_paths(
        get_preset("tiny-grpo"),
        {"trainer.output_dir": str(out), "trainer.save_freq": 2, "trainer.total_steps": 4}
        | {k.replace("__", "."): v for k, v in updates.items()},
    )
    return ConfigDocument.of(config), compile_plan(config)


def commit_checkpoint(folder: RunFolder, step: int) -> None:
    """What the workers and the controller do for one save, with small files instead of megatron's."""
    for role, path in folder.ckpt.begin(step).items():
        role_dir = Path(path)
        (role_dir / "weights.bin").write_bytes(b"w" * 4096)
        contents = list(folder.ckpt.contents.get(role, ("model",)))
        (role_dir / ck.META).write_text(json.dumps({"role": role, "contents": contents}))
        ck.write_manifest(role_dir, role)
    folder.ckpt.commit(step)


def started(out: Path, steps: list[int], **updates) -> None:
    """A run folder as a run leaves it: config.yaml, checkpoints of `steps`, metrics up to the last one."""
    config, plan = tiny(out, **updates)
    folder = RunFolder.open(config, plan)
    folder.record_start(config, plan)
    for step in steps:
        commit_checkpoint(folder, step)
    (out / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s}) + "\n" for s in range(1, max(steps) + 1))
    )
    folder.close()


def rltrain(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rltrain.cli", "tiny-grpo", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )


@pytest.fixture
def holder(tmp_path):
    """Another process holding the lock of tmp_path/run."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "locked"
    yield proc
    proc.kill()
    proc.wait()


# ============================================================================================ the lock
def test_second_run_on_a_held_folder_exits_2_naming_the_holder_and_keeps_its_save(tmp_path, holder):
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as exc:
        RunLock.acquire(out)
    text = exc.value.format()
    assert exc.value.paths == ("trainer.output_dir",)
    assert f"PID {holder.pid} on host {socket.gethostname()}, since " in text
    assert "wait for that run to finish" in text and "another --trainer.output_dir" in text

    # The real command, on a folder whose holder is writing a save: exit 2 before Ray, the save untouched.
    staged = out / "checkpoints" / "global_step_3.tmp-0123456789"
    (staged / "actor").mkdir(parents=True)
    result = rltrain("--trainer.output_dir", str(out))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "run-folder-locked" in result.stderr and f"PID {holder.pid}" in result.stderr
    assert "Traceback" not in result.stderr and "Started a local Ray instance" not in result.stderr
    assert staged.is_dir(), "the second run deleted the first run's save in progress"
    assert not (out / "config.yaml").exists()


def test_lock_of_a_killed_holder_is_taken_over_with_a_message(tmp_path, holder, capsys):
    out = tmp_path / "run"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lock = RunLock.acquire(out)
    assert f"taking over the lock from dead PID {holder.pid}" in capsys.readouterr().err
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert (out / LOCK_FILE).read_text() == "", "a released lock names no holder"
    RunLock.acquire(out).release()
    assert "taking over" not in capsys.readouterr().err


# ============================================================================================ finished runs
def test_finished_run_exits_0_before_ray_and_says_how_to_extend(tmp_path):
    out = tmp_path / "run"
    started(out, [2, 4])
    config, plan = tiny(out)
    folder = RunFolder.open(config, plan)
    folder.close()
    assert folder.finished is not None
    assert "finished (step 4 of trainer.total_steps 4" in folder.finished
    assert "--trainer.total_steps N (N > 4)" in folder.finished

    written = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file() and p.name != LOCK_FILE}
    result = rltrain(
        "--trainer.output_dir", str(out), "--trainer.save_freq", "2", "--trainer.total_steps", "4"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "nothing to do: the run in" in result.stdout
    assert {
        p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file() and p.name != LOCK_FILE
    } == written
    assert "Started a local Ray instance" not in result.stderr + result.stdout, (
        "Ray started for a finished run"
    )

    # A larger total_steps extends it (tiny-grpo's lr is constant: no step changes its lr).
    config, plan = tiny(out, trainer__total_steps=6)
    folder = RunFolder.open(config, plan)
    assert folder.finished is None and folder.start_step == 5
    folder.record_start(config, plan)
    folder.close()
    (entry,) = read_history(out)
    assert entry["step"] == 5 and entry["changes"] == [
        {"path": "trainer.total_steps", "old": 4, "new": 6, "kind": "free", "why": "an extension"}
    ]
    assert "total_steps: 4" in (out / "config.yaml").read_text()


def test_finished_run_checks_a_changed_command_like_an_unfinished_one(tmp_path):
    """A finished folder does not swallow a changed command: a shorter total_steps is still finished (and
    the hint names a total that would train), another change is refused (run-config-changed) or, when
    accepted explicitly, nothing is left to train."""
    out = tmp_path / "run"
    started(out, [2, 4])
    config, plan = tiny(out, trainer__total_steps=3)  # shorter than what is done
    folder = RunFolder.open(config, plan)
    folder.close()
    assert folder.finished is not None and "--trainer.total_steps N (N > 4)" in folder.finished

    config, plan = tiny(out, actor__optim__lr=5e-4)
    with pytest.raises(ConfigError) as exc:
        RunFolder.open(config, plan)
    assert exc.value.issues[0].rule == "run-config-changed" and exc.value.issues[0].path == "actor.optim.lr"
    assert "--trainer.accept_config_changes true" in exc.value.format()

    config, plan = tiny(out, actor__optim__lr=5e-4, trainer__accept_config_changes=True)
    folder = RunFolder.open(config, plan)
    folder.close()
    assert folder.finished is not None

    # The real command: exit 2 before Ray, the folder untouched.
    result = rltrain("--trainer.output_dir", str(out), "--trainer.save_freq", "2", "--trainer.total_steps", "4",
                     "--rollout.temperature", "0.5")  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr[-2000:]
    assert "run-config-changed" in result.stderr and "rollout.temperature" in result.stderr
    assert "nothing to do" not in result.stdout and "Traceback" not in result.stderr


def test_run_without_checkpoints_is_finished_when_its_metrics_are(tmp_path):
    out = tmp_path / "run"
    config, plan = tiny(out, trainer__save_freq=0)
    folder = RunFolder.open(config, plan)
    folder.record_start(config, plan)
    folder.close()
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    folder = RunFolder.open(config, plan)
    folder.close()
    assert folder.finished is None, "3 of 4 steps logged"
    with (out / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 4}) + "\n")
    folder = RunFolder.open(config, plan)
    folder.close()
    assert folder.finished is not None and "step 4 of trainer.total_steps 4" in folder.finished
    assert "no checkpoint to continue from: it trains again from step 1" in folder.finished


# ============================================================================================ history
def test_resume_with_a_changed_config_is_refused_with_old_and_new(tmp_path):
    out = tmp_path / "run"
    started(out, [2])
    original = (out / "config.yaml").read_text()
    config, plan = tiny(out, actor__optim__lr=5e-4, algorithm__gamma=0.9)
    with pytest.raises(ConfigError) as exc:
        RunFolder.open(config, plan)
    text = exc.value.format()
    assert exc.value.paths == ("actor.optim.lr", "algorithm.gamma", "trainer.accept_config_changes")
    assert (
        "actor.optim.lr: 0.001 -> 0.0005: differs" in text and "algorithm.gamma: 1.0 -> 0.9: differs" in text
    )
    assert "resumes from step 2" in text
    for fix in (
        "another --trainer.output_dir",
        "--trainer.resume_mode disable",
        "--trainer.accept_config_changes",
    ):
        assert fix in text
    RunLock.acquire(out).release()  # the refusal let go of the lock
    assert (out / "config.yaml").read_text() == original

    # Logging, profiling, saving and validation are not changes of the run.
    config, plan = tiny(out, logging__level="DEBUG", trainer__save_freq=1, trainer__test_freq=0,
                        profile__tool="torch", profile__steps=(3,), logging__val_generations=4,
                        rollout__val__temperature=0.7, rollout__val__top_k=20,
                        actor__checkpoint__save_contents=("model", "optimizer", "extra", "hf_model"))  # fmt: skip
    folder = RunFolder.open(config, plan)
    folder.close()
    assert {c.path for c in folder.changes} == {"logging.level", "trainer.save_freq", "trainer.test_freq",
                                                "profile.tool", "profile.steps", "logging.val_generations",
                                                "rollout.val.temperature", "rollout.val.top_k",
                                                "actor.checkpoint.save_contents"}  # fmt: skip
    assert all(c.free for c in folder.changes)


def test_accepted_changes_are_recorded_from_their_step_and_config_yaml_stays(tmp_path):
    out = tmp_path / "run"
    started(out, [2])
    original = (out / "config.yaml").read_text()
    config, plan = tiny(out, actor__optim__lr=5e-4, trainer__accept_config_changes=True)
    folder = RunFolder.open(config, plan)
    folder.record_start(config, plan)
    folder.close()
    assert (out / "config.yaml").read_text() == original
    (entry,) = read_history(out)
    assert entry["step"] == 3 and not entry["restart"]
    assert {"path": "actor.optim.lr", "old": 0.001, "new": 0.0005, "kind": "accepted"} in entry["changes"]
    assert recorded_config(out)["actor.optim.lr"] == 5e-4

    # The folder now holds lr 5e-4: the same command resumes without the flag, the old lr is a change.
    folder = RunFolder.open(*tiny(out, actor__optim__lr=5e-4))
    folder.close()
    assert [c.path for c in folder.changes if not c.free] == []
    with pytest.raises(ConfigError) as exc:
        RunFolder.open(*tiny(out))
    assert "actor.optim.lr: 0.0005 -> 0.001" in exc.value.format()


def test_total_steps_that_moves_the_lr_of_remaining_steps_is_a_change(tmp_path):
    out = tmp_path / "run"
    cosine = {"actor__optim__lr_decay_style": "cosine", "actor__optim__min_lr": 1e-5}
    started(out, [2], **cosine)
    with pytest.raises(ConfigError) as exc:
        RunFolder.open(*tiny(out, trainer__total_steps=8, **cosine))
    assert exc.value.paths[0] == "trainer.total_steps"
    assert "lr schedule follows total_steps: step 3 would use lr" in exc.value.format()
    # With the decay span fixed, more steps leave steps 3-4 as they were: an extension.
    out2 = tmp_path / "fixed"
    started(out2, [2], actor__optim__lr_decay_steps=4, **cosine)
    folder = RunFolder.open(*tiny(out2, trainer__total_steps=8, actor__optim__lr_decay_steps=4, **cosine))
    folder.close()
    assert [(c.path, c.free) for c in folder.changes] == [("trainer.total_steps", "an extension")]


def test_resume_mode_disable_starts_over_and_records_a_restart(tmp_path):
    out = tmp_path / "run"
    started(out, [2, 4])
    config, plan = tiny(out, actor__optim__lr=5e-4, trainer__resume_mode="disable")
    folder = RunFolder.open(config, plan)
    assert folder.finished is None and folder.start_step == 1
    folder.record_start(config, plan)
    folder.close()
    (entry,) = read_history(out)
    assert entry["step"] == 1 and entry["restart"]
    assert (out / HISTORY_FILE).read_text().count("\n") == 1
    assert "lr: 0.001" in (out / "config.yaml").read_text()
