"""This machine's memory: the budget of the plan's memory check on cpu (cluster.device = cpu).

On cpu the "devices" are worker processes on this host, so the host's RAM is what the plan's per-device
estimate must fit: `memory_budget` divides it by cluster.gpus_per_node (the workers one node runs).

MemTotal (not MemAvailable) is the budget, lowered to the cgroup's memory limit when one is set (a container
or a CI job sees the host's MemTotal in /proc/meminfo but is killed at its cgroup limit): the check answers
"can this plan ever run here", which must not flip between two runs of `rlconf validate` because another
process on a shared machine happened to use memory at that moment; MemAvailable would make the same config
valid or invalid by the minute. A plan that fits MemTotal but not what is free fails at start-up as it would
anyway. `cluster.device_memory_gib` overrides it (a config checked here for another machine).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlconf.config import RLConfig
from rlconf.errors import ConfigError
from rlconf.files import KIB, read_text

GIB = 1 << 30
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def _read(path: str) -> str | None:
    try:
        return read_text(path, 64 * KIB, key="", what="memory information")
    except ConfigError:
        return None


def host_memory_bytes() -> tuple[int, str] | None:
    """(bytes, where they were read) of this machine's memory: /proc/meminfo's MemTotal, or the cgroup limit
    when that is lower; None where neither can be read (not Linux)."""
    text = _read("/proc/meminfo")
    best: tuple[int, str] | None = None
    for line in (text or "").splitlines():
        if line.startswith("MemTotal:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                best = (int(parts[1]) * KIB, "MemTotal in /proc/meminfo")
    for path in _CGROUP_LIMITS:
        raw = (_read(path) or "").strip()
        if raw.isdigit() and (best is None or int(raw) < best[0]):
            best = (int(raw), f"the cgroup limit {path}")
    return best


@dataclass(frozen=True)
class MemoryBudget:
    """What the memory check compares each pool's per-device peak with."""

    gib: float
    """Memory per device (per worker process on cpu) in GiB."""
    text: str
    """Where it comes from, for the message."""


def memory_budget(config: RLConfig) -> MemoryBudget | None:
    """cluster.device_memory_gib when given; on cpu, else, this host's memory shared by the node's
    cluster.gpus_per_node workers; None (no check) for an accelerator whose memory is not given."""
    dev = config.cluster.device_memory_gib
    if dev is not None:
        return MemoryBudget(dev, f"cluster.device_memory_gib = {dev:g} GiB")
    if config.cluster.device != "cpu":
        return None
    host = host_memory_bytes()
    if host is None:
        return None
    n = config.cluster.gpus_per_node
    total = host[0] / GIB
    shared = f"{total:.1f} GiB shared by cluster.gpus_per_node = {n} workers, " if n > 1 else ""
    return MemoryBudget(
        total / n, f"this machine's memory per worker on cpu = {total / n:.1f} GiB ({shared}{host[1]})"
    )
