"""What a run checks before it writes anything (`check_start`; `rltrain --dry-run` runs the same): the Ray
cluster it joins is reachable within `cluster.connect_timeout_s` and holds the nodes and devices the plan
places ranks on, and the run folder's filesystem has room for one checkpoint (the plan's estimate; the
controller checks again before each save, rltrain.storage).

`ray.init(address=...)` of an address where no cluster answers waits without bound (its GCS client retries
every 30 s), and a plan for more nodes than the cluster has fails only at placement, after the run folder is
written. So `check_cluster` asks the cluster's GCS itself, over gRPC with a deadline: a TCP connect, then the
GCS's node table (`NodeInfoGcsService.GetAllNodeInfo`), no driver registered. Used by `rltrain` before the
run folder is opened and by `rltrain --dry-run` (which, without an address, can only check that the plan
fits the one-node Ray instance a run starts here: cluster.nnodes 1).

Addresses: HOST:PORT, `auto` (the cluster `ray start` left on this machine) and `ray://` (Ray Client, not
probed: its server speaks another protocol). A GCS that requires a token (Ray's token auth) answers
UNAUTHENTICATED: it is reachable, and its nodes are then checked by the placement (rltrain.ray_group).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

from rlconf.errors import ConfigError, error
from rlconf.plan import TrainerPlan

RULE = "ray-cluster"


@dataclass(frozen=True)
class ClusterInfo:
    """What a probe learned about a cluster: its alive nodes' resources (None when it would not say)."""

    address: str
    nodes: tuple[dict[str, float], ...] | None


def cluster_address(address: str | None) -> tuple[str | None, str]:
    """(the address a run joins, the setting that names it): cluster.ray_address, else RAY_ADDRESS."""
    if address:
        return address, "cluster.ray_address"
    env = os.environ.get("RAY_ADDRESS")
    return (env, "RAY_ADDRESS") if env else (None, "cluster.ray_address")


def _unreachable(address: str, source: str, why: str, timeout_s: float) -> ConfigError:
    where = f"{address} (from the environment variable RAY_ADDRESS)" if source == "RAY_ADDRESS" else address
    return ConfigError(
        [
            error(
                "cluster.ray_address",
                f"no Ray cluster answers at {where}: {why}",
                "start the cluster there (`ray start --head --port PORT` on the head node) or give its address "
                f"(--cluster.ray_address HOST:PORT, or unset RAY_ADDRESS to start a local one); "
                f"cluster.connect_timeout_s ({timeout_s:g} s) bounds the wait",
                RULE,
            )
        ]
    )


def probe(address: str, timeout_s: float, source: str = "cluster.ray_address") -> ClusterInfo:
    """Ask the GCS at `address` for its nodes within `timeout_s`; ConfigError naming the address when nothing
    answers as a Ray GCS."""
    if address.startswith("ray://"):
        return ClusterInfo(address, None)
    if address == "auto":
        from ray._private import services

        try:
            address = services.canonicalize_bootstrap_address_or_die("auto")
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise _unreachable("auto", source, str(exc).splitlines()[0], timeout_s) from None
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text.isdigit() or not host:
        raise ConfigError(
            [error("cluster.ray_address", f"{address!r} is not HOST:PORT", "write it as HOST:PORT (the head node's "
                   "GCS port, 6379 by default), auto, or ray://HOST:PORT", RULE)]
        )  # fmt: skip
    host = host.strip("[]")
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((host, int(port_text)), timeout=timeout_s):
            pass
    except OSError as exc:
        why = "nothing listens there (connection refused)" if isinstance(exc, ConnectionRefusedError) else (
            f"no connection within {timeout_s:g} s" if isinstance(exc, TimeoutError) else str(exc))  # fmt: skip
        raise _unreachable(address, source, why, timeout_s) from None
    import grpc
    from ray.core.generated import gcs_pb2, gcs_service_pb2, gcs_service_pb2_grpc

    left = max(deadline - time.monotonic(), 0.1)
    from ray._private.ray_constants import GLOBAL_GRPC_OPTIONS  # Ray's own (no HTTP proxy unless asked)

    channel = grpc.insecure_channel(f"{host}:{port_text}", options=GLOBAL_GRPC_OPTIONS)
    try:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        reply = stub.GetAllNodeInfo(gcs_service_pb2.GetAllNodeInfoRequest(), timeout=left)
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return ClusterInfo(address, None)  # a GCS with token auth: reachable; ray.init brings the token
        why = (
            f"it accepts connections but no Ray GCS answered within {timeout_s:g} s"
            if code == grpc.StatusCode.DEADLINE_EXCEEDED
            else f"it accepts connections but does not answer as a Ray GCS ({code.name if code else exc})"
        )
        raise _unreachable(address, source, why, timeout_s) from None
    finally:
        channel.close()
    alive = gcs_pb2.GcsNodeInfo.GcsNodeState.Value("ALIVE")
    nodes = tuple(dict(n.resources_total) for n in reply.node_info_list if n.state == alive)
    return ClusterInfo(address, nodes)


def check_fits(info: ClusterInfo, plan: TrainerPlan) -> str:
    """ConfigError naming cluster.nnodes / cluster.gpus_per_node when the cluster's alive nodes cannot hold
    the plan's nodes; else a line saying what was checked."""
    from rltrain import device as devices

    res = plan.resources
    if info.nodes is None:
        return f"cluster at {info.address}: reachable; its nodes are checked when the run places its workers"
    resource = devices.ray_resource(res.device)
    fitting = [n for n in info.nodes if resource is None or n.get(resource, 0.0) >= res.gpus_per_node]
    have = len(info.nodes)
    if len(fitting) < res.nnodes:
        if resource is None or len(fitting) == have:
            what = f"{have} alive node{'s' if have != 1 else ''}"
            path, fix = "cluster.nnodes", f"set cluster.nnodes to at most {have}, or add nodes to the cluster"
        else:
            what = (f"{have} alive node{'s' if have != 1 else ''}, {len(fitting)} of them with "
                    f"{res.gpus_per_node} {resource} (cluster.gpus_per_node)")  # fmt: skip
            path, fix = (
                "cluster.nnodes",
                "match cluster.nnodes / cluster.gpus_per_node to the cluster, or add nodes",
            )
        raise ConfigError(
            [error(path, f"cluster.nnodes = {res.nnodes}, but the Ray cluster at {info.address} has {what}", fix,
                   RULE)]
        )  # fmt: skip
    return (
        f"cluster at {info.address}: {have} alive node{'s' if have != 1 else ''}, "
        f"{len(fitting)} fit{'s' if len(fitting) == 1 else ''} {res.gpus_per_node} device(s) per node "
        f"(cluster.nnodes {res.nnodes})"
    )


def check_cluster(plan: TrainerPlan) -> str:
    """Check the cluster the run would use (see the module docstring); returns what was checked, in words."""
    cluster = plan.run.cluster
    address, source = cluster_address(cluster.ray_address)
    if address is None:
        if plan.resources.nnodes > 1:
            raise ConfigError(
                [
                    error(
                        "cluster.nnodes",
                        f"cluster.nnodes = {plan.resources.nnodes} but there is no Ray cluster to join: without "
                        "cluster.ray_address (or RAY_ADDRESS) rltrain starts a one-node Ray instance on this "
                        "machine",
                        "start a Ray cluster and pass its address (--cluster.ray_address HEAD:6379 or "
                        "RAY_ADDRESS; docs/multi-node.md), or set cluster.nnodes: 1",
                        RULE,
                    )
                ]
            )
        return "cluster: none given; the run starts a one-node Ray instance on this machine"
    return check_fits(probe(address, cluster.connect_timeout_s, source), plan)


def check_start(plan: TrainerPlan) -> list[str]:
    """What a run checks before it writes anything (`rltrain --dry-run` too): the Ray cluster it joins
    answers within cluster.connect_timeout_s and holds the plan's nodes, and the run folder's filesystem has
    room for one checkpoint. Raises ConfigError (exit 2); returns what was checked, one line each."""
    notes = check_engine(plan)
    return [*notes, check_cluster(plan), *check_disk(plan)]


ENGINE_RULE = "model-engine-support"
_MODEL_PATHS = {
    "policy": "model.path",
    "critic": "critic.model_path",
    "reward_model": "reward.reward_model.path",
}


def check_engine(plan: TrainerPlan) -> list[str]:
    """Models the plan reads, counts and sizes but the megatron engine cannot train yet
    (rlconf.model_spec.training_gaps: deepseek_v3 routing megatron-core computes otherwise, multi-token
    prediction layers of a built-in model.arch) are refused here, before Ray starts or anything is written:
    ConfigError naming the model's config path (exit 2), never a model trained without them. Returns a note
    per model folder whose multi-token prediction layers are kept untrained (and exported unchanged)."""
    from rlconf.model_spec import training_gaps

    issues = [
        error(_MODEL_PATHS[m.name] if m.source != "model.arch" else f"model.arch.{field}",
              f"{m.source}: {gap}",
              "`rlconf plan` shows this model's parameters and memory; to train, use a config.json without "
              "what the message names, or a model rlplan computes exactly (docs/troubleshooting.md)", ENGINE_RULE)
        for m in plan.models
        for field, gap in training_gaps(m.arch, from_folder=m.source != "model.arch")
    ]  # fmt: skip
    if issues:
        raise ConfigError(issues)
    return [
        f"{_MODEL_PATHS[m.name]}: {m.arch.num_mtp_layers} multi-token prediction layer(s) "
        f"(num_nextn_predict_layers, model.layers.{m.arch.num_layers}..) are not trained (transformers does not "
        "build them either); exports copy them unchanged from the folder"
        for m in plan.models
        if m.arch.num_mtp_layers and m.source != "model.arch"
    ]


def check_disk(plan: TrainerPlan) -> list[str]:
    """The run folder's filesystem has room for one checkpoint of the plan (none saved: nothing to check)."""
    from rltrain.storage import check_free_space, existing_ancestor, free_bytes

    ck = plan.checkpoint
    if not ck.enabled:
        return []
    where = existing_ancestor(plan.run.output_dir)
    check_free_space(where, ck.size_bytes, f"a checkpoint of this run does not fit in {where}")
    return [
        f"disk: {free_bytes(where) / (1 << 30):.2f} GiB free at {where}; a checkpoint needs about "
        f"{ck.size_bytes / (1 << 30):.3f} GiB (checked again before each save)"
    ]
