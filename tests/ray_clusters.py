"""Real Ray clusters on this machine for the tests that join one (`cluster.ray_address`): their own head and
nodes, not a test's driver, set up as rltrain sets up the local cluster it starts."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from rltrain.ray_group import LOCAL_CLUSTER_SYSTEM_CONFIG


@contextlib.contextmanager
def ray_test_cluster(nodes: int, cpus_per_node: int, prefix: str) -> Iterator[Any]:
    """A `ray.cluster_utils.Cluster` of `nodes` nodes of `cpus_per_node` CPUs, without a dashboard and
    without Ray's metrics (their exporter thread once crashed a finished driver; the drivers that join take
    the setting from the head), shut down and its temp folder removed after."""
    from ray.cluster_utils import Cluster

    temp_dir = tempfile.mkdtemp(prefix=prefix, dir="/tmp")  # short: Ray's socket paths have a length limit
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_AUTH_MODE", "disabled")
        head = {"num_cpus": cpus_per_node, "temp_dir": temp_dir, "include_dashboard": False,
                "_system_config": LOCAL_CLUSTER_SYSTEM_CONFIG}  # fmt: skip
        cluster = Cluster(initialize_head=True, head_node_args=head)
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=cpus_per_node, temp_dir=temp_dir)
        cluster.wait_for_nodes()
        try:
            yield cluster
        finally:
            cluster.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)
