"""Process-group setup for the megatron engine: torch.distributed + megatron-core parallel_state.

One entry point per process: `init_parallel(sizes, device, seed)` (sizes: the role's plan `RoleLayout`, or
`GroupSizes` for an engine-less process) initialises torch.distributed (the
device layer's backend: gloo on cpu, nccl on cuda, hccl on npu) from the usual env vars (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) or
explicit arguments, builds megatron's TP/PP/CP/EP/DP groups and seeds the model-parallel RNG tracker.
`destroy_parallel()` tears both down (tests run several layouts in one process).
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Protocol

import torch

from rlconf.seeding import run_seed
from rltrain import device as devices

# Ports free_port handed out, each held bound by this process until release_port (or exit).
_held_ports: dict[int, socket.socket] = {}


def free_port() -> int:
    """A TCP port for a torch.distributed rendezvous (MASTER_PORT), held for it by this process until
    `release_port(port)` or exit.

    Held, not only found free: between finding a free port and rank 0's store listening on it, another
    process's bind to port 0 (another run's rendezvous, Ray's own servers) could take it, and rank 0 would
    fail with EADDRINUSE. The port stays bound here with SO_REUSEADDR and never listens: the kernel then
    gives it to no other bind(0) or connect(), a bind without SO_REUSEADDR is refused, and torch's TCPStore,
    which binds with SO_REUSEADDR, listens on it as usual (in this process or another)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", 0))
    port = sock.getsockname()[1]
    _held_ports[port] = sock
    return port


def release_port(port: int) -> None:
    """Stop holding a port `free_port` handed out (once its store listens, or its world is gone)."""
    sock = _held_ports.pop(port, None)
    if sock is not None:
        sock.close()


def init_distributed(
    device: str,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    timeout_minutes: int = 30,
) -> None:
    """Initialise the default torch.distributed process group (no-op when already initialised).

    Missing arguments come from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (torchrun and Ray workers set
    them); a lone process without them becomes a world of one.
    """
    # Bind this process to its device before NCCL / HCCL create communicators on it (cpu: megatron's CPU
    # redirects). A worker has done this already in its constructor; then this is a no-op.
    devices.prepare_process(device, local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    if torch.distributed.is_initialized():
        return
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if master_addr is None:
        master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if master_port is None:
        master_port = int(os.environ.get("MASTER_PORT", "29500"))
    torch.distributed.init_process_group(
        backend=devices.dist_backend(device),
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=timeout_minutes),
    )


class ParallelSizes(Protocol):
    """The process-group sizes megatron's parallel state is built from (a plan's RoleLayout has them)."""

    @property
    def tp(self) -> int: ...
    @property
    def pp(self) -> int: ...
    @property
    def vpp(self) -> int | None: ...
    @property
    def cp(self) -> int: ...
    @property
    def ep(self) -> int: ...
    @property
    def etp(self) -> int | None: ...


@dataclass(frozen=True)
class GroupSizes:
    """Explicit process-group sizes, for processes that build no planned engine (tools, tests, benchmarks)."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    """Expert tensor parallel size (None: tp, megatron's default)."""


def init_parallel(sizes: ParallelSizes, device: str, seed: int | None = None, **dist_kwargs: object) -> None:
    """Initialise torch.distributed, megatron's model-parallel groups from `sizes` and the RNG tracker from
    `seed` (a plan's resolved seed; None: the default trainer.seed, for processes outside a run)."""
    from megatron.core import parallel_state

    init_distributed(device, **dist_kwargs)  # type: ignore[arg-type]
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=sizes.tp,
        pipeline_model_parallel_size=sizes.pp,
        virtual_pipeline_model_parallel_size=sizes.vpp,
        context_parallel_size=sizes.cp,
        expert_model_parallel_size=sizes.ep,
        expert_tensor_parallel_size=sizes.etp,
    )
    seed_parallel_rng(run_seed(seed))


def seed_parallel_rng(seed: int) -> None:
    """Seed torch and megatron's model-parallel RNG tracker (same seed on every rank; megatron offsets the
    tensor-parallel stream by the TP rank). Used at start-up (weight init) and before each update, with
    the step's dropout seed (`MegatronEngine.seed_update`)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy_parallel(destroy_process_group: bool = True) -> None:
    """Tear down megatron's groups and (optionally) the default process group."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if destroy_process_group and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
