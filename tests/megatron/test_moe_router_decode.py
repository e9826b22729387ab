"""The generation path's static router (rltrain/megatron/moe_decode.py: `static_routing`, `route` and its
compiled `fused_route`) against megatron-core's TopKRouter.forward on the router configurations rlplan's
families use: the same experts in the same top-k order and the same weights (eagerly bit for bit, compiled to
the rounding of the dtype); configurations it does not reproduce are refused by `router_unsupported`, and
`moe_forward` runs megatron's router where a replay object is to see the call or autograd is on. The training
passes' router (`train_route`) against TopKRouter.forward in training mode: routing, losses and gradients.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from ._common import free_port, run_spawned, spawn
from .test_moe import _actor, make_tiny_moe

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]

# name -> (TransformerConfig router fields, params dtypes to try). The families' routers: qwen3-moe
# (softmax over the top k = norm_topk_prob), qwen2-moe / no norm_topk_prob (pre-softmax), top-1, softmax
# with group-limited routing, presets/tiny.py's deepseek-style sigmoid router (expert bias, groups,
# scaling, fp32 routing), sigmoid without bias.
ROUTERS: dict[str, tuple[dict[str, Any], tuple[torch.dtype, ...]]] = {
    "softmax-norm-topk": ({"num_moe_experts": 64, "moe_router_topk": 8}, (torch.float32, torch.bfloat16)),
    "softmax-pre": ({"num_moe_experts": 16, "moe_router_topk": 4, "moe_router_pre_softmax": True},
                    (torch.float32, torch.bfloat16)),
    "softmax-top1": ({"num_moe_experts": 8, "moe_router_topk": 1, "moe_router_pre_softmax": True},
                     (torch.float32,)),
    "softmax-groups": ({"num_moe_experts": 16, "moe_router_topk": 4, "moe_router_num_groups": 4,
                        "moe_router_group_topk": 2, "moe_router_topk_scaling_factor": 1.5}, (torch.float32,)),
    "sigmoid-deepseek": ({"num_moe_experts": 8, "moe_router_topk": 4, "moe_router_score_function": "sigmoid",
                          "moe_router_enable_expert_bias": True, "moe_router_num_groups": 4,
                          "moe_router_group_topk": 2, "moe_router_topk_scaling_factor": 2.5,
                          "moe_router_dtype": "fp32"}, (torch.float32, torch.bfloat16)),
    "sigmoid-plain": ({"num_moe_experts": 16, "moe_router_topk": 3, "moe_router_score_function": "sigmoid"},
                      (torch.float32,)),
}  # fmt: skip
CASES = [pytest.param(name, dtype, id=f"{name}-{str(dtype).removeprefix('torch.')}")
         for name, (_, dtypes) in ROUTERS.items() for dtype in dtypes]  # fmt: skip
HIDDEN = 32


def _router(fields: dict[str, Any], dtype: torch.dtype, **extra: Any) -> torch.nn.Module:
    """megatron's TopKRouter in eval mode, its weight (and expert bias) drawn again with a fixed seed."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    from rltrain.megatron.model import define_missing_te_names

    define_missing_te_names()  # as the engine does before it builds a MoE model
    cfg = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1, add_bias_linear=False,
                            params_dtype=dtype, bf16=dtype == torch.bfloat16, **fields, **extra)  # fmt: skip
    router = TopKRouter(cfg, get_default_pg_collection()).eval()
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        if router.expert_bias is not None:
            router.expert_bias.copy_(torch.randn(router.expert_bias.shape, generator=gen) * 0.1)
    return router


def _megatron(router: torch.nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TopKRouter.forward's top-k (indices in its top-k order, taken by the replay hook the static layer
    used before) and its dense probabilities gathered there: [T, k] each."""
    from rltrain.megatron.moe_decode import _TopkTap

    tap = router.router_replay = _TopkTap(None, silent=True)
    try:
        dense, routing_map = router(hidden)
    finally:
        router.router_replay = None
    assert tap.index is not None
    assert torch.equal(torch.zeros_like(routing_map).scatter(1, tap.index, True), routing_map)
    return dense.gather(1, tap.index), tap.index


def _separated(router: torch.nn.Module, tokens: int, seed: int) -> torch.Tensor:
    """Hidden states whose logits are far from ties: one-hot rows (the logits are then columns of the
    weight, exactly, in any dtype), the weight's columns permutations of a grid of step 1/16 in [-2, 2)
    (exact in bf16). Adjacent logits differ by 1/16, well past any rounding of the score function, so a
    compiled score function that rounds otherwise still chooses the experts megatron's does; the expert bias
    (sigmoid) is redrawn on a grid of 1e-3, below the scores' spacing."""
    gen = torch.Generator().manual_seed(seed)
    experts = router.weight.shape[0]
    grid = torch.arange(-32, 32)[torch.randperm(64, generator=gen)[:experts]].float() / 16
    with torch.no_grad():
        cols = torch.stack([grid[torch.randperm(experts, generator=gen)] for _ in range(HIDDEN)], 1)
        router.weight.copy_(cols)
        if router.expert_bias is not None:
            router.expert_bias.copy_(torch.randint(0, 3, (experts,), generator=gen).float() * 1e-3)
    pick = torch.randint(0, HIDDEN, (tokens,), generator=gen)
    return torch.nn.functional.one_hot(pick, HIDDEN).to(router.weight.dtype).view(tokens, 1, HIDDEN)


@pytest.mark.parametrize(("name", "dtype"), CASES)
def test_static_router_is_megatrons_router(mp_world, name, dtype):
    """The eager static router gives megatron's indices and probabilities bit for bit on random inputs
    (the same ops in the same dtypes, ties broken by the same top-k); the compiled one the same indices on
    inputs far from ties and the probabilities to the dtype's rounding (fp32 tight, bf16 a few ulps)."""
    from rltrain.megatron.moe_decode import fused_route, route, router_unsupported, static_routing

    fields, _ = ROUTERS[name]
    router = _router(fields, dtype)
    assert router_unsupported(router) is None
    gen = torch.Generator().manual_seed(5)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-5}
    with torch.no_grad():
        for tokens in (1, 7, 64):
            hidden = torch.randn(tokens, 1, HIDDEN, generator=gen).to(dtype)
            want_p, want_i = _megatron(router, hidden)
            got_p, got_i = static_routing(router, hidden, route)
            assert got_p.dtype == want_p.dtype and got_i.dtype == want_i.dtype
            assert torch.equal(got_i, want_i), (name, tokens)
            assert torch.equal(got_p, want_p), (name, tokens)
        # Compiled afresh: a session that compiled more routings than torch's limit would run `route` eagerly.
        torch._dynamo.reset()
        for seed, tokens in ((0, 1), (1, 5), (2, 64)):
            hidden = _separated(router, tokens, seed)
            want_p, want_i = _megatron(router, hidden)
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message=".*recompile limit")
                got_p, got_i = static_routing(router, hidden, fused_route)
            assert torch.equal(got_i, want_i), (name, tokens)
            torch.testing.assert_close(got_p, want_p, **tol)
            # Not trivially equal: the choice depends on the token.
            assert tokens == 1 or len({tuple(r) for r in want_i.tolist()}) > 1


def test_router_unsupported_names_what_it_refuses(mp_world):
    """Routers whose routing `route` would not reproduce are refused with a reason: input jitter (megatron
    jitters in eval too), random logits for load balancing, a TopKRouter subclass (it may route otherwise)."""
    from megatron.core.transformer.moe.router import TopKRouter

    from rltrain.megatron.moe_decode import router_unsupported

    fields = ROUTERS["softmax-norm-topk"][0]
    assert "jitter" in router_unsupported(_router(fields, torch.float32, moe_input_jitter_eps=1e-2))
    assert "moe_router_force_load_balancing" in router_unsupported(
        _router(fields, torch.float32, moe_router_force_load_balancing=True)
    )

    class Routed(TopKRouter):
        pass

    router = _router(fields, torch.float32)
    router.__class__ = Routed
    assert router_unsupported(router) == "router Routed"


# The routers `train_route` takes (the expert bias keeps megatron's router) x (z-loss, padding mask).
TRAIN_CASES = [
    pytest.param(name, dtype, z_loss, padded, id=f"{name}-{str(dtype).removeprefix('torch.')}"
                 f"{'-zloss' if z_loss else ''}{'-padded' if padded else ''}")
    for name, (fields, dtypes) in ROUTERS.items() if not fields.get("moe_router_enable_expert_bias")
    for dtype in dtypes
    for z_loss, padded in ((False, False), (False, True), (True, True))
]  # fmt: skip


@pytest.mark.parametrize(("name", "dtype", "z_loss", "padded"), TRAIN_CASES)
def test_train_route_trains_as_megatrons_router(mp_world, monkeypatch, name, dtype, z_loss, padded):
    """The training router (`train_route`) against TopKRouter.forward in training mode, load-balancing loss
    on (and the z-loss, and a padding mask, where the case says): the same experts and top-k probabilities
    bit for bit, the same losses in megatron's tracker bit for bit, and the same gradients of the hidden
    states and the router's weight to the dtype's rounding (megatron's router adds the logits' gradient
    paths in another order)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    # A backward outside megatron's schedule sets the loss scale megatron keeps process-wide: undone after.
    monkeypatch.setattr(MoEAuxLossAutoScaler, "main_loss_backward_scale", None)
    _compare_train_route(name, dtype, z_loss, padded, seed=7)


def _compare_train_route(name: str, dtype: torch.dtype, z_loss: bool, padded: bool, seed: int) -> None:
    """`test_train_route_trains_as_megatrons_router`'s comparison on this rank's hidden states (`seed`)."""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    from rltrain.megatron.moe_decode import _TopkTap, train_route, train_router_unsupported

    from ..tolerance import tolerance

    fields, _ = ROUTERS[name]
    extra = {"moe_aux_loss_coeff": 0.01, **({"moe_z_loss_coeff": 1e-3} if z_loss else {})}
    router = _router(fields, dtype, **extra).train()
    router.set_layer_number(1)  # the tracker records a layer's losses only
    assert train_router_unsupported(router) is None
    gen = torch.Generator().manual_seed(seed)
    seq, rows = 6, 3
    hidden = torch.randn(seq, rows, HIDDEN, generator=gen).to(dtype)
    padding = torch.zeros(seq, rows, dtype=torch.bool)  # [s, b] True on padding, as MoELayer.route takes it
    if padded:
        padding[4:, 1] = padding[5:, 2] = True
    mask = padding if padded else None
    weight_out = torch.randn(seq * rows, router.topk, generator=gen)
    results = {}
    for path in ("megatron", "train_route"):
        clear_aux_losses_tracker()
        x = hidden.clone().requires_grad_()
        if path == "megatron":
            tap = router.router_replay = _TopkTap(None, silent=True)
            try:
                dense, _ = router(x, mask)
            finally:
                router.router_replay = None
            index = tap.index
            probs = dense.gather(1, index)
        else:
            probs, index = train_route(router, x, mask)
        grads = torch.autograd.grad((probs.float() * weight_out).sum(), [x, router.weight])
        tracker = get_moe_layer_wise_logging_tracker()
        losses = {key: v["values"].clone() for key, v in tracker.items() if bool(v["values"].any())}
        results[path] = (probs.detach(), index, grads, losses)
    clear_aux_losses_tracker()
    (want_p, want_i, want_g, want_l), (got_p, got_i, got_g, got_l) = (
        results["megatron"],
        results["train_route"],
    )
    assert torch.equal(got_i, want_i) and got_p.dtype == want_p.dtype and torch.equal(got_p, want_p)
    assert want_l.keys() == got_l.keys() == {"load_balancing_loss", *(["z_loss"] if z_loss else [])}
    for key, value in want_l.items():
        assert torch.equal(got_l[key], value), key
    for label, g, w in zip(("hidden", "router weight"), got_g, want_g, strict=True):
        tol = tolerance(dtype, reduction=router.weight.shape[0], magnitude=float(w.abs().max()))
        torch.testing.assert_close(g, w, **tol, msg=lambda m, label=label: f"{label}: {m}")


def _tp2_worker(rank: int, world: int, port: int) -> None:
    run_spawned(_tp2_train_route, rank, world, port)


def _tp2_train_route(rank: int, world: int, port: int) -> None:
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from rltrain.megatron.parallel import GroupSizes, destroy_parallel, init_parallel

    init_parallel(GroupSizes(tp=2), "cpu", rank=rank, world_size=world, master_port=port)
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    for padded in (False, True):  # each rank routes its own tokens (its sequence shard)
        _compare_train_route("softmax-norm-topk", torch.float32, False, padded, seed=7 + rank)
    destroy_parallel()


@pytest.mark.multiproc
def test_train_route_reduces_the_expert_load_over_tensor_parallel_ranks(tmp_path):
    """At TP = 2 the load-balancing loss counts tokens per expert over both ranks' tokens (megatron reduces
    them over the TP x CP group): `train_route` equals megatron's router on each rank, with ranks routing
    different tokens, padded and unpadded."""
    spawn(_tp2_worker, args=(2, free_port()), nprocs=2, join=True)


def test_train_router_unsupported_keeps_megatrons_router_where_it_must(mp_world):
    """Where megatron's router does more than `train_route` reproduces, it is named and megatron's runs:
    a replay object (recording and replaying go through megatron's hook), the expert bias (its token count
    for the bias update), the sequence-level or global balancing losses; and whatever the static router
    refuses."""
    from rltrain.megatron.moe_decode import train_router_unsupported

    fields = ROUTERS["softmax-norm-topk"][0]
    router = _router(fields, torch.float32, moe_aux_loss_coeff=0.01)
    assert train_router_unsupported(router) is None
    router.router_replay = _Recorder()
    assert train_router_unsupported(router) == "router replay"
    assert "expert bias" in train_router_unsupported(_router(ROUTERS["sigmoid-deepseek"][0], torch.float32))
    for kind in ("seq_aux_loss", "global_aux_loss"):
        refused = _router(fields, torch.float32, moe_router_load_balancing_type=kind, moe_aux_loss_coeff=0.01)
        assert "load-balancing" in train_router_unsupported(refused), kind
    assert "jitter" in train_router_unsupported(_router(fields, torch.float32, moe_input_jitter_eps=1e-2))


@pytest.mark.parametrize("k", [2, 4])
def test_dispatch_takes_topk_probabilities(k):
    """The glue's dispatch given the top-k probabilities [T, k] and the expert count gives what it gives
    from megatron's dense [T, E] ones, also where k == E (the same shapes, told apart by `experts`)."""
    from rltrain.megatron import moe_decode

    gen = torch.Generator().manual_seed(4)
    tokens, experts = 9, 4
    x = torch.randn(tokens, 8, generator=gen)
    dense = torch.rand(tokens, experts, generator=gen)
    index = torch.rand(tokens, experts, generator=gen).topk(k, dim=1).indices
    for by_rank in (True, False):
        want = moe_decode.dispatch(x, index, dense, by_rank)
        for fn in (moe_decode.dispatch, moe_decode.fused_dispatch):
            got = fn(x, index, dense.gather(1, index), by_rank, experts)
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g, w), (fn.__name__, by_rank)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return make_tiny_moe(tmp_path_factory.mktemp("router_decode") / "hf", "qwen3_moe")


class _Recorder:
    """A replay object attached to a router (as moe_replay.record_routing attaches one): counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        self.calls += 1
        return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)


def test_moe_forward_takes_the_static_router_only_where_unwatched(mp_world, qwen3_moe, monkeypatch):
    """moe_forward with the glue takes `route` without autograd where no replay object is attached or the
    call is silent, with megatron's bits (eager); megatron's router where a replay object is to see the
    call (it sees it), with autograd on, and for a router `router_unsupported` refuses."""
    from megatron.core.transformer.moe.router import TopKRouter

    from rltrain.megatron import moe_decode
    from rltrain.megatron.model import unwrap

    actor = _actor(qwen3_moe)
    actor.eval()
    layer = next(layer for layer in unwrap(actor.chunks[0]).decoder.layers if moe_decode.is_moe(layer.mlp))
    mlp, router = layer.mlp, layer.mlp.router
    routes: list[int] = []

    def spy(*args):
        routes.append(1)
        return moe_decode.route(*args)

    weights = moe_decode.ExpertWeights()
    hidden = torch.randn(1, 6, layer.config.hidden_size, generator=torch.Generator().manual_seed(8))

    def call(silent: bool = False, route=spy):
        routes.clear()
        (out, _), index = moe_decode.moe_forward(
            mlp, hidden, weights, silent, glue=moe_decode.EAGER_GLUE, route=route
        )
        return out, index, bool(routes)

    with torch.no_grad():
        want, want_index, routed = call(route=None)
        assert not routed
        got, index, routed = call()
        assert routed and torch.equal(index, want_index) and torch.equal(got, want)
        recorder = _Recorder()
        router.router_replay = recorder
        try:
            assert call(silent=False)[2] is False and recorder.calls == 1  # the recorder saw it
            assert call(silent=True)[2] is True and recorder.calls == 1  # a captured step's call
        finally:
            router.router_replay = None

        class Routed(TopKRouter):
            pass

        monkeypatch.setattr(router, "__class__", Routed)
        got, index, routed = call()
        assert not routed and torch.equal(got, want)
        monkeypatch.undo()
    with torch.enable_grad():
        assert call()[2] is False
