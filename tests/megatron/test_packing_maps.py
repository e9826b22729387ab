"""The index maps of sequence packing (rltrain/megatron/packing.py), property-tested: packing the engine's
batch layout and unpacking it gives every row's valid tokens back, cu_seqlens and the restarting positions
describe the packed sequence, each response token is read from the packed position just before it, and the
token-balanced splits cover every row once within their budgets."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ..tolerance import tolerance
from ._common import batch_from_lengths

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning:megatron")]

# (prompt length >= 1, response length >= 0) per row; rows of very different lengths.
ROWS = st.lists(st.tuples(st.integers(1, 12), st.integers(0, 9)), min_size=1, max_size=7)


@settings(max_examples=60, deadline=None)
@given(rows=ROWS, multiple=st.sampled_from([1, 2, 4]))
def test_pack_rows_round_trip_and_cu_seqlens(rows, multiple):
    from rltrain.megatron.packing import pack_rows, unpack

    batch = batch_from_lengths(rows, 12, 9, seed=len(rows))
    packed = pack_rows(batch, multiple, torch.device("cpu"))
    lengths = [p + r for p, r in rows]
    tokens, positions = packed.tokens[0], packed.position_ids[0]
    cu = packed.params.cu_seqlens_q.tolist()
    # One segment per row, plus one padding segment when the total is not a multiple of `multiple`.
    assert tokens.shape[0] % multiple == 0 and tokens.shape[0] - sum(lengths) < multiple
    assert cu[: len(rows) + 1] == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert cu[-1] == tokens.shape[0] and list(packed.params.seqlens) == [
        b - a for a, b in itertools.pairwise(cu)
    ]
    assert packed.params.max_seqlen_q == max(packed.params.seqlens)
    # The MoE padding mask: exactly the trailing padding segment.
    pad = tokens.shape[0] - sum(lengths)
    assert packed.params.padding_mask[0].tolist() == [False] * sum(lengths) + [True] * pad
    # Positions restart at 0 in every segment.
    for a, b in itertools.pairwise(cu):
        assert positions[a:b].tolist() == list(range(b - a))
    # Unpacking gives each row's valid tokens (prompt then response) in order.
    back = unpack(tokens, packed.params.seqlens, len(rows))
    for i, n in enumerate(lengths):
        valid = batch["input_ids"][i][batch["attention_mask"][i].bool()]
        assert torch.equal(back[i, :n], valid)
    # The packed position before each valid response token predicts it.
    mask = batch["response_mask"].bool()
    assert torch.equal(tokens[packed.gather_index[mask] + 1], batch["responses"][mask])
    # Every index (padding ones too) stays inside its own row.
    for i in range(len(rows)):
        assert bool(((packed.gather_index[i] >= cu[i]) & (packed.gather_index[i] < cu[i + 1])).all())


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=40), parts=st.integers(1, 8))
def test_balanced_split_equal_rows(lengths, parts):
    from rltrain.token_balance import balanced_split

    groups = balanced_split(lengths, parts, equal_rows=True)
    assert len(groups) == parts
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    sizes = [len(g) for g in groups]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == len(lengths)
    sums = [sum(lengths[i] for i in g) for g in groups]
    if all(sizes):
        # Greedy longest-first: no group exceeds another by more than the longest row.
        assert max(sums) - min(sums) <= max(lengths)
    assert balanced_split(lengths, parts, equal_rows=True) == groups  # deterministic


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=40),
    budget=st.integers(1, 1200),
    multiple=st.sampled_from([1, 2, 8]),
)
def test_split_packed_by_tokens_budget(lengths, budget, multiple):
    from rltrain.token_balance import _first_fit_decreasing, split_packed_by_tokens

    groups = split_packed_by_tokens(lengths, budget, multiple)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(groups)
    for g in groups:
        size = math.ceil(sum(lengths[i] for i in g) / multiple) * multiple
        assert size <= budget or len(g) == 1
    # Never fewer micro-batches than the tokens need (the budget counts real tokens, not padded rows), and
    # never more than first-fit-decreasing needs.
    over = [x for x in lengths if x > budget]
    assert len(groups) >= len(over) + math.ceil((sum(lengths) - sum(over)) / budget)
    assert len(groups) <= len(_first_fit_decreasing(lengths, budget, multiple))


def test_split_packed_by_tokens_stays_fast_when_rows_fill_half_the_budget():
    """Rows just over half the budget each need a micro-batch of their own: found in a few tries."""
    import time

    from rltrain.token_balance import split_packed_by_tokens

    t0 = time.perf_counter()
    groups = split_packed_by_tokens([513] * 512, 1024)
    assert len(groups) == 512 and time.perf_counter() - t0 < 5.0


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=2, max_size=40), dp=st.integers(2, 4))
def test_dp_balanced_order_keeps_shard_sizes_and_inverts(lengths, dp):
    """The controller's DP spread of a forward pass: the contiguous split's shard sizes, balanced tokens,
    and the inverse permutation puts per-row results back in the batch's order."""
    from rltrain.token_balance import dp_balanced_order

    n = len(lengths)
    sizes = [n * (d + 1) // dp - n * d // dp for d in range(dp)]
    order, inverse = dp_balanced_order(lengths, sizes)
    assert sorted(order.tolist()) == list(range(n))
    values = torch.tensor(lengths)
    assert torch.equal(values[order][inverse], values)
    bounds = [0, *itertools.accumulate(sizes)]
    sums = [int(values[order][a:b].sum()) for a, b in itertools.pairwise(bounds)]
    if min(sizes) > 0:
        assert max(sums) - min(sums) <= max(lengths)


def _block_causal_reference(q, k, v, seqlens, scale):
    """SDPA over the whole packed sequence with a block-diagonal causal mask (the definition)."""
    seg = torch.repeat_interleave(torch.arange(len(seqlens)), torch.tensor(seqlens))
    idx = torch.arange(q.shape[0])
    allowed = (seg[:, None] == seg[None, :]) & (idx[:, None] >= idx[None, :])
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=allowed,
        scale=scale, enable_gqa=q.shape[1] != k.shape[1],
    )  # fmt: skip
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the varlen flash path)"))])  # fmt: skip
def test_packed_attention_is_causal_within_each_row(device):
    """Each packed row attends to its own earlier tokens only (GQA: 4 query heads on 2 KV heads), on cpu one
    SDPA call per row, on cuda (bf16) torch's varlen flash kernel; gradients flow to q, k and v."""
    from rltrain.megatron.packing import RowPackedSeqParams, packed_attention, varlen_supported

    seqlens = [5, 1, 9, 3]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(seqlens), h, 16, generator=gen).to(device, dtype) for h in (4, 2, 2))
    cu = torch.tensor([0, *itertools.accumulate(seqlens)], dtype=torch.int32, device=device)
    params = RowPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9,
                                max_seqlen_kv=9, seqlens=tuple(seqlens))  # fmt: skip
    assert varlen_supported(q, 0.0) == (device == "cuda")
    q.requires_grad_()
    out = packed_attention(q, k, v, params, scale=0.25)
    ref = _block_causal_reference(q.float(), k.float(), v.float(), seqlens, 0.25)
    # Rounding of the dtype over the widest sum (a row's keys x the head dimension); bf16 inputs and output.
    torch.testing.assert_close(out.float(), ref, **tolerance(dtype, reduction=9 * 16, magnitude=4.0))
    out.float().sum().backward()
    assert q.grad is not None and bool(torch.isfinite(q.grad).all())


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=48), dp=st.integers(1, 4))
def test_dp_balanced_columns_keeps_positions_and_balances(lengths, dp):
    """The update's DP spread: rows move between shards only at the same position (so every mini-batch
    keeps its rows), and the shards' token sums differ by at most the widest spread of one position."""
    from rltrain.token_balance import dp_balanced_columns

    n = len(lengths) - len(lengths) % dp
    lengths = lengths[:n]
    order = dp_balanced_columns(lengths, dp).tolist()
    assert sorted(order) == list(range(n))
    if not n:
        return
    per = n // dp
    assert all(order[i] % per == i % per for i in range(n))
    loads = [sum(lengths[j] for j in order[d * per : (d + 1) * per]) for d in range(dp)]
    widest = max(max(lengths[p::per]) - min(lengths[p::per]) for p in range(per))
    assert max(loads) - min(loads) <= widest
