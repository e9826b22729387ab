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
names no reason; the compiled functions stay the reference and the CPU path. Triton comes from triton_runtime
(None where absent).

`swiglu_probs` / `swiglu_probs_back`: the MoE experts' elementwise work between their grouped products
(moe_experts.fused_swiglu_probs and its backward: SwiGLU times each row's routing probability, and the
backward's recomputed fc2 input, fc1's output gradient and the probabilities' gradient). Why: inductor wrote
the backward as a pointwise kernel plus a reduction kernel that read fc1's output and the gradient again
for the probabilities' sum: 0.15 s + 0.12 s of a qwen3-moe update's 3.6 s of kernels on the H200 (288 calls
each, docs/benchmarks.md), where reading the inputs once and writing the outputs once needs ~0.08 s. Here a
program walks BLOCK_ROWS rows across the columns once, summing the probabilities' gradient in registers. The
math is the compiled function's: fp32 throughout, each output rounded once (the activation not rounded
between SwiGLU and the probability product), so the backward's recomputed fc2 input equals the forward's.
"""

from __future__ import annotations

import torch

from rltrain import device as devices
from rltrain.megatron import decode_kernels
from rltrain.megatron.triton_runtime import tl, triton

# Columns of the gradient's halves per program.
BLOCK = 1024
# `swiglu_probs`: rows per program and columns per step (a [16, 128] tile of each input in registers).
BLOCK_ROWS = 16
BLOCK_COLS = 128


def unsupported(device: str, dtype: torch.dtype) -> str | None:
    """Why `swiglu_back` cannot serve megatron's SwiGLU backward on `device` (the plan's `cluster.device`)
    in `dtype` (None: it can)."""
    if dtype not in decode_kernels.DTYPES:
        return f"dtype {dtype}"
    return decode_kernels.where_unsupported(devices.kind(device).name)


def probs_unsupported(h: torch.Tensor, probs: torch.Tensor) -> str | None:
    """Why `swiglu_probs` / `swiglu_probs_back` cannot take fc1's output h [M, 2F] and the probabilities
    [M] (None: they can): on CUDA with triton, h in a dtype the kernels store."""
    if h.dtype not in decode_kernels.DTYPES or probs.dtype not in decode_kernels.DTYPES:
        return f"dtypes {h.dtype} / {probs.dtype}"
    if h.dim() != 2 or h.shape[1] % 2 or probs.shape != h.shape[:1] or probs.device != h.device:
        return f"shapes {tuple(h.shape)} / {tuple(probs.shape)} (needs [M, 2F] and [M] on one device)"
    return decode_kernels.where_unsupported(h.device.type)


def swiglu_probs(h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """(silu(gate) * up) * p [M, F] in h's dtype from fc1's output h [M, 2F] = [gate, up] and each row's
    probability p [M]: in fp32 and rounded once, as `moe_experts.fused_swiglu_probs` compiled computes it."""
    assert triton is not None, "triton is not installed (triton_swiglu.probs_unsupported)"
    rows, ffn = h.shape[0], h.shape[1] // 2
    h, probs = h.contiguous(), probs.contiguous()
    out = h.new_empty((rows, ffn))
    if rows and ffn:
        grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(ffn, BLOCK_COLS))
        _swiglu_probs_kernel[grid](h, probs, out, rows, F=ffn, BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS)
    return out


def swiglu_probs_back(
    h: torch.Tensor, probs: torch.Tensor, dscaled: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_experts.swiglu_probs_backward` compiled, in one pass over the rows: (fc2's input as
    `swiglu_probs` computes it [M, F]; dh [M, 2F] in h's dtype; dp [M] in p's dtype) from fc1's output h,
    the probabilities p and fc2's input gradient dscaled [M, F]."""
    assert triton is not None, "triton is not installed (triton_swiglu.probs_unsupported)"
    rows, ffn = h.shape[0], h.shape[1] // 2
    assert dscaled.shape == (rows, ffn), (h.shape, dscaled.shape)
    h, probs, dscaled = h.contiguous(), probs.contiguous(), dscaled.contiguous()
    scaled = h.new_empty((rows, ffn))
    dh = torch.empty_like(h)
    dprobs = torch.empty_like(probs)
    if rows:
        grid = (triton.cdiv(rows, BLOCK_ROWS),)
        _swiglu_probs_back_kernel[grid](
            h, probs, dscaled, scaled, dh, dprobs, rows, F=ffn, BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS
        )
    return scaled, dh, dprobs


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

    @triton.jit
    def _swiglu_probs_kernel(
        h_ptr, p_ptr, out_ptr, M, F: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr
    ):
        """BLOCK_ROWS rows x BLOCK_COLS columns of (silu(gate) * up) * p (F, the experts' width, is static: one
        compilation per model)."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        live = rows < M
        on = live[:, None] & (cols < F)[None, :]
        at = rows[:, None] * 2 * F + cols[None, :]
        gate = tl.load(h_ptr + at, mask=on, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + at + F, mask=on, other=0.0).to(tl.float32)
        p = tl.load(p_ptr + rows, mask=live, other=0.0).to(tl.float32)
        scaled = gate * tl.sigmoid(gate) * up * p[:, None]
        tl.store(out_ptr + rows[:, None] * F + cols[None, :], scaled.to(out_ptr.dtype.element_ty), mask=on)

    @triton.jit
    def _swiglu_probs_back_kernel(
        h_ptr,
        p_ptr,
        ds_ptr,
        scaled_ptr,
        dh_ptr,
        dp_ptr,
        M,
        F: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_COLS: tl.constexpr,
    ):
        """BLOCK_ROWS rows, all their columns in steps of BLOCK_COLS: the recomputed fc2 input, both halves of
        dh and, summed in fp32 across the steps, dp."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        live = rows < M
        p = tl.load(p_ptr + rows, mask=live, other=0.0).to(tl.float32)
        dp = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
        dt = dh_ptr.dtype.element_ty
        for start in range(0, F, BLOCK_COLS):
            cols = start + tl.arange(0, BLOCK_COLS)
            on = live[:, None] & (cols < F)[None, :]
            at = rows[:, None] * 2 * F + cols[None, :]
            at_f = rows[:, None] * F + cols[None, :]
            gate = tl.load(h_ptr + at, mask=on, other=0.0).to(tl.float32)
            up = tl.load(h_ptr + at + F, mask=on, other=0.0).to(tl.float32)
            ds = tl.load(ds_ptr + at_f, mask=on, other=0.0).to(tl.float32)
            sig = tl.sigmoid(gate)
            silu = gate * sig
            act = silu * up
            tl.store(scaled_ptr + at_f, (act * p[:, None]).to(scaled_ptr.dtype.element_ty), mask=on)
            dp += tl.sum(ds * act, axis=1)
            dact = ds * p[:, None]
            tl.store(dh_ptr + at, (dact * up * (sig * (1 + gate * (1 - sig)))).to(dt), mask=on)
            tl.store(dh_ptr + at + F, (dact * silu).to(dt), mask=on)
        tl.store(dp_ptr + rows, dp.to(dp_ptr.dtype.element_ty), mask=live)
