"""The KV-cache engine's static-shape MoE layer (rltrain/megatron/moe_decode.py) on tiny random MoE models
(CPU, fp32): it computes what megatron's MoELayer computes, so MoE generation can take the static decode
step (CUDA graphs on a GPU; eager here) and give the tokens and log-probs of megatron's MoELayer on the
dynamic path; router replay records the same routing through the static step. The generation path's glue
(`moe_decode.DecodeGlue`: dispatch by rank, SwiGLU-times-probability, combine) and its static router
(`moe_decode.route`; tests/megatron/test_moe_router_decode.py compares it with megatron's router) give the
argsort path's bits.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ._common import actor_of
from .test_moe import _actor, _batch, make_tiny_moe

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe"])
def moe_model(request, tmp_path_factory):
    """Qwen3-MoE (normalised top-k, a dense layer) and Qwen2-MoE (gated shared expert, unnormalised top-k)."""
    return make_tiny_moe(tmp_path_factory.mktemp(request.param) / "hf", request.param)


def _moe_layers(actor):
    from rltrain.megatron import moe_decode
    from rltrain.megatron.model import unwrap

    return [layer for layer in unwrap(actor.chunks[0]).decoder.layers if moe_decode.is_moe(layer.mlp)]


def test_static_moe_layer_equals_megatrons_moe_layer(mp_world, moe_model):
    """Same output as MoELayer.forward on random hidden states (fp32 rounding only), and the top-k it
    reports is the router's own choice (the experts that received each token)."""
    from rltrain.megatron import moe_decode

    actor = _actor(moe_model)
    actor.eval()
    layers = _moe_layers(actor)
    assert layers
    weights = moe_decode.ExpertWeights()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in layers:
            assert moe_decode.unsupported(layer.mlp) is None
            hidden = torch.randn(5, 3, layer.config.hidden_size, generator=gen)
            want, _ = layer.mlp(hidden)
            (got, bias), index = moe_decode.moe_forward(layer.mlp, hidden, weights)
            assert bias is None and got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            _, routing_map = layer.mlp.router(hidden)
            chosen = torch.zeros_like(routing_map).scatter(1, index, True)
            assert torch.equal(chosen, routing_map)
            # Not a trivially equal pair: another routing gives another output.
            assert not torch.allclose(got, torch.zeros_like(got))


@st.composite
def _routings(draw):
    """A top-k index [T, k] over E experts with ties across tokens (few experts, many pairs) and within a
    token (megatron's top-k never repeats an expert in a row, the dispatch does not rely on it)."""
    tokens, k, experts = draw(st.integers(1, 64)), draw(st.integers(1, 8)), draw(st.integers(1, 16))
    seed = draw(st.integers(0, 2**31 - 1))
    if draw(st.booleans()) and k <= experts:  # distinct experts per token, as the router picks
        gen = torch.Generator().manual_seed(seed)
        return torch.rand(tokens, experts, generator=gen).topk(k, dim=1).indices, experts
    few = draw(st.integers(1, experts))  # only the first `few` experts used: long runs of one expert
    return torch.randint(0, few, (tokens, k), generator=torch.Generator().manual_seed(seed)), experts


@settings(max_examples=200, deadline=None)
@given(_routings())
def test_dispatch_by_rank_is_the_stable_argsort(routing):
    """The rank dispatch (no sort) gives the stable argsort's order, inverse and offsets exactly: expert-major
    rows, token order within an expert, empty experts included."""
    from rltrain.megatron.moe_decode import expert_positions

    index, experts = routing
    want = expert_positions(index, experts, by_rank=False)
    got = expert_positions(index, experts, by_rank=True)
    for name, g, w in zip(("order", "inverse", "offsets"), got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), name
    # And the argsort's own meaning, not only the agreement of the two: rows sorted by expert, stable.
    order, inverse, offsets = got
    flat = index.reshape(-1)
    keys = flat[order] * flat.numel() + order  # expert-major, then pair index: strictly increasing
    assert bool((keys[1:] > keys[:-1]).all())
    assert torch.equal(order[inverse.reshape(-1)], torch.arange(flat.numel()))
    assert torch.equal(offsets.long(), torch.bincount(flat, minlength=experts).cumsum(0))


def test_decode_glue_is_the_argsort_path_bit_for_bit(mp_world, moe_model, monkeypatch):
    """moe_forward with the generation glue (eager: the reference the engine runs without fused kernels)
    equals the argsort path bit for bit in fp32, by rank and past RANK_DISPATCH_MAX_PAIRS (the sort), and
    megatron's MoELayer within the existing tolerance; the compiled glue equals it to fp32 rounding."""
    from rltrain.megatron import moe_decode

    actor = _actor(moe_model)
    actor.eval()
    weights = moe_decode.ExpertWeights()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in _moe_layers(actor):
            for s, n in ((1, 1), (1, 7), (5, 3)):  # a one-row decode step, a decode column, a prefill
                hidden = torch.randn(s, n, layer.config.hidden_size, generator=gen)
                (want, _), want_index = moe_decode.moe_forward(layer.mlp, hidden, weights)
                megatron, _ = layer.mlp(hidden)
                for limit in (moe_decode.RANK_DISPATCH_MAX_PAIRS, 0):  # by rank, then by the sort
                    monkeypatch.setattr(moe_decode, "RANK_DISPATCH_MAX_PAIRS", limit)
                    (got, bias), index = moe_decode.moe_forward(
                        layer.mlp, hidden, weights, glue=moe_decode.EAGER_GLUE
                    )
                    assert bias is None and torch.equal(index, want_index)
                    assert torch.equal(got, want), (s, n, limit)
                    torch.testing.assert_close(got, megatron, rtol=1e-5, atol=1e-6)
                    (fused, _), _ = moe_decode.moe_forward(
                        layer.mlp, hidden, weights, glue=moe_decode.FUSED_GLUE
                    )
                    torch.testing.assert_close(fused, want, rtol=1e-5, atol=1e-6)
                monkeypatch.undo()
                assert not torch.allclose(want, torch.zeros_like(want))


def test_the_glues_experts_function_serves_decode_batches_only(mp_world, moe_model, monkeypatch):
    """A glue with an `experts` function (the engine's Triton kernels on CUDA; here the products it replaces,
    recorded) gets the decode-sized batches, up to RANK_DISPATCH_MAX_PAIRS pairs, with the tokens and each
    row's token (it reads the rows itself), the stacked weights, each row's probability and the offsets, and
    its result is the layer's; prefills past that keep the grouped products."""
    from dataclasses import replace

    from rltrain.megatron import moe_decode
    from rltrain.megatron.moe_experts import grouped_mm, swiglu_probs

    seen = []

    def experts(x, token, w1, w2, p, offsets):
        seen.append(token.shape[0])
        rows = x.index_select(0, token)
        h = grouped_mm(rows, w1.transpose(1, 2), offsets)
        return grouped_mm(swiglu_probs(h, p), w2.transpose(1, 2), offsets) * 2  # visibly its result

    glue = replace(moe_decode.EAGER_GLUE, experts=experts)
    actor = _actor(moe_model)
    actor.eval()
    weights = moe_decode.ExpertWeights()
    layer = _moe_layers(actor)[0]
    k = layer.mlp.router.topk
    gen = torch.Generator().manual_seed(6)
    monkeypatch.setattr(moe_decode, "RANK_DISPATCH_MAX_PAIRS", 7 * k)
    with torch.no_grad():
        for s, n, takes in ((1, 7, True), (2, 4, False)):
            hidden = torch.randn(s, n, layer.config.hidden_size, generator=gen)
            seen.clear()
            (want, _), _ = moe_decode.moe_forward(layer.mlp, hidden, weights, glue=moe_decode.EAGER_GLUE)
            (got, _), _ = moe_decode.moe_forward(layer.mlp, hidden, weights, glue=glue)
            assert seen == ([s * n * k] if takes else []), (s, n, seen)
            shared = layer.mlp.shared_experts(hidden) if layer.mlp.use_shared_expert else 0
            expected = (want - shared) * 2 + shared if takes else want  # the routed part doubled
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_glue_keeps_grouped_swiglus_dtypes(dtype):
    """In 16 bits too (where the order of roundings shows), the eager glue around the grouped products is
    GroupedSwiGLU.forward plus the argsort path's unpermute-and-sum, bit for bit: activations in `dtype`,
    the router's fp32 probabilities, the sum over k in fp32."""
    from rltrain.megatron.moe_decode import EAGER_GLUE
    from rltrain.megatron.moe_experts import GroupedSwiGLU, grouped_mm

    gen = torch.Generator().manual_seed(3)
    tokens, k, experts, hidden, ffn = 9, 3, 5, 16, 8
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    probs = torch.rand(tokens, experts, generator=gen)  # fp32, as megatron's router hands them out
    index = torch.rand(tokens, experts, generator=gen).topk(k, dim=1).indices
    w1 = (torch.randn(experts, 2 * ffn, hidden, generator=gen) * 0.3).to(dtype)
    w2 = (torch.randn(experts, hidden, ffn, generator=gen) * 0.3).to(dtype)
    rows, p, inverse, offsets = EAGER_GLUE.dispatch(x, index, probs, True)
    h = grouped_mm(rows, w1.transpose(1, 2), offsets)
    got = EAGER_GLUE.combine(grouped_mm(EAGER_GLUE.swiglu(h, p), w2.transpose(1, 2), offsets), inverse, dtype)
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    y = GroupedSwiGLU.apply(
        x.index_select(0, order // k), w1, w2, probs.gather(1, index).reshape(-1)[order], offsets
    )
    want = y.index_select(0, inverse.reshape(-1)).view(tokens, k, -1).sum(1, dtype=torch.float32).to(dtype)
    assert got.dtype == dtype
    assert torch.equal(got, want)


def test_decode_glue_refuses_autograd(mp_world, moe_model):
    """The glue has no backward: moe_forward takes it only with the engine's stacked weights."""
    from rltrain.megatron import moe_decode

    actor = _actor(moe_model)
    layer = _moe_layers(actor)[0]
    with pytest.raises(AssertionError, match="generation only"), torch.no_grad():
        moe_decode.moe_forward(
            layer.mlp, torch.randn(2, 1, layer.config.hidden_size), glue=moe_decode.EAGER_GLUE
        )


def test_grouped_mm_takes_device_offsets_and_skips_empty_groups():
    from rltrain.megatron.moe_experts import grouped_mm, grouped_mm_weight

    gen = torch.Generator().manual_seed(1)
    a = torch.randn(7, 4, generator=gen, dtype=torch.float64)
    b = torch.randn(3, 4, 5, generator=gen, dtype=torch.float64)
    offsets = torch.tensor([3, 3, 7], dtype=torch.int32)  # group 1 has no rows
    want = torch.cat([a[:3] @ b[0], a[3:] @ b[2]])
    torch.testing.assert_close(grouped_mm(a, b, offsets), want)
    torch.testing.assert_close(grouped_mm(a, b, [3, 0, 4]), want)
    dy = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    dw = grouped_mm_weight(a.t(), dy, offsets)
    torch.testing.assert_close(
        dw, torch.stack([a[:3].t() @ dy[:3], torch.zeros(4, 5, dtype=a.dtype), a[3:].t() @ dy[3:]])
    )


def _generate(actor, prompts, static: bool, megatron_moe: bool, **kw):
    from rltrain.megatron import inference

    inference.KVCacheGenerator.static_moe = not megatron_moe
    try:
        return actor.generate(prompts, 8, pad_id=0, cuda_graph=static, seed=3, **kw)
    finally:
        inference.KVCacheGenerator.static_moe = True


@pytest.mark.slow
def test_moe_generation_takes_the_static_step_with_megatrons_results(mp_world, moe_model, monkeypatch):
    """Static decode (the path CUDA graphs capture) of a MoE model equals the dynamic path through megatron's
    MoELayer: the same tokens and log-probs up to fp32 rounding, greedy and sampled with stop tokens (rows
    leave the batch: the step is rebuilt over the compacted cache)."""
    from rltrain.megatron import inference

    actor = _actor(moe_model)
    assert inference.static_moe_unsupported(actor) is None
    steps = []
    original = inference.StaticDecodeStep.__call__
    monkeypatch.setattr(
        inference.StaticDecodeStep, "__call__", lambda s, *a: (steps.append(1), original(s, *a))[1]
    )
    prompts = _batch()["input_ids"][:4, :12].repeat(2, 1)
    for kw in ({"temperature": 0.0}, {"temperature": 1.0, "eos_id": 7, "stop_token_ids": (11, 13, 17, 19)}):
        steps.clear()
        want = _generate(actor, prompts, static=False, megatron_moe=True, **kw)
        assert not steps
        got = _generate(actor, prompts, static=True, megatron_moe=False, **kw)
        assert steps, "the static step did not run"
        assert torch.equal(got["responses"], want["responses"]), kw
        assert torch.equal(got["response_mask"], want["response_mask"])
        torch.testing.assert_close(got["rollout_log_probs"], want["rollout_log_probs"], rtol=1e-4, atol=1e-5)
    assert bool((got["response_mask"].sum(-1) < 8).any()), "no row stopped early: compaction not exercised"


@pytest.mark.slow
def test_static_generation_with_and_without_the_decode_glue(mp_world, moe_model, monkeypatch):
    """The static decode step with the MoE glue (the class switch KVCacheGenerator.fuse_moe_glue, eager and
    compiled), with megatron's router and with the static router (KVCacheGenerator.fuse_moe_router, taken
    with the glue), gives the argsort path's tokens, greedy and sampled with stop tokens, and its log-probs
    (bit for bit eagerly, to fp32 rounding compiled); the glue and router are what ran."""
    from rlconf.config import ModelConfig
    from rltrain.megatron import inference, moe_decode

    from .test_moe import _layout_cfg

    prompts = _batch()["input_ids"][:4, :12].repeat(2, 1)
    calls = []
    original = moe_decode.moe_forward
    monkeypatch.setattr(
        moe_decode,
        "moe_forward",
        lambda *a, **kw: (calls.append((kw["glue"], kw["route"])), original(*a, **kw))[1],
    )
    for fused in (False, True):
        model = ModelConfig(
            path=str(moe_model), attention_backend="sdpa", fused_kernels="compiled" if fused else "eager"
        )
        actor = actor_of(model, _layout_cfg(), "cpu", trainable=False, total_steps=4)
        assert actor.fused_kernels is fused
        for kw in (
            {"temperature": 0.0},
            {"temperature": 1.0, "eos_id": 7, "stop_token_ids": (11, 13, 17, 19)},
        ):
            results = {}
            for glue, router in ((False, False), (True, False), (True, True)):
                inference.KVCacheGenerator.fuse_moe_glue = glue
                inference.KVCacheGenerator.fuse_moe_router = router
                calls.clear()
                try:
                    results[glue, router] = _generate(actor, prompts, static=True, megatron_moe=False, **kw)
                finally:
                    inference.KVCacheGenerator.fuse_moe_glue = True
                    inference.KVCacheGenerator.fuse_moe_router = True
                expected = (moe_decode.FUSED_GLUE if fused else moe_decode.EAGER_GLUE) if glue else None
                route = (moe_decode.fused_route if fused else moe_decode.route) if router else None
                assert calls and all(c == (expected, route) for c in calls), (fused, glue, router)
            want = results[False, False]
            for got in (results[True, False], results[True, True]):
                assert torch.equal(got["responses"], want["responses"]), (fused, kw)
                assert torch.equal(got["response_mask"], want["response_mask"])
                if fused:
                    torch.testing.assert_close(
                        got["rollout_log_probs"], want["rollout_log_probs"], rtol=1e-4, atol=1e-5
                    )
                else:
                    assert torch.equal(got["rollout_log_probs"], want["rollout_log_probs"])
    assert bool((got["response_mask"].sum(-1) < 8).any()), "no row stopped early: compaction not exercised"


@pytest.mark.slow
def test_static_step_records_the_routing_of_megatrons_path(mp_world, moe_model):
    """Router replay's recording through the static step (no router Python runs when a graph replays) is
    the routing megatron's MoELayer records on the dynamic path, row for row and column for column."""
    from rltrain.megatron.moe_replay import record_routing

    actor = _actor(moe_model)
    prompts = _batch()["input_ids"][:4, :12].repeat(2, 1)
    kw = {"temperature": 1.0, "eos_id": 7, "stop_token_ids": (11, 13, 17, 19)}
    routed = {}
    for static in (False, True):
        with record_routing(actor) as recorder:
            out = _generate(actor, prompts, static=static, megatron_moe=not static, **kw)
        routed[static] = (recorder.routed_experts(out), out)
    (want, out_d), (got, out_s) = routed[False], routed[True]
    assert torch.equal(out_s["responses"], out_d["responses"])
    assert bool((want >= 0).any())
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that read device values on the host (`.item()`, `.tolist()`, `bool(t)`) or size an
    output from them (`nonzero`, `bincount`, `unique`): what a CUDA graph cannot capture."""

    OPS = ("_local_scalar_dense", "nonzero", "bincount", "_unique2", "unique_dim", "masked_select")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in self.OPS:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def _grouped_mm_without_host_reads(a, b, offsets):
    """The grouped product as masked dense products (what the CUDA kernel computes from device offsets)."""
    row = torch.arange(a.shape[0]).unsqueeze(1)
    ends = offsets.long().unsqueeze(0)
    group = (row >= ends).sum(1)  # [M]: the group of each row
    full = torch.einsum("mk,gkn->gmn", a, b)
    return full.gather(0, group.view(1, -1, 1).expand(1, -1, b.shape[2])).squeeze(0)


def test_static_moe_step_reads_nothing_on_the_host(mp_world, moe_model, monkeypatch):
    """The static decode step of a MoE model, whole (embedding, attention, MoE layers, logits, sampling),
    makes no host read of a device value besides the grouped GEMM's CPU loop (on CUDA, torch._grouped_mm
    takes the offsets on the device): it can live in a CUDA graph. megatron's MoELayer, the old decode
    path, makes such reads (the counter sees them)."""
    from rltrain.megatron import inference, moe_experts

    monkeypatch.setattr(moe_experts, "grouped_mm", _grouped_mm_without_host_reads)
    actor = _actor(moe_model)
    b, p, n = 4, 6, 10
    ids = torch.randint(1, 90, (b, p), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(p + n).expand(b, p + n).contiguous()
    with actor._ctx(), inference.sequence_parallel_off(actor.modules()), torch.no_grad():
        actor.eval()
        engine = inference.KVCacheGenerator(actor, positions, zero_cache=True)
        engine.forward(ids, 0, torch.arange(b), None)
        key_masked = torch.zeros((b, p + n), dtype=torch.bool)
        key_masked[:, p:] = True
        step = inference.StaticDecodeStep(engine, torch.arange(b), key_masked, (1.0, 1.0, -1, 0.0))
        step.tokens.copy_(ids[:, -1:])
        step.col.fill_(p)
        step.uniform.copy_(torch.rand(b))
        with _HostReads() as reads:
            tok, _, routing = step._body(p + n)
        assert reads.seen == [], reads.seen
        assert tok.shape == (b,) and sorted(routing) == [
            layer.mlp.router.layer_number for layer in _moe_layers(actor)
        ]
        # The megatron layer on the same input does read the host.
        layer = _moe_layers(actor)[0]
        with _HostReads() as reads:
            layer.mlp(torch.randn(1, b, layer.config.hidden_size))
        assert reads.seen, "the counter saw no host read in megatron's MoELayer"


def _grouped_actor(path, cfg=None):
    from rlconf.config import ModelConfig

    from .test_moe import _layout_cfg

    model = ModelConfig(path=str(path), attention_backend="sdpa", moe_grouped_gemm=True)
    return actor_of(model, cfg or _layout_cfg(aux=0.01), "cpu", trainable=True, total_steps=4)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_grouped_moe_layer_trains_as_megatrons_moe_layer(mp_world, moe_model, monkeypatch, padded):
    """model.moe_grouped_gemm's MoE layer (GroupedMoELayer: moe_forward, no token dispatcher, the router
    `train_route` without dense maps) in training mode, load-balancing loss on, with and without a padding
    mask: the output and every gradient (hidden states, router, each expert's own weights, shared expert)
    equal megatron's MoELayer.forward on the same module (fp32 rounding); the load-balancing loss megatron's
    tracker records and the routing metrics' token counts are the same numbers."""
    from megatron.core.transformer.moe.moe_utils import (
        MoEAuxLossAutoScaler,
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    from rltrain.megatron.model import MoeRoutingStats
    from rltrain.megatron.moe_decode import GroupedMoELayer, train_router_unsupported

    # A backward outside megatron's schedule sets the loss scale megatron keeps process-wide: undone after.
    monkeypatch.setattr(MoEAuxLossAutoScaler, "main_loss_backward_scale", None)
    actor = _grouped_actor(moe_model)
    layer = _moe_layers(actor)[0]
    assert isinstance(layer.mlp, GroupedMoELayer)
    assert train_router_unsupported(layer.mlp.router) is None
    layer.mlp.train()
    params = [p for p in layer.mlp.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(6, 3, layer.config.hidden_size, generator=gen)
    dy = torch.randn(6, 3, layer.config.hidden_size, generator=gen)
    # [b, s] True on padding, as the engine passes it (row 1 ends two columns early, row 2 one).
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[1, 4:] = padding[2, 5:] = True
    kwargs = {"padding_mask": padding} if padded else {}
    calls = []
    layer.mlp.router.register_forward_hook(lambda *_: calls.append(1))
    results = {}
    for static in (False, True):
        GroupedMoELayer.static = static
        calls.clear()
        clear_aux_losses_tracker()
        try:
            with MoeRoutingStats(actor.chunks, torch.device("cpu")) as stats:
                x = hidden.clone().requires_grad_()
                out, bias = layer.mlp(x, **kwargs)
                assert bias is None
                grads = torch.autograd.grad(out, [x, *params], dy, allow_unused=True)
                aux = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].clone()
                counts = {k: v.clone() for k, v in stats.counts.items()}
        finally:
            GroupedMoELayer.static = True
        assert bool(calls) == (not static), (
            "the grouped layer ran megatron's router forward" if static else ""
        )
        results[static] = (out.detach(), grads, aux, counts)
    (want, want_grads, want_aux, want_counts), (got, got_grads, got_aux, got_counts) = (
        results[False],
        results[True],
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    names = ["hidden"] + [n for n, p in layer.mlp.named_parameters() if p.requires_grad]
    for name, g, w in zip(names, got_grads, want_grads, strict=True):
        assert (g is None) == (w is None), name
        if g is not None:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6, msg=name)
    router_grad = got_grads[1 + names[1:].index(next(n for n in names[1:] if n.startswith("router")))]
    assert router_grad is not None and bool(router_grad.abs().sum() > 0)
    # The same ops on the same numbers: the loss and the counts are equal bit for bit.
    assert bool(want_aux.sum() > 0) and torch.equal(got_aux, want_aux)
    assert want_counts.keys() == got_counts.keys() == {layer.mlp.router.layer_number}
    for key, c in want_counts.items():
        assert torch.equal(got_counts[key], c)
        assert float(c.sum()) == layer.mlp.router.topk * (18 - 3 * padded)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return make_tiny_moe(tmp_path_factory.mktemp("replay_grouped") / "hf", "qwen3_moe")


@pytest.mark.slow
def test_replay_routes_the_grouped_moe_layer_to_the_recorded_experts(mp_world, qwen3_moe):
    """Router replay through GroupedMoELayer: the old log-prob and update passes route every token to the
    recorded (random) experts, as through megatron's layer (tests/megatron/test_router_replay.py)."""

    from .test_router_replay import RoutingSpy, _assert_used, _numbered, _random_routing, _replay_cfg

    cfg = _replay_cfg(ppo_micro_batch_size_per_gpu=3, shuffle=True)
    actor = _grouped_actor(qwen3_moe, cfg)
    batch = _numbered(_batch())
    routed = _random_routing(batch)
    actor.router_replay = False  # replay off for the reference pass
    plain = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
    actor.router_replay = True
    spy = RoutingSpy(actor)
    replayed = actor.compute_log_prob({**batch, "routed_experts": routed}, with_entropy=False)["log_probs"]
    _assert_used(spy, routed, batch, "old log-prob pass")
    assert not torch.allclose(replayed, plain)
    spy = RoutingSpy(actor)
    sign = torch.tensor([1.0 if i % 2 else -1.0 for i in range(8)]).unsqueeze(1)
    rl = {
        **batch,
        "routed_experts": routed,
        "old_log_probs": replayed,
        "advantages": sign * batch["response_mask"],
    }
    metrics = actor.update_policy(rl)
    _assert_used(spy, routed, batch, "update pass")
    assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
