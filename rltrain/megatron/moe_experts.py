"""Routed experts computed with grouped GEMM (`model.moe_grouped_gemm`): all local experts of a MoE layer in
three grouped matrix products forward and five backward, instead of megatron's SequentialMLP loop of two
linears (and their kernel launches) per expert.

Why our own: megatron's GroupedMLP needs the CUDA-only `grouped_gemm` package and TEGroupedMLP Transformer
Engine, neither of which installs here, while torch ships `torch._grouped_mm` (bf16, CUDA sm90+), which has
no backward we can rely on across the torch versions in use (2.11 on the GPU machine, 2.13 here). An H200
measurement of one Qwen3-MoE-shaped layer put the grouped kernel at 5.1 ms against SequentialMLP's 33.6 ms;
bench/moe_experts_gpu.py times forward + backward of both modules.

Layout: `GroupedGemmExperts` *is* a SequentialMLP (same submodules, parameter names, sharded state dict,
HF mapping, expert marking and offload): only `forward` differs. It stacks the local experts' fc1 [2F, H]
and fc2 [H, F] weights into [E, 2F, H] / [E, H, F] (a copy of the layer's expert weights, the price of
keeping the checkpoint layout, included in the benchmark) and runs the grouped products (`expert_swiglu`).

`GroupedSwiGLU` is one autograd.Function: y_e = ((silu(x_e G_e^T) * x_e U_e^T) * p) W2_e^T for the rows
x_e of expert e (rows sorted by expert, `tokens_per_expert` of them each; [G; U] = fc1 as megatron fuses
it), p the routing probability of each row, multiplied in megatron's order and dtype (`MLP.forward`). The
backward is written out (dx, dW1, dW2, dp). The products go through `grouped_mm` / `grouped_mm_weight`:
`torch._grouped_mm` for bf16 on CUDA, else a per-expert loop of the same products, so the CPU tests run
this Function's forward and backward too.

The training path (`expert_swiglu`, issue 36: a qwen3-moe update on the H200 spent as much time in glue as
in the grouped products) takes three steps past stacking through autograd per call, each behind a class
switch of `ExpertUpdate`: the elementwise work fused (`fused_swiglu_probs`, its backward: compiled, on CUDA
`triton_swiglu`'s kernels); the weights entering `ExpertParamsSwiGLU` as parameters, their gradients added
into megatron DDP's main_grads in one multi-tensor add (instead of DDP's hook per expert weight); the stacks
made once per mini-batch (`cached_expert_stacks`) instead of per micro-batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

from rltrain.megatron import triton_grad_add, triton_swiglu
from rltrain.megatron.fused import bench_off, compiled, compiled_or_eager, unbacked_rows


def _use_grouped_kernel(t: torch.Tensor) -> bool:
    return t.is_cuda and t.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


Groups = list[int] | torch.Tensor
"""Row groups of a grouped product: a list of row counts, or their cumulative offsets as an int32 tensor on
the rows' device (the last one the row count), which the CUDA kernel takes without any host read."""


def _offsets(groups: Groups, device: torch.device) -> torch.Tensor:
    if isinstance(groups, torch.Tensor):
        return groups
    return torch.tensor(groups, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)


def _counts(groups: Groups) -> list[int]:
    if isinstance(groups, torch.Tensor):  # (the CPU loop: a host read of the offsets)
        ends = groups.tolist()
        return [e - s for s, e in zip([0, *ends[:-1]], ends, strict=True)]
    return groups


def grouped_mm(a: torch.Tensor, b: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Rows of `a` [M, K] in consecutive `groups` (sum M) times their group's `b` [G, K, N]: [M, N]."""
    if _use_grouped_kernel(a):
        return torch._grouped_mm(a, b, offs=_offsets(groups, a.device))
    out = a.new_zeros((a.shape[0], b.shape[2]))
    start = 0
    for g, n in enumerate(_counts(groups)):
        if n:
            out[start : start + n] = a[start : start + n] @ b[g]
        start += n
    return out


def grouped_mm_weight(a: torch.Tensor, b: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Per group g: a[:, rows_g] @ b[rows_g] for `a` [M, K_total], `b` [K_total, N] (rows in consecutive
    `groups`): [G, M, N] (weight gradients; an empty group gives zeros)."""
    if _use_grouped_kernel(a):
        return torch._grouped_mm(a, b, offs=_offsets(groups, a.device))
    counts = _counts(groups)
    out = a.new_zeros((len(counts), a.shape[0], b.shape[1]))
    start = 0
    for g, n in enumerate(counts):
        if n:
            out[g] = a[:, start : start + n] @ b[start : start + n]
        start += n
    return out


class ExpertUpdate:
    """Class switches of the training path's expert work (issue 36: a qwen3-moe update was host-bound on the
    H200), all on by default; benchmarks turn them off to time the path before them side by side
    (bench/moe_experts_gpu.py, bench/grpo_step_gpu.py).

    `fuse`: GroupedSwiGLU's elementwise work (SwiGLU, probability product, their backward) as compiled
    kernels, where the engine runs fused kernels (`model.fused_kernels`: megatron's `bias_activation_fusion`).
    `main_grad`: the expert weights enter `ExpertParamsSwiGLU` as parameters and their gradients are added
    into megatron DDP's main_grad buffers in one multi-tensor add per layer, not by DDP's per-parameter
    hooks (one add_ per expert weight per micro-batch). `cache`: inside `cached_expert_stacks` (the engine's
    forward + backward of one mini-batch) each layer's weights are stacked once, not per micro-batch.
    `no_accumulators`: with `main_grad`, the expert weights are held by the Function, not its autograd inputs,
    where no DDP hook needs their gradients (`_held`), so autograd runs no gradient accumulator and megatron
    DDP no Python hook per expert weight per micro-batch (128 per qwen3-moe layer; the qwen3-moe update was
    host-bound on the H200, 4.5 s of kernels in 7.2 s, docs/benchmarks.md).
    Off, all four: the experts' weights are stacked through autograd on every call, as before."""

    fuse: bool = True
    main_grad: bool = True
    cache: bool = True
    no_accumulators: bool = True

    @classmethod
    def set(cls, on: bool) -> None:
        """All four switches on or off."""
        cls.fuse = cls.main_grad = cls.cache = cls.no_accumulators = on


def swiglu_probs(h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """The forward's elementwise work: fc1's output h [M, 2F] = [gate, up] to fc2's input (silu(gate) * up)
    * p [M, F], megatron's order and dtypes (`MLP.forward`: the product with fp32 probabilities rounded back
    to the activation's dtype)."""
    gate, up = h.chunk(2, dim=-1)
    act = F.silu(gate) * up
    return (act * probs.unsqueeze(-1)).to(act.dtype)


def swiglu_probs_backward(
    h: torch.Tensor, probs: torch.Tensor, dscaled: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward's elementwise work from fc1's output h [M, 2F], the probabilities p [M] and the gradient
    of fc2's input dscaled [M, F]: (fc2's input recomputed as the forward rounded it, for fc2's weight
    gradient; dh [M, 2F] in h's dtype; dp [M] in p's dtype). In at least fp32 (16-bit activations are
    upcast, float64 stays)."""
    wide = torch.promote_types(h.dtype, torch.float32)
    gate, up = (t.to(wide) for t in h.chunk(2, dim=-1))
    sig = torch.sigmoid(gate)
    silu = gate * sig
    act = (F.silu(gate.to(h.dtype)) * up.to(h.dtype)).to(wide)  # the forward's activation, its rounding
    scaled = (act * probs.unsqueeze(-1)).to(h.dtype)
    dscaled = dscaled.to(wide)
    dprobs = (dscaled * act).sum(-1).to(probs.dtype)
    dact = dscaled * probs.to(wide).unsqueeze(-1)
    dgate = dact * up * (sig * (1 + gate * (1 - sig)))
    dup = dact * silu
    dh = torch.cat([dgate, dup], dim=-1).to(h.dtype)
    return scaled, dh, dprobs


def _swiglu_probs_rows(h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    torch._check(probs.shape[0] == h.shape[0])
    return swiglu_probs(h, probs)


def _swiglu_probs_backward_rows(
    h: torch.Tensor, probs: torch.Tensor, dscaled: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch._check(probs.shape[0] == h.shape[0])
    torch._check(dscaled.shape[0] == h.shape[0])
    return swiglu_probs_backward(h, probs, dscaled)


def _triton_swiglu_probs(h: torch.Tensor, probs: torch.Tensor) -> bool:
    """Whether `triton_swiglu`'s kernels serve the fused path for these tensors (CUDA with triton; the bench
    switch `swigluprobs` keeps the compiled functions)."""
    return triton_swiglu.probs_unsupported(h, probs) is None and not bench_off("swigluprobs")


def fused_swiglu_probs(h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """`swiglu_probs` torch.compile'd (one kernel, fp32 inside, one rounding), once per dtype; on CUDA
    `triton_swiglu.swiglu_probs`, the same math."""
    if _triton_swiglu_probs(h, probs):
        return triton_swiglu.swiglu_probs(h, probs)
    return compiled_or_eager(compiled(_swiglu_probs_rows), _swiglu_probs_rows, *unbacked_rows(h, probs))


def fused_swiglu_probs_backward(
    h: torch.Tensor, probs: torch.Tensor, dscaled: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`swiglu_probs_backward` torch.compile'd, once per dtype (eager's ~20 kernels of [M, F] in fp32
    become a pointwise kernel and the dp reduction); on CUDA `triton_swiglu.swiglu_probs_back`, the same
    math in one pass over the inputs."""
    if _triton_swiglu_probs(h, probs):
        return triton_swiglu.swiglu_probs_back(h, probs, dscaled)
    rows = unbacked_rows(h, probs, dscaled)
    return compiled_or_eager(compiled(_swiglu_probs_backward_rows), _swiglu_probs_backward_rows, *rows)


def _swiglu_forward(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, probs: torch.Tensor, groups: Groups, fused: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [M, H], fc1's output h [M, 2F], saved for the backward)."""
    # w1 [E, 2F, H], w2 [E, H, F]; the transposed views are what the products take (no copy).
    h = grouped_mm(x, w1.transpose(1, 2), groups)  # [M, 2F]
    scaled = (fused_swiglu_probs if fused else swiglu_probs)(h, probs)
    return grouped_mm(scaled, w2.transpose(1, 2), groups), h  # [M, H]


def _swiglu_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    probs: torch.Tensor,
    h: torch.Tensor,
    groups: Groups,
    fused: bool,
    weight_grads: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """(dx, dW1 [E, 2F, H], dW2 [E, H, F], dp); the weight gradients only when `weight_grads`."""
    dy = dy.contiguous()
    dscaled = grouped_mm(dy, w2, groups)  # [M, F]
    scaled, dh, dprobs = (fused_swiglu_probs_backward if fused else swiglu_probs_backward)(h, probs, dscaled)
    dw2 = grouped_mm_weight(dy.t(), scaled, groups) if weight_grads else None  # [E, H, F]
    dw1 = grouped_mm_weight(dh.t(), x, groups) if weight_grads else None  # [E, 2F, H]
    dx = grouped_mm(dh, w1, groups)  # [M, H]
    return dx, dw1, dw2, dprobs


class GroupedSwiGLU(torch.autograd.Function):
    """All experts' gated MLP over expert-sorted rows, from stacked weights w1 [E, 2F, H] and w2 [E, H, F];
    see the module docstring for the math. `fused`: the elementwise work compiled (`fused_swiglu_probs`)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        probs: torch.Tensor,
        counts: Groups,
        fused: bool = False,
    ) -> torch.Tensor:
        y, h = _swiglu_forward(x, w1, w2, probs, counts, fused)
        ctx.save_for_backward(x, w1, w2, probs, h)
        ctx.counts, ctx.fused = counts, fused
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w1, w2, probs, h = ctx.saved_tensors
        dx, dw1, dw2, dprobs = _swiglu_backward(dy, x, w1, w2, probs, h, ctx.counts, ctx.fused, True)
        return dx, dw1, dw2, dprobs, None, None


_STACKS: dict[int, tuple[tuple[int, ...], torch.Tensor, torch.Tensor]] | None = None
"""Inside `cached_expert_stacks`: each layer's stacked expert weights (keyed by its first fc1 weight) and
the parameters' version counters they were stacked at."""
_PARAMS: dict[int, tuple[Any, tuple[torch.Tensor, ...], bool, bool]] | None = None
"""Inside `cached_expert_stacks`: each layer's list of experts (held, so its id stays its own) and its
`_expert_params`, keyed by the list's id."""
_TARGETS: dict[int, tuple[torch.Tensor, torch.Tensor, Any]] | None = None
"""Inside `cached_expert_stacks`: a layer's first and last expert weights (held) and its
`_main_grad_targets`, keyed by the first weight's id."""


@contextlib.contextmanager
def cached_expert_stacks() -> Iterator[None]:
    """Within this context each MoE layer looks up its experts' weights and main_grads once
    (`_expert_params`, `_main_grad_targets`) and stacks them once (`ExpertUpdate.cache`): the engine
    enters it around one mini-batch's forward + backward and around a forward-only pass's micro-batches
    (rltrain/megatron/engine.py `run_schedule`), so the optimizer, which changes the weights, runs outside
    it; the stacks are dropped on exit.

    Why not keyed on the parameters' version counters alone: megatron's distributed optimizer writes the
    new weights into its parameter buffer, which does not bump the parameters' own counters. The counters
    are checked too, so an in-place change inside the context (a test, a user's hook) restacks. Memory:
    the stacks of every MoE layer of the stage are held for the mini-batch (or the forward-only pass), where
    per-call stacks were held for each micro-batch in flight (the same at pp = 1; rlconf/plan/memory.py
    counts them in the update and the log-prob passes)."""
    global _STACKS, _PARAMS, _TARGETS
    outer = _STACKS, _PARAMS, _TARGETS
    if _STACKS is None:  # nested: the outer context's caches
        _STACKS, _PARAMS, _TARGETS = {}, {}, {}
    try:
        yield
    finally:
        _STACKS, _PARAMS, _TARGETS = outer


def _stack(fc1: Sequence[torch.Tensor], fc2: Sequence[torch.Tensor], cache: bool) -> tuple[torch.Tensor, ...]:
    """w1 [E, 2F, H], w2 [E, H, F] stacked without autograd; from `cached_expert_stacks` when `cache`."""
    if not cache or _STACKS is None:
        return torch.stack([w.detach() for w in fc1]), torch.stack([w.detach() for w in fc2])
    versions = tuple(w._version for w in (*fc1, *fc2))
    key = id(fc1[0])
    hit = _STACKS.get(key)
    if hit is not None and hit[0] == versions:
        return hit[1], hit[2]
    w1, w2 = torch.stack([w.detach() for w in fc1]), torch.stack([w.detach() for w in fc2])
    _STACKS[key] = (versions, w1, w2)
    return w1, w2


def _into_main_grads(params: Sequence[torch.Tensor]) -> bool:
    """Whether every parameter takes megatron DDP's fused weight-gradient protocol: a main_grad buffer (one
    dtype for all), the `grad_added_to_main_grad` flag DDP resets in `zero_grad_buffer`, and no
    `zero_out_wgrad` (megatron's hook adds param.grad for those whatever the flag; only the shared
    embedding has it)."""
    dtypes = set()
    for p in params:
        main = getattr(p, "main_grad", None)
        if main is None or not hasattr(p, "grad_added_to_main_grad") or getattr(p, "zero_out_wgrad", False):
            return False
        dtypes.add(main.dtype)
    return len(dtypes) == 1


def _hooks_needed(params: Sequence[torch.Tensor]) -> bool:
    """Whether some expert weight's DDP hook must see a gradient even though it is in main_grad already:
    megatron DDP's hook marks a gradient ready for its overlapped reduction (`overlap_grad_reduce`);
    without that it only drops the gradient the flag says was added. Weights the engine did not mark
    (`ddp_hook_needed`, set by model.build_model_chunks from the DDP config) count as needing it."""
    return any(getattr(p, "ddp_hook_needed", True) for p in params)


# The most bytes of expert gradients cast to the main_grad dtype for one foreach add: a whole layer's dW in
# fp32 at once would be a transient of GBs for 30B-class models (4 bytes per local expert parameter) at the
# backward's peak, which the memory estimate does not hold; 256 MiB keeps it to a few adds per layer.
MAIN_GRAD_CHUNK_BYTES = 256 * 2**20


MainGrads = tuple[list[torch.Tensor], "triton_grad_add.Destination | str"]
"""A weight kind's main_grads, and where triton_grad_add's kernel adds into them (or why it cannot)."""


def _main_grad_targets(params: tuple[torch.Tensor, ...]) -> tuple[MainGrads, MainGrads]:
    """The fc1 and the fc2 weights' `MainGrads`, made once per layer per training pass inside
    `cached_expert_stacks` (keyed by the layer's first expert weight, as the stacks are): the kernel's checks
    over 2E main_grads and its offsets' copy to the device are not repeated per micro-batch."""
    hit = None if _TARGETS is None else _TARGETS.get(id(params[0]))
    # The entry holds the weights it was made for: a matching first and last weight is this layer's.
    if (
        hit is not None
        and hit[0] is params[0]
        and hit[1] is params[-1]
        and len(hit[2][0][0]) * 2 == len(params)
    ):
        return hit[2]
    n = len(params) // 2
    kinds = []
    for half in (params[:n], params[n:]):
        mains = [p.main_grad for p in half]
        kinds.append((mains, triton_grad_add.destination(mains)))
    targets = (kinds[0], kinds[1])
    if _TARGETS is not None:
        _TARGETS[id(params[0])] = (params[0], params[-1], targets)
    return targets


def _add_into_main_grads(target: MainGrads, dw: torch.Tensor) -> None:
    """main_grads[e] += dw[e] for the stacked gradients dw [E, ...]: one Triton kernel where the target has
    a `triton_grad_add.Destination` that takes dw (CUDA, DDP's buffer), else a chunk of experts per foreach
    add. The same sums either way."""
    mains, dest = target
    if (
        not isinstance(dest, str)
        and triton_grad_add.gradients_unsupported(dest, dw) is None
        and not bench_off("maingrad")
    ):
        triton_grad_add.add_into(dest, dw)
        return
    wide = mains[0].dtype
    chunk = max(1, MAIN_GRAD_CHUNK_BYTES // max(1, dw[0].numel() * wide.itemsize))
    for lo in range(0, dw.shape[0], chunk):
        torch._foreach_add_(list(mains[lo : lo + chunk]), dw[lo : lo + chunk].to(wide).unbind(0))


class ExpertParamsSwiGLU(torch.autograd.Function):
    """`GroupedSwiGLU` over the experts' own weights: `weights` are the E fc1 weights [2F, H] then the E fc2
    weights [H, F] (the parameters themselves), stacked inside forward without autograd (`_stack`; once
    per mini-batch under `cached_expert_stacks` when `cache`).

    Gradients: dW1 / dW2 come out stacked. Where every weight has megatron DDP's main_grad (`main_grad`, which
    the caller passes on only where `_into_main_grads` holds), they are added into the main_grads by
    `_add_into_main_grads` (triton_grad_add's kernel on CUDA, else `torch._foreach_add_` cast to the
    buffer's dtype a chunk of experts at a time), `grad_added_to_main_grad` is set, and
    the per-expert views of dW1 / dW2 are returned as the parameters' gradients: DDP's hooks fire
    (overlap_grad_reduce marks parameters ready in them), see the flag and skip their own add_, and the
    views cost no copy (autograd takes an unshared gradient of the parameter's layout as it is). Where no
    hook needs them the weights come `held` (a tuple, not autograd inputs; `_held`) and get no gradient
    but their main_grads'. This is Transformer Engine's and megatron's own
    `gradient_accumulation_fusion` contract (tensor_parallel/layers.py), whose dummy gradient is a fresh
    empty tensor. Otherwise the same views are the real gradients (no DDP: plain modules, tests)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        probs: torch.Tensor,
        groups: Groups,
        fused: bool,
        cache: bool,
        main_grad: bool,
        held: tuple[torch.Tensor, ...] | None,
        *weights: torch.Tensor,
    ) -> torch.Tensor:
        params = held if held is not None else weights
        n = len(params) // 2
        w1, w2 = _stack(params[:n], params[n:], cache)
        y, h = _swiglu_forward(x, w1, w2, probs, groups, fused)
        ctx.save_for_backward(x, w1, w2, probs, h)
        ctx.groups, ctx.fused, ctx.main_grad, ctx.params, ctx.held = groups, fused, main_grad, params, held
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w1, w2, probs, h = ctx.saved_tensors
        params = ctx.params
        held = ctx.held is not None
        need = (True,) * len(params) if held else ctx.needs_input_grad[7:]
        dx, dw1, dw2, dprobs = _swiglu_backward(dy, x, w1, w2, probs, h, ctx.groups, ctx.fused, any(need))
        if dw1 is None or dw2 is None:  # frozen experts (LoRA)
            return dx, dprobs, None, None, None, None, None, *([None] * len(params))
        grads = [*dw1.unbind(0), *dw2.unbind(0)]
        # `main_grad` comes on only where every weight takes DDP's main_grad (`_expert_params` checked it once
        # per layer per pass), and held weights always do.
        if held or (ctx.main_grad and all(need)):
            fc1, fc2 = _main_grad_targets(params)
            _add_into_main_grads(fc1, dw1)
            _add_into_main_grads(fc2, dw2)
            for p in params:
                p.grad_added_to_main_grad = True
            if held:  # the weights were no autograd inputs: their gradients are in main_grad, and only there
                return dx, dprobs, None, None, None, None, None
        else:
            for p in params:  # a flag a fused call of this step left set would make DDP drop these gradients
                if getattr(p, "grad_added_to_main_grad", False):
                    p.grad_added_to_main_grad = False
        return (
            dx,
            dprobs,
            None,
            None,
            None,
            None,
            None,
            *(g if nd else None for g, nd in zip(grads, need, strict=True)),
        )


def expert_swiglu(
    experts: Sequence[torch.nn.Module], x: torch.Tensor, probs: torch.Tensor, groups: Groups, config: Any
) -> torch.Tensor:
    """The training path's experts: `GroupedSwiGLU`'s math over expert-sorted rows x [M, H] with the
    local experts' (megatron MLPs') own fc1 / fc2 weights, gradients reaching each expert's parameters.

    `ExpertUpdate` picks the way: the weights as parameters of `ExpertParamsSwiGLU` (main_grad or cache on),
    or stacked through autograd on every call into `GroupedSwiGLU` (both off, the path before them). The
    elementwise work is compiled where the engine's fused kernels are on (`config.bias_activation_fusion`,
    set by `model.fused_kernels`) and `ExpertUpdate.fuse`. The stacks are cached (`cached_expert_stacks`)
    except where megatron recomputes the MoE layer (full recompute, or selective with "moe"), which keeps
    one layer's activations at a time: a cache would hold every layer's stack."""
    fused = bool(config.bias_activation_fusion) and ExpertUpdate.fuse
    params, into_main_grads, can_hold = _expert_params(experts)
    n = len(experts)
    if not (ExpertUpdate.main_grad or ExpertUpdate.cache):
        return GroupedSwiGLU.apply(x, torch.stack(params[:n]), torch.stack(params[n:]), probs, groups, fused)
    recomputed = config.recompute_granularity == "full" or (
        config.recompute_granularity == "selective" and "moe" in (config.recompute_modules or ())
    )
    cache = ExpertUpdate.cache and not recomputed
    main_grad = ExpertUpdate.main_grad and into_main_grads
    if _held(can_hold, x, probs):
        return ExpertParamsSwiGLU.apply(x, probs, groups, fused, cache, main_grad, params)
    return ExpertParamsSwiGLU.apply(x, probs, groups, fused, cache, main_grad, None, *params)


def _expert_params(experts: Sequence[torch.nn.Module]) -> tuple[tuple[torch.Tensor, ...], bool, bool]:
    """(the local experts' fc1 weights then their fc2 weights, whether every one takes DDP's main_grad
    (`_into_main_grads`), whether they could be held: all trained, taking main_grad and no DDP hook needing
    them (not `_hooks_needed`)). Looked up
    once per layer per training pass inside `cached_expert_stacks` (the DDP buffers and flags do not
    change within it): two module lookups per expert and the checks over 2E weights cost ~0.3 ms of host
    time per MoE layer per micro-batch on a 64-expert layer."""
    hit = None if _PARAMS is None else _PARAMS.get(id(experts))
    if hit is not None and hit[0] is experts:
        return hit[1:]
    params = (*(e.linear_fc1.weight for e in experts), *(e.linear_fc2.weight for e in experts))
    into = _into_main_grads(params)
    can_hold = into and all(p.requires_grad for p in params) and not _hooks_needed(params)
    if _PARAMS is not None:
        _PARAMS[id(experts)] = (experts, params, into, can_hold)
    return params, into, can_hold


def _held(can_hold: bool, x: torch.Tensor, probs: torch.Tensor) -> bool:
    """Whether the expert weights go into `ExpertParamsSwiGLU` held, not as autograd inputs
    (`ExpertUpdate.no_accumulators`): their gradients will go into main_grad (`main_grad` on, every weight
    trained with DDP's main_grad and no DDP hook needing to see it: `can_hold`, `_expert_params`), and the
    rows' input or probabilities take gradients, so that autograd runs the backward at all. Then autograd
    holds no gradient accumulator for them and megatron DDP runs no Python hook per expert weight per
    micro-batch: a hook fires after its accumulator even for a None gradient."""
    return (
        can_hold
        and ExpertUpdate.no_accumulators
        and ExpertUpdate.main_grad
        and torch.is_grad_enabled()
        and (x.requires_grad or probs.requires_grad)
        and not bench_off("held")
    )


class GroupedGemmExperts(SequentialMLP):
    """megatron's SequentialMLP (parameters, checkpoints, HF names unchanged) whose forward runs every local
    expert through `expert_swiglu` (SwiGLU experts without bias, as all families here have)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.config
        if not (cfg.gated_linear_unit and cfg.activation_func is F.silu and not cfg.add_bias_linear):
            raise ValueError("grouped-GEMM experts compute SwiGLU experts without bias")
        if cfg.activation_func_clamp_value is not None or cfg.glu_linear_offset != 0.0:
            raise ValueError("grouped-GEMM experts take no GLU clamp or offset")

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        if self.config.moe_apply_probs_on_input or self.config.fp8 or self.config.fp4:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x = permuted_local_hidden_states
        groups: Groups
        if _use_grouped_kernel(x) and tokens_per_expert.device == x.device:
            groups = tokens_per_expert.cumsum(0).to(torch.int32)  # the kernel reads them on the device
        else:
            groups = [int(n) for n in tokens_per_expert.tolist()]
        out = expert_swiglu(
            self.local_experts, x.reshape(-1, x.shape[-1]), permuted_probs, groups, self.config
        )
        return out.view(*x.shape[:-1], out.shape[-1]), None


__all__ = [
    "ExpertParamsSwiGLU",
    "ExpertUpdate",
    "GroupedGemmExperts",
    "GroupedSwiGLU",
    "Groups",
    "cached_expert_stacks",
    "expert_swiglu",
    "fused_swiglu_probs",
    "fused_swiglu_probs_backward",
    "grouped_mm",
    "grouped_mm_weight",
    "swiglu_probs",
    "swiglu_probs_backward",
]
