"""Grouped-GEMM experts (`model.moe_grouped_gemm`, rltrain/megatron/moe_experts.py) on CPU.

The autograd Function's hand-written backward equals autograd through the plain per-expert math (float64,
gradcheck as well), with an expert that receives no token; in a model, log-probs and one PPO update equal
megatron's SequentialMLP, and the HF export of a grouped-GEMM model is the checkpoint it loaded (same
parameters and names). The CUDA kernel path (torch._grouped_mm, bf16) is timed by bench/moe_experts_gpu.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from rlconf.config import ModelConfig

from ..tolerance import assert_close, tolerance
from ._common import actor_of, assert_export_round_trips
from .test_moe import (
    MOE_CONFIGS,
    MOE_DEPTH,
    _batch,
    _close,
    _layout_cfg,
    _rl_batch,
    make_tiny_moe,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]

COUNTS = [3, 0, 5, 2]  # rows per expert, one expert without tokens
H, FF = 8, 6


def _reference(x, w1, w2, probs, counts):
    """megatron's SequentialMLP math, expert by expert, through plain autograd."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        gate, up = (x[start : start + n] @ w1[e].t()).chunk(2, -1)
        outs.append(((F.silu(gate) * up) * probs[start : start + n, None]) @ w2[e].t())
        start += n
    return torch.cat(outs)


def _inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    m = sum(COUNTS)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()  # noqa: E731
    return make(m, H), make(len(COUNTS), 2 * FF, H), make(len(COUNTS), H, FF), make(m)


def test_grouped_swiglu_backward_equals_autograd_of_the_per_expert_math():
    from rltrain.megatron.moe_experts import GroupedSwiGLU

    x, w1, w2, p = _inputs()
    dy = torch.randn(sum(COUNTS), H, dtype=torch.float64)
    got = GroupedSwiGLU.apply(x, w1, w2, p, COUNTS)
    grads = torch.autograd.grad(got, (x, w1, w2, p), dy)
    want = _reference(x, w1, w2, p, COUNTS)
    ref_grads = torch.autograd.grad(want, (x, w1, w2, p), dy)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(("x", "w1", "w2", "probs"), grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)
    assert bool((grads[1][1] == 0).all()) and bool((grads[2][1] == 0).all())  # the expert without tokens
    assert torch.autograd.gradcheck(lambda *t: GroupedSwiGLU.apply(*t, COUNTS), (x, w1, w2, p))


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return make_tiny_moe(tmp_path_factory.mktemp("grouped") / "hf", "qwen3_moe")


def _actor(path, grouped: bool):

    model = ModelConfig(path=str(path), attention_backend="sdpa", moe_grouped_gemm=grouped)
    return actor_of(model, _layout_cfg(), "cpu", trainable=True, total_steps=4)


def test_grouped_experts_match_sequential_mlp_in_log_probs_and_one_update(mp_world, qwen3_moe, tmp_path):
    from rltrain.megatron.model import unwrap
    from rltrain.megatron.moe_experts import GroupedGemmExperts

    batch = _batch()
    results = {}
    for grouped in (False, True):
        actor = _actor(qwen3_moe, grouped)
        experts = [
            type(layer.mlp.experts)
            for layer in unwrap(actor.chunks[0]).decoder.layers
            if hasattr(layer.mlp, "experts")
        ]
        assert (experts == [GroupedGemmExperts] * 2) == grouped, experts
        if grouped:  # loaded weights export unchanged: same parameters, names and HF mapping
            assert_export_round_trips(actor, qwen3_moe, tmp_path / "export", ("num_experts",),
                                      MOE_CONFIGS["qwen3_moe"][1], "grouped")  # fmt: skip
        old = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
        metrics = actor.update_policy(_rl_batch(batch, old))
        after = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
        results[grouped] = (old, metrics, after)
    _close(results[True][0], results[False][0], "log-probs", depth=MOE_DEPTH)
    assert results[True][1]["actor/grad_norm"] == pytest.approx(
        results[False][1]["actor/grad_norm"], rel=1e-4
    )
    _close(results[True][2], results[False][2], "after one update", depth=MOE_DEPTH + 4)
    # The update moved the weights: the comparison after it is not the one before it again.
    assert not torch.allclose(results[False][2], results[False][0])


def test_plan_carries_the_switch():
    from presets import get_preset
    from rlconf.config import RLConfig
    from rlconf.plan import compile_plan

    cfg: RLConfig = get_preset("tiny-grpo-moe")
    cfg = replace(cfg, model=replace(cfg.model, moe_grouped_gemm=True))
    assert compile_plan(cfg).engine("actor").settings.transformer.moe_grouped_gemm


# ------------------------------------------------------------------ the update path (moe_experts.ExpertUpdate)
class _Experts(torch.nn.Module):
    """E megatron-shaped experts (linear_fc1.weight [2F, H], linear_fc2.weight [H, F]) from stacked weights."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        self.local_experts = torch.nn.ModuleList()
        for a, b in zip(w1, w2, strict=True):
            e = torch.nn.Module()
            e.linear_fc1, e.linear_fc2 = torch.nn.Module(), torch.nn.Module()
            e.linear_fc1.weight = torch.nn.Parameter(a.detach().clone())
            e.linear_fc2.weight = torch.nn.Parameter(b.detach().clone())
            self.local_experts.append(e)

    def weights(self) -> list[torch.nn.Parameter]:
        return [e.linear_fc1.weight for e in self.local_experts] + [
            e.linear_fc2.weight for e in self.local_experts
        ]


@dataclasses.dataclass(frozen=True)
class _Config:
    """The TransformerConfig fields `expert_swiglu` reads."""

    bias_activation_fusion: bool = False
    recompute_granularity: str | None = None
    recompute_modules: tuple[str, ...] | None = None


@contextlib.contextmanager
def _switches(on: bool):
    from rltrain.megatron.moe_experts import ExpertUpdate

    names = ("fuse", "main_grad", "cache", "no_accumulators")
    before = [getattr(ExpertUpdate, n) for n in names]
    ExpertUpdate.set(on)
    try:
        yield
    finally:
        for n, v in zip(names, before, strict=True):
            setattr(ExpertUpdate, n, v)


def _run(experts: _Experts, x, probs, counts, dy, config=_Config()):
    """Output, and the gradients of x, probs and every expert weight (as autograd leaves them)."""
    from rltrain.megatron.moe_experts import expert_swiglu

    x, probs = x.detach().requires_grad_(), probs.detach().requires_grad_()
    out = expert_swiglu(experts.local_experts, x, probs, counts, config)
    out.backward(dy)
    grads = [x.grad, probs.grad] + [p.grad for p in experts.weights()]
    for p in experts.weights():
        p.grad = None
    return out.detach(), grads


@pytest.mark.parametrize("on", [False, True])
def test_expert_params_path_gives_every_expert_parameter_its_gradient(on):
    """Without DDP (no main_grad) both ways give each expert parameter the per-expert math's gradient
    (float64), the expert without tokens zeros; switched on and off they are bit-identical."""
    x, w1, w2, p = _inputs()
    dy = torch.randn(sum(COUNTS), H, dtype=torch.float64)
    want = _reference(x, w1, w2, p, COUNTS)
    ref = torch.autograd.grad(want, (x, p, w1, w2), dy)
    experts = _Experts(w1, w2)
    with _switches(on):
        out, grads = _run(experts, x, p, COUNTS, dy)
    with _switches(not on):
        out_other, grads_other = _run(experts, x, p, COUNTS, dy)
    torch.testing.assert_close(out, want.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads[0], ref[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[1], ref[1], rtol=1e-10, atol=1e-12)
    e = len(COUNTS)
    for i in range(e):
        torch.testing.assert_close(grads[2 + i], ref[2][i], rtol=1e-10, atol=1e-12, msg=f"fc1 {i}")
        torch.testing.assert_close(grads[2 + e + i], ref[3][i], rtol=1e-10, atol=1e-12, msg=f"fc2 {i}")
    assert bool((grads[3] == 0).all()) and bool((grads[3 + e] == 0).all())  # expert 1 has no token
    assert torch.equal(out, out_other)
    for a, b in zip(grads, grads_other, strict=True):
        assert torch.equal(a, b)


def _ddp_like(experts: _Experts, main_dtype: torch.dtype, hook_needed: bool = True) -> dict[str, list]:
    """megatron DDP's gradient protocol on the experts' weights: a main_grad per parameter, the
    grad_added_to_main_grad flag, and its backward post-hook on each gradient accumulator
    (distributed_data_parallel.py `_make_backward_post_hook`: add param.grad unless the flag says it was
    added, then drop param.grad), and the engine's `ddp_hook_needed` mark (DDP overlaps its gradient
    reduction, whose hook must see every gradient). Records each hook call's gradient storage."""
    seen: dict[str, list] = {"fired": [], "storage": []}
    keep = []
    for i, param in enumerate(experts.weights()):
        param.main_grad = torch.zeros(param.shape, dtype=main_dtype)
        param.grad_added_to_main_grad = False
        param.ddp_hook_needed = hook_needed

        def hook(*_unused, param=param, i=i):
            assert param.grad is not None  # what overlap_grad_reduce asserts
            seen["fired"].append(i)
            seen["storage"].append(param.grad.untyped_storage().data_ptr())
            if not param.grad_added_to_main_grad:
                param.main_grad.add_(param.grad.data)
            param.grad = None

        acc = param.expand_as(param).grad_fn.next_functions[0][0]
        acc.register_hook(hook)
        keep.append(acc)
    seen["accumulators"] = keep
    return seen


@pytest.mark.parametrize("hook_needed", [True, False], ids=["overlapped-reduce", "no-overlap"])
@pytest.mark.parametrize("chunk_bytes", [None, 1], ids=["one-add", "an-add-per-expert"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_main_grads_accumulate_over_micro_batches_without_the_hooks_adding(
    dtype, chunk_bytes, hook_needed, monkeypatch
):
    """With megatron DDP's protocol (fp32 main_grad, bf16 or fp32 weights), three micro-batches (different
    rows, an expert without tokens in one) accumulate into main_grad exactly what DDP's per-parameter hooks
    accumulate with the switches off. On, where DDP overlaps its reduction the hooks still fire for every
    parameter with a gradient (what overlap_grad_reduce needs), the gradients they see are views of one
    stacked tensor per weight kind (no copy per parameter), and the flag tells them not to add; where it
    does not, no expert weight gets an autograd gradient and no hook fires. The same whether the experts'
    fp32 gradients are added all at once or in chunks (`MAIN_GRAD_CHUNK_BYTES`, down to one per add)."""
    from rltrain.megatron import moe_experts

    if chunk_bytes is not None:
        monkeypatch.setattr(moe_experts, "MAIN_GRAD_CHUNK_BYTES", chunk_bytes)
    g = torch.Generator().manual_seed(1)
    e = len(COUNTS)
    w1 = (torch.randn(e, 2 * FF, H, generator=g) * 0.3).to(dtype)
    w2 = (torch.randn(e, H, FF, generator=g) * 0.3).to(dtype)
    batches = []
    for counts in (COUNTS, [1, 4, 0, 2], [2, 2, 2, 2]):
        m = sum(counts)
        batches.append((torch.randn(m, H, generator=g).to(dtype), torch.rand(m, generator=g), counts,
                        torch.randn(m, H, generator=g).to(dtype)))  # fmt: skip
    mains = {}
    for on in (False, True):
        experts = _Experts(w1, w2)
        seen = _ddp_like(experts, torch.float32, hook_needed)
        with _switches(on):
            for x, p, counts, dy in batches:
                _run(experts, x, p, counts, dy)
        params = experts.weights()
        assert all(p.grad is None for p in params)
        assert all(p.grad_added_to_main_grad == on for p in params)
        fires = 0 if on and not hook_needed else len(batches)  # no accumulator ran, no hook: none
        assert len(seen["fired"]) == fires * 2 * e
        for b in range(fires):  # every hook once per micro-batch
            assert sorted(seen["fired"][b * 2 * e : (b + 1) * 2 * e]) == list(range(2 * e))
        if on and hook_needed:  # per micro-batch: the E fc1 gradients share one storage, the E fc2 another
            for b in range(len(batches)):
                storages = seen["storage"][b * 2 * e : (b + 1) * 2 * e]
                assert len(set(storages)) == 2, storages
        mains[on] = [p.main_grad.clone() for p in params]
        assert any(bool(m.abs().sum() > 0) for m in mains[on])
    for a, b in zip(mains[False], mains[True], strict=True):
        assert torch.equal(a, b)


def test_stacks_are_made_once_per_context_and_again_after_an_in_place_change(monkeypatch):
    """Inside `cached_expert_stacks` the second micro-batch reuses the first one's stacks; an in-place change
    of a weight (its version counter) restacks; outside the context (and where megatron recomputes the MoE
    layer) every call stacks. Outputs equal the uncached path's."""
    from rltrain.megatron import moe_experts
    from rltrain.megatron.moe_experts import cached_expert_stacks

    stacks = []
    real_stack = torch.stack
    monkeypatch.setattr(
        moe_experts.torch, "stack", lambda ts, *a, **k: stacks.append(len(ts)) or real_stack(ts, *a, **k)
    )
    x, w1, w2, p = _inputs()
    dy = torch.randn(sum(COUNTS), H, dtype=torch.float64)
    experts = _Experts(w1, w2)

    def selective(*modules: str) -> _Config:
        return _Config(recompute_granularity="selective", recompute_modules=modules)

    with _switches(True):
        plain, _ = _run(experts, x, p, COUNTS, dy)
        assert len(stacks) == 2  # fc1 and fc2, no cache outside the context
        with cached_expert_stacks():
            first, _ = _run(experts, x, p, COUNTS, dy)
            second, _ = _run(experts, x, p, COUNTS, dy)
            assert len(stacks) == 4
            assert torch.equal(first, plain) and torch.equal(second, plain)
            _run(experts, x, p, COUNTS, dy, _Config(recompute_granularity="full"))
            assert len(stacks) == 6
            # megatron recomputes the MoE layer: a cache would hold every layer's stack at once.
            _run(experts, x, p, COUNTS, dy, selective("moe"))
            assert len(stacks) == 8
            _run(experts, x, p, COUNTS, dy, selective("mlp"))
            assert len(stacks) == 8  # other modules recomputed: the cached stacks serve
            with torch.no_grad():
                experts.local_experts[2].linear_fc2.weight.mul_(2)
            changed, _ = _run(experts, x, p, COUNTS, dy)
            assert len(stacks) == 10
            assert not torch.equal(changed, plain)
        assert moe_experts._STACKS is None
        _run(experts, x, p, COUNTS, dy)
        assert len(stacks) == 12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_elementwise_equals_eager_and_compiles_once_across_row_counts(dtype):
    """The compiled SwiGLU x probability and its backward equal the eager functions within the dtype's
    rounding, for row counts 0, 1 and more; each compiles one graph for the dtype (a recompile raises)."""
    from torch._dynamo.utils import counters

    from rltrain.megatron.moe_experts import (
        fused_swiglu_probs,
        fused_swiglu_probs_backward,
        swiglu_probs,
        swiglu_probs_backward,
    )

    g = torch.Generator().manual_seed(2)
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for m in (7, 1, 0, 33, 2):
            h = torch.randn(m, 2 * FF, generator=g).to(dtype)
            probs = torch.rand(m, generator=g)
            dscaled = torch.randn(m, FF, generator=g).to(dtype)
            got = fused_swiglu_probs(h, probs)
            want = swiglu_probs(h, probs)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert_close(got, want, reduction=2)
            for a, b in zip(fused_swiglu_probs_backward(h, probs, dscaled), swiglu_probs_backward(h, probs, dscaled),
                            strict=True):  # fmt: skip
                assert a.dtype == b.dtype and a.shape == b.shape
                # dp is fp32 but sums the activation eager rounds to the input's dtype: that dtype's rounding.
                magnitude = float(b.abs().max()) if b.numel() else 1.0
                torch.testing.assert_close(
                    a.float(), b.float(), **tolerance(dtype, 2 * FF, magnitude=magnitude)
                )
    assert counters["stats"]["unique_graphs"] - before == 2


def test_fused_switch_follows_the_engines_fused_kernels(monkeypatch):
    """`expert_swiglu` runs the compiled elementwise functions only where the config says fused kernels
    (`bias_activation_fusion`) and the switch is on; the gradients through them (compiled for real) match
    the eager path's to rounding."""
    from rltrain.megatron import moe_experts

    calls = []
    for name in ("fused_swiglu_probs", "fused_swiglu_probs_backward"):
        real = getattr(moe_experts, name)
        monkeypatch.setattr(moe_experts, name, lambda *t, _n=name, _f=real: calls.append(_n) or _f(*t))
    x, w1, w2, p = _inputs(torch.float32)
    dy = torch.randn(sum(COUNTS), H)
    experts = _Experts(w1, w2)
    with _switches(True):
        _, eager = _run(experts, x, p, COUNTS, dy)
        assert calls == []
        _, fused = _run(experts, x, p, COUNTS, dy, _Config(bias_activation_fusion=True))
        assert calls == ["fused_swiglu_probs", "fused_swiglu_probs_backward"]
    with _switches(False):
        _run(experts, x, p, COUNTS, dy, _Config(bias_activation_fusion=True))
        assert len(calls) == 2
    for a, b in zip(fused, eager, strict=True):
        assert_close(a, b, reduction=max(sum(COUNTS), 2 * FF))


def test_update_through_megatron_ddp_equals_the_path_before(mp_world, qwen3_moe):
    """A grouped-GEMM actor's update (megatron DDP and distributed optimizer on gloo, fp32, four
    micro-batches of two rows into one optimizer step) gives the same main_grads and the same parameters
    after the step with the update path's switches on as off: the gradients went into main_grad by the
    multi-tensor add (the flag is still set after the step), the stacks were reused across micro-batches and
    the weights were held, not autograd inputs (no accumulator and no DDP hook per expert weight)."""
    from rltrain.megatron import moe_experts
    from rltrain.megatron.model import unwrap

    batch = _batch()
    results = {}
    for on in (False, True):
        with _switches(on):
            actor = _actor(qwen3_moe, True)
            old = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
            stacks: list[torch.Tensor] = []

            def record(*args, _real=moe_experts._stack, _out=stacks):
                w1, w2 = _real(*args)
                _out.append(w1)
                return w1, w2

            held: list[bool] = []

            def held_or_not(*args, _real=moe_experts._held, _out=held):
                _out.append(_real(*args))
                return _out[-1]

            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(moe_experts, "_stack", record)
                mp.setattr(moe_experts, "_held", held_or_not)
                actor.update_policy(_rl_batch(batch, old))
            # On: megatron DDP without overlapped reduction needs no hook per expert weight, so the weights
            # were held (no autograd accumulator) in every layer and micro-batch.
            assert held == ([True] * 8 if on else [])
            model = unwrap(actor.chunks[0])
            named = dict(model.named_parameters())
            experts = [n for n in named if ".experts.local_experts." in n]
            assert experts
            assert all(named[n].grad_added_to_main_grad == on for n in experts)
            # On: 2 layers x 4 micro-batches, one stack per layer from the context's cache; off: none (the
            # weights stacked through autograd instead).
            assert (len(stacks), len({id(t) for t in stacks})) == ((8, 2) if on else (0, 0))
            results[on] = {n: (p.main_grad.clone(), p.detach().clone()) for n, p in named.items()}
    assert results[True].keys() == results[False].keys()
    for n, (grad, param) in results[True].items():
        assert torch.equal(grad, results[False][n][0]), n
        assert torch.equal(param, results[False][n][1]), n


def test_a_forward_only_pass_stacks_each_layer_once(mp_world, qwen3_moe, monkeypatch):
    """A log-prob pass of four micro-batches stacks each of the two MoE layers' expert weights once (the
    engine's `cached_expert_stacks` around the pass, dropped after it), not once per micro-batch (the bench
    switch `passstacks`, the way before), with the same log-probs bit for bit; after an update the next
    pass stacks the new weights."""
    from rltrain.megatron import moe_experts
    from rltrain.megatron.fused import TRAIN_KERNELS_OFF_ENV

    cfg = replace(_layout_cfg(), log_prob_micro_batch_size_per_gpu=2)
    model = ModelConfig(path=str(qwen3_moe), attention_backend="sdpa", moe_grouped_gemm=True)
    actor = actor_of(model, cfg, "cpu", trainable=True, total_steps=4)
    batch = _batch()
    stacks: list[torch.Tensor] = []

    def record(*args, _real=moe_experts._stack):
        w1, w2 = _real(*args)
        stacks.append(w1)
        return w1, w2

    def log_probs() -> torch.Tensor:
        stacks.clear()
        return actor.compute_log_prob(batch, with_entropy=False)["log_probs"]

    monkeypatch.setattr(moe_experts, "_stack", record)
    monkeypatch.setenv(TRAIN_KERNELS_OFF_ENV, "passstacks")
    per_micro_batch = log_probs()
    assert (len(stacks), len({id(t) for t in stacks})) == (8, 8)  # 2 layers x 4 micro-batches
    monkeypatch.delenv(TRAIN_KERNELS_OFF_ENV)
    once = log_probs()
    assert (len(stacks), len({id(t) for t in stacks})) == (8, 2)
    assert torch.equal(once, per_micro_batch)
    assert moe_experts._STACKS is None  # dropped with the pass
    first = list(stacks)
    actor.update_policy(_rl_batch(batch, once))
    after = log_probs()
    assert len({id(t) for t in stacks}) == 2
    assert not any(torch.equal(new, old) for new, old in zip(stacks[:2], first[:2], strict=True))
    assert not torch.equal(after, once)


def test_one_kernel_adds_the_experts_gradients_into_megatron_ddps_buffer(mp_world, qwen3_moe, monkeypatch):
    """`triton_grad_add` takes the main_grads real megatron DDP gives the experts as they are (its layout
    check passes: fp32 views into one buffer), and an update whose experts' gradients go through it (two
    launches per MoE layer and micro-batch, each at that weight kind's offsets into the buffer) ends with the
    main_grads and parameters of the foreach path bit for bit. Triton cannot run on this CPU machine: the
    launch is the kernel's documented math in torch (checked against the kernel in Triton's interpreter and
    on the device by bench/train_kernels_gpu.py); the offsets, the buffer view and the dispatch are real."""
    from rltrain.megatron import triton_grad_add
    from rltrain.megatron.model import unwrap

    batch = _batch()
    results = {}
    launches: list[tuple[int, tuple[int, ...]]] = []

    def launch(buffer, offsets, dw, size):  # the kernel's math
        index = (offsets.unsqueeze(1) + torch.arange(size)).reshape(-1)
        buffer.index_put_((index,), dw.reshape(-1).to(buffer.dtype), accumulate=True)
        launches.append((len(offsets), tuple(offsets.tolist())))

    made: list = []

    def destination(mains, _real=triton_grad_add.destination):
        made.append(_real(mains))
        return made[-1]

    for kernel in (False, True):
        with _switches(True), monkeypatch.context() as m:
            if kernel:
                m.setattr(triton_grad_add, "device_unsupported", lambda device: None)
                m.setattr(triton_grad_add, "destination", destination)
                m.setattr(triton_grad_add, "_launch", launch)
            actor = _actor(qwen3_moe, True)
            old = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
            actor.update_policy(_rl_batch(batch, old))
            named = dict(unwrap(actor.chunks[0]).named_parameters())
            results[kernel] = {n: (p.main_grad.clone(), p.detach().clone()) for n, p in named.items()}
    # Made once per layer and weight kind for the mini-batch (not per micro-batch), and all taken.
    assert len(made) == 2 * 2 and not any(isinstance(d, str) for d in made), made
    assert len(launches) == 2 * 2 * 4  # fc1 and fc2, 2 layers, 4 micro-batches
    assert len({offsets for _, offsets in launches}) == 4  # each layer's fc1 and fc2 at their own offsets
    for n, (grad, param) in results[True].items():
        assert torch.equal(grad, results[False][n][0]), n
        assert torch.equal(param, results[False][n][1]), n


def test_triton_grad_add_refuses_what_it_cannot_take(monkeypatch):
    """The kernel's destination refuses main_grads outside one buffer, of another dtype or size, and takes
    no gradient stack of another size, count or layout; on this CPU machine it names the device."""
    from rltrain.megatron import triton_grad_add as t

    buffer = torch.zeros(40)
    mains = [buffer[i * 10 : (i + 1) * 10].view(2, 5) for i in (3, 1, 2)]
    assert t.destination(mains) == "no triton on this device"
    monkeypatch.setattr(t, "device_unsupported", lambda device: None)
    dest = t.destination(mains)
    assert not isinstance(dest, str) and dest.offsets.tolist() == [30, 10, 20] and dest.size == 10
    assert dest.buffer.data_ptr() == buffer.data_ptr() and dest.buffer.numel() == 40
    assert "one buffer" in t.destination([*mains[:2], torch.zeros(2, 5)])
    assert "fp32" in t.destination([m.double() for m in mains])
    assert "one size" in t.destination([*mains[:2], buffer[:4]])
    dw = torch.ones(3, 2, 5, dtype=torch.bfloat16)
    assert t.gradients_unsupported(dest, dw) is None
    assert "size" in t.gradients_unsupported(dest, torch.ones(3, 2, 4, dtype=torch.bfloat16))
    assert "per main_grad" in t.gradients_unsupported(dest, dw[:2])
    assert "contiguous" in t.gradients_unsupported(dest, torch.ones(3, 5, 2).transpose(1, 2))
