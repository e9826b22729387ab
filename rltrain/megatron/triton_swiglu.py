"""megatron's SwiGLU (`fused_bias_swiglu.swiglu`) and its backward (`swiglu_back`) as Triton kernels, for
training and decode on CUDA.

Why the forward: torch.compile's kernel (widths static, rows unbacked) ran at ~2.5 TB/s on the H200 at a
training micro-batch (350 us for 16,384 rows of the 1.5B, 463-482 us a call in a log-prob pass's profile,
17% of the pass's device time, docs/benchmarks.md); a program here reads a tile of both halves of a row
once and writes the product, as the backward does.

Why the backward: torch.compile writes the backward's torch.cat as one pointwise kernel over the [n, 2F]
gradient whose every element loads its column of g, y_1 and y_2 again (both halves need all three) and
evaluates the sigmoid again: 0.86-1.39 ms (two calls) for a 16,384-token micro-batch of the 1.5B (2 x 8,960
wide) on the H200, 1-1.7 TB/s, once per layer per micro-batch of every update (docs/benchmarks.md). Here a
program reads a tile of g, y_1 and y_2 once and writes both halves of the gradient (358 us).

`fused.use_unbacked_swiglu` serves them for megatron's `swiglu` and `swiglu_back` on CUDA where `unsupported`
names no reason; the compiled functions stay the reference and the CPU path. Triton is imported guarded, as in
decode_kernels.py.
"""

from __future__ import annotations

import torch

from rltrain import device as devices
from rltrain.megatron import decode_kernels

try:  # triton ships with torch's CUDA wheels; CPU installs have none (and must not add it)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None  # type: ignore[assignment]

# Columns of the gradient's halves per program.
BLOCK = 1024


def unsupported(device: str, dtype: torch.dtype) -> str | None:
    """Why `swiglu_back` cannot serve megatron's SwiGLU backward on `device` (the plan's `cluster.device`)
    in `dtype` (None: it can)."""
    if dtype not in decode_kernels.DTYPES:
        return f"dtype {dtype}"
    return decode_kernels.where_unsupported(devices.kind(device).name)


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """megatron's `swiglu`: silu(y_1) * y_2 [..., F] for y [..., 2F] ([y_1; y_2]), in fp32 and rounded once,
    as the compiled function computes it."""
    assert triton is not None, "triton is not installed (triton_swiglu.unsupported)"
    ffn = y.shape[-1] // 2
    y_rows = y.reshape(-1, 2 * ffn).contiguous()
    out = y_rows.new_empty((y_rows.shape[0], ffn))
    if y_rows.shape[0]:
        _swiglu_kernel[(y_rows.shape[0], triton.cdiv(ffn, BLOCK))](y_rows, out, ffn, BLOCK=BLOCK)
    return out.view(*y.shape[:-1], ffn)


def swiglu_back(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient [..., 2F] of SwiGLU's input y [..., 2F] ([y_1; y_2]) for the output's gradient g [..., F]:
    megatron's `swiglu_back`, (g * s * (1 + y_1 * (1 - s)) * y_2, g * silu(y_1)) with s = sigmoid(y_1), each
    half in fp32 and rounded once, as the compiled function computes it."""
    assert triton is not None, "triton is not installed (triton_swiglu.unsupported)"
    ffn = g.shape[-1]
    assert y.shape[-1] == 2 * ffn and y.shape[:-1] == g.shape[:-1], (g.shape, y.shape)
    g_rows = g.reshape(-1, ffn).contiguous()
    y_rows = y.reshape(-1, 2 * ffn).contiguous()
    out = torch.empty_like(y_rows)
    if g_rows.shape[0]:
        _swiglu_back_kernel[(g_rows.shape[0], triton.cdiv(ffn, BLOCK))](g_rows, y_rows, out, ffn, BLOCK=BLOCK)
    return out.view(y.shape)


if triton is not None:

    @triton.jit
    def _swiglu_kernel(y_ptr, out_ptr, F, BLOCK: tl.constexpr):
        """One (row, tile of F columns) of silu(y_1) * y_2."""
        row = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        on = j < F
        y1 = tl.load(y_ptr + row * 2 * F + j, mask=on, other=0.0).to(tl.float32)
        y2 = tl.load(y_ptr + row * 2 * F + F + j, mask=on, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * F + j, (y1 * tl.sigmoid(y1) * y2).to(out_ptr.dtype.element_ty), mask=on)

    @triton.jit
    def _swiglu_back_kernel(g_ptr, y_ptr, out_ptr, F, BLOCK: tl.constexpr):
        """One (row, tile of F columns): both halves of its gradient."""
        row = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        on = j < F
        g = tl.load(g_ptr + row * F + j, mask=on, other=0.0).to(tl.float32)
        y1 = tl.load(y_ptr + row * 2 * F + j, mask=on, other=0.0).to(tl.float32)
        y2 = tl.load(y_ptr + row * 2 * F + F + j, mask=on, other=0.0).to(tl.float32)
        s = tl.sigmoid(y1)
        dt = out_ptr.dtype.element_ty
        tl.store(out_ptr + row * 2 * F + j, (g * s * (1 + y1 * (1 - s)) * y2).to(dt), mask=on)
        tl.store(out_ptr + row * 2 * F + F + j, (g * (y1 * s)).to(dt), mask=on)
