"""Shared test setup: hypothesis profiles (CI runs more examples) and paths."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

# derandomize: every run of the suite draws the same examples, so a green run stays green on any machine
# and a red one reproduces; new examples come with changed tests or strategies. Explore more with
# HYPOTHESIS_PROFILE=explore (random examples; what it finds goes in as an @example).
# ci: twice the local examples (400 cost ~200 s of CI's budget on 2 cores, 200 ~100 s).
settings.register_profile(
    "ci",
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
    derandomize=True,
)
settings.register_profile(
    "dev", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile(
    "explore", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture(scope="module")
def world():
    """gloo world of one at TP = PP = 1 (or the session's, when the megatron tests already made one)."""
    import torch

    torch.set_num_threads(1)

    from rltrain.megatron.parallel import GroupSizes, destroy_parallel, init_parallel
    from tests.megatron._common import free_port

    owned = not torch.distributed.is_initialized()
    init_parallel(GroupSizes(), "cpu", rank=0, world_size=1, master_port=free_port())
    yield
    if owned:
        destroy_parallel()
