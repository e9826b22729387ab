"""torch.nn.RMSNorm's forward and backward as Triton kernels (`triton_rms_norm`), the norms of engines with
fused kernels (`TritonRMSNorm`).

The kernels need triton: on CUDA they are compared with torch's RMSNorm, forward and backward (skipped where
no GPU is present, CI); where triton is installed without a GPU, its interpreter runs them on the CPU
(skipped where triton is absent, CI). Everywhere: `TritonRMSNorm` is torch.nn.RMSNorm where the kernels
cannot run (same parameter, state dict and bits), takes the kernels where they can (a recording stand-in)
unless the bench switch `rmsnorm` is set, and `unsupported` names each reason. tests/megatron/
test_fused_kernels.py checks that engines with fused kernels build their norms as `TritonRMSNorm`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rltrain.megatron import decode_kernels, fused, triton_rms_norm
from rltrain.megatron.triton_rms_norm import TritonRMSNorm

from ._common import check_kernels_where

# (rows, width): empty, one row, qwen3's 128-wide head norms, a width that is no power of two, a hidden size.
SHAPES = [(0, 64), (1, 1), (300, 128), (37, 96), (19, 1536)]


def _inputs(rows: int, width: int, dtype: torch.dtype, device: str = "cpu", strided: bool = False):
    """x and dy [rows, 2, width]; `strided`: views of wider rows (as a key head split from the QKV output),
    which the kernels read in place."""
    g = torch.Generator(device=device).manual_seed(rows * 7 + width)
    pad = 3 if strided else 0
    x = (3 * torch.randn(rows, 2, width + pad, device=device, generator=g)).to(dtype)[..., :width]
    weight = (1 + 0.2 * torch.randn(width, device=device, generator=g)).to(dtype)
    dy = torch.randn(rows, 2, width + pad, device=device, generator=g).to(dtype)[..., :width]
    return x, weight, dy


def _check_kernels(x, weight, dy, exact_rounding: bool) -> None:
    """The kernels against torch's RMSNorm (F.rms_norm and autograd), forward and backward, each output
    within fp32 summation order plus one step of its dtype of the fp64 result, and (`exact_rounding`, the
    GPU) almost every 16-bit element equal to torch's."""
    eps = 1e-6
    width = x.shape[-1]
    xs, ws = x.detach().requires_grad_(), weight.detach().requires_grad_()  # detach keeps x's strides
    y = triton_rms_norm.rms_norm(xs, ws, eps)
    dx, dw = torch.autograd.grad(y, (xs, ws), dy)
    with torch.no_grad():  # the forward kernel alone (log-prob passes): the same bits
        assert torch.equal(triton_rms_norm.rms_norm(xs, ws, eps), y)
    yt = F.rms_norm(xs, (width,), ws, eps)
    dxt, dwt = torch.autograd.grad(yt, (xs, ws), dy)
    x64, w64, dy64 = x.double().requires_grad_(), weight.double().requires_grad_(), dy.double()
    y64 = F.rms_norm(x64, (width,), w64, eps)
    y64.backward(dy64)
    # Each output's fp32 error is relative to its terms' magnitudes (dx cancels exactly for one element), in
    # a sum of `reduction` of them: fp32 steps of sqrt(reduction) x the largest term, plus one rounding step
    # of the dtype.
    rstd = (x64.detach().pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    terms = (
        (y64.detach(), width),
        (rstd * (w64.detach() * dy64).abs() + x64.detach().abs() * rstd.pow(3) * (w64.detach() * dy64 * x64.detach()).abs().mean(-1, keepdim=True), width),
        ((dy64 * x64.detach() * rstd).abs().reshape(-1, width).sum(0), max(x.numel() // max(width, 1), 1)),
    )  # fmt: skip
    for got, torchs, exact, (term, reduction) in zip(
        (y, dx, dw), (yt, dxt, dwt), (y64.detach(), x64.grad, w64.grad), terms, strict=True
    ):
        assert got.dtype == torchs.dtype == x.dtype and got.shape == torchs.shape
        scale = float(term.abs().max()) if term.numel() else 0.0
        bound = 2 * torch.finfo(x.dtype).eps * exact.abs() + 4 * reduction**0.5 * 1.2e-7 * scale
        for result in (got, torchs):
            assert ((result.double() - exact).abs() <= bound).all(), float(
                (result.double() - exact).abs().max()
            )
        # Where torch's sums and ours round alike almost every 16-bit element is equal (0.99998 on the H200
        # at 24,576 x 1,024); a share needs elements to be one: a one-row norm may differ in every element.
        if exact_rounding and got.numel() >= 1000 and x.dtype != torch.float32 and got is not dw:
            assert (got == torchs).double().mean() > 0.98


def test_a_strided_view_is_read_in_place():
    """A norm over a view of wider rows reads it where it is: no copy, so the backward saves only what
    torch's RMSNorm saves (the input as given)."""
    x = _inputs(6, 8, torch.float32, strided=True)[0]
    assert not x.is_contiguous()
    rows = triton_rms_norm._rows(x, 8)
    assert rows.data_ptr() == x.data_ptr() and rows.stride() == (11, 1)
    assert triton_rms_norm._rows(x.transpose(0, 1), 8).is_contiguous()  # no row stride: a copy


def test_unsupported_names_each_reason(monkeypatch):
    x, weight, _ = _inputs(4, 8, torch.bfloat16)
    assert triton_rms_norm.unsupported(x, None).startswith("no weight")
    assert triton_rms_norm.unsupported(x, weight.float()).startswith("dtypes")
    assert triton_rms_norm.unsupported(x.double(), weight.double()).startswith("dtypes")
    assert triton_rms_norm.unsupported(x, weight[:4]).startswith("a norm over")
    wide = triton_rms_norm.MAX_WIDTH + 1
    assert triton_rms_norm.unsupported(torch.zeros(1, wide), torch.ones(wide)).startswith("width")
    assert triton_rms_norm.unsupported(x, weight).startswith("device cpu")
    kinds = []
    monkeypatch.setattr(decode_kernels, "where_unsupported", lambda kind: kinds.append(kind))
    assert triton_rms_norm.unsupported(x, weight) is None and kinds == ["cpu"]  # the device's verdict last


def test_where_the_kernels_cannot_run_the_module_is_torchs_rmsnorm():
    """Same parameter and state dict keys as torch.nn.RMSNorm, and on the CPU the same bits forward and
    backward (torch's own forward)."""
    x, weight, dy = _inputs(6, 16, torch.float32)
    mine, torchs = TritonRMSNorm(16, eps=1e-5), torch.nn.RMSNorm(16, eps=1e-5)
    assert isinstance(mine, torch.nn.RMSNorm) and mine.state_dict().keys() == torchs.state_dict().keys()
    for norm in (mine, torchs):
        norm.weight.data.copy_(weight)
    outs = []
    for norm in (mine, torchs):
        xs = x.clone().requires_grad_()
        y = norm(xs)
        y.backward(dy)
        outs.append((y, xs.grad, norm.weight.grad))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("switched_off", [False, True])
def test_the_module_takes_the_kernels_where_they_run(monkeypatch, switched_off):
    """Where `unsupported` names no reason the forward is `rms_norm` (a recording stand-in returning torch's
    result), with the module's weight and eps (torch's default eps where None); the bench switch `rmsnorm`
    keeps torch's forward. A module asks `unsupported` once per input and weight device, dtype and width."""
    x = _inputs(5, 8, torch.float32)[0]
    seen = []

    def stand_in(t, w, eps):
        seen.append((t.shape, w is norm.weight, eps))
        return F.rms_norm(t, (t.shape[-1],), w, eps)

    asked = []
    monkeypatch.setattr(triton_rms_norm, "rms_norm", stand_in)
    monkeypatch.setattr(triton_rms_norm, "unsupported", lambda t, w: asked.append((t.dtype, w.dtype)))
    if switched_off:
        monkeypatch.setenv(fused.TRAIN_KERNELS_OFF_ENV, "rmsnorm")
    for eps in (1e-6, None):
        seen.clear()
        norm = TritonRMSNorm(8, eps=eps)
        for _ in range(2):
            torch.testing.assert_close(norm(x), F.rms_norm(x, (8,), norm.weight, eps), rtol=0, atol=0)
        assert seen == ([] if switched_off else [(x.shape, True, eps)] * 2)
    # The verdict is asked once per input and weight device / dtype / width, again when they change.
    assert asked == [(torch.float32, torch.float32)] * 2
    norm.double()
    norm(x.double())
    assert asked[-1] == (torch.float64, torch.float64) and len(asked) == 3


@pytest.mark.parametrize("where", ["cuda", "interpreter"])
def test_the_kernels_compute_torchs_rmsnorm(where):
    """On a GPU, and in triton's interpreter where triton is installed without one (a developer's CPU
    machine): every dtype the kernels take, the shapes above, contiguous and strided inputs."""
    check_kernels_where(where, __name__)


def _check_all(device: str, exact_rounding: bool) -> None:
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for rows, width in SHAPES:
            for strided in (False, True):
                x, weight, dy = _inputs(rows, width, dtype, device, strided)
                assert triton_rms_norm.unsupported(x, weight) is None or device == "cpu"
                _check_kernels(x, weight, dy, exact_rounding)
