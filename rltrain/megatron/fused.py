"""torch.compile'd kernels of the megatron engine (`model.fused_kernels`): RoPE for training (megatron's
`apply_rope_fusion` hooks, padded and packed rows), RoPE and the attention inputs (split, q/k norm, RoPE,
cache write) of the decode step, and megatron's SwiGLU fusion compiled once; plus the start-up probe that the
toolchain works.

Every compiled function here sees rows whose count (and head count) is unbacked, so it compiles once per
dtype: dynamic=True alone still specialises sizes of 0 and 1 (a decode step's one column, a one-row prefill,
a packed micro-batch's batch of 1), guards on strides and view bases, and recompiled per multi-turn prefill
shape until torch's recompile limit (tests/megatron/test_recompile.py counts).
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

from rltrain import device as devices

TRAIN_KERNELS_OFF_ENV = "RLPLAN_BENCH_TRAIN_KERNELS_OFF"
"""Benchmarks only (bench/grpo_step_gpu.py --off-env): a comma list of the training kernels of 2026-12-04 to
leave off, so whole steps time the path before them side by side: `swiglu` (megatron's SwiGLU forward
compiled, not Triton's), `rope` (RoPE compiled, not Triton's), `wgrad` (weight gradients added by DDP's
hooks, not summed in their products), `foreach` (megatron's per-parameter gradient norm and clipping
loops, not multi_tensor's foreach kernels), `held` (MoE expert weights through autograd's accumulators and
DDP's hooks, not held by the experts' Function), `maingrad` (the experts' weight gradients cast and added by
foreach ops, not triton_grad_add's kernel), `router` (megatron's router in training passes, not
moe_decode.train_route), `gathersum` (a MoE layer's k expert rows per token gathered, summed and cast by
torch's three ops, not triton_gather_sum's kernel; the combine's backward is its gather either way),
`passstacks` (a forward-only pass stacks each MoE layer's expert weights per micro-batch, not once per pass),
`deviceguard` (the optimizer step's norm, clipping and divergence guard decided on the host as megatron's
step does, reading the norm and the loss back, not on the device: model.steps_on_device), `swigluprobs` (the
MoE experts' SwiGLU-and-probability work and its backward compiled, not triton_swiglu's kernels), `rmsnorm`
(the training norms as torch's RMSNorm, not triton_rms_norm's kernels)."""


def bench_off(kernel: str) -> bool:
    """Whether a benchmark switched `kernel` off (`TRAIN_KERNELS_OFF_ENV`)."""
    return kernel in os.environ.get(TRAIN_KERNELS_OFF_ENV, "").split(",")


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of t [s, b, heads, d] with cos / sin [s, b or 1, 1, rot] in t's dtype: megatron's
    `_apply_rotary_pos_emb_bshd` (not interleaved, mscale 1), the same ops in the same order, so the same
    bits. The decode step computes cos and sin once per forward instead of in every layer."""
    rot = cos.shape[-1]
    x, rest = t[..., :rot], t[..., rot:]
    x1, x2 = torch.chunk(x, 2, dim=-1)
    out = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


def _rotate_rows(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rotate` over rows: t [n, heads, d], cos / sin [n, 1, rot], n unbacked (the same n for all three)."""
    torch._check(cos.shape[0] == t.shape[0])
    torch._check(sin.shape[0] == t.shape[0])
    return rotate(t, cos, sin)


@functools.cache
def _compiled_rotate() -> Callable[..., torch.Tensor]:
    return torch.compile(_rotate_rows, dynamic=True, fullgraph=True)


def fused_rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rotate` as one torch.compile'd kernel (fp32 inside, one rounding): a decode step ran ~11 small
    kernels per query and key per layer for it (docs/benchmarks.md).

    The kernel sees rows, not [s, b]: t [s, b, heads, d] becomes [s * b, heads, d] and cos / sin are expanded
    to it, with the row count unbacked. dynamic=True alone specialises a size of 1 (decode's s, a one-row
    prefill's b, cos's broadcast b), so multi-turn prefills of every shape recompiled until torch's limit;
    rows and heads are unbacked, so it compiles once per dtype (tests/megatron/test_inference.py counts)."""
    s, b, heads, d = t.shape
    rot = cos.shape[-1]
    # detach: a view's base would be guarded on too (generation needs no autograd).
    rows = t.reshape(s * b, heads, d).detach().contiguous()
    c = cos.expand(s, b, 1, rot).reshape(s * b, 1, rot).detach().contiguous()
    n = sin.expand(s, b, 1, rot).reshape(s * b, 1, rot).detach().contiguous()
    for x in (rows, c, n):
        torch._dynamo.decorators.mark_unbacked(x, 0)
    torch._dynamo.decorators.mark_unbacked(rows, 1)  # query and key heads (and a single KV head) alike
    return _compiled_rotate()(rows, c, n).view(s, b, heads, d)


def decode_attention_inputs(
    mixed: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    col: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The glue of one decode step's attention between the QKV projection and the core attention.

    mixed [n, groups, (q_per_group + 2) * d] is megatron's unsplit QKV (`get_query_key_value_tensors(...,
    split_qkv=False)`), one decode column of n rows, its bias added, or `bias` [groups * (q_per_group + 2) * d]
    the QKV projection's bias to add first (megatron's add: the caller ran the projection with it deferred,
    which saves a kernel per layer in the Triton version); cos / sin [n, 1, rot]; the caches
    [max_len, n, groups, d]; col a 1-element column index. Splits q, k, v as megatron does, applies the
    per-head RMSNorm of q and k when given (`q_norm` / `k_norm` weights, megatron's q/k_layernorm: the same
    `F.rms_norm` call torch.nn.RMSNorm makes), RoPE (`rotate`), writes k and v into column `col` of the
    caches and returns the rotated query [n, heads, d]. Compiled (`fused_decode_attention_inputs`) it is
    five small kernels where the unfused step launched seven per layer (on the H200: 664 -> 526 kernels per
    1.5B step with the additive mask, docs/benchmarks.md)."""
    n, groups, width = mixed.shape
    d = k_cache.shape[-1]
    torch._check(k_cache.shape[1] == n)
    torch._check(v_cache.shape[1] == n)
    torch._check(cos.shape[0] == n)
    torch._check(sin.shape[0] == n)
    if bias is not None:
        mixed = mixed + bias.view(groups, width)
    query, key, value = torch.split(mixed, [width - 2 * d, d, d], dim=-1)
    query = query.reshape(n, groups * (width // d - 2), d)  # no -1: n is unbacked
    if q_norm is not None:
        query = torch.nn.functional.rms_norm(query, (d,), q_norm, eps)
    if k_norm is not None:
        key = torch.nn.functional.rms_norm(key, (d,), k_norm, eps)
    query = rotate(query, cos, sin)
    key = rotate(key, cos, sin)
    k_cache.index_copy_(0, col, key.view(1, n, groups, d))
    v_cache.index_copy_(0, col, value.view(1, n, groups, d))
    return query


def fused_decode_attention_inputs(
    mixed: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *rest: Any,
) -> torch.Tensor:
    """`decode_attention_inputs` (the same arguments) torch.compile'd, the caches written in place (no
    copy of them), compiled once per attention shape and dtype: the row count is unbacked (a static
    step's rows, 1 for a rollout's last row) and the cache length dynamic, so no row set, rollout length, key bucket or layer compiles it
    again. The other sizes (heads, head dim) are static: with them symbolic too, inductor emitted code
    naming an undefined size for the q/k norm (torch 2.13)."""
    mixed = mixed.detach()
    cos, sin = cos.detach().contiguous(), sin.detach().contiguous()
    for t, dim in ((mixed, 0), (cos, 0), (sin, 0), (k_cache, 1), (v_cache, 1)):
        torch._dynamo.decorators.mark_unbacked(t, dim)
    for cache in (k_cache, v_cache):  # the rollout's length (prompt + new tokens), at least 2
        torch._dynamo.decorators.mark_dynamic(cache, 0)
    return compiled_or_eager(compiled(decode_attention_inputs), decode_attention_inputs, mixed, cos, sin,
                             k_cache, v_cache, *rest)  # fmt: skip


@functools.cache
def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` torch.compile'd whole, its sizes static (dynamic=False: the widths are the model's), compiled once
    per function: callers mark the row count unbacked (`unbacked_rows`) so that one graph per model shape
    and dtype serves every batch."""
    return torch.compile(fn, dynamic=False, fullgraph=True)


def unbacked_rows(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors detached and contiguous with their row count (dim 0) unbacked: no row count (0 and 1
    among them), stride or view base is guarded on. Rows of different tensors are separate symbols; a
    compiled function that relates them says so with torch._check."""
    rows = [t.detach().contiguous() for t in tensors]
    for r in rows:
        torch._dynamo.decorators.mark_unbacked(r, 0)
    return rows


def compiled_or_eager(compiled: Callable[..., Any], eager: Callable[..., Any], *args: Any) -> Any:
    """`compiled(*args)`; past torch's recompile limit `eager(*args)` (the same function uncompiled), with a
    warning once per function. The decode-step functions compile one graph per model shape and dtype: a
    process that decodes more model shapes than the limit (a long test session) runs the rest eagerly
    instead of failing."""
    try:
        return compiled(*args)
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        _warn_eager_once(eager.__qualname__)
        return eager(*args)


@functools.cache
def _warn_eager_once(name: str) -> None:
    warnings.warn(
        f"{name} reached torch's recompile limit (more shapes in this process than it compiles); further "
        "shapes run eagerly",
        stacklevel=4,
    )


def rope_bshd(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """megatron's unfused RoPE from the angles, written to be compiled whole: t [s, b, heads, d], freqs
    [s, b or 1, 1, rot] (fp32)."""
    assert not interleaved, "interleaved rotary embeddings are refused before this point"
    return rotate(t, torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype))


def _rope_rows(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """`rope_bshd` over rows: t [n, heads, d], freqs [n, 1, rot] (n unbacked, the same n for both)."""
    torch._check(freqs.shape[0] == t.shape[0])
    return rotate(t, torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype))


def _rope_rows_backward(g: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """d rope / d t applied to the gradient g [n, heads, d]: RoPE is linear in t (t cos + R(t) sin, R the
    half rotation), so the gradient is g cos + R^T(g sin) with R^T(u1, u2) = (u2, -u1); columns past the
    rotary dimension pass through."""
    torch._check(freqs.shape[0] == g.shape[0])
    rot = freqs.shape[-1]
    cos, sin = torch.cos(freqs).to(g.dtype), torch.sin(freqs).to(g.dtype)
    x, rest = g[..., :rot], g[..., rot:]
    u1, u2 = torch.chunk(x * sin, 2, dim=-1)
    out = x * cos + torch.cat((u2, -u1), dim=-1)
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


@functools.cache
def _compiled_rope_rows(backward: bool) -> Callable[..., torch.Tensor]:
    return torch.compile(_rope_rows_backward if backward else _rope_rows, dynamic=True, fullgraph=True)


def _as_rows(t: torch.Tensor, freqs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """t [s, b, heads, d] as detached contiguous rows [s * b, heads, d] (and freqs [s, b or 1, 1, rot] as
    [s * b, 1, rot]) whose row and head counts are unbacked: no size, stride or view base is guarded on."""
    s, b, heads, d = t.shape
    rows = t.reshape(s * b, heads, d).detach().contiguous()
    torch._dynamo.decorators.mark_unbacked(rows, 0)
    torch._dynamo.decorators.mark_unbacked(rows, 1)
    if freqs is None:
        return rows, None
    f = freqs.expand(s, b, 1, freqs.shape[-1]).reshape(s * b, 1, freqs.shape[-1]).detach().contiguous()
    torch._dynamo.decorators.mark_unbacked(f, 0)
    return rows, f


class _CompiledRope(torch.autograd.Function):
    """`rope_bshd` with a compiled forward and a compiled backward, each compiled once per dtype: both see
    rows whose count is unbacked, so no sequence length, batch size (a packed micro-batch's 1, a decode
    step's 1), head count (query or key heads), stride or grad mode compiles them again."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        rows, f = _as_rows(t, freqs)
        # The angles as given (megatron's table, shared by every layer), not their per-row expansion.
        ctx.save_for_backward(freqs)
        ctx.shape = t.shape
        return _compiled_rope_rows(False)(rows, f).view(t.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (freqs,) = ctx.saved_tensors
        rows, f = _as_rows(grad.reshape(ctx.shape), freqs)
        return _compiled_rope_rows(True)(rows, f).view(ctx.shape), None


def compiled_rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """megatron's `fused_apply_rotary_pos_emb` hook: `rope_bshd` compiled (forward and backward kernels)
    once per dtype whatever the shapes (tests/megatron/test_recompile.py counts)."""
    assert not interleaved, "interleaved rotary embeddings are refused before this point"
    return _CompiledRope.apply(t, freqs)


class _TritonRope(torch.autograd.Function):
    """`rope_bshd` as `triton_rope`'s kernel, forward and backward, from the angle table's cos and sin
    (computed once per table, `triton_rope.tables`, and saved for the backward: every layer shares them)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        from rltrain.megatron import triton_rope

        cos, sin = triton_rope.tables(freqs)
        ctx.save_for_backward(cos, sin)
        return triton_rope.rope(t, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        from rltrain.megatron import triton_rope

        cos, sin = ctx.saved_tensors
        return triton_rope.rope(grad, cos, sin, backward=True), None


def triton_rope_hook(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """megatron's `fused_apply_rotary_pos_emb` hook on CUDA: `triton_rope`'s kernel (`_TritonRope`), the
    compiled function for tensors it does not take (`triton_rope.args_unsupported`) and inside a compiled
    function (traced inline)."""
    from rltrain.megatron import triton_rope

    assert not interleaved, "interleaved rotary embeddings are refused before this point"
    if triton_rope.args_unsupported(t, freqs) is not None or torch.compiler.is_compiling():
        return compiled_rope(t, freqs)
    return _TritonRope.apply(t, freqs)


def use_compiled_rope(device: str | None = None, dtype: torch.dtype | None = None) -> None:
    """Serve megatron's `apply_rope_fusion` hooks where Transformer Engine, megatron's only provider, is
    absent: padded rows (bshd) and packed rows (thd, through `packing.rope_thd`), by `triton_rope`'s kernel
    on a `device` and `dtype` where `triton_rope.unsupported` names no reason (`triton_rope_hook`), else by
    `rope_bshd` compiled by torch.compile (forward and backward as fused kernels). Hooks that rlplan set
    are replaced, Transformer Engine's kept; the hooks are read only by configs with apply_rope_fusion,
    i.e. engines whose plan says fused_kernels."""
    from megatron.core.models.common.embeddings import rope_utils

    from rltrain.megatron import triton_rope

    kernel = device is not None and dtype is not None and triton_rope.unsupported(device, dtype) is None
    hook = triton_rope_hook if kernel and not bench_off("rope") else compiled_rope
    current = rope_utils.fused_apply_rotary_pos_emb
    if current is None or current in (compiled_rope, triton_rope_hook):
        rope_utils.fused_apply_rotary_pos_emb = hook
    current_thd = rope_utils.fused_apply_rotary_pos_emb_thd
    if current_thd is None or getattr(current_thd, "_rlplan", False):
        # Packed rows (THD): each token's angle at its position within its row, then the same RoPE.
        from rltrain.megatron.packing import rope_thd

        thd = functools.partial(rope_thd, rotate=hook)
        thd._rlplan = True  # type: ignore[attr-defined]
        rope_utils.fused_apply_rotary_pos_emb_thd = thd


def _unbacked_rows(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`fn` (a function of row tensors [n, ...] with the same n, elementwise along the rows) compiled once
    with the row count unbacked: every argument is flattened to rows, detached (callers run it inside an
    autograd Function, so no graph is lost) and made contiguous, so no view base or 0/1 size is guarded on.
    Inside another compiled function it is `fn` itself, traced inline. The widths stay static (`compiled`):
    with them symbolic (dynamic=True) inductor's SwiGLU split its input by index arithmetic, 9.8 us for a
    decode step's 256 x 17,920 (docs/benchmarks.md)."""
    whole = compiled(fn)

    def call(*tensors: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return fn(*tensors)
        shape = tensors[0].shape
        rows = []
        for t in tensors:
            # reshape before detach: a detached tensor is a view no more, a reshaped one would be again.
            r = t.reshape(-1, t.shape[-1]).detach().contiguous()
            torch._dynamo.decorators.mark_unbacked(r, 0)
            rows.append(r)
        out = whole(*rows)
        return out.view(*shape[:-1], out.shape[-1])

    return call


def use_unbacked_swiglu(device: str | None = None, dtype: torch.dtype | None = None) -> None:
    """Serve megatron's compiled SwiGLU (`bias_activation_fusion`: `fused_bias_swiglu.swiglu` and its
    backward `swiglu_back`, torch.compile'd with default settings by megatron's jit_fuser) compiled once
    with the row count unbacked; on a `device` and `dtype` where `triton_swiglu.unsupported` names no
    reason both are `triton_swiglu`'s kernels instead (each input read once at the memory's speed, where
    the compiled forward ran at ~2.5 TB/s and the compiled backward's torch.cat read its inputs again for
    each half of the gradient; docs/benchmarks.md).

    Why: megatron compiles them with automatic dynamic shapes, which guard on whether each dimension of
    the input's [s, b] base is 1 (a decode step's s, a one-row prefill's b, a packed micro-batch's b): a
    multi-turn rollout's prefills and decode steps compiled them again per combination and reached
    torch._dynamo's recompile limit (tests/megatron/test_recompile.py). Same math, same function body.
    Idempotent."""
    from megatron.core.fusions import fused_bias_swiglu as fbs

    from rltrain.megatron import triton_swiglu

    kernel = device is not None and dtype is not None and triton_swiglu.unsupported(device, dtype) is None
    for name in ("swiglu", "swiglu_back"):
        current = getattr(fbs, name)
        if getattr(current, "_rlplan_unbacked", False):
            continue
        wrapped = _unbacked_rows(getattr(current, "_torchdynamo_orig_callable", current))
        if kernel and not (name == "swiglu" and bench_off("swiglu")):
            wrapped = _triton_swiglu(wrapped, name)
        wrapped._rlplan_unbacked = True  # type: ignore[attr-defined]
        wrapped._rlplan_original = current  # type: ignore[attr-defined]
        setattr(fbs, name, wrapped)


def _triton_swiglu(compiled_fn: Callable[..., torch.Tensor], name: str) -> Callable[..., torch.Tensor]:
    """megatron's `swiglu(y)` / `swiglu_back(g, y)` (`name`) as `triton_swiglu`'s kernel of that name, the
    compiled function where the inputs' dtypes differ (torch's promotion decides its result's dtype there)
    or inside a compiled function (traced inline). The kernel is looked up at call time (tests swap it)."""
    from rltrain.megatron import triton_swiglu

    def call(*tensors: torch.Tensor) -> torch.Tensor:
        if len({t.dtype for t in tensors}) > 1 or torch.compiler.is_compiling():
            return compiled_fn(*tensors)
        return getattr(triton_swiglu, name)(*tensors)

    return call


class FusedKernelsError(RuntimeError):
    """torch.compile cannot build kernels on this machine, so model.fused_kernels cannot be honoured."""


def check_fused_kernels(device: str, dtype: torch.dtype) -> None:
    """Compile and run the fused RoPE on a small tensor before the model is built, so that a machine whose
    torch.compile toolchain is missing or broken (Triton on cuda, a C++ compiler on cpu) stops at start-up
    with what to do, not in the middle of a step. The kernel is the one training uses (Triton's on CUDA,
    `use_compiled_rope`; the compiled graph, with dynamic sizes, elsewhere), so the probe costs one compile,
    not an extra one."""
    use_compiled_rope(device, dtype)
    from megatron.core.models.common.embeddings import rope_utils

    dev = devices.torch_device(device)
    t = torch.zeros((3, 2, 2, 8), dtype=dtype, device=dev)
    freqs = torch.zeros((3, 1, 1, 8), device=dev)
    try:
        rope_utils.fused_apply_rotary_pos_emb(t, freqs)
    except Exception as exc:  # whatever the toolchain raises, the fix is the same
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise FusedKernelsError(
            f"model.fused_kernels: torch.compile cannot build kernels on this machine "
            f"({type(exc).__name__}: {first}). Fix: set model.fused_kernels: eager (--model.fused_kernels "
            f"eager), or install what torch.compile needs (Triton on cuda, a C++ compiler on cpu)"
        ) from exc
