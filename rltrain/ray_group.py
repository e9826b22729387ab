"""Ray plumbing: start or join a cluster, reserve device pools, and run worker groups with named errors.

A pool is one placement group with a bundle per device; every role placed in the pool puts its rank r into
bundle r, so colocated roles (actor, rollout, ref, and a colocated critic) share devices. The Ray resource of
a device (GPU, NPU, none on cpu) and the environment of the worker processes come from the device layer
(rltrain.device). A failing call
raises `WorkerError` naming the role and the rank, never a bare Ray traceback.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlconf.errors import ConfigError, error
from rltrain import device as devices
from rltrain.megatron.parallel import free_port

PLACEMENT_TIMEOUT_S = 600


class WorkerError(RuntimeError):
    """A worker failed or died. Names the role and the rank; the run can resume from its last checkpoint."""

    def __init__(self, role: str, rank: int, message: str, died: bool) -> None:
        self.role, self.rank, self.died = role, rank, died
        what = "died" if died else "failed"
        super().__init__(f"{role} worker rank {rank} {what}: {message}")


def start_ray(address: str | None, num_cpus: int, temp_dir: str | None = None) -> None:
    """Join `address` (or RAY_ADDRESS) when given, else start a local cluster sized for this run."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
        return
    kwargs: dict[str, Any] = {"num_cpus": num_cpus, "include_dashboard": False, "log_to_driver": True}
    if temp_dir:
        kwargs["_temp_dir"] = temp_dir
    ray.init(**kwargs)


@dataclass
class Pool:
    """A reserved set of devices: one placement-group bundle per device."""

    name: str
    size: int
    pg: PlacementGroup
    roles_sharing: int

    @classmethod
    def reserve(cls, name: str, size: int, device: str, cpus_per_worker: float, roles_sharing: int) -> Pool:
        bundle: dict[str, float] = {"CPU": cpus_per_worker * roles_sharing}
        if resource := devices.ray_resource(device):
            bundle[resource] = 1
        pg = placement_group([dict(bundle) for _ in range(size)], strategy="PACK", name=f"rlplan-{name}")
        try:
            ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            have = ray.cluster_resources()
            raise ConfigError(
                [
                    error(
                        "cluster.gpus_per_node",
                        f"Ray could not reserve pool {name}: {size} x {bundle} within {PLACEMENT_TIMEOUT_S} s; "
                        f"the cluster has {have}",
                        "match cluster.nnodes / cluster.gpus_per_node / cluster.cpus_per_worker to the Ray "
                        "cluster, or add nodes",
                        "ray-resources",
                    )
                ]
            ) from None
        return cls(name, size, pg, roles_sharing)

    def release(self) -> None:
        remove_placement_group(self.pg)


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
        # port there (the controller's own address is wrong when the pool spans nodes).
        probe = (
            ray.remote(_Probe)
            .options(
                num_cpus=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pool.pg, placement_group_bundle_index=0),
            )
            .remote()
        )
        master_addr, master_port = ray.get(probe.address.remote())
        ray.kill(probe)
        self.workers = [
            remote_cls.options(
                num_cpus=cpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pool.pg, placement_group_bundle_index=rank
                ),
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
        refs = [
            getattr(w, method).remote(*(per_rank_args[r] if per_rank_args else ()), **kwargs)
            for r, w in enumerate(self.workers)
        ]
        return self.wait(refs)

    def wait(self, refs: list[Any]) -> list[Any]:
        results = []
        for rank, ref in enumerate(refs):
            try:
                results.append(ray.get(ref))
            except ray.exceptions.RayActorError as exc:
                raise WorkerError(self.role, rank, _first_line(exc), died=True) from None
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                raise WorkerError(self.role, rank, f"{type(cause).__name__}: {cause}", died=False) from None
        return results

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)


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
    """Runs in bundle 0 of a pool to report that node's address and a free port."""

    def address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), free_port()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
