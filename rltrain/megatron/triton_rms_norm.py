"""torch.nn.RMSNorm's forward and backward as Triton kernels, for the training passes' norms on CUDA.

Why: every decoder layer normalises its input and its MLP input, and Qwen3-style layers every query and key
head (rows of 128): a qwen3-moe update on the H200 spent 0.31 s of its 3.6 s of kernels in torch's RMSNorm
(0.11 s forward, 0.20 s backward; docs/benchmarks.md), ~3x what reading the inputs and writing the outputs
once needs at the memory's speed. Here a forward program normalises BLOCK_ROWS rows held in registers (many
short rows per program, so the 128-wide head norms fill the machine), and a backward program walks
BLOCK_ROWS x TILES rows, writing each row's input gradient and one fp32 partial of the weight's gradient;
the partials are summed by one reduction.

Numerics are torch's CUDA RMSNorm's: in fp32, rstd = rsqrt(mean(x^2) + eps), y = w * (x * rstd) rounded
once; dx = rstd * (w * dy) - x * rstd^3 * mean(w * dy * x) rounded once; dw = sum over rows of dy * x * rstd
in fp32, rounded to the weight's dtype. They differ from torch by the order of the sums only
(tests/megatron/test_rms_norm_kernels.py).

`TritonRMSNorm` is a torch.nn.RMSNorm (same parameter, state dict and HF mapping) that takes these kernels
where `unsupported` names no reason and the bench switch `rmsnorm` is not set; `model.TorchRMSNorm` builds it
for engines with fused kernels. Triton comes from triton_runtime (None where absent).
"""

from __future__ import annotations

from typing import Any

import torch

from rltrain.megatron import decode_kernels
from rltrain.megatron.fused import bench_off
from rltrain.megatron.triton_runtime import tl, triton

MAX_WIDTH = 16384
"""Widest row a program holds in registers (decode_kernels.ADD_NORM_MAX_WIDTH's bound)."""
TILE_ELEMENTS = 8192
"""Elements of a program's [BLOCK_ROWS, width] tile: BLOCK_ROWS = TILE_ELEMENTS / width (a power of two)."""
TILES = 8
"""Tiles of BLOCK_ROWS rows per backward program: fewer programs, so fewer weight-gradient partials."""


def unsupported(x: torch.Tensor, weight: torch.Tensor | None) -> str | None:
    """Why `rms_norm` cannot normalise the last dimension of `x` by `weight` (None: it can)."""
    if weight is None:
        return "no weight (elementwise_affine=False)"
    if x.dtype not in decode_kernels.DTYPES or weight.dtype != x.dtype:
        return f"dtypes {x.dtype} / {weight.dtype} (the kernels take one of {decode_kernels.DTYPES} for both)"
    if weight.dim() != 1 or x.shape[-1:] != weight.shape:
        return f"a norm over {tuple(weight.shape)} of {tuple(x.shape)} (the kernels take the last dimension)"
    if x.shape[-1] > MAX_WIDTH:
        return f"width {x.shape[-1]} (a program holds a row of at most {MAX_WIDTH})"
    if weight.device != x.device:
        return "the weight on another device"
    return decode_kernels.where_unsupported(x.device.type)


def _block_rows(width: int, tile_elements: int = TILE_ELEMENTS) -> tuple[int, int]:
    """(rows of a program's tile, the power-of-two width it holds)."""
    block_h = decode_kernels.next_power_of_2(width)
    return max(1, min(64, tile_elements // block_h)), block_h


def _eps(x: torch.Tensor, eps: float | None) -> float:
    return torch.finfo(x.dtype).eps if eps is None else eps  # torch.nn.RMSNorm's default


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """t as rows [n, width] that the kernels read with a row stride: a view where torch can make one (a
    key head split from the QKV output is), else a contiguous copy."""
    rows = t.reshape(-1, width)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, each row's rstd in fp32)."""
    width = x.shape[-1]
    rows = _rows(x, width)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        block_r, block_h = _block_rows(width)
        _forward_kernel[(triton.cdiv(rows.shape[0], block_r),)](
            rows, weight, out, rstd, rows.shape[0], rows.stride(0), eps,
            H=width, BLOCK_ROWS=block_r, BLOCK_H=block_h,
        )  # fmt: skip
    return out.view(x.shape), rstd


class _RMSNorm(torch.autograd.Function):
    """Saves what torch's RMSNorm saves: the input as given (no copy of a strided view) and each row's rstd."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd = _forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        dx, partial = _backward(x, weight, rstd, dy)
        dw = partial.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None  # (frozen under LoRA)
        return dx, dw, None


def _backward(
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    dy: torch.Tensor,
    tile_elements: int = TILE_ELEMENTS,
    tiles: int = TILES,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, the programs' fp32 partials of dw); the launch's shape is a parameter for
    bench/train_kernels_gpu.py's `rmsnorm-tune`."""
    width = x.shape[-1]
    rows, dy_rows = _rows(x, width), _rows(dy, width)
    n = rows.shape[0]
    dx = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    block_r, block_h = _block_rows(width, tile_elements)
    programs = triton.cdiv(n, block_r * tiles)
    partial = torch.empty((programs, width), dtype=torch.float32, device=x.device)
    if n:
        _backward_kernel[(programs,)](
            rows, weight, dy_rows, rstd, dx, partial, n, rows.stride(0), dy_rows.stride(0),
            H=width, BLOCK_ROWS=block_r, BLOCK_H=block_h, TILES=tiles, num_warps=num_warps,
        )  # fmt: skip
    return dx.view(x.shape), partial


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float | None) -> torch.Tensor:
    """`F.rms_norm(x, (width,), weight, eps)` by the kernels, differentiable in x and weight (`unsupported`
    names no reason for these tensors). Without autograd (log-prob passes, generation) the forward kernel
    alone runs: the passes' host launches every layer's kernels, and an autograd Function adds its own cost."""
    assert triton is not None, "triton is not installed (triton_rms_norm.unsupported)"
    eps = _eps(x, eps)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps)
    return _forward(x, weight, eps)[0]


class TritonRMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm whose forward is `rms_norm` where the kernels can run (CUDA with triton, the
    weight's dtype, a normalised last dimension), else torch's. The verdict is kept per input device, dtype
    and width and the weight's device and dtype (offloading moves the weight), so a layer's call pays for no
    check after the first."""

    _verdict: tuple[tuple[Any, ...], bool] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        key = (x.device, x.dtype, x.shape[-1], None if weight is None else (weight.device, weight.dtype))
        if self._verdict is None or self._verdict[0] != key:
            kernels = len(self.normalized_shape) == 1 and unsupported(x, weight) is None
            self._verdict = (key, kernels and not bench_off("rmsnorm"))
        if self._verdict[1]:
            return rms_norm(x, weight, self.eps)
        return super().forward(x)


RMS_NORMS = (torch.nn.RMSNorm, TritonRMSNorm)
"""The module types that compute torch.nn.RMSNorm's function (what the decode step's fused kernels take)."""


if triton is not None:

    @triton.jit
    def _forward_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        rstd_ptr,
        R,
        stride_x,
        eps,
        H: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """BLOCK_ROWS rows (x's `stride_x` apart; y contiguous): y = w * (x * rsqrt(mean(x^2) + eps)) and each
        row's rstd (for the backward)."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.arange(0, BLOCK_H)
        live = rows < R
        on = live[:, None] & (cols < H)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=on, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / H + eps)
        w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        y = (w[None, :] * (x * rstd[:, None])).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rows[:, None] * H + cols[None, :], y, mask=on)
        tl.store(rstd_ptr + rows, rstd, mask=live)

    @triton.jit
    def _backward_kernel(
        x_ptr,
        w_ptr,
        dy_ptr,
        rstd_ptr,
        dx_ptr,
        partial_ptr,
        R,
        stride_x,
        stride_dy,
        H: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_H: tl.constexpr,
        TILES: tl.constexpr,
    ):
        """TILES x BLOCK_ROWS rows (x's and dy's strides apart; dx contiguous): dx of each, and this program's
        fp32 partial of dw = sum dy * x * rstd."""
        cols = tl.arange(0, BLOCK_H)
        col_on = cols < H
        w = tl.load(w_ptr + cols, mask=col_on, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK_H,), dtype=tl.float32)
        first = tl.program_id(0).to(tl.int64) * BLOCK_ROWS * TILES
        for tile in tl.static_range(TILES):
            rows = first + tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            live = rows < R
            on = live[:, None] & col_on[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=on, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=on, other=0.0).to(
                tl.float32
            )
            rstd = tl.load(rstd_ptr + rows, mask=live, other=0.0)
            wdy = w[None, :] * dy
            mean = tl.sum(wdy * x, axis=1) / H
            dx = rstd[:, None] * wdy - x * (rstd * rstd * rstd * mean)[:, None]
            tl.store(dx_ptr + rows[:, None] * H + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=on)
            dw += tl.sum(dy * x * rstd[:, None], axis=0)
        tl.store(partial_ptr + tl.program_id(0).to(tl.int64) * H + cols, dw, mask=col_on)


__all__ = ["MAX_WIDTH", "RMS_NORMS", "TritonRMSNorm", "rms_norm", "unsupported"]
