"""Process-group setup for the megatron engine: torch.distributed + megatron-core parallel_state.

One entry point per process: `init_parallel(megatron_cfg, device)` initialises torch.distributed (the
device layer's backend: gloo on cpu, nccl on cuda, hccl on npu) from the usual env vars (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) or
explicit arguments, builds megatron's TP/PP/CP/EP/DP groups and seeds the model-parallel RNG tracker.
`destroy_parallel()` tears both down (tests run several layouts in one process).
"""

from __future__ import annotations

import datetime
import os
import socket

import torch

from rlconf.config import MegatronConfig
from rlconf.seeding import run_seed
from rltrain import device as devices


def free_port() -> int:
    """A TCP port free on this host now, for a torch.distributed rendezvous (MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


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


def init_parallel(cfg: MegatronConfig, device: str, **dist_kwargs: object) -> None:
    """Initialise torch.distributed, megatron's model-parallel groups and the RNG tracker from `cfg`."""
    from megatron.core import parallel_state

    init_distributed(device, **dist_kwargs)  # type: ignore[arg-type]
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_model_parallel_size,
        context_parallel_size=cfg.context_parallel_size,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        expert_tensor_parallel_size=cfg.expert_tensor_parallel_size,
    )
    # A run's plan has resolved the seed (None -> trainer.seed); engines built outside a run use the default.
    seed_parallel_rng(run_seed(cfg.seed))


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
