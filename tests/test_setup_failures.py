"""Setup failures are one line: a disk without room (checked before each save, and ENOSPC / EROFS /
ENAMETOOLONG during one), an output_dir too long for the filesystem, a Ray address where nothing answers, and
more nodes than the cluster has. Each is exit 2 naming the config path and the fix, before anything is
written where that is possible, never a traceback and never "rerun the same command" (a rerun cannot fix it).

Real parts: the real `rltrain` / `rlconf` commands, real tmpfs mounts (small, full, read-only bind mounts),
real sockets, a real one-node Ray cluster, and megatron's own save of a real engine onto a full disk."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rlconf.errors import ConfigError
from rltrain.storage import RULE as STORAGE_RULE
from rltrain.storage import check_free_space, storage_errno, storage_errors

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
ENV.pop("RAY_ADDRESS", None)


def run(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout,
                          env=env or ENV)  # fmt: skip


def rltrain(*args: str, **kw) -> subprocess.CompletedProcess[str]:
    return run("rltrain.cli", "tiny-grpo", *args, **kw)


def one_line_error(result: subprocess.CompletedProcess[str], rule: str, path: str) -> str:
    """The run failed with exit 2 and one error of `rule` on `path`, no traceback, no "rerun"."""
    err = result.stderr
    assert result.returncode == 2, (result.returncode, err[-3000:], result.stdout[-2000:])
    assert f"error [{rule}] {path}: " in err, err[-3000:]
    assert err.count("error [") == 1, err[-3000:]
    assert "Traceback" not in err + result.stdout and "internal error" not in err
    assert "rerun the same command" not in err
    return err


# ============================================================================================ mounts
@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A real tmpfs of `size` at `path` (root only: skipped where mounting is impossible)."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def read_only_bind(src: Path, dst: Path):
    """`src` seen read-only at `dst` (a ro bind mount: chmod does not stop root)."""
    dst.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "--bind", str(src), str(dst)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {done.stderr.strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(dst)], check=True, capture_output=True)
        yield dst
    finally:
        subprocess.run(["umount", "-l", str(dst)], capture_output=True)


def fill(folder: Path) -> None:
    """Write into `folder` until its filesystem is full."""
    with open(folder / "filler.bin", "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 65536)
            f.flush()


# ============================================================================================ storage errors
def test_storage_errors_are_named_from_real_filesystems(tmp_path):
    import torch

    with tmpfs(tmp_path / "small", "1m") as small:
        fill(small)
        # A plain write: the errno is there.
        with pytest.raises(OSError) as raw:
            (small / "x.bin").write_bytes(b"x" * 100_000)
        assert storage_errno(raw.value, small) == errno.ENOSPC
        # torch.save loses the errno ("enforce fail at inline_container.cc ... unexpected pos"): the full
        # filesystem itself names the cause.
        wrapped = storage_errors(f"the checkpoint of step 2 could not be written to {small}", small, 1 << 20,
                                 "the checkpoints before it are intact")  # fmt: skip
        with pytest.raises(ConfigError) as exc, wrapped:
            torch.save(torch.zeros(100_000), small / "t.pt")
        text = exc.value.format()
        assert f"[{STORAGE_RULE}] trainer.output_dir: the checkpoint of step 2 could not be written" in text
        assert "no space left on the device" in text and "(ENOSPC)" in text and "intact" in text
        # The free-space check before a save, on the same real filesystem.
        with pytest.raises(ConfigError, match=r"does not fit.*a checkpoint needs about 2\.0 MiB"):
            check_free_space(small, 2 << 20, f"the checkpoint of step 3 does not fit in {small}")

    src = tmp_path / "src"
    src.mkdir()
    with read_only_bind(src, tmp_path / "ro") as ro:
        with pytest.raises(OSError) as raw:
            (ro / "global_step_1.tmp-x").mkdir()
        assert storage_errno(raw.value, ro) == errno.EROFS
    with pytest.raises(OSError) as raw:
        (tmp_path / ("n" * 300)).mkdir()
    assert storage_errno(raw.value, tmp_path) == errno.ENAMETOOLONG
    # Not the filesystem's fault: passes unchanged.
    with pytest.raises(ValueError), storage_errors("x", tmp_path):
        raise ValueError("a bug")


@pytest.mark.slow
@pytest.mark.usefixtures("world")
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")
def test_megatron_save_onto_a_full_disk_is_one_config_error(tmp_path):
    """The worker's save path: megatron's dist checkpoint of a real engine onto a full tmpfs, and onto a
    read-only one, inside the wrapper MegatronWorker.save_checkpoint puts around it."""
    from rltrain import checkpoint as ck
    from tests.test_checkpoint import _actor

    actor = _actor()
    with tmpfs(tmp_path / "small", "512k") as small:
        folder = small / "checkpoints" / "global_step_1.tmp-0123456789" / "actor"
        wrapped = storage_errors(
            f"the checkpoint of step 1 could not be written to {folder}", folder, 2 << 20
        )
        with pytest.raises(ConfigError) as exc, wrapped:
            ck.save_engine(actor, folder, ("model", "optimizer", "extra"), {"step": 1})
        assert exc.value.paths == ("trainer.output_dir",)
        assert "(ENOSPC)" in exc.value.format()
    src = tmp_path / "src"
    (src / "checkpoints").mkdir(parents=True)
    with read_only_bind(src, tmp_path / "ro") as ro:
        folder = ro / "checkpoints" / "global_step_1.tmp-0123456789" / "actor"
        wrapped = storage_errors("the checkpoint of step 1 could not be written", folder, 2 << 20)
        with pytest.raises(ConfigError, match=r"the filesystem is read-only \(EROFS\)"), wrapped:
            ck.save_engine(actor, folder, ("model", "optimizer", "extra"), {"step": 1})


def test_dry_run_and_run_refuse_a_disk_without_room_for_one_checkpoint(tmp_path):
    with tmpfs(tmp_path / "small", "1m") as small:
        out = small / "run"
        flags = ("--trainer.output_dir", str(out), "--trainer.save_freq", "1", "--trainer.total_steps", "2")
        err = one_line_error(rltrain(*flags, "--dry-run"), STORAGE_RULE, "trainer.output_dir")
        assert f"a checkpoint of this run does not fit in {small}" in err
        assert "a checkpoint needs about 2.5 MiB (the plan's estimate)" in err and "(ENOSPC)" in err
        assert not out.exists(), "a dry run writes nothing"
        # The run checks once it holds the folder (a finished run needs no room), before config.yaml.
        err = one_line_error(rltrain(*flags), STORAGE_RULE, "trainer.output_dir")
        assert f"a checkpoint of this run does not fit in {out}" in err and "(ENOSPC)" in err
        assert [p.name for p in out.iterdir()] == ["run.lock"], "no config.yaml / plan.json"
        assert "Started a local Ray instance" not in err
    # With room, --dry-run says what it checked.
    result = rltrain("--trainer.output_dir", str(tmp_path / "run"), "--dry-run")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "# checked before a run writes anything" in result.stdout
    assert "cluster: none given" in result.stdout and "a checkpoint needs about" in result.stdout
    assert "about 2.5 MiB each (the free space each save needs)" in result.stdout  # the plan's estimate


@pytest.mark.slow
@pytest.mark.multiproc
def test_disk_full_mid_run_stops_before_the_save_and_keeps_the_checkpoints(tmp_path):
    """4 MiB: step 1's checkpoint (about 1.8 MB) fits, step 2's does not. The run stops with one line, the
    checkpoint of step 1 stays complete and named by the latest file; with room again the same command
    resumes from it."""
    from rltrain.checkpoint import CheckpointRegistry

    with tmpfs(tmp_path / "disk", "4m") as disk:
        out = disk / "run"
        flags = ("--trainer.output_dir", str(out), "--trainer.save_freq", "1", "--trainer.total_steps", "3",
                 "--trainer.max_ckpt_to_keep", "None", "--logging.plot_reward", "false")  # fmt: skip
        err = one_line_error(rltrain(*flags, timeout=600), STORAGE_RULE, "trainer.output_dir")
        assert f"the checkpoint of step 2 does not fit in {out / 'checkpoints'}" in err, err[-3000:]
        assert "the checkpoints before it are intact (newest: step 1)" in err
        reg = CheckpointRegistry(out / "checkpoints")
        assert reg.complete_steps() == [1] and reg.read_latest_file() == 1
        assert reg.check_complete(reg.step_dir(1), full=True) is None
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
            "global_step_1", "latest_checkpointed_iteration.txt"]  # fmt: skip

        subprocess.run(["mount", "-o", "remount,size=32m", str(disk)], check=True)
        result = rltrain(*flags, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"resumed from {reg.step_dir(1)} (step 1)" in result.stdout
        steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2, 3]


@pytest.mark.slow
@pytest.mark.multiproc
def test_checkpoints_turning_read_only_mid_run_stop_with_one_line(tmp_path):
    """checkpoints/ is a bind mount made read-only once step 1 is committed (between saves nothing there is
    open for writing): the next save's staging folder gets EROFS. One line, exit 2, the committed
    checkpoints intact; read-write again, the same command resumes."""
    from rltrain.checkpoint import CheckpointRegistry

    with tmpfs(tmp_path / "disk", "64m") as disk:
        out = disk / "run"
        ckpts = out / "checkpoints"
        ckpts.mkdir(parents=True)
        subprocess.run(["mount", "--bind", str(ckpts), str(ckpts)], check=True)
        try:
            flags = ("--trainer.output_dir", str(out), "--trainer.save_freq", "1", "--trainer.total_steps", "8",
                     "--trainer.max_ckpt_to_keep", "None", "--logging.plot_reward", "false")  # fmt: skip
            proc = subprocess.Popen([sys.executable, "-m", "rltrain.cli", "tiny-grpo", *flags], env=ENV,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
            latest = ckpts / "latest_checkpointed_iteration.txt"
            deadline = time.monotonic() + 300
            while proc.poll() is None and time.monotonic() < deadline:
                if latest.is_file() and latest.read_text().strip() == "1":
                    done = subprocess.run(["mount", "-o", "remount,bind,ro", str(ckpts)], capture_output=True)
                    if done.returncode == 0:
                        break
                time.sleep(0.02)
            stdout, stderr = proc.communicate(timeout=300)
            result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
            err = one_line_error(result, STORAGE_RULE, "trainer.output_dir")
            assert "the filesystem is read-only (EROFS)" in err, err[-3000:]
            reg = CheckpointRegistry(ckpts)
            committed = reg.complete_steps()
            assert committed and committed == list(range(1, committed[-1] + 1)) and committed[-1] < 8
            assert reg.read_latest_file() == committed[-1]
            assert all(reg.check_complete(reg.step_dir(s), full=True) is None for s in committed)

            subprocess.run(["mount", "-o", "remount,bind,rw", str(ckpts)], check=True)
            result = rltrain(*flags, timeout=600)
            assert result.returncode == 0, result.stderr[-3000:]
            assert f"resumed from {reg.step_dir(committed[-1])} (step {committed[-1]})" in result.stdout
        finally:
            subprocess.run(["umount", "-l", str(ckpts)], capture_output=True)


# ============================================================================================ output_dir length
def path_of_length(base: str, n: int) -> str:
    """A path of exactly `n` characters under `base`, of folder names of at most 201 characters."""
    p = base
    while (left := n - len(p)) > 0:
        p += "d" if left == 1 else "/" + "d" * min(200, left - 1)
    assert len(p) == n
    return p


def test_a_4030_character_output_dir_is_refused_before_training(tmp_path):
    long = path_of_length(str(tmp_path), 4030)
    err = one_line_error(rltrain("--trainer.output_dir", long), "output-dir-length", "trainer.output_dir")
    assert "4030 bytes long" in err and "over the filesystem's PATH_MAX of 4096" in err
    assert "global_step_100.tmp-" in err
    assert list(tmp_path.iterdir()) == [], "nothing is created"
    result = run("rlconf.cli", "validate", "--preset", "tiny-grpo", "--set", f"trainer.output_dir={long}")
    assert result.returncode == 2 and "[output-dir-length]" in result.stderr

    # One folder name over NAME_MAX.
    err = one_line_error(rltrain("--trainer.output_dir", f"{tmp_path}/{'n' * 256}/run"), "output-dir-length",
                         "trainer.output_dir")  # fmt: skip
    assert "256 bytes" in err and "NAME_MAX" in err


def test_the_longest_allowed_output_dir_passes_and_one_more_byte_does_not(tmp_path):
    from presets import get_preset
    from rlconf.fields import replace_paths
    from rlconf.run_paths import deepest_file
    from rlconf.validate import check_config

    config = get_preset("tiny-grpo")
    room = os.pathconf(tmp_path, "PC_PATH_MAX") - 2 - len(deepest_file(config))
    for length, refused in ((room, False), (room + 1, True)):
        c = replace_paths(config, {"trainer.output_dir": path_of_length(str(tmp_path), length)})
        rules = {i.rule for i in check_config(c, filesystem=True) if i.severity == "error"}
        assert ("output-dir-length" in rules) is refused, (length, rules)
    # What the rule keeps room for is real: the deepest file fits under the longest allowed folder.
    deepest = Path(path_of_length(str(tmp_path), room)) / deepest_file(config)
    deepest.parent.mkdir(parents=True)
    deepest.write_bytes(b"x")


# ============================================================================================ Ray address
def test_an_unreachable_ray_address_fails_at_once_naming_it(tmp_path):
    out = tmp_path / "run"
    for dry in ((), ("--dry-run",)):
        t0 = time.monotonic()
        result = rltrain("--cluster.ray_address", "127.0.0.1:1", "--trainer.output_dir", str(out), *dry)
        err = one_line_error(result, "ray-cluster", "cluster.ray_address")
        assert time.monotonic() - t0 < 30
        assert "no Ray cluster answers at 127.0.0.1:1: nothing listens there (connection refused)" in err
        assert not out.exists(), "nothing is written"
    # RAY_ADDRESS names it too.
    result = rltrain("--trainer.output_dir", str(out), env={**ENV, "RAY_ADDRESS": "127.0.0.1:1"})
    err = one_line_error(result, "ray-cluster", "cluster.ray_address")
    assert "127.0.0.1:1 (from the environment variable RAY_ADDRESS)" in err


def test_an_address_that_accepts_but_never_answers_is_bounded_by_connect_timeout(tmp_path):
    """A port that accepts connections and says nothing (a firewall, a stuck GCS): cluster.connect_timeout_s."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                held.append(server.accept()[0])  # never answers

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        out = tmp_path / "run"
        t0 = time.monotonic()
        result = rltrain("--cluster.ray_address", f"127.0.0.1:{port}", "--cluster.connect_timeout_s", "3",
                         "--trainer.output_dir", str(out))  # fmt: skip
        took = time.monotonic() - t0
        err = one_line_error(result, "ray-cluster", "cluster.ray_address")
        assert f"127.0.0.1:{port}: it accepts connections but no Ray GCS answered within 3 s" in err, err
        assert 3 <= took < 25, took
        assert not out.exists()
    finally:
        stop.set()
        thread.join()
        for s in held:
            s.close()
        server.close()


# ============================================================================================ nodes
def test_two_nodes_without_a_cluster_are_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    for dry in ((), ("--dry-run",)):
        err = one_line_error(rltrain("--cluster.nnodes", "2", "--trainer.output_dir", str(out), *dry),
                             "ray-cluster", "cluster.nnodes")  # fmt: skip
        assert "no Ray cluster to join" in err and "--cluster.ray_address" in err
        assert not out.exists(), "no config.yaml / plan.json / run.lock left behind"


@pytest.fixture(scope="module")
def one_node():
    """A real one-node Ray cluster (its own processes, not this test's driver)."""
    from tests.ray_clusters import ray_test_cluster

    with ray_test_cluster(1, 2, "rlsf") as cluster:
        yield cluster


@pytest.mark.slow
@pytest.mark.multiproc
def test_nnodes_beyond_a_reachable_cluster_is_refused_by_dry_run_and_before_the_run_writes(
    one_node, tmp_path
):
    address = one_node.address
    out = tmp_path / "run"
    for dry in (("--dry-run",), ()):
        t0 = time.monotonic()
        result = rltrain("--cluster.ray_address", address, "--cluster.nnodes", "2", "--trainer.output_dir",
                         str(out), *dry)  # fmt: skip
        err = one_line_error(result, "ray-cluster", "cluster.nnodes")
        assert f"cluster.nnodes = 2, but the Ray cluster at {address} has 1 alive node" in err
        assert time.monotonic() - t0 < 60
        assert not out.exists(), "no config.yaml / plan.json / run.lock left behind"
    result = rltrain("--cluster.ray_address", address, "--trainer.output_dir", str(out), "--dry-run")
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"cluster at {address}: 1 alive node" in result.stdout


# ============================================================================================ worker failures
def test_worker_failure_advice_says_rerun_only_when_the_process_died(tmp_path):
    """ "rerun the same command" only where a rerun can succeed: a process that died (killed, out of memory);
    an exception a worker raised comes back on a rerun until its cause is fixed."""
    from rltrain.controller import _worker_failure_fix
    from rltrain.ray_group import WorkerError
    from rltrain.runfolder import RunFolder
    from tests.test_runfolder import started, tiny

    out = tmp_path / "run"
    started(out, [2])
    folder = RunFolder.open(*tiny(out))
    folder.close()
    died = _worker_failure_fix(WorkerError("actor", 0, "the actor died unexpectedly", died=True), folder)
    assert "rerun the same command to resume from the last complete checkpoint (step 2)" in died
    raised = _worker_failure_fix(WorkerError("actor", 0, "KeyError: 'x'", died=False), folder)
    assert "rerun the same command" not in raised
    assert "a rerun as is meets it again" in raised and "(step 2)" in raised
