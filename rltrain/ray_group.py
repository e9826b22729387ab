"""Ray plumbing: start or join a cluster, reserve device pools, and run worker groups with named errors.

A pool is a placement group with a bundle per device; every role placed in the pool puts its rank r into
bundle r, so colocated roles (actor, rollout, ref, and a colocated critic) share devices. A pool that spans
nodes (cluster.nnodes > 1) is one placement group per node, each on a node of its own, so ranks sit node by
node as the plan numbers devices. The Ray resource of a device (GPU, NPU, none on cpu) and the environment
of the worker processes come from the device layer (rltrain.device). A failing call raises `WorkerError`
naming the role and the rank, never a bare Ray traceback. A local cluster started here dies with the
driver, even after `kill -9` (rltrain.ray_reaper).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psutil
import ray
from ray.util.placement_group import (
    NODE_ID_LABEL_KEY,
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlconf.errors import ConfigError, error
from rlconf.plan import Pool as PlanPool
from rlconf.plan import Resources
from rltrain import device as devices
from rltrain.megatron.parallel import free_port

PLACEMENT_TIMEOUT_S = 600


class WorkerError(RuntimeError):
    """A worker failed or died. Names the role and the rank; the run can resume from its last checkpoint."""

    def __init__(self, role: str, rank: int, message: str, died: bool) -> None:
        self.role, self.rank, self.died = role, rank, died
        what = "died" if died else "failed"
        super().__init__(f"{role} worker rank {rank} {what}: {message}")


# Whether start_ray started the cluster here (one node), rather than joining one.
_local_cluster = False

# The reaper of the local cluster and the pipe to it: the pipe closes when this process dies, however it
# dies, which tells the reaper to kill the cluster's processes. Kept here so the pipe stays open.
_reaper: subprocess.Popen | None = None


# Ray settings of the local cluster `start_ray` starts (a cluster it joins keeps its own).
LOCAL_CLUSTER_SYSTEM_CONFIG = {"enable_metrics_collection": False, "enable_open_telemetry": False}


def start_ray(
    address: str | None,
    num_cpus: int,
    temp_dir: str | None = None,
    on_started: Callable[[], None] | None = None,
) -> None:
    """Join `address` (or RAY_ADDRESS) when given, else start a local cluster sized for this run whose
    processes all end with this one (ray.shutdown, exit, or kill -9). `on_started` runs right after
    `ray.init`: ray.init installs its own SIGTERM handler, which aborts the process (exit 134, a C stack
    dump) instead of stopping the run; the caller puts its own back there, before anything else runs."""
    global _local_cluster
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    _local_cluster = not address
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
        if on_started is not None:
            on_started()
        return
    kwargs: dict[str, Any] = {
        "num_cpus": num_cpus,
        "include_dashboard": False,
        "log_to_driver": True,
        # No metrics: nothing reads them without a dashboard, and Ray's OpenTelemetry exporter thread has
        # crashed the driver with SIGSEGV (opentelemetry MetricReader::Collect) after a finished run.
        "_system_config": LOCAL_CLUSTER_SYSTEM_CONFIG,
    }
    if temp_dir:
        kwargs["_temp_dir"] = temp_dir
    # address="local": a new cluster even when `ray start` left one on this machine (ray.init() would join it).
    ray.init(address="local", **kwargs)
    if on_started is not None:
        on_started()
    _start_reaper()


def local_cluster_down() -> bool:
    """Whether the local cluster this process started has lost its GCS or raylet (a SIGTERM sent to the
    whole process group, as `timeout` and Slurm's scancel do, ends them too). Ray calls would then wait 60 s
    for them and abort the process, so a stopping run makes none. False for a joined cluster."""
    if not _local_cluster or not ray.is_initialized():
        return False
    node = getattr(ray._private.worker, "_global_node", None)
    procs = getattr(node, "all_processes", {}) if node is not None else {}
    return any(
        info.process.poll() is not None for name in ("gcs_server", "raylet") for info in procs.get(name, ())
    )


def _start_reaper() -> None:
    """Start rltrain.ray_reaper for the cluster ray.init just started under this process."""
    global _reaper
    ray_dir = os.path.dirname(ray.__file__)
    roots = []
    for child in psutil.Process().children():
        try:
            if any(ray_dir in part for part in child.cmdline()):
                roots.append(child)
        except psutil.Error:
            continue
    raylet = next((p for p in roots if p.name() == "raylet"), None)
    if raylet is None:
        print(f"warning: no raylet among the processes ray.init started ({[p.name() for p in roots]}); "
              "a kill -9 of this process may leave Ray's agents running for a minute", file=sys.stderr)  # fmt: skip
        return
    _reaper = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rltrain.ray_reaper",
            str(os.getpid()),
            str(raylet.pid),
            *(str(p.pid) for p in roots),
        ],
        stdin=subprocess.PIPE,
        # Not our stdout / stderr: a caller reading them to EOF (subprocess.run) would wait for the reaper.
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # Its own session: Ctrl-C or a kill of this process group leaves it alive to clean up after us.
        start_new_session=True,
    )


@dataclass
class Pool:
    """A reserved set of devices: one placement-group bundle per device, one placement group per node."""

    name: str
    size: int
    groups: list[PlacementGroup]
    """One per node the pool spans (a single group on one node), in the plan's node order."""
    slots: list[tuple[int, int]]
    """Rank r's (group, bundle) index."""
    roles_sharing: int

    @classmethod
    def for_plan(
        cls, pool: PlanPool, resources: Resources, cpus_per_worker: float, roles_sharing: int
    ) -> Pool:
        """Reserve a plan pool with its devices node by node, as the plan numbers them."""
        if resources.nnodes > 1 and _local_cluster:
            # Ray would wait 600 s for nodes that a one-node local instance never gets.
            raise ConfigError(
                [
                    error(
                        "cluster.nnodes",
                        f"cluster.nnodes = {resources.nnodes} but there is no Ray cluster to join: rltrain "
                        "started a one-node Ray instance on this machine",
                        "start a Ray cluster and pass its address (--cluster.ray_address HEAD:6379 or "
                        "RAY_ADDRESS; docs/multi-node.md), or set cluster.nnodes: 1",
                        "ray-resources",
                    )
                ]
            )
        return cls.reserve(pool.name, pool.num_devices, resources.device, cpus_per_worker, roles_sharing,
                           devices_per_node(pool, resources.gpus_per_node))  # fmt: skip

    @classmethod
    def reserve(
        cls,
        name: str,
        size: int,
        device: str,
        cpus_per_worker: float,
        roles_sharing: int,
        per_node: Sequence[int] = (),
    ) -> Pool:
        """`per_node[i]` devices on the i-th node of the pool (in rank order); empty: all on one node if
        Ray can (strategy PACK), as on a single-node cluster. Over several nodes each node's bundles are
        one STRICT_PACK group, and every group avoids the nodes the earlier groups took."""
        bundle: dict[str, float] = {"CPU": cpus_per_worker * roles_sharing}
        if resource := devices.ray_resource(device):
            bundle[resource] = 1
        counts = list(per_node) or [size]
        assert sum(counts) == size, (per_node, size)
        groups: list[PlacementGroup] = []
        taken: list[str] = []
        for count in counts:
            if len(counts) == 1:
                pg = placement_group(
                    [dict(bundle) for _ in range(size)], strategy="PACK", name=f"rlplan-{name}"
                )
            else:
                avoid = [{NODE_ID_LABEL_KEY: f"!in({','.join(taken)})"}] * count if taken else None
                pg = placement_group([dict(bundle) for _ in range(count)], strategy="STRICT_PACK",
                                     name=f"rlplan-{name}-node{len(groups)}", bundle_label_selector=avoid)  # fmt: skip
            groups.append(pg)
            try:
                ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                for g in groups:
                    remove_placement_group(g)
                raise _placement_error(name, counts, len(groups) - 1, bundle) from None
            taken.append(_node_ids(pg)[0])
        slots = [(g, b) for g, count in enumerate(counts) for b in range(count)]
        pool = cls(name, size, groups, slots, roles_sharing)
        print(f"pool {name}: {pool.describe()}", flush=True)
        return pool

    def strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        """Where rank r runs: its bundle."""
        group, bundle = self.slots[rank]
        return PlacementGroupSchedulingStrategy(self.groups[group], placement_group_bundle_index=bundle)

    def node_ids(self) -> list[str]:
        """Ray node id of every rank's bundle."""
        per_group = [_node_ids(g) for g in self.groups]
        return [per_group[g][b] for g, b in self.slots]

    def describe(self) -> str:
        """Ranks per node, e.g. `ranks 0-3 on node 10.0.0.1 (1a2b3c4d), ranks 4-7 on node 10.0.0.2 (...)`."""
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        runs: list[tuple[str, int, int]] = []
        for rank, node in enumerate(self.node_ids()):
            if runs and runs[-1][0] == node:
                runs[-1] = (node, runs[-1][1], rank)
            else:
                runs.append((node, rank, rank))
        return ", ".join(
            f"{'rank' if a == b else 'ranks'} {a if a == b else f'{a}-{b}'} on node {ips.get(node, '?')} ({node[:8]})"
            for node, a, b in runs
        )

    def release(self) -> None:
        for pg in self.groups:
            remove_placement_group(pg)


def devices_per_node(pool: PlanPool, gpus_per_node: int) -> list[int]:
    """How many of the pool's devices each of its nodes holds (the plan numbers devices node by node)."""
    end = pool.first_device + pool.num_devices
    return [min(end, (n + 1) * gpus_per_node) - max(pool.first_device, n * gpus_per_node) for n in pool.nodes]


def _node_ids(pg: PlacementGroup) -> list[str]:
    by_bundle = placement_group_table(pg)["bundles_to_node_id"]
    return [by_bundle[b] for b in sorted(by_bundle)]


def _placement_error(name: str, counts: list[int], group: int, bundle: dict[str, float]) -> ConfigError:
    have = ray.cluster_resources()
    where = (
        f" (node {group + 1} of {len(counts)}: {counts[group]} x {bundle} on a node of its own)"
        if len(counts) > 1
        else ""
    )
    return ConfigError(
        [
            error(
                "cluster.gpus_per_node",
                f"Ray could not reserve pool {name}: {sum(counts)} x {bundle}{where} within {PLACEMENT_TIMEOUT_S} s; "
                f"the cluster has {have}",
                "match cluster.nnodes / cluster.gpus_per_node / cluster.cpus_per_worker to the Ray "
                "cluster, or add nodes",
                "ray-resources",
            )
        ]
    )


class WorkerGroup:
    """`world_size` Ray actors of one role, rank r in bundle r of its pool."""

    def __init__(
        self,
        role: str,
        worker_cls: type,
        pool: Pool,
        world_size: int,
        device: str,
        cpus_per_worker: float,
        init_kwargs: dict[str, Any],
        runtime_envs: Sequence[dict[str, Any] | None] | None = None,
    ) -> None:
        """`runtime_envs[r]`, when given, is rank r's Ray runtime_env (e.g. to run it under nsys)."""
        self.role = role
        self.world_size = world_size
        remote_cls = ray.remote(worker_cls)
        accel = accelerator_options(device, 1.0 / pool.roles_sharing)
        # Every worker process starts with the device layer's environment (before it imports torch); a
        # rank's own runtime_env (nsys) keeps its other keys.
        env_vars = devices.worker_env(device)
        envs = [dict(runtime_envs[rank] or {}) if runtime_envs else {} for rank in range(world_size)]
        for env in envs:
            if env_vars:
                env["env_vars"] = {**env_vars, **env.get("env_vars", {})}
        # torch.distributed rendezvous on rank 0's node: ask a probe in bundle 0 for its address and a free
        # port there (the controller's own address is wrong when the pool spans nodes). The probe holds the
        # port until rank 0 listens on it (release_rendezvous_port): nothing else on the node takes it first.
        self._port_holder: Any = (
            ray.remote(_Probe).options(num_cpus=0, scheduling_strategy=pool.strategy(0)).remote()
        )
        master_addr, master_port = ray.get(self._port_holder.address.remote())
        self.workers = [
            remote_cls.options(
                num_cpus=cpus_per_worker,
                scheduling_strategy=pool.strategy(rank),
                name=None,
                runtime_env=envs[rank] or None,
                **accel,
            ).remote(
                role=role,
                rank=rank,
                world_size=world_size,
                master_addr=master_addr,
                master_port=master_port,
                **init_kwargs,
            )
            for rank in range(world_size)
        ]

    def call(self, method: str, per_rank_args: Sequence[tuple] | None = None, **kwargs: Any) -> list[Any]:
        """Call `method` on every rank (rank r gets per_rank_args[r]) and wait for all results."""
        return self.wait(self.submit(method, per_rank_args, **kwargs))

    def submit(self, method: str, per_rank_args: Sequence[tuple] | None = None, **kwargs: Any) -> list[Any]:
        """Start `method` on every rank; the refs, one per rank, for `wait` / `wait_all`."""
        return [
            getattr(w, method).remote(*(per_rank_args[r] if per_rank_args else ()), **kwargs)
            for r, w in enumerate(self.workers)
        ]

    def wait(self, refs: list[Any]) -> list[Any]:
        """The results of `refs` (one per rank) in rank order. The first rank to fail or die raises at once:
        the others may be waiting for it in a collective, and would answer only at its timeout."""
        return wait_all([(self, refs)])[0]

    def _result(self, ref: Any, rank: int) -> Any:
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            raise WorkerError(self.role, rank, _first_line(exc), died=True) from None
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            if isinstance(cause, ConfigError):
                # A setting the worker found it cannot run: the config error itself (exit 2, its path and
                # fix), not a worker failure that rerunning would resume from.
                raise cause from None
            raise WorkerError(self.role, rank, f"{type(cause).__name__}: {cause}", died=False) from None

    def release_rendezvous_port(self) -> None:
        """End the probe holding the group's rendezvous port: call once rank 0's store listens on it (after
        the workers' init_model)."""
        if self._port_holder is not None:
            ray.kill(self._port_holder, no_restart=True)
            self._port_holder = None

    def shutdown(self) -> None:
        self.release_rendezvous_port()
        for w in self.workers:
            ray.kill(w, no_restart=True)


def wait_all(calls: Sequence[tuple[WorkerGroup, list[Any]]]) -> list[list[Any]]:
    """The results of calls running on several groups at once (e.g. both sides of a weight push), each in
    rank order. The first rank of any group to fail or die raises at once, naming its role and rank: the
    other side may be waiting for it in a collective."""
    owner = {ref: (group, rank) for group, refs in calls for rank, ref in enumerate(refs)}
    pending = list(owner)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        for ref in done:
            group, rank = owner[ref]
            try:
                group._result(ref, rank)
            except WorkerError as exc:
                if not exc.died:
                    _raise_dead_peer(pending, owner)
                raise
    return [[group._result(ref, rank) for rank, ref in enumerate(refs)] for group, refs in calls]


DEAD_PEER_GRACE_S = 10.0
"""After a rank of `wait_all` fails, how long to look for a rank that died (the likely cause)."""


def _raise_dead_peer(pending: list[Any], owner: dict[Any, tuple[WorkerGroup, int]]) -> None:
    """A rank whose collective broke (gloo's "Connection reset by peer") usually failed because its peer's
    process died, and it notices at once while Ray reports the death a moment later: raise the dead rank,
    the cause, if one shows within DEAD_PEER_GRACE_S."""
    deadline = time.monotonic() + DEAD_PEER_GRACE_S
    while pending and (left := deadline - time.monotonic()) > 0:
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in done:
            group, rank = owner[ref]
            try:
                group._result(ref, rank)
            except WorkerError as exc:
                if exc.died:
                    raise exc from None


def nsight_runtime_env(nsys_argv: Sequence[str]) -> dict[str, Any] | None:
    """Ray's `nsight` runtime_env from an `nsys profile ...` argv prefix (None when it is empty): Ray then
    starts the worker process under nsys with these options."""
    if not nsys_argv:
        return None
    opts: dict[str, str] = {}
    args = list(nsys_argv[2:])  # drop "nsys profile"
    i = 0
    while i < len(args):
        arg = args[i].lstrip("-")
        if "=" in arg:
            key, value = arg.split("=", 1)
        else:
            key, value = arg, args[i + 1]
            i += 1
        opts[key] = value
        i += 1
    return {"nsight": opts}


def accelerator_options(device: str, share: float) -> dict[str, Any]:
    """Ray actor options reserving `share` of one device: `num_gpus` for GPUs (Ray refuses "GPU" among
    custom resources), `resources` for others (NPU), nothing on cpu."""
    resource = devices.ray_resource(device)
    if resource is None:
        return {}
    return {"num_gpus": share} if resource == "GPU" else {"resources": {resource: share}}


class _Probe:
    """Runs in bundle 0 of a pool to report that node's address and a free port, which it holds for the
    group's rendezvous while it lives (free_port)."""

    def address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), free_port()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
