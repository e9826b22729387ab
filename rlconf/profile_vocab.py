"""Leaf vocabulary of the config that the plan and rltrain carry verbatim: the profiled roles, the profiler
tools and their option dataclasses, the built-in tool names. rlconf.config re-exports every name here (the
config sections use them); rltrain imports them from here, never from rlconf.config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ProfileTool = Literal["none", "torch", "nsys", "npu"]
Role = Literal[
    "generate_sequences",
    "actor_compute_log_prob",
    "ref_compute_log_prob",
    "actor_update",
    "critic_compute_values",
    "critic_update",
    "reward_compute",
]
ROLES: tuple[str, ...] = Role.__args__
"""The profiled roles (profile.roles), in the order of a training step."""

BUILTIN_TOOLS: tuple[str, ...] = ("calculator", "python")
"""Tools rltrain ships (rltrain/tools/): `calculator` (arithmetic on numbers, no names) and `python` (code
run in a sandboxed subprocess)."""


@dataclass(frozen=True)
class TorchProfileOptions:
    """torch.profiler options."""

    activities: tuple[Literal["cpu", "cuda", "npu"], ...] = ("cpu", "cuda")
    """Activities recorded (cuda is dropped on cpu runs)."""
    record_shapes: bool = False
    """Record operator input shapes."""
    profile_memory: bool = False
    """Track tensor allocations."""
    with_stack: bool = False
    """Record Python stacks (large traces)."""
    with_flops: bool = False
    """Estimate FLOPs of matmuls and convolutions."""


@dataclass(frozen=True)
class NpuProfileOptions:
    """Ascend (torch_npu / MindSpeed) profiler options."""

    level: Literal["level_none", "level0", "level1", "level2"] = "level1"
    """Collection level."""
    contents: tuple[Literal["npu", "cpu", "memory", "shapes", "module", "stack"], ...] = ("npu", "cpu")
    """What is collected."""
    analysis: bool = True
    """Run the offline analysis after collection."""


@dataclass(frozen=True)
class NsysProfileOptions:
    """Nsight Systems options (capture through cudaProfilerApi, NVTX ranges named by role)."""

    trace: tuple[Literal["cuda", "nvtx", "cublas", "cudnn", "osrt"], ...] = ("cuda", "nvtx")
    """APIs traced by nsys."""
    cuda_memory_usage: bool = False
    """Track CUDA memory usage."""


__all__ = [
    "BUILTIN_TOOLS",
    "ROLES",
    "NpuProfileOptions",
    "NsysProfileOptions",
    "ProfileTool",
    "Role",
    "TorchProfileOptions",
]
