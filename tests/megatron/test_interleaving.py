"""Micro-batches for megatron's interleaved (virtual pipeline) schedule, which refuses a count per pass that
is not a multiple of pp (`forward_backward_pipelining_with_interleaving` raises on M < pp and on M % pp):
the engine halves its largest micro-batches until the count fits, keeping every row once."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]


@pytest.mark.parametrize(
    ("sizes", "pp", "want"),
    [([64], 2, [32, 32]), ([3, 3, 1], 2, [2, 1, 3, 1]), ([4, 4], 2, [4, 4]), ([5], 4, [1, 1, 1, 2]), ([2, 2, 2], 4, [1, 1, 2, 2])],
)  # fmt: skip
def test_micro_batches_become_a_multiple_of_pp(sizes, pp, want):
    from rltrain.megatron.engine import _split_for_interleaving

    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    sets = [torch.arange(s, s + n) for s, n in zip(starts, sizes, strict=True)]
    got = _split_for_interleaving(sets, pp)
    assert [len(x) for x in got] == want
    assert sorted(torch.cat(got).tolist()) == list(range(sum(sizes)))  # every row exactly once


def test_too_few_rows_is_a_named_error():
    from rltrain.megatron.engine import _split_for_interleaving

    with pytest.raises(RuntimeError, match="virtual_pipeline_model_parallel_size: null"):
        _split_for_interleaving([torch.arange(1)], 2)
