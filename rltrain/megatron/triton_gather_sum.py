"""Each token's k rows of a MoE layer's expert-ordered tensor gathered and summed in fp32, by one Triton kernel.

Why: the training path of a MoE layer (`moe_decode.moe_forward`) sums each token's k expert rows twice per
micro-batch: the combine after the second grouped product (forward) and the gradient of the rows' gather
before the first (backward). In torch that is three kernels each, a gather that writes the [T, k, H] rows,
an fp32 sum over k that reads them back and a cast to the activations' dtype: for a qwen3-moe micro-batch
(12,288 tokens, top 8, H 1,024, bf16) ~450 MB of traffic per sum, where the sum needs to read the rows
once (~200 MB) and write [T, H] (~25 MB). Here one program gathers a tile of rows for BLOCK_T tokens, adds
their k rows in fp32 in slot order and rounds once.

The sum is the one torch's path computes up to fp32 summation order (torch's reduction may pair the k
addends differently): both round an fp32 sum of the same k values once. The torch path stays the CPU path
and the reference (tests/megatron/test_triton_gather_sum.py compares the two on CUDA; the MoE layer's
tests, tests/megatron/test_moe_decode.py, run the torch path against megatron's layer on the CPU).
"""

from __future__ import annotations

import torch

from rltrain.megatron import decode_kernels
from rltrain.megatron.triton_runtime import tl, triton

BLOCK_T = 8
"""Tokens per program."""
BLOCK_H = 256
"""Columns per program."""


def gather_sum_reference(src: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T, H] in `dtype`: out[t] = sum over j of src[index[t, j]] (src [N, H], index [T, k] int64), summed in
    fp32 (float64 stays float64) and rounded once."""
    tokens, k = index.shape
    wide = torch.promote_types(src.dtype, torch.float32)
    rows = src.index_select(0, index.reshape(-1)).view(tokens, k, src.shape[-1])
    return rows.sum(1, dtype=wide).to(dtype)


def unsupported(src: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> str | None:
    """Why `gather_sum` takes torch's path for these tensors (None: the kernel runs)."""
    reason = decode_kernels.where_unsupported(src.device.type)
    if reason is not None:
        return reason
    if src.dtype not in (torch.bfloat16, torch.float16, torch.float32) or dtype not in decode_kernels.DTYPES:
        return "a 16/32-bit source and output"
    if src.dim() != 2 or not src.is_contiguous() or index.dim() != 2 or index.device != src.device:
        return "a contiguous [N, H] source and [T, k] indices on its device"
    return None


def gather_sum(src: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`gather_sum_reference`'s result: the kernel where `unsupported` names no reason, else torch's ops."""
    if unsupported(src, index, dtype) is not None:
        return gather_sum_reference(src, index, dtype)
    return kernel_sum(src, index, dtype)


def kernel_sum(src: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The kernel's sum (what `gather_sum` runs where `unsupported` names no reason)."""
    assert triton is not None, "triton is not installed (triton_gather_sum.unsupported)"
    tokens, k = index.shape
    width = src.shape[1]
    out = torch.empty((tokens, width), dtype=dtype, device=src.device)
    if tokens and width:
        index = index.contiguous()
        grid = (triton.cdiv(tokens, BLOCK_T), triton.cdiv(width, BLOCK_H))
        _gather_sum_kernel[grid](src, index, out, tokens, width, K=k, BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H)
    return out


if triton is not None:

    @triton.jit
    def _gather_sum_kernel(
        src, index, out, tokens, width, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr
    ):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        keep_rows = rows < tokens
        keep = keep_rows[:, None] & (cols < width)[None, :]
        total = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
        for j in tl.static_range(K):
            at = tl.load(index + rows * K + j, mask=keep_rows, other=0)
            total += tl.load(src + at[:, None] * width + cols[None, :], mask=keep, other=0.0).to(tl.float32)
        tl.store(out + rows[:, None] * width + cols[None, :], total.to(out.dtype.element_ty), mask=keep)


__all__ = ["BLOCK_H", "BLOCK_T", "gather_sum", "gather_sum_reference", "kernel_sum", "unsupported"]
