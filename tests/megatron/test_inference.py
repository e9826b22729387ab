"""The KV-cache rollout engine (rltrain/megatron/inference.py) against the no-cache sampler it replaces.

Single process (gloo world of 1): greedy parity with `generate(use_cache=False)` on left/right-padded
prompts of different lengths, stop tokens, early exit and cache compaction, log-probs against
`compute_log_prob`, n samples per prompt sharing one prefill, the SDPA core attention with a query shorter
than the keys, and `sample_tokens` filters on crafted logits. One 2-process spawn checks TP=2 (with and
without sequence parallel), PP=2 and PP=2 x VPP=2 against the single-process results.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.megatron._common import spawn

from ..tolerance import assert_close
from ._common import (
    CountForwards,
    actor_cfg,
    actor_of,
    assert_tiny_close,
    free_port,
    init_groups,
    make_batch,
    run_spawned,
    tiny_model_cfg,
)

# megatron-core warns about missing apex / Transformer Engine and deprecated arguments on every build.
_QUIET = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]
pytestmark = _QUIET

KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


@pytest.fixture(scope="module")
def actor(mp_world, tiny_hf):

    return actor_of(tiny_model_cfg(str(tiny_hf)), actor_cfg(), "cpu", trainable=False)


def _prompts(b: int = 6) -> torch.Tensor:
    """Left-padded prompts of lengths 6, 5, 4, 6, 5, 4 (pad 0)."""
    return make_batch(b=b)["input_ids"][:, :6]


def _assert_same_batch(a: dict, b: dict, msg: str = "") -> None:
    for key in KEYS:
        assert torch.equal(a[key], b[key]), f"{msg}: {key}\n{a[key]}\n{b[key]}"
    assert_tiny_close(a["rollout_log_probs"], b["rollout_log_probs"], msg=msg)


# ------------------------------------------------------------------------------------ greedy parity
def test_greedy_matches_no_cache_path_on_padded_prompts(actor):
    prompts = _prompts()
    old = actor.generate(prompts, 8, temperature=0.0, pad_id=0, use_cache=False)
    new = actor.generate(prompts, 8, temperature=0.0, pad_id=0)
    _assert_same_batch(old, new, "left-padded")
    assert new["response_mask"].all()
    # The same prompts right-padded (prompt_mask says where the tokens are) give the same batch.
    mask = (prompts != 0).long()
    lengths = mask.sum(-1)
    right = torch.zeros_like(prompts)
    for i, row in enumerate(prompts):
        right[i, : lengths[i]] = row[row != 0]
    right_mask = (torch.arange(6).unsqueeze(0) < lengths.unsqueeze(1)).long()
    new_right = actor.generate(right, 8, temperature=0.0, pad_id=0, prompt_mask=right_mask)
    _assert_same_batch(old, new_right, "right-padded")
    # Unpadded prompts (no mask at all: SDPA's causal fast path in prefill, no mask in decode).
    full = prompts[[0, 3]]
    _assert_same_batch(
        actor.generate(full, 5, temperature=0.0, use_cache=False), actor.generate(full, 5, temperature=0.0)
    )


def test_local_attention_backend_matches_too(mp_world):
    """megatron's own DotProductAttention (not SDPA) under the cached path."""
    from rltrain.megatron.inference import kv_cache_unsupported
    from rltrain.megatron.parallel import seed_parallel_rng

    seed_parallel_rng(3)
    local = actor_of(tiny_model_cfg(None, "local"), actor_cfg(), "cpu", trainable=False)
    assert kv_cache_unsupported(local) is None
    prompts = _prompts(4) % 32  # the random-init arch has a vocabulary of 32
    _assert_same_batch(
        local.generate(prompts, 6, temperature=0.0, use_cache=False),
        local.generate(prompts, 6, temperature=0.0),
        "local attention",
    )


# ------------------------------------------------------------------------------------ stop tokens
def test_stop_tokens_compaction_and_early_exit(actor, monkeypatch):
    prompts = _prompts()
    free = actor.generate(prompts, 8, temperature=0.0, pad_id=0)["responses"]
    # Rows 0-2 stop at their first token (EOS or an extra stop id): half the batch leaves the cache.
    eos, extra = int(free[0, 0]), tuple(int(t) for t in free[1:3, 0])
    assert not set(free[3:, 0].tolist()) & {eos, *extra}, "pick prompts whose first tokens differ"
    counter = CountForwards(monkeypatch)
    # A pad id other than the prompts' 0: the prompt mask says which tokens are real.
    kw = dict(temperature=0.0, pad_id=7, eos_id=eos, stop_token_ids=extra, prompt_mask=(prompts != 0).long())
    new = actor.generate(prompts, 8, **kw)
    old = actor.generate(prompts, 8, **kw, use_cache=False)
    _assert_same_batch(old, new, "stops")
    for i in range(3):
        assert new["response_mask"][i].tolist() == [1] + [0] * 7
        assert (new["responses"][i, 1:] == 7).all() and (new["rollout_log_probs"][i, 1:] == 0).all()
    # Rows that never stop keep their free-running tokens.
    later_stops = torch.isin(free[3:], torch.tensor([eos, *extra]))
    for j, row in enumerate(range(3, 6)):
        if not later_stops[j].any():
            assert torch.equal(new["responses"][row], free[row])
    # Decode steps after the first sample run on the 3 live rows only (the cache dropped rows 0-2).
    assert counter.calls[0] == (6, 6, 0)
    assert counter.calls[1][0] <= 3
    # Every row stops at its first token: the prefill is the only forward, the tail is padding.
    counter.calls.clear()
    every = actor.generate(prompts, 8, temperature=0.0, pad_id=0, stop_token_ids=tuple(free[:, 0].tolist()))
    assert counter.calls == [(6, 6, 0)]
    assert every["response_mask"].sum(-1).tolist() == [1] * 6
    assert every["attention_mask"].shape == (6, 14)


# ------------------------------------------------------------------------------------ log-probs
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_match_compute_log_prob(actor, temperature):
    prompts = _prompts()
    kw = dict(temperature=temperature, top_p=0.9, top_k=20, eos_id=5, pad_id=0, seed=3)
    out = actor.generate(prompts, 8, **kw)
    recomputed = actor.compute_log_prob(out, temperature=temperature, with_entropy=False)["log_probs"]
    assert_tiny_close(out["rollout_log_probs"], recomputed)
    assert (out["rollout_log_probs"] < 0).any()
    # Same seed: same samples, and the same uniforms as the no-cache path (same tokens).
    assert torch.equal(actor.generate(prompts, 8, **kw)["responses"], out["responses"])
    _assert_same_batch(actor.generate(prompts, 8, **kw, use_cache=False), out, "sampled")
    other = actor.generate(prompts, 8, **{**kw, "seed": 4})
    assert not torch.equal(other["responses"], out["responses"])


# ------------------------------------------------------------------------------------ n samples
def test_n_samples_per_prompt_share_one_prefill(actor, monkeypatch):
    n = 4
    unique = _prompts(3)
    prompts = unique.repeat_interleave(n, 0)
    counter = CountForwards(monkeypatch)
    greedy = actor.generate(prompts, 6, temperature=0.0, pad_id=0)
    assert counter.calls[0] == (3, 6, 0), "each distinct prompt is prefilled once"
    assert counter.calls[1] == (12, 1, 6), "then decoded as 12 rows"
    ref = actor.generate(unique, 6, temperature=0.0, pad_id=0, use_cache=False)
    for key in KEYS:
        assert torch.equal(greedy[key], ref[key].repeat_interleave(n, 0)), key
    sampled = actor.generate(prompts, 6, temperature=1.0, pad_id=0, seed=11)
    groups = sampled["responses"].view(3, n, 6)
    assert any(not torch.equal(g[0], g[k]) for g in groups for k in range(1, n)), (
        "copies sample independently"
    )
    recomputed = actor.compute_log_prob(sampled, with_entropy=False)["log_probs"]
    assert_tiny_close(sampled["rollout_log_probs"], recomputed)


# ------------------------------------------------------------------------------------ static decode
def _static_equals_dynamic(actor) -> Iterator[dict]:
    """The static step's decode cases on the padded prompts (greedy; sampled with filters; greedy with stops,
    rows 0-2 stopping at their first token, so the batch compacts): yields each case's generate kwargs once
    `cuda_graph=True` gave the dynamic path's batch."""
    prompts = _prompts()
    free = actor.generate(prompts, 8, temperature=0.0, pad_id=0)["responses"]
    stop_kw = dict(temperature=0.0, eos_id=int(free[0, 0]), stop_token_ids=(int(free[1, 0]), int(free[2, 0])))
    sample_kw = dict(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=3)
    for kw in (dict(temperature=0.0), sample_kw, stop_kw):
        dynamic = actor.generate(prompts, 8, pad_id=0, **kw)
        static = actor.generate(prompts, 8, pad_id=0, cuda_graph=True, **kw)
        _assert_same_batch(dynamic, static, str(kw))
        yield kw


def _rows_per_static_step(monkeypatch) -> list[int]:
    """The rows of every static decode step called from now on, in order."""
    from rltrain.megatron import inference

    rows: list[int] = []
    inner = inference.StaticDecodeStep.__call__

    def call(step, tokens, start, uniform):
        rows.append(step.rows.numel())
        return inner(step, tokens, start, uniform)

    monkeypatch.setattr(inference.StaticDecodeStep, "__call__", call)
    return rows


@pytest.mark.parametrize("bucket", [4, 256])
def test_static_decode_step_matches_the_dynamic_path(actor, monkeypatch, bucket):
    """`cuda_graph=True` decodes through StaticDecodeStep: fixed shapes, whole buckets of cache columns with
    the unwritten ones masked. Captured in CUDA graphs on a GPU (tests/megatron/test_gpu.py); here the same
    step runs eagerly and must give the dynamic path's batch: padded prompts, decode crossing key-length
    buckets (bucket 4), sampling with filters, stop tokens with cache compaction."""
    from rltrain.megatron import inference

    monkeypatch.setattr(inference, "KEY_BUCKET", bucket)
    # 6 rows read buckets of `bucket` columns; after the compaction to 3 rows, twice as wide.
    monkeypatch.setattr(inference, "BUCKET_ROWS", 6)
    rows_per_step = _rows_per_static_step(monkeypatch)
    for kw in _static_equals_dynamic(actor):
        assert len(rows_per_step) == 7, "every decode step after the first sample is a static step"
        if "eos_id" in kw:
            # With stops, rows 0-2 finish at their first token and the static step is rebuilt over the 3
            # still running (3 is a size of the compaction ladder 1, 2, 3, 4, 6, 8, ...).
            assert rows_per_step[0] == 3
        rows_per_step.clear()


def _fake_graphs(monkeypatch) -> list[bool]:
    """CUDA graphs cannot exist on this CPU: the device layer's capture replaced by a graph whose replay runs
    the step again into the captured outputs (what a replay computes), its warm-up run where asked; the
    static decode's decisions around captures are the production code's. Returns each capture's
    `warm_up`, in order."""
    from rltrain import device as devices
    from rltrain.megatron import inference

    warm: list[bool] = []

    def capture(device, fn, pool=None, warm_up=True):
        warm.append(warm_up)
        if warm_up:
            fn()
        out = fn()

        def replay():
            tok, lp, routing = fn()
            out[0].copy_(tok)
            out[1].copy_(lp)
            for k, v in routing.items():
                out[2][k].copy_(v)

        return SimpleNamespace(replay=replay), out

    monkeypatch.setattr(devices, "graphs_supported", lambda device: True)
    monkeypatch.setattr(devices, "graph_pool", lambda device: None)
    monkeypatch.setattr(devices, "capture_graph", capture)
    monkeypatch.setattr(inference, "CAPTURED", weakref.WeakKeyDictionary())
    return warm


def test_a_capture_of_a_step_met_before_skips_its_warm_up(actor, monkeypatch):
    """A graph capture runs the step once eagerly first (the warm-up: compilation, lazy initialisation);
    a capture whose rows, cache columns, key bucket, sampling and code path an earlier capture of the actor
    met skips it (30-40 ms of Python per capture of a 1.5B step on the H200, and a realistic rollout
    captures after each compaction). With `_fake_graphs`: the second rollout skips every warm-up and gives
    the same batch as the first and the dynamic path; new sampling and a switched code path warm up again."""
    from rltrain.megatron import inference

    warm = _fake_graphs(monkeypatch)
    monkeypatch.setattr(inference, "KEY_BUCKET", 4)
    monkeypatch.setattr(inference, "BUCKET_ROWS", 6)  # 4-column buckets: a capture per bucket reached
    prompts = _prompts()
    free = actor.generate(prompts, 8, temperature=0.0, pad_id=0)["responses"]
    stops = dict(temperature=0.0, eos_id=int(free[0, 0]), stop_token_ids=(int(free[1, 0]), int(free[2, 0])))
    first = actor.generate(prompts, 8, pad_id=0, cuda_graph=True, **stops)
    assert len(warm) >= 2 and all(warm), warm  # each bucket a new shape
    n = len(warm)
    warm.clear()
    again = actor.generate(prompts, 8, pad_id=0, cuda_graph=True, **stops)
    assert warm == [False] * n, warm
    _assert_same_batch(first, again, "a capture without its warm-up")
    _assert_same_batch(actor.generate(prompts, 8, pad_id=0, **stops), again, "the dynamic path")
    warm.clear()
    actor.generate(prompts, 8, pad_id=0, cuda_graph=True, temperature=0.7, seed=3, eos_id=stops["eos_id"])
    assert warm and warm[0], "new sampling parameters: a new signature"
    warm.clear()
    monkeypatch.setattr(inference.KVCacheGenerator, "fuse_step_glue", False)
    actor.generate(prompts, 8, pad_id=0, cuda_graph=True, **stops)
    assert warm and all(warm), "another code path warms up"


def test_a_captured_decode_compacts_only_where_the_steps_left_pay_for_it(actor, monkeypatch):
    """Once a row set's graph is captured, a compaction costs a copy and a new capture: it happens only where
    the rows dropped times the steps left reach `COMPACTION_ROW_STEPS` (a realistic rollout's last steps
    keep their rows). Rows end at drawn lengths (the benchmarks' forced stops); with `_fake_graphs` the
    batch equals the dynamic path's whether the decode compacts or not."""
    from rltrain.megatron import inference

    _fake_graphs(monkeypatch)
    monkeypatch.setenv(inference.FORCE_EOS_ENV, "0.4")
    prompts = _prompts()
    kw = dict(temperature=0.0, pad_id=0, eos_id=1, seed=5)
    lengths = inference.forced_lengths(6, 16, 5).tolist()
    assert len(set(lengths)) > 2, lengths  # rows leave along the way
    dynamic = actor.generate(prompts, 16, **kw)
    rows_per_step = _rows_per_static_step(monkeypatch)
    sets = {}
    for threshold in (0, 10**9):
        monkeypatch.setattr(inference, "COMPACTION_ROW_STEPS", threshold)
        _assert_same_batch(dynamic, actor.generate(prompts, 16, cuda_graph=True, **kw), str(threshold))
        sets[threshold] = list(dict.fromkeys(rows_per_step))
        rows_per_step.clear()
    assert len(sets[0]) > 1, sets  # compactions along the way
    assert len(sets[10**9]) == 1, sets  # none after the first capture


def test_static_decode_through_the_attention_kernel_path_matches_the_dynamic_path(actor, monkeypatch):
    """The static step's `decode_attention` path (each row's own columns, `StepKeys`), here with the kernel's
    torch reference in place of the Triton kernel (CUDA only; bench/decode_tail_gpu.py checks the kernel
    against SDPA on the device): the same batch as the dynamic path on padded prompts, with sampling
    filters and with stops and compaction, and every step of a row set reads the whole cache, so a row set
    needs one graph where SDPA's key buckets need one per bucket."""
    from rltrain.megatron import decode_kernels, inference

    monkeypatch.setattr(inference, "KEY_BUCKET", 4)
    monkeypatch.setattr(
        inference.KVCacheGenerator,
        "_pick_decode_attention",
        lambda self, layers: (decode_kernels.decode_attention_reference, None),
    )
    seen: list[tuple[int, int]] = []
    body = inference.StaticDecodeStep._body

    def record(step, keys):
        seen.append((step.rows.numel(), keys))
        return body(step, keys)

    monkeypatch.setattr(inference.StaticDecodeStep, "_body", record)
    for _ in _static_equals_dynamic(actor):
        assert len(seen) == 7 and {keys for _, keys in seen} == {6 + 8}, seen
        seen.clear()


def test_static_decode_with_each_residual_add_and_its_norm_as_one_call_matches_the_dynamic_path(
    actor, monkeypatch
):
    """The static step's `add_norm` path (each residual add with the RMSNorm after it, the layer handing the
    next its input normed and the last one the final norm's output), here with the kernel's torch reference
    (the Triton kernel is CUDA's; bench/decode_tail_gpu.py --only-add-norm checks it on the device): the
    dynamic path's batch (greedy, sampled with filters, stops with compaction), two calls per layer per
    step."""
    from rltrain.megatron import decode_kernels, inference

    calls = []

    def add_norm(x, residual, weight, eps):
        calls.append(x.shape)
        return decode_kernels.add_rms_norm_reference(x, residual, weight, eps)

    monkeypatch.setattr(inference.KVCacheGenerator, "_pick_add_norm", lambda self: (add_norm, None))
    layers = len(actor.modules()[0].decoder.layers)
    steps = []
    body = inference.StaticDecodeStep._body

    def record(step, keys):
        steps.append(step.rows.numel())
        return body(step, keys)

    monkeypatch.setattr(inference.StaticDecodeStep, "_body", record)
    for _ in _static_equals_dynamic(actor):
        assert len(calls) == 2 * layers * len(steps) and len(steps) == 7, (len(calls), steps)
        assert [shape[1] for shape in calls[:: 2 * layers]] == steps  # [1, rows, h]: one column per step
        calls.clear()
        steps.clear()


def test_the_attention_kernels_reference_sees_each_rows_own_columns():
    """`decode_kernels.decode_attention_reference` (the kernel's semantics): row r attends over columns
    first[r]..col not hidden, whatever the cache holds elsewhere (NaN past col, before first and in a
    hidden hole), as SDPA does over just those columns; grouped query heads share their KV group."""
    from rltrain.megatron import decode_kernels

    gen = torch.Generator().manual_seed(0)
    n, heads, groups, d, max_len, col = 3, 6, 2, 8, 12, 8
    q = torch.randn(n, heads, d, generator=gen)
    k, v = (
        torch.randn(max_len, n, groups, d, generator=gen),
        torch.randn(max_len, n, groups, d, generator=gen),
    )
    first = torch.tensor([0, 2, 5])
    masked = torch.zeros(n, max_len, dtype=torch.bool)
    masked[1, 4] = True  # a hole
    for t in (k, v):
        t[col + 1 :] = float("nan")
        t[:2, 1] = float("nan")
        t[:5, 2] = float("nan")
        t[4, 1] = float("nan")
    out = decode_kernels.decode_attention_reference(q, k, v, masked, first, torch.tensor([col]), 0.3)
    assert out.shape == (n, heads * d) and not out.isnan().any()
    for r, cols in enumerate(([*range(0, 9)], [2, 3, 5, 6, 7, 8], [5, 6, 7, 8])):
        kk, vv = k[cols, r].repeat_interleave(3, 1), v[cols, r].repeat_interleave(3, 1)  # [c, heads, d]
        w = (torch.einsum("hd,chd->hc", q[r], kk) * 0.3).softmax(-1)
        assert_close(out[r].view(heads, d), torch.einsum("hc,chd->hd", w, vv), reduction=max_len)


def test_compaction_copies_the_cache_a_layer_at_a_time(monkeypatch):
    """`KVCacheGenerator.select_rows` (compaction, and the n samples' repeat of a shared prefill): row i of the
    new cache is row rows[i] of the old one in every layer, and each layer's old keys and values are gone
    before the next layer's are copied, so a compaction holds one layer beside the cache, not a second cache
    (what the plan's "rollout kv compaction" counts)."""
    import weakref
    from types import SimpleNamespace

    from rltrain.megatron.inference import KVCacheGenerator

    layers = [tuple(torch.randn(5, 4, 2, 3) for _ in range(2)) for _ in range(3)]
    engine = SimpleNamespace(cache=[list(layers)])
    old = [[weakref.ref(t) for t in kv] for kv in layers]
    want = [tuple(t[:, [2, 0, 0]] for t in kv) for kv in layers]
    del layers
    seen: list[int] = []
    inner = torch.Tensor.index_select

    def index_select(t, dim, index):
        # Layers before the one being copied: their old tensors are freed already.
        seen.append(sum(r() is not None for kv in old for r in kv))
        return inner(t, dim, index)

    monkeypatch.setattr(torch.Tensor, "index_select", index_select)
    KVCacheGenerator.select_rows(engine, torch.tensor([2, 0, 0]))
    monkeypatch.undo()
    assert seen == [6, 6, 4, 4, 2, 2]  # layer i's copies see only layers i.. of the old cache
    for got, expected in zip(engine.cache[0], want, strict=True):
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


@given(still=st.lists(st.booleans(), min_size=1, max_size=70).filter(any))
def test_compaction_keeps_a_size_of_the_ladder(still):
    """The static step's compaction keeps every running row plus the first finished ones up to the smallest
    size of the ladder 1, 2, 3, 4, 6, 8, 12, ... (powers of two and 1.5x them) that holds them, at most all
    rows, so its shapes recur from one rollout to the next; that size is never more than 4/3 of the
    running rows past 2 (the idle rows a step carries)."""
    from rltrain.megatron.inference import _ladder_rows, compacted_rows

    running = torch.tensor(still)
    kept = _ladder_rows(running)
    n, total = int(running.sum()), len(still)
    assert bool(kept[running].all())
    size = int(kept.sum())
    assert size == compacted_rows(n, total) and n <= size <= total
    assert size == total or size in {1 << i for i in range(8)} | {3 << i for i in range(7)}
    assert size == total or n < 3 or 3 * size <= 4 * n


def test_key_buckets_widen_as_rows_shrink(monkeypatch):
    from rltrain.megatron import inference

    monkeypatch.setattr(inference, "KEY_BUCKET", 256)
    monkeypatch.setattr(inference, "BUCKET_ROWS", 256)
    widths = [inference.key_bucket(rows) for rows in (1024, 512, 256, 200, 128, 64, 8, 1, 0)]
    assert widths == [256, 256, 256, 256, 512, 1024, 8192, 65536, 65536]
    # Columns read past the current length stay bounded by rows x width (>= KEY_BUCKET columns).
    assert all(rows * inference.key_bucket(rows) <= 256 * 256 for rows in range(1, 257))


# ------------------------------------------------------------------------------------ attention
def _reference_attention(q, k, v, allowed, scale):
    """q [s, b, h, d], k/v [t, b, g, d]; allowed [s, t] bool -> [s, b, h*d]."""
    rep = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(rep, 2)
    v = v.repeat_interleave(rep, 2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.einsum("bhst,tbhd->sbhd", torch.softmax(scores, -1), v)
    return out.reshape(q.shape[0], q.shape[1], -1)


def test_sdpa_attention_with_a_query_shorter_than_the_keys(actor):
    from megatron.core.transformer.enums import AttnMaskType

    from rltrain.megatron.model import SdpaAttention, unwrap

    core = unwrap(actor.chunks[0]).decoder.layers[0].self_attention.core_attention
    assert isinstance(core, SdpaAttention)
    h, g = core.num_attention_heads_per_partition, core.num_query_groups_per_partition
    d = core.hidden_size_per_attention_head
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, h, d, generator=gen)
    k = torch.randn(5, 3, g, d, generator=gen)
    v = torch.randn(5, 3, g, d, generator=gen)
    scale = 1.0 / math.sqrt(d)
    # Causal, no mask, 2 queries over 5 keys: the queries are keys 3 and 4 (bottom-right aligned).
    allowed = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    out = core(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    # Scores sum over the head dim, the softmax and the weighted values over the keys: depth 3.
    assert_close(out, _reference_attention(q, k, v, allowed, scale), reduction=d, depth=3)
    # Decode (megatron's no_mask): one query sees every key.
    out = core(q[:1], k, v, None, attn_mask_type=AttnMaskType.no_mask)
    ref = _reference_attention(q[:1], k, v, torch.ones(1, 5, dtype=torch.bool), scale)
    assert_close(out, ref, reduction=d, depth=3)
    # Decode with a key-padding mask per row (the static step's buckets; megatron's convention, True =
    # hidden) and grouped KV heads.
    assert h > g, "the fixture must have grouped KV heads"
    hidden = torch.tensor([[1, 0, 0, 1, 1], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    out = core(q[:1], k, v, hidden[:, None, None, :], attn_mask_type=AttnMaskType.no_mask)
    for row in range(3):
        ref = _reference_attention(q[:1, row : row + 1], k[:, row : row + 1], v[:, row : row + 1],
                                   ~hidden[row : row + 1], scale)  # fmt: skip
        assert_close(out[:, row : row + 1], ref, reduction=d, depth=3)
    # Square and causal: unchanged (SDPA's fast path).
    out = core(q[:1].expand(5, -1, -1, -1), k, v, None)
    ref = _reference_attention(q[:1].expand(5, -1, -1, -1), k, v, torch.ones(5, 5).tril().bool(), scale)
    assert_close(out, ref, reduction=d, depth=3)


def test_prefill_mask_hides_pads_and_avoids_empty_rows():
    from rltrain.megatron.inference import prefill_mask

    valid = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    masked = prefill_mask(valid)
    assert masked is not None and masked.shape == (2, 1, 4, 4)
    allowed = ~masked[:, 0]
    # Real queries see real keys up to themselves; pad queries see only themselves.
    assert allowed[0].int().tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    assert allowed[1].int().tolist() == torch.ones(4, 4).tril().int().tolist()
    assert prefill_mask(torch.ones(2, 3, dtype=torch.bool)) is None


# ------------------------------------------------------------------------------------ sampling filters
def _support(logits: torch.Tensor, draws: int = 2000, **kw) -> torch.Tensor:
    """Frequencies of each token over evenly spaced uniforms (inverse-CDF sampling is then exact)."""
    from rltrain.megatron.inference import sample_tokens

    u = (torch.arange(draws) + 0.5) / draws
    tok, _ = sample_tokens(logits.expand(draws, -1), kw.pop("temperature", 1.0), uniform=u, **kw)
    return torch.bincount(tok, minlength=logits.shape[-1]).float() / draws


def test_sample_tokens_filters_on_crafted_logits():
    from rltrain.megatron.inference import sample_tokens

    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    torch.testing.assert_close(_support(logits), probs[0], atol=1e-3, rtol=0)
    # top-k keeps the k most likely tokens, renormalised.
    torch.testing.assert_close(
        _support(logits, top_k=2), torch.tensor([0.625, 0.375, 0, 0]), atol=1e-3, rtol=0
    )
    # top-p keeps the smallest prefix whose mass reaches p (the top token always stays).
    assert _support(logits, top_p=0.7).nonzero().flatten().tolist() == [0, 1]
    assert _support(logits, top_p=0.85).nonzero().flatten().tolist() == [0, 1, 2]
    assert _support(logits, top_p=0.5).nonzero().flatten().tolist() == [0]
    # min-p drops tokens below min_p x the top probability.
    assert _support(logits, min_p=0.5).nonzero().flatten().tolist() == [0, 1]
    assert _support(logits, min_p=0.2).nonzero().flatten().tolist() == [0, 1, 2]
    torch.testing.assert_close(
        _support(logits, min_p=0.2), torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95, atol=1e-3, rtol=0
    )
    assert _support(logits, top_k=3, min_p=0.5).nonzero().flatten().tolist() == [0, 1]
    # Temperature sharpens; the log-prob is the temperature-scaled one before filtering.
    sharp = _support(logits, temperature=0.5)
    torch.testing.assert_close(sharp, torch.softmax(logits[0] / 0.5, -1), atol=1e-3, rtol=0)
    tok, lp = sample_tokens(logits, 2.0, top_k=1, uniform=torch.tensor([0.9]))
    assert tok.tolist() == [0]
    torch.testing.assert_close(lp, torch.log_softmax(logits / 2.0, -1)[:, 0])
    # Greedy: argmax and its log-prob at temperature 1.
    tok, lp = sample_tokens(torch.tensor([[0.1, 0.2, 5.0, 0.3]]), 0.0)
    assert tok.tolist() == [2]
    torch.testing.assert_close(lp, torch.log_softmax(torch.tensor([0.1, 0.2, 5.0, 0.3]), -1)[2:3])
    # A draw of exactly 0 never lands on a filtered (zero-probability) token.
    tok, _ = sample_tokens(torch.tensor([[0.1, 0.2, 5.0, 0.3]]), 1.0, top_k=1, uniform=torch.zeros(1))
    assert tok.tolist() == [2]
    # A seeded generator is reproducible.
    many = torch.randn(16, 50, generator=torch.Generator().manual_seed(1))
    a, _ = sample_tokens(many, 1.0, top_p=0.9, generator=torch.Generator().manual_seed(5))
    b, _ = sample_tokens(many, 1.0, top_p=0.9, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


def test_min_p_needs_the_cached_path(actor):
    prompts = _prompts(2)
    out = actor.generate(prompts, 3, temperature=1.0, min_p=0.3, seed=1)
    recomputed = actor.compute_log_prob(out, with_entropy=False)["log_probs"]
    assert_tiny_close(out["rollout_log_probs"], recomputed)
    with pytest.raises(NotImplementedError):
        actor.generate(prompts, 3, min_p=0.3, use_cache=False)


# ------------------------------------------------------------------------------------ TP / PP
LAYOUTS = [  # (name, tp, pp, vpp, sequence_parallel)
    ("tp2", 2, 1, None, False),
    ("tp2_sp", 2, 1, None, True),
    ("pp2", 1, 2, None, False),
    ("pp2_vpp2", 1, 2, 2, False),
]


def _layout_worker(rank: int, world: int, port: int, hf_path: str, ref: dict) -> None:
    run_spawned(_check_layouts, rank, world, port, hf_path, ref)


def _check_layouts(rank: int, world: int, port: int, hf_path: str, ref: dict) -> None:
    from dataclasses import replace

    from rltrain.megatron.parallel import destroy_parallel, init_distributed

    init_distributed("cpu", rank=rank, world_size=world, master_port=port)
    for name, tp, pp, vpp, sp in LAYOUTS:
        cfg = actor_cfg(tp, pp, vpp)
        cfg = replace(cfg, megatron=replace(cfg.megatron, sequence_parallel=sp))
        init_groups(cfg.megatron, "cpu")
        actor = actor_of(tiny_model_cfg(hf_path), cfg, "cpu", trainable=False)
        greedy = actor.generate(ref["prompts"], 8, temperature=0.0, pad_id=0)
        for key in KEYS:
            assert torch.equal(greedy[key], ref["greedy"][key]), (name, key)
        sampled = actor.generate(ref["prompts"], 8, **ref["sample_kw"])
        assert torch.equal(sampled["responses"], ref["sampled"]), name
        assert_tiny_close(sampled["rollout_log_probs"], ref["sampled_lp"])
        lp = actor.compute_log_prob(sampled, with_entropy=False)["log_probs"]
        assert_tiny_close(sampled["rollout_log_probs"], lp, msg=name)
        # The static step (fused attention inputs, additive mask; PP layouts decode dynamically) on TP shards.
        plain = dict(temperature=1.0, eos_id=5, pad_id=0, seed=7)
        dynamic = actor.generate(ref["prompts"], 8, **plain)
        static = actor.generate(ref["prompts"], 8, cuda_graph=True, **plain)
        assert torch.equal(static["responses"], dynamic["responses"]), name
        assert_tiny_close(static["rollout_log_probs"], dynamic["rollout_log_probs"])
        # Sequence parallel is back on for training after generation.
        assert actor.config.sequence_parallel is sp, name
        del actor
    destroy_parallel()


@pytest.mark.multiproc
@pytest.mark.slow
def test_tp_and_pp_layouts_match_single_process(actor):
    # 8 prompts: the no-cache reference path under VPP needs >= PP micro-batches of 2 rows.
    prompts = make_batch(b=8)["input_ids"][:, :6]
    sample_kw = dict(temperature=1.0, top_p=0.95, eos_id=5, pad_id=0, seed=7)
    greedy = actor.generate(prompts, 8, temperature=0.0, pad_id=0, use_cache=False)
    sampled = actor.generate(prompts, 8, **sample_kw)
    ref = {
        "prompts": prompts,
        "greedy": greedy,
        "sample_kw": sample_kw,
        "sampled": sampled["responses"],
        "sampled_lp": sampled["rollout_log_probs"],
    }
    hf_path = actor.spec.model.weights
    spawn(_layout_worker, args=(2, free_port(), hf_path, ref), nprocs=2, join=True)


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.integers(1, 3000),
    rows=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    excluded=st.floats(0.0, 0.99),
    edge=st.sampled_from([None, 0.0, 1.0 - 2**-24]),
)
def test_inverse_cdf_picks_the_token_whose_cumulative_weight_reaches_the_draw(
    vocab, rows, seed, excluded, edge
):
    """The two-level search picks what one cumulative sum over the whole vocabulary picks (float64
    reference), never an excluded (-inf) token, and reports the weights' total; draws at 0 and just below
    1 included. Vocabularies of one block, several blocks and a ragged last block."""
    from rltrain.megatron.inference import CDF_BLOCK, inverse_cdf

    assert CDF_BLOCK < 3000
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[torch.rand(rows, vocab, generator=gen) < excluded] = float("-inf")
    logits[:, torch.randint(vocab, (1,), generator=gen)] = 0.5  # at least one token per row stays
    u = torch.rand(rows, generator=gen) if edge is None else torch.full((rows,), edge)
    top = logits.amax(-1, keepdim=True)
    tok, total = inverse_cdf(logits, top, u)
    weights = (logits - top).double().exp()
    assert bool((weights.gather(1, tok[:, None]) > 0).all())  # never an excluded token
    torch.testing.assert_close(total.double(), weights.sum(-1), rtol=1e-5, atol=0)
    cdf = weights.cumsum(-1)
    draw = (u.double() * cdf[:, -1]).clamp(min=1e-300)
    ref = torch.searchsorted(cdf, draw[:, None]).squeeze(1).clamp(max=vocab - 1)
    # Away from a boundary (float32 vs float64 sums) the token is the reference's.
    gap = torch.minimum((cdf.gather(1, ref[:, None]).squeeze(1) - draw).abs(),
                        (draw - torch.where(ref > 0, cdf.gather(1, (ref - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)).abs())  # fmt: skip
    clear = gap > 1e-5 * cdf[:, -1]
    assert torch.equal(tok[clear], ref[clear])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot_dim", [16, 8])
def test_rotate_is_megatrons_rope_bit_for_bit(dtype, rot_dim):
    """The engine's RoPE with cos / sin computed once per forward gives megatron's bits (full and partial
    rotary dims); the compiled kernel (model.fused_kernels) agrees to the dtype's rounding."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from rltrain.megatron.model import fused_rotate, rotate

    gen = torch.Generator().manual_seed(0)
    t = torch.randn(3, 5, 4, 16, generator=gen).to(dtype)
    freqs = torch.rand(3, 5, 1, rot_dim, generator=gen) * 20
    ref = _apply_rotary_pos_emb_bshd(t, freqs)
    out = rotate(t, freqs.cos().to(dtype), freqs.sin().to(dtype))
    assert torch.equal(out, ref)
    fused = fused_rotate(t, freqs.cos().to(dtype), freqs.sin().to(dtype))
    assert_close(fused, ref, reduction=2)


def test_fused_rotate_compiles_once_per_dtype_across_prefill_shapes():
    """Multi-turn prefills come in every [s, b] (decode's s = 1, one-row prefills, cos broadcast over b) and
    query / key head counts (a single KV head too): the compiled RoPE must not recompile per shape (on the
    H200 the 0.5B tool preset hit torch's recompile limit on it and fell back to eager)."""
    from torch._dynamo.utils import counters

    from rltrain.megatron.model import fused_rotate, rotate

    before = counters["stats"]["unique_graphs"]
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for heads in (4, 2, 1):
            for s, b in ((1, 1), (1, 5), (7, 1), (7, 3), (13, 4), (1, 64), (33, 1)):
                for cos_b in {1, b}:
                    t = torch.randn(s, b, heads, 16, generator=gen).to(dtype)
                    freqs = torch.rand(s, cos_b, 1, 8, generator=gen) * 20
                    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
                    assert_close(fused_rotate(t, cos, sin), rotate(t, cos, sin), reduction=2)
    assert counters["stats"]["unique_graphs"] - before <= 2  # one graph per dtype, whatever the shapes
