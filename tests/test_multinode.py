"""Multi-node on one machine: two Ray nodes (two raylets, ray.cluster_utils.Cluster) and the `rltrain`
command joining them with `--cluster.ray_address`, one actor rank per node (DP=2): placement on distinct
nodes, the gloo rendezvous across them, checkpoints written by both nodes and a resume across them.

What this cannot show: separate hosts (one IP here, one filesystem), NCCL, or a network interface choice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rlconf.plan import Pool as PlanPool
from rltrain.ray_group import devices_per_node
from tests.ray_clusters import ray_test_cluster

pytestmark = [pytest.mark.multiproc]

# Each node could hold both actor ranks (2 CPUs, a rank takes 1): only the per-node placement groups put
# one rank on each node, so the test fails if pools fall back to packing.
CPUS_PER_NODE = 2
RUN_FLAGS = (
    "--cluster.nnodes", "2", "--cluster.gpus_per_node", "1",
    "--actor.ppo_micro_batch_size_per_gpu", "16",  # the preset's 32 exceeds a DP=2 rank's mini-batch share
    "--trainer.save_freq", "2", "--trainer.max_ckpt_to_keep", "None",
    "--trainer.test_freq", "0", "--trainer.val_before_train", "false", "--logging.plot_reward", "false",
)  # fmt: skip


@pytest.mark.parametrize(
    ("first", "num", "gpus_per_node", "expected"),
    [
        (0, 8, 8, [8]),
        (0, 8, 4, [4, 4]),
        (0, 6, 4, [4, 2]),
        (6, 2, 4, [2]),
        (2, 4, 4, [2, 2]),
        (0, 2, 1, [1, 1]),
    ],
)
def test_devices_per_node_follows_the_plans_numbering(first, num, gpus_per_node, expected):
    """Devices are numbered node by node; a pool's ranks fill its first node, then the next."""
    nodes = tuple(range(first // gpus_per_node, (first + num - 1) // gpus_per_node + 1))
    pool = PlanPool("actor_pool", first, num, nodes, ("actor",))
    assert devices_per_node(pool, gpus_per_node) == expected


@pytest.fixture(scope="module")
def two_nodes():
    with ray_test_cluster(2, CPUS_PER_NODE, "rlmn") as cluster:
        yield cluster


def _raylets() -> set[int]:
    """The two nodes' raylets: the Cluster started them from this process."""
    return {p.pid for p in psutil.Process().children() if p.name() == "raylet"}


def _policy_workers(raylets: set[int]) -> dict[int, int]:
    """pid -> raylet pid of the actor processes on this cluster (Ray renames them `ray::PolicyWorker...`).
    Helpers they fork (dist_checkpointing's save process) share the name; the raylet is the actor's parent."""
    found = {}
    for proc in psutil.process_iter(["name", "ppid"]):
        if (proc.info["name"] or "").startswith("ray::PolicyWorker") and proc.info["ppid"] in raylets:
            found[proc.pid] = proc.info["ppid"]
    return found


def _run(address: str, out: Path, total_steps: int, raylets: set[int]) -> tuple[str, dict[int, int]]:
    """Run the CLI against the cluster; return its stdout and the raylet of every actor process seen."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    cmd = [sys.executable, "-m", "rltrain.cli", "tiny-grpo", "--cluster.ray_address", address,
           "--trainer.total_steps", str(total_steps), "--trainer.output_dir", str(out), *RUN_FLAGS]  # fmt: skip
    log = out.parent / f"{out.name}-{total_steps}.log"
    workers: dict[int, int] = {}
    t0 = time.monotonic()
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, text=True)
        try:
            while proc.poll() is None and time.monotonic() - t0 < 300:
                workers.update(_policy_workers(raylets))
                time.sleep(0.5)
        finally:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    print(f"{total_steps} steps on two nodes: {time.monotonic() - t0:.1f} s")
    return text, workers


@pytest.mark.slow
def test_tiny_grpo_one_rank_per_node_saves_and_resumes(two_nodes, tmp_path):
    address = two_nodes.address
    raylets = _raylets()
    assert len(raylets) == 2, raylets
    node_ids = {two_nodes.head_node.node_id, *(n.node_id for n in two_nodes.worker_nodes)}
    out = tmp_path / "run"

    stdout, workers = _run(address, out, 2, raylets)
    # Placement: the two ranks' processes ran under different raylets, i.e. on different Ray nodes, and
    # the run says so, naming both nodes.
    assert len(workers) == 2 and set(workers.values()) == raylets, workers
    pool_line = next(line for line in stdout.splitlines() if line.startswith("pool actor_pool:"))
    named = {node_id for node_id in node_ids if f"({node_id[:8]})" in pool_line}
    assert named == node_ids and "rank 0 on node" in pool_line and "rank 1 on node" in pool_line, pool_line
    ckpts = out / "checkpoints"
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text().strip() == "2"

    # Resume from step 2 on the same two nodes, to step 4: both ranks load what both nodes wrote.
    stdout, workers = _run(address, out, 4, raylets)
    assert f"resumed from {ckpts / 'global_step_2'} (step 2)" in stdout, stdout[-3000:]
    assert len(workers) == 2 and set(workers.values()) == raylets, workers
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["actor/grad_norm"] > 0 for r in rows), rows
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text().strip() == "4"


@pytest.mark.slow
def test_several_nodes_without_a_cluster_is_a_config_error(tmp_path):
    """nnodes > 1 with no cluster to join: a named error at once (exit 2), not 600 s waiting for nodes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "rltrain.cli", "tiny-grpo", "--trainer.output_dir", str(tmp_path / "run"),
           "--trainer.total_steps", "1", *RUN_FLAGS]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "cluster.nnodes" in result.stderr and "--cluster.ray_address" in result.stderr, result.stderr[
        -3000:
    ]
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_kill_9_of_the_driver_frees_the_joined_cluster(two_nodes, tmp_path):
    """A joined cluster outlives the run; what the run took does not: after kill -9 of rltrain its actor
    processes end, its placement groups are removed and every CPU is free again for the next job."""
    import ray
    from ray.util import placement_group_table

    raylets = _raylets()
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    cmd = [sys.executable, "-m", "rltrain.cli", "tiny-grpo", "--cluster.ray_address", two_nodes.address,
           "--trainer.total_steps", "1000", "--trainer.output_dir", str(out), *RUN_FLAGS]  # fmt: skip
    with open(tmp_path / "run.log", "w") as sink:
        driver = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 180
        while not (out / "metrics.jsonl").exists() and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert driver.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
        workers = [psutil.Process(pid) for pid in _policy_workers(raylets)]
        assert len(workers) == 2
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        _, alive = psutil.wait_procs(workers, timeout=30)
        assert not alive, f"actor processes outlived the driver: {alive}"
    finally:
        driver.kill()
        driver.wait()
    with pytest.MonkeyPatch.context() as env_patch:
        env_patch.setenv("RAY_AUTH_MODE", "disabled")
        ray.init(address=two_nodes.address)
        try:
            deadline = time.monotonic() + 30
            while True:
                states = {pg["name"]: pg["state"] for pg in placement_group_table().values()}
                free = ray.available_resources().get("CPU", 0)
                if (all(s == "REMOVED" for s in states.values()) and free == 2 * CPUS_PER_NODE) or (
                    time.monotonic() > deadline
                ):
                    break
                time.sleep(0.5)
        finally:
            ray.shutdown()
    assert states and all(s == "REMOVED" for s in states.values()), states
    assert free == 2 * CPUS_PER_NODE
