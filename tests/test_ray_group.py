"""Worker groups on a real local Ray cluster: rank placement, per-rank arguments, named failures."""

from __future__ import annotations

import os
import tempfile

import pytest
import ray

from rltrain.ray_group import Pool, WorkerError, WorkerGroup, start_ray

pytestmark = [pytest.mark.multiproc]


class EchoWorker:
    def __init__(self, role: str, rank: int, world_size: int, master_addr: str, master_port: int, tag: str):
        self.rank, self.world_size, self.tag = rank, world_size, tag

    def whoami(self, x: int) -> tuple[int, int, str, int]:
        return self.rank, self.world_size, self.tag, x * 10

    def fail(self) -> None:
        if self.rank == 1:
            raise ValueError("bad batch on rank 1")

    def die(self) -> None:
        if self.rank == 1:
            os._exit(3)


@pytest.fixture(scope="module")
def ray_cluster():
    # A short private temp dir: Ray's socket paths must stay under the OS limit, and tests must not share
    # the user's ~/.ray session.
    temp = tempfile.mkdtemp(prefix="rlray", dir="/tmp")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    start_ray(None, num_cpus=2, temp_dir=temp)
    yield
    ray.shutdown()


def test_group_passes_rank_args_and_names_failures(ray_cluster):
    pool = Pool.reserve("test", 2, "cpu", 1.0, 1)
    group = WorkerGroup("critic", EchoWorker, pool, 2, "cpu", 1.0, {"tag": "t"})
    try:
        assert group.call("whoami", per_rank_args=[(1,), (2,)]) == [(0, 2, "t", 10), (1, 2, "t", 20)]
        with pytest.raises(WorkerError) as exc:
            group.call("fail")
        assert (exc.value.role, exc.value.rank, exc.value.died) == ("critic", 1, False)
        assert "critic worker rank 1 failed: ValueError: bad batch on rank 1" in str(exc.value)
        with pytest.raises(WorkerError) as exc:
            group.call("die")
        assert (exc.value.role, exc.value.rank, exc.value.died) == ("critic", 1, True)
        assert "critic worker rank 1 died" in str(exc.value)
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
