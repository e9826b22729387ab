"""RoPE of the training passes and prefills (megatron's `apply_rope_fusion` hook) as one Triton kernel on CUDA,
forward and backward.

Why: the torch.compile'd RoPE (`fused.compiled_rope`) evaluated cos and sin of the angles for every element
of every head (12 query heads of the 1.5B: twelve times per angle) and ran at ~0.5-1 TB/s: 73-77 us a call,
0.19 s of a 1.5B log-prob pass and 0.41 s of its update on the H200 (docs/benchmarks.md). Here the angles'
cos and sin are computed once per angle table (`tables`: every layer's query and key share megatron's
table, and a packed micro-batch's angles are one tensor, packing._packed_angles), in fp32, and a program
rotates a block of (token, head) pairs reading each element once: out = t cos + R(t) sin with R(x1, x2) =
(-x2, x1), in fp32 and rounded once, as the compiled function computes it (inductor keeps cos and sin in
fp32 where megatron's unfused RoPE rounds them to the activations' dtype first: tables rounded to bf16 put
the kernel's largest error against fp64 at 0.025 where the compiled function's is 0.016, measured on the
device). The backward is RoPE's transpose, g cos + R^T(g sin).

`fused.use_compiled_rope(device, dtype)` serves it where `unsupported` names no reason; the compiled function
stays the reference and the CPU path. Triton comes from triton_runtime (None where absent).
"""

from __future__ import annotations

import torch

from rltrain import device as devices
from rltrain.megatron import decode_kernels
from rltrain.megatron.triton_runtime import tl, triton

# (token, head) pairs per program.
PAIRS = 32


def unsupported(device: str, dtype: torch.dtype) -> str | None:
    """Why `rope` cannot serve megatron's RoPE on `device` (the plan's `cluster.device`) in `dtype` (None: it
    can); each call's tensors are checked too (`args_unsupported`)."""
    if dtype not in decode_kernels.DTYPES:
        return f"dtype {dtype}"
    return decode_kernels.where_unsupported(devices.kind(device).name)


def args_unsupported(t: torch.Tensor, freqs: torch.Tensor) -> str | None:
    """Why `rope` cannot rotate t [s, b, heads, d] by freqs [s, b or 1, 1, rot] (None: it can)."""
    if t.dtype not in decode_kernels.DTYPES:
        return f"dtype {t.dtype}"
    if t.dim() != 4 or freqs.dim() != 4:
        return (
            f"t {tuple(t.shape)} / freqs {tuple(freqs.shape)} (needs [s, b, heads, d] / [s, b or 1, 1, rot])"
        )
    s, b, _, d = t.shape
    rot = freqs.shape[-1]
    if freqs.shape[0] != s or freqs.shape[1] not in (1, b) or freqs.shape[2] != 1:
        return f"freqs {tuple(freqs.shape)} for t {tuple(t.shape)}"
    if not (0 < rot <= d and rot % 2 == 0):
        return f"rotary dimension {rot} with head dimension {d} (needs an even one, at most d)"
    return None


_TABLES: list[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]] = []
"""The last angle table's (freqs, its version, cos, sin): every layer's query and key of a forward share
megatron's freqs tensor, so cos and sin are computed once per forward, not per call."""


def tables(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of freqs [s, fb, 1, rot] in fp32, as contiguous [s, fb, rot] tables; the last table's are
    reused while freqs is the same tensor, unchanged."""
    cacheable = not freqs.is_inference()  # an inference tensor has no version counter to check
    if _TABLES and cacheable:
        f, version, cos, sin = _TABLES[0]
        if f is freqs and version == freqs._version:
            return cos, sin
    angles = freqs.detach().reshape(freqs.shape[0], freqs.shape[1], freqs.shape[-1]).float()
    cos, sin = torch.cos(angles).contiguous(), torch.sin(angles).contiguous()
    _TABLES[:] = [(freqs, freqs._version, cos, sin)] if cacheable else []
    return cos, sin


def rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False) -> torch.Tensor:
    """RoPE of t [s, b, heads, d] by the fp32 tables cos / sin [s, fb, rot] (fb 1 or b, `tables`), columns
    past rot passed through; `backward`: its transpose applied to a gradient t."""
    assert triton is not None, "triton is not installed (triton_rope.unsupported)"
    s, b, heads, d = t.shape
    fb, rot = cos.shape[1], cos.shape[2]
    src = t.contiguous()
    out = torch.empty_like(src)
    pairs = s * b * heads
    if pairs:
        half = rot // 2
        _rope_kernel[(triton.cdiv(pairs, PAIRS),)](
            src, cos, sin, out, pairs, heads, b, fb, d, half,
            HALF=decode_kernels.next_power_of_2(half), REST=decode_kernels.next_power_of_2(max(d - rot, 1)),
            HAS_REST=d > rot, BACKWARD=backward, PAIRS=PAIRS,
        )  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def _rope_kernel(
        t_ptr, cos_ptr, sin_ptr, out_ptr, pairs, heads, b, fb, d, half,
        HALF: tl.constexpr, REST: tl.constexpr, HAS_REST: tl.constexpr, BACKWARD: tl.constexpr,
        PAIRS: tl.constexpr,
    ):  # fmt: skip
        """PAIRS (token, head) pairs of contiguous t [tokens, heads, d]: both halves of the rotary columns
        rotated (forward: x1 c1 - x2 s1, x2 c2 + x1 s2; backward: g1 c1 + g2 s2, g2 c2 - g1 s1), the rest
        copied. A token's table row: its position s times fb, plus its batch index where fb is b."""
        p = tl.program_id(0).to(tl.int64) * PAIRS + tl.arange(0, PAIRS)
        live = p < pairs
        token = p // heads
        table = (token // b) * fb + tl.where(fb == 1, 0, token % b)
        j = tl.arange(0, HALF)
        on = live[:, None] & (j < half)[None, :]
        base = p[:, None] * d + j[None, :]
        tb = table[:, None] * (2 * half) + j[None, :]
        x1 = tl.load(t_ptr + base, mask=on, other=0.0).to(tl.float32)
        x2 = tl.load(t_ptr + base + half, mask=on, other=0.0).to(tl.float32)
        c1 = tl.load(cos_ptr + tb, mask=on, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + tb + half, mask=on, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + tb, mask=on, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + tb + half, mask=on, other=0.0).to(tl.float32)
        if BACKWARD:
            o1 = x1 * c1 + x2 * s2
            o2 = x2 * c2 - x1 * s1
        else:
            o1 = x1 * c1 - x2 * s1
            o2 = x2 * c2 + x1 * s2
        dt = out_ptr.dtype.element_ty
        tl.store(out_ptr + base, o1.to(dt), mask=on)
        tl.store(out_ptr + base + half, o2.to(dt), mask=on)
        if HAS_REST:
            r = 2 * half + tl.arange(0, REST)
            keep = live[:, None] & (r < d)[None, :]
            rest = p[:, None] * d + r[None, :]
            tl.store(out_ptr + rest, tl.load(t_ptr + rest, mask=keep, other=0.0), mask=keep)
