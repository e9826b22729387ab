"""triton_gather_sum: a MoE layer's k expert rows per token gathered and summed in fp32 by one kernel.

The kernel needs triton: its comparison with torch's gather, sum and cast runs on a GPU, or in triton's
interpreter where triton is installed without one (both skipped in CI); the CPU path (torch's ops, what `gather_sum` runs there) is tested here and through the MoE
layer's tests (tests/megatron/test_moe_decode.py)."""

from __future__ import annotations

import pytest
import torch

from rltrain.megatron import triton_gather_sum

from ._common import check_kernels_where


def test_the_cpu_path_is_torchs_gather_sum_and_cast():
    g = torch.Generator().manual_seed(0)
    src = torch.randn(24, 5, generator=g).to(torch.bfloat16)
    index = torch.randperm(24, generator=g).view(8, 3)
    assert triton_gather_sum.unsupported(src, index, torch.bfloat16) is not None
    got = triton_gather_sum.gather_sum(src, index, torch.bfloat16)
    want = torch.stack([src[row].float().sum(0) for row in index]).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    # float64 sums stay float64
    src64 = src.double()
    assert torch.equal(triton_gather_sum.gather_sum(src64, index, torch.float64), src64[index].sum(1))


@pytest.mark.parametrize("where", ["cuda", "interpreter"])
def test_the_kernel_sums_as_torch_does(where):
    """On a GPU, and in triton's interpreter where triton is installed without one (a developer's CPU
    machine): bf16, fp16 and fp32, empty, one-element and wide shapes."""
    check_kernels_where(where, __name__)


def _check_all(device: str, exact_rounding: bool) -> None:
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for tokens, k, width in [(0, 8, 64), (1, 1, 1), (37, 8, 1024), (300, 6, 200)]:
            _check_kernel(dtype, tokens, k, width, device, exact_rounding)


def _check_kernel(dtype, tokens, k, width, device, exact_rounding) -> None:
    g = torch.Generator(device=device).manual_seed(tokens + k + width)
    src = torch.randn(tokens * k + 3, width, device=device, generator=g).to(dtype)
    index = torch.randperm(tokens * k + 3, device=device, generator=g)[: tokens * k].view(tokens, k)
    assert triton_gather_sum.unsupported(src, index, dtype) is None or device == "cpu"
    got = triton_gather_sum.kernel_sum(src, index, dtype)
    want = triton_gather_sum.gather_sum_reference(src, index, dtype)
    assert got.shape == want.shape == (tokens, width) and got.dtype == dtype
    # Both add the same k values in fp32 and round once: they may differ by the fp32 sums' rounding (the
    # order of the additions may differ; each within (k - 1) fp32 steps of the sum of magnitudes) plus one
    # rounding step of `dtype` at most.
    terms = src.double()[index]
    fp32_sums = 2 * (k - 1) * torch.finfo(torch.float32).eps * terms.abs().sum(1)
    rounding = torch.finfo(dtype).eps * torch.maximum(got.double().abs(), want.double().abs())
    assert ((got.double() - want.double()).abs() <= fp32_sums + rounding).all()
    if exact_rounding and tokens and dtype != torch.float32:  # a 16-bit rounding hides the fp32 order
        assert (got == want).float().mean() > 0.99
