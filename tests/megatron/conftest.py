"""Fixtures of the megatron engine tests: one gloo world of a single process (TP = PP = DP = 1) per test
session, since megatron's parallel state is process-global and `import megatron.core` costs seconds."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def mp_world():
    """torch.distributed (gloo, world of 1) + megatron parallel state at TP = PP = 1."""
    import torch

    torch.set_num_threads(1)

    from rltrain.megatron.parallel import GroupSizes, destroy_parallel, init_parallel

    from ._common import free_port

    init_parallel(GroupSizes(), "cpu", rank=0, world_size=1, master_port=free_port())
    yield
    destroy_parallel()


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """A tiny random Qwen2 (tied embeddings) saved by transformers."""
    from ._common import make_tiny_qwen2

    return make_tiny_qwen2(tmp_path_factory.mktemp("hf") / "qwen2_tiny")
