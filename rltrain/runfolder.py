"""The run folder (`trainer.output_dir`) around a run: one run at a time, what the folder already holds, its
config history, and a clean stop on SIGINT / SIGTERM.

`RunFolder.open(document, plan)` runs in `run_training` before Ray starts (seconds, no workers):
  1. lock: `run.lock` is flock'ed for the whole run and names its holder (host, pid, start time, command);
     a second run on the folder is a ConfigError (exit 2) naming the holder. The kernel drops the lock when
     its holder dies; the next run reports that it takes over from the dead PID.
  2. checkpoints: what crashed saves left is removed (only ever under the lock: a run must not delete the
     save another run is writing) and the resume point is resolved.
  3. history: every checkpoint's COMPLETE marker records the resolved config and the size and sha256 of
     every data file of the start that wrote it (rltrain.run_record). A resume is compared with the record
     of the checkpoint it resumes from, whatever config.yaml says: a changed field (old -> new) or a data
     file with other content is a ConfigError, unless `trainer.accept_config_changes` is set; accepted
     changes are recorded in `config_history.jsonl` with the step they take effect from. The folder's
     config is `config.yaml` (written once, by the first start, never rewritten; restored from the
     checkpoint's record when it was deleted) with the history applied in order: what a resume from a
     checkpoint without a record (older rlplan versions) is compared with, with a warning.
  4. finished: a run whose steps are all done says so and exits 0 (nothing is written, Ray never starts).

Fields that are not changes of the run (recorded in the history, never refused), see
`rlconf.run_config.free_reason`:
  logging.*, profile.*                                    what is observed, not what is trained
  trainer.output_dir, project_name, experiment_name       names
  trainer.resume_mode, resume_from_path, accept_config_changes    how this start resumes
  trainer.save_freq, max_ckpt_to_keep, *.checkpoint.save_contents, *.checkpoint.async_save    saving
  trainer.test_freq, val_before_train, rollout.val.*      validation (its sampling streams are its own)
  cluster.ray_address, cpus_per_worker, connect_timeout_s, device_memory_gib   where it runs, not the layout
  rollout.push_timeout_s                                  when a stuck push counts as failed
  trainer.total_steps     when the steps still to run keep their learning rates (an extension); with a
                          schedule that follows total_steps (decay span or warmup ratio) it is a change
A fresh start at step 1 (no checkpoint to resume, or trainer.resume_mode disable) may change anything; its
changes are recorded as a restart.

`StopSignals` turns SIGINT / SIGTERM into KeyboardInterrupt (Ray's blocking `ray.get` only gives way to
that) and remembers which signal came; `run_training` then stops the run cleanly and prints `stop_message`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import signal
import socket
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlconf.errors import ConfigError, error
from rlconf.plan import plan_to_dict
from rlconf.run_config import (
    ConfigChange,
    ConfigDocument,
    canonical_yaml,
    config_changes,
    flatten,
    parse_flat,
    yaml_scalar,
)
from rltrain import metrics_file
from rltrain.run_record import DataChange, RunRecord, checkpoint_record, record_file

if TYPE_CHECKING:
    from rlconf.plan import TrainerPlan
    from rlconf.plan.run import RunPlan
    from rltrain.checkpoint import CheckpointRegistry, Resume

LOCK_FILE = "run.lock"
CONFIG_FILE = "config.yaml"
PLAN_FILE = "plan.json"
HISTORY_FILE = "config_history.jsonl"
METRICS_FILE = "metrics.jsonl"  # rltrain.metrics.METRICS_FILE, without importing torch through it

EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


# ============================================================================================ the lock
@dataclass(frozen=True)
class Holder:
    """Who holds (or last held) a run folder's lock, as written in its lock file."""

    host: str
    pid: int
    since: str
    command: str

    @classmethod
    def me(cls) -> Holder:
        return cls(
            socket.gethostname(), os.getpid(), time.strftime("%Y-%m-%d %H:%M:%S %z"), " ".join(sys.argv)
        )

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        try:
            data = json.loads(text)
            return cls(str(data["host"]), int(data["pid"]), str(data["since"]), str(data.get("command", "")))
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        return f"PID {self.pid} on host {self.host}, since {self.since}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """An exclusive flock on `output_dir/run.lock`, held by this process until `release()` (or its death).

    flock, not a pid file: the kernel frees the lock when the holder dies (kill -9 included), so a stale lock
    never blocks a folder; the holder's details in the file are for the messages only. The descriptor is
    not inherited by child processes (Ray's daemons), so only this process holds the lock.
    """

    def __init__(self, path: Path, fd: int, took_over: Holder | None) -> None:
        self.path, self._fd, self.took_over = path, fd, took_over

    @classmethod
    def acquire(cls, folder: str | os.PathLike) -> RunLock:
        """Lock `folder` (created if missing); ConfigError naming the holder when another run has it."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = Holder.parse(os.pread(fd, 1 << 16, 0).decode(errors="replace"))
            os.close(fd)
            who = holder.describe() if holder else "another process (it has not written its details yet)"
            command = f" ({holder.command})" if holder and holder.command else ""
            raise ConfigError(
                [
                    error(
                        "trainer.output_dir",
                        f"{folder} is in use by another run: {who}{command}",
                        "wait for that run to finish (or stop it), or give this run another "
                        "--trainer.output_dir",
                        "run-folder-locked",
                    )
                ]
            ) from None
        # The file still names a holder only when that run ended without releasing the lock (it died).
        previous = Holder.parse(os.pread(fd, 1 << 16, 0).decode(errors="replace"))
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(dataclasses.asdict(Holder.me())).encode() + b"\n", 0)
        os.fsync(fd)
        if previous is not None:
            if previous.host == socket.gethostname() and not _pid_alive(previous.pid):
                what = f"dead PID {previous.pid} (started {previous.since})"
            else:
                what = f"{previous.describe()}, which no longer holds it"
            print(f"run folder {folder}: taking over the lock from {what}", file=sys.stderr, flush=True)
        return cls(path, fd, previous)

    def release(self) -> None:
        """Empty the file (no holder) and unlock; the file stays (deleting it would race a new holder)."""
        if self._fd < 0:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = -1


# ============================================================================================ history
def recorded_config(folder: str | os.PathLike) -> dict[str, Any] | None:
    """{dotted path: value} of the folder's current config: config.yaml with config_history.jsonl applied;
    None when the folder holds no config.yaml (a new run)."""
    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file():
        return None
    flat = parse_flat((folder / CONFIG_FILE).read_text(), str(folder / CONFIG_FILE))
    for entry in read_history(folder):
        for change in entry["changes"]:
            if change["new"] is None and change.get("removed"):
                flat.pop(change["path"], None)
            else:
                flat[change["path"]] = change["new"]
    return flat


def read_history(folder: str | os.PathLike) -> list[dict[str, Any]]:
    """The entries of config_history.jsonl, oldest first (a half-written last line is skipped)."""
    path = Path(folder) / HISTORY_FILE
    if not path.is_file():
        return []
    entries = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            entries.append(json.loads(line))
    return entries


def last_logged_step(folder: str | os.PathLike) -> int:
    """The last step in metrics.jsonl (0 when there is none)."""
    path = Path(folder) / METRICS_FILE
    last = 0
    if path.is_file():
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError, KeyError, TypeError, ValueError):
                last = max(last, int(json.loads(line)["step"]))
    return last


# ============================================================================================ the folder
@dataclass
class RunFolder:
    """A locked run folder and what it holds: the checkpoint registry, the resume point, the config changes
    of this start, and whether the run is already finished (`finished` is then the message to print)."""

    path: Path
    lock: RunLock
    ckpt: CheckpointRegistry
    resume: Resume | None
    changes: list[ConfigChange] = field(default_factory=list)
    new: bool = True
    finished: str | None = None
    record: RunRecord | None = None
    """This start's config and data files, recorded in every checkpoint it writes."""
    saved: RunRecord | None = None
    """The record of the checkpoint resumed from (None: none, or one written before records existed)."""
    expected: RunRecord | None = None
    """`saved` with the changes earlier starts from the same checkpoint accepted: what this start must match."""
    data_changes: list[DataChange] = field(default_factory=list)

    @property
    def start_step(self) -> int:
        return self.resume.step + 1 if self.resume is not None else 1

    @classmethod
    def open(cls, document: ConfigDocument, plan: TrainerPlan) -> RunFolder:
        """Lock the plan's run folder and check it against the run's config `document` (see the module
        docstring); ConfigError (exit 2) when another run holds it, a resume path is bad, or the config
        changed without being accepted."""
        from rltrain.checkpoint import CheckpointRegistry

        run = plan.run
        path = Path(run.output_dir)
        lock = RunLock.acquire(path)
        try:
            ckpt = CheckpointRegistry.from_plan(plan)
            ckpt.cleanup_incomplete()
            resume = ckpt.resolve_resume(plan) if plan.checkpoint.roles else None
            if resume is not None:
                from rltrain.checkpoint.safe_load import check_resume

                check_resume(resume.folder, ckpt.roles, run.resume_mode)
            folder = cls(path, lock, ckpt, resume)
            folder.record = RunRecord.of(document, plan.data)
            ckpt.run_record = folder.record.to_json()  # every checkpoint of this start carries it
            folder._check(document, run)
        except BaseException:
            lock.release()
            raise
        return folder

    def _check(self, document: ConfigDocument, run: RunPlan) -> None:
        """`run.total_steps`: the run's steps as the plan counts them (trainer.total_epochs derives them)."""
        total = run.total_steps
        done = self.resume.step if self.resume is not None else 0
        # A resume is compared with the record of the checkpoint it resumes from, whatever config.yaml says
        # (deleted or edited by hand); checkpoints of older versions have none: config.yaml, as before.
        self.saved = self.expected = None
        if self.resume is not None and run.resume_mode != "disable":
            from rltrain.checkpoint.manifest import read_marker  # here: the package imports torch

            self.saved, why = checkpoint_record(read_marker(self.resume.folder)[0])
            if self.saved is None:
                warnings.warn(
                    f"{record_file(self.resume.folder)}: {why}; the resume is checked against {CONFIG_FILE} "
                    f"with {HISTORY_FILE} applied, and the data files are not checked",
                    stacklevel=2,
                )
        self.new = not (self.path / CONFIG_FILE).is_file()
        if self.saved is not None:
            # Changes accepted by an earlier start from this same checkpoint hold for this one too.
            self.expected = self.saved.with_history(read_history(self.path), done)
            recorded = flatten(self.expected.config)
        else:
            recorded = recorded_config(self.path)
        self.changes = [] if recorded is None else config_changes(recorded, document.flat, done)
        self.data_changes = self.expected.data_changes(self.record) if self.expected is not None else []
        real = [c for c in self.changes if c.free is None]
        if run.resume_mode == "disable":
            return  # a fresh start: anything may change, it is recorded as a restart
        # Before anything is started: a malformed line is exit 2 naming it; a torn last line is removed.
        metrics_file.repair(self.path / METRICS_FILE)
        logged = last_logged_step(self.path)
        if done >= total or (not self.ckpt.step_folders() and not real and 0 < total <= logged):
            # A finished folder gets the same check as an unfinished one: a changed command must not be
            # swallowed by "nothing to do" (a longer total_steps never reaches here: it resumes).
            if done and real and not run.accept_config_changes:
                self._refuse(real, done)
            self.finished = self._finished_message(run.total_epochs, done if done >= total else logged, total)
            return
        if done and (real or self.data_changes) and not run.accept_config_changes:
            self._refuse(real, done)

    def _refuse(self, real: list[ConfigChange], done: int) -> None:
        against = (
            f"the config recorded in the checkpoint of step {done} ({record_file(self.resume.folder)})"
            if self.saved is not None and self.resume is not None
            else f"the folder's config ({CONFIG_FILE} with {HISTORY_FILE} applied)"
        )
        issues = [
            error(c.path, f"{yaml_scalar(c.old)} -> {yaml_scalar(c.new)}{f' ({c.note})' if c.note else ''}: differs from "
                  f"the run in {self.path}",
                  f"set it back to {yaml_scalar(c.old)}", "run-config-changed")
            for c in real
        ]  # fmt: skip
        issues += [
            error(d.key, f"{d.file} changed since the checkpoint of step {done} was saved ({d.old.describe()} -> "
                  f"{d.new.describe()}): the resumed run would not read the prompts it was trained on",
                  f"put the original {d.file} back", "run-data-changed")
            for d in self.data_changes
        ]  # fmt: skip
        what = [f"{len(real)} field{'s' if len(real) != 1 else ''}"] if real else []
        if self.data_changes:
            n = len(self.data_changes)
            what.append(f"{n} data file{'s' if n != 1 else ''}")
        issues.append(
            error(
                "trainer.accept_config_changes",
                f"{self.path} holds a run that resumes from step {done} with another config "
                f"({' and '.join(what)} above, compared with {against})",
                "keep the run's config; or give this run another --trainer.output_dir; or start over in this "
                "folder with --trainer.resume_mode disable; or continue with the changes from step "
                f"{done + 1} on with --trainer.accept_config_changes true (recorded in {HISTORY_FILE})",
                "run-data-changed" if not real else "run-config-changed",
            )
        )
        raise ConfigError(issues, str(self.path))

    def _finished_message(self, epochs: int | None, done: int, total: int) -> str:
        where = f"checkpoint {self.resume.folder}" if self.resume is not None else f"{METRICS_FILE}"
        further = f"--trainer.total_steps N (N > {max(done, total)})" if epochs is None else (
            f"--trainer.total_epochs N (N > {epochs}) --trainer.accept_config_changes true")  # fmt: skip
        if self.resume is None:
            further += " (there is no checkpoint to continue from: it trains again from step 1)"
        return (
            f"nothing to do: the run in {self.path} is finished (step {done} of trainer.total_steps {total} "
            f"is done; {where}).\n"
            f"    to train further: rerun the same command with {further}; "
            "to start over: --trainer.resume_mode disable, or another --trainer.output_dir"
        )

    def record_start(self, document: ConfigDocument, plan: TrainerPlan) -> None:
        """Write what this start adds to the folder: config.yaml on the first start (never rewritten), a
        config_history.jsonl entry when the config changed, and plan.json (the plan of this start)."""
        if self.new and self.saved is not None:
            self._restore_config_yaml()
        if self.new and self.saved is None:
            _write_text(self.path / CONFIG_FILE, document.text)
        elif self.changes or self.data_changes:
            restart = self.start_step == 1
            entry = {
                "step": self.start_step,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "restart": restart,
                "changes": [
                    c.record("restart" if restart else "free" if c.free else "accepted") for c in self.changes
                ],
            }
            if self.saved is not None and self.resume is not None and not restart:
                entry["from_checkpoint"] = self.saved.anchor(self.resume.step)
            if self.data_changes:
                entry["data_changes"] = [
                    d.record("restart" if restart else "accepted") for d in self.data_changes
                ]
            with (self.path / HISTORY_FILE).open("a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")
                f.flush()
                os.fsync(f.fileno())
            accepted = [c.describe() for c in self.changes if c.free is None]
            accepted += [f"{d.key} {d.describe()}" for d in self.data_changes]
            if not restart and accepted:
                print(f"config changes accepted from step {self.start_step} on (recorded in "
                      f"{self.path / HISTORY_FILE}): " + "; ".join(accepted), file=sys.stderr, flush=True)  # fmt: skip
        _write_text(self.path / PLAN_FILE, json.dumps(plan_to_dict(plan), indent=2) + "\n")

    def _restore_config_yaml(self) -> None:
        """config.yaml is gone but the checkpoint resumed from records its config: write that config (the
        run's at that checkpoint) as config.yaml, so the folder's config stays the run's and this start's
        changes go to the history. A history left without its config.yaml has no base: it is moved aside."""
        assert self.saved is not None and self.resume is not None
        history = self.path / HISTORY_FILE
        moved = ""
        if history.is_file():
            aside = history.with_name(f"{HISTORY_FILE}.orphaned-{int(time.time())}")
            os.replace(history, aside)
            moved = f"; {HISTORY_FILE}, which had no {CONFIG_FILE} to apply to, is now {aside.name}"
        text = canonical_yaml(self.saved.config)  # the config's field order (the marker's keys are sorted)
        _write_text(self.path / CONFIG_FILE, text)
        print(f"run folder {self.path}: {CONFIG_FILE} was missing; written from the config recorded in the "
              f"checkpoint of step {self.resume.step}{moved}", file=sys.stderr, flush=True)  # fmt: skip

    def stop_message(self, signum: int) -> str:
        """One line: which signal stopped the run, what the folder holds, and how to resume."""
        name = signal.Signals(signum).name
        steps = self.ckpt.complete_steps()
        logged = last_logged_step(self.path)
        if steps:
            held = f"its last complete checkpoint is step {steps[-1]} ({self.ckpt.step_dir(steps[-1])})"
            how = f"rerun the same command to resume from step {steps[-1]}"
        else:
            held = "it holds no complete checkpoint"
            how = "rerun the same command to start again from step 1"
        return f"stopped by {name}: {self.path} has metrics up to step {logged} and {held}; {how}"

    def close(self) -> None:
        self.lock.release()


def _write_text(path: Path, text: str) -> None:
    """Write through a temporary file and os.replace, so a crash never leaves half a file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


# ============================================================================================ stopping
class StopSignals:
    """SIGINT and SIGTERM stop the run cleanly: the first raises KeyboardInterrupt in the main thread (the
    only exception Ray's blocking calls give way to) and is remembered in `signum`; a second one while the
    run is stopping exits at once.

    `install()` again after `ray.init`, which puts its own SIGTERM handler in place.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for signum in EXIT_SIGNAL:
            previous = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, previous)

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            print(f"{signal.Signals(signum).name} again: exiting without finishing the clean stop (the next run "
                  "removes any half-written checkpoint)", file=sys.stderr, flush=True)  # fmt: skip
            os._exit(EXIT_SIGNAL[signum])
        self.signum = signum
        raise KeyboardInterrupt

    def exit_code(self) -> int:
        return EXIT_SIGNAL.get(self.signum or signal.SIGINT, 130)
