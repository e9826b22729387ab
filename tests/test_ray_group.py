"""Worker groups on a real local Ray cluster: rank placement, per-rank arguments, named failures; and the
local cluster's lifetime: none of its processes outlives the driver (ray.shutdown, or kill -9)."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import ray

from rlconf.errors import ConfigError
from rltrain.ray_group import Pool, WorkerError, WorkerGroup, start_ray

pytestmark = [pytest.mark.multiproc]


class EchoWorker:
    def __init__(self, role: str, rank: int, world_size: int, master_addr: str, master_port: int, tag: str):
        self.rank, self.world_size, self.tag = rank, world_size, tag
        self.master_port = master_port

    def rendezvous_port(self) -> int:
        return self.master_port

    def listen(self) -> int:
        """Rank 0's store listening on the rendezvous port, as init_process_group's would."""
        import datetime

        import torch.distributed

        self.store = torch.distributed.TCPStore(
            "127.0.0.1", self.master_port, 1, True, datetime.timedelta(seconds=30)
        )
        return self.master_port

    def close(self) -> None:
        del self.store

    def whoami(self, x: int) -> tuple[int, int, str, int]:
        return self.rank, self.world_size, self.tag, x * 10

    def fail(self) -> None:
        if self.rank == 1:
            raise ValueError("bad batch on rank 1")

    def die(self) -> None:
        if self.rank == 1:
            os._exit(3)

    def reject_setting(self) -> None:
        from rlconf.errors import ConfigError, error

        raise ConfigError(
            [error("actor.megatron.seed", "not runnable here", "use another seed", "seed-range")]
        )

    def fail_while_rank0_waits(self) -> None:
        """Rank 0 waits as it would in a collective whose peer failed (gloo's default timeout is 30 min)."""
        if self.rank == 1:
            raise ValueError("rank 1 failed before the all-reduce")
        time.sleep(600)


@pytest.fixture(scope="module")
def ray_cluster():
    # A short private temp dir: Ray's socket paths must stay under the OS limit, and tests must not share
    # the user's ~/.ray session.
    temp = tempfile.mkdtemp(prefix="rlray", dir="/tmp")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    start_ray(None, num_cpus=2, temp_dir=temp)
    yield
    ray.shutdown()


def test_the_local_cluster_runs_no_metrics_exporter(ray_cluster):
    """The driver of the local cluster collects and exports no Ray metrics (the exporter thread crashed a
    finished run's driver in CI): Ray logs that its stats are off in the driver's own log."""
    from ray._private.worker import global_worker

    logs = Path(global_worker.node.get_logs_dir_path())
    (driver_log,) = logs.glob(f"python-core-driver-*_{os.getpid()}.log")
    assert "Disabled stats." in driver_log.read_text()


def test_group_passes_rank_args_and_names_failures(ray_cluster):
    pool = Pool.reserve("test", 2, "cpu", 1.0, 1)
    group = WorkerGroup("critic", EchoWorker, pool, 2, "cpu", 1.0, {"tag": "t"})
    try:
        assert group.call("whoami", per_rank_args=[(1,), (2,)]) == [(0, 2, "t", 10), (1, 2, "t", 20)]
        with pytest.raises(WorkerError) as exc:
            group.call("fail")
        assert (exc.value.role, exc.value.rank, exc.value.died) == ("critic", 1, False)
        assert "critic worker rank 1 failed: ValueError: bad batch on rank 1" in str(exc.value)
        # A config error a worker finds is the config error (exit 2, path and fix), not a worker failure.
        with pytest.raises(ConfigError) as cfg_exc:
            group.call("reject_setting")
        assert cfg_exc.value.issues[0].path == "actor.megatron.seed"
        # A failure is reported when it happens, not after the ranks still waiting for the failed one.
        t0 = time.monotonic()
        with pytest.raises(WorkerError) as exc:
            group.call("fail_while_rank0_waits")
        assert exc.value.rank == 1 and time.monotonic() - t0 < 60
        with pytest.raises(WorkerError) as exc:
            group.call("die")
        assert (exc.value.role, exc.value.rank, exc.value.died) == ("critic", 1, True)
        assert "critic worker rank 1 died" in str(exc.value)
    finally:
        group.shutdown()
        pool.release()


def _plain_bind_refused(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError as exc:
            assert exc.errno == errno.EADDRINUSE
            return True
        return False


def test_the_rendezvous_port_stays_held_until_rank_0_listens(ray_cluster):
    """Between the probe finding the group's port and rank 0's store listening on it, nothing else on the
    node can take the port (CI once lost a run to EADDRINUSE there); once released, it is free again."""
    pool = Pool.reserve("test", 1, "cpu", 1.0, 1)
    group = WorkerGroup("actor", EchoWorker, pool, 1, "cpu", 1.0, {"tag": "t"})
    try:
        (port,) = group.call("rendezvous_port")
        assert _plain_bind_refused(port), "the probe no longer holds the port: another process could take it"
        assert group.call("listen") == [port]  # torch's store listens on the held port
        group.release_rendezvous_port()
        group.call("close")
        deadline = time.monotonic() + 30
        while _plain_bind_refused(port) and time.monotonic() < deadline:
            time.sleep(0.2)  # the probe's process ends asynchronously
        assert not _plain_bind_refused(port)
    finally:
        group.shutdown()
        pool.release()


def test_nsys_argv_becomes_ray_nsight_runtime_env():
    from rltrain.ray_group import nsight_runtime_env

    argv = [
        "nsys",
        "profile",
        "-o",
        "/p/nsys/actor_rank_0_%p",
        "--capture-range=cudaProfilerApi",
        "--trace=cuda,nvtx",
    ]
    assert nsight_runtime_env(argv) == {
        "nsight": {"o": "/p/nsys/actor_rank_0_%p", "capture-range": "cudaProfilerApi", "trace": "cuda,nvtx"}
    }
    assert nsight_runtime_env([]) is None


# A driver as users run one: a local cluster from start_ray, a pool and a worker group that has answered a
# call, so Ray's agents and worker processes exist; then it reports and waits to be killed or shut down.
DRIVER = textwrap.dedent(
    """
    import sys, time
    import ray
    from rltrain.ray_group import Pool, WorkerGroup, start_ray

    class Echo:
        def __init__(self, role, rank, world_size, master_addr, master_port):
            self.rank = rank

        def rank_of(self):
            return self.rank

    temp_dir, mode = sys.argv[1], sys.argv[2]
    start_ray(None, num_cpus=2, temp_dir=temp_dir)
    pool = Pool.reserve("test", 2, "cpu", 1.0, 1)
    group = WorkerGroup("actor", Echo, pool, 2, "cpu", 1.0, {})
    assert group.call("rank_of") == [0, 1]
    print("ready", flush=True)
    if mode == "shutdown":
        ray.shutdown()
        print("down", flush=True)
    time.sleep(600)
    """
)
SURVIVAL_LIMIT_S = 20


def _start_driver(tmp_path, temp_dir: str, mode: str) -> subprocess.Popen:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    driver = subprocess.Popen(
        [sys.executable, str(script), temp_dir, mode], stdout=subprocess.PIPE, text=True, env=env
    )
    _read_until(driver, "ready")
    return driver


def _read_until(driver: subprocess.Popen, word: str) -> None:
    assert driver.stdout is not None
    lines = []
    while (line := driver.stdout.readline()) and line.strip() != word:
        lines.append(line)
    assert line, f"the driver exited before printing {word!r}: {''.join(lines)}"


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _ray_processes(
    family: list[psutil.Process], temp_dir: str, raylet_pid: int, driver_pid: int
) -> list[str]:
    """Live processes of the driver's cluster: its recorded processes, anything whose command line names
    the cluster's temp dir, and anything whose environment names its raylet (agents and workers rename
    themselves, `ray::DashboardAgent`, so their command line no longer shows the temp dir)."""
    found = {p.pid: p for p in family if _alive(p)}
    for proc in psutil.process_iter():
        if proc.pid == driver_pid:  # after ray.shutdown the driver lives on, its temp dir on its command line
            continue
        try:
            if temp_dir in " ".join(proc.cmdline()) or proc.environ().get("RAY_RAYLET_PID") == str(
                raylet_pid
            ):
                found.setdefault(proc.pid, proc)
        except psutil.Error:
            continue
    described = []
    for proc in found.values():
        if _alive(proc):
            try:
                described.append(f"{proc.pid} {proc.name()} {' '.join(proc.cmdline())[:120]}")
            except psutil.Error:
                continue
    return described


def _wait_until_gone(family: list[psutil.Process], temp_dir: str, raylet_pid: int, driver_pid: int):
    t0 = time.monotonic()
    left = _ray_processes(family, temp_dir, raylet_pid, driver_pid)
    while left and time.monotonic() - t0 < SURVIVAL_LIMIT_S:
        time.sleep(0.5)
        left = _ray_processes(family, temp_dir, raylet_pid, driver_pid)
    return left, time.monotonic() - t0


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["kill -9", "ray.shutdown"])
def test_no_ray_process_outlives_the_driver(tmp_path, ending):
    """kill -9 of the driver (Ray's agents used to linger ~1 min) or ray.shutdown: within 20 s no process
    of its cluster is left, the reaper included."""
    temp_dir = tempfile.mkdtemp(prefix="rlray", dir="/tmp")  # short: Ray's socket paths have a length limit
    driver = _start_driver(tmp_path, temp_dir, "shutdown" if ending == "ray.shutdown" else "wait")
    try:
        family = psutil.Process(driver.pid).children(recursive=True)
        names = {p.name() for p in family}
        # The cluster is really up: its head processes, both agents, the workers and our reaper.
        assert {"gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= names, names
        assert sum(1 for p in family if p.name() == "ray::Echo") == 2, names
        assert any("rltrain.ray_reaper" in " ".join(p.cmdline()) for p in family), names
        raylet_pid = next(p.pid for p in family if p.name() == "raylet")
        if ending == "kill -9":
            os.kill(driver.pid, signal.SIGKILL)
            driver.wait()
        else:
            _read_until(driver, "down")
        left, waited = _wait_until_gone(family, temp_dir, raylet_pid, driver.pid)
        print(f"after {ending}: the cluster's {len(family)} processes were gone in {waited:.1f} s")
        assert not left, f"{len(left)} Ray processes left {waited:.0f} s after {ending}:\n" + "\n".join(left)
        if ending == "ray.shutdown":
            assert driver.poll() is None  # the driver itself lives on
    finally:
        driver.kill()
        driver.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)
