"""The MoE experts' SwiGLU-and-probability work as Triton kernels (`triton_swiglu.swiglu_probs` and
`swiglu_probs_back`), served by `moe_experts.fused_swiglu_probs` and its backward on CUDA.

The kernels need triton: on CUDA they are compared with the math of the compiled functions they replace
(skipped where no GPU is present, CI); where triton is installed without a GPU, its interpreter runs them on
the CPU (skipped where triton is absent, CI). The dispatch (which path the fused functions take, the bench switch) and the
reasons `probs_unsupported` names run everywhere, with recording stand-ins for the kernels."""

from __future__ import annotations

import pytest
import torch

from rltrain.megatron import decode_kernels, fused, moe_experts, triton_swiglu

from ..tolerance import tolerance
from ._common import check_kernels_where

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]


def _inputs(rows: int, ffn: int, dtype: torch.dtype, device: str = "cpu"):
    g = torch.Generator(device=device).manual_seed(rows * 31 + ffn)
    h = (2 * torch.randn(rows, 2 * ffn, device=device, generator=g)).to(dtype)
    probs = torch.rand(rows, device=device, generator=g)
    dscaled = torch.randn(rows, ffn, device=device, generator=g).to(dtype)
    return h, probs, dscaled


def test_probs_unsupported_names_the_device_dtype_shape_and_a_missing_triton(monkeypatch):
    h, probs, _ = _inputs(4, 3, torch.bfloat16)
    monkeypatch.setattr(decode_kernels, "triton", object())
    assert triton_swiglu.probs_unsupported(h, probs).startswith("device cpu")
    assert triton_swiglu.probs_unsupported(h.double(), probs).startswith("dtypes")
    assert triton_swiglu.probs_unsupported(h[:, :5], probs).startswith("shapes")  # an odd width
    assert triton_swiglu.probs_unsupported(h, probs[:3]).startswith("shapes")
    assert triton_swiglu.probs_unsupported(h.view(2, 2, 6), probs).startswith("shapes")
    kinds = []
    monkeypatch.setattr(decode_kernels, "where_unsupported", lambda kind: kinds.append(kind))
    assert triton_swiglu.probs_unsupported(h, probs) is None and kinds == ["cpu"]  # the device's verdict last


@pytest.mark.parametrize("switched_off", [False, True])
def test_the_fused_functions_take_the_kernels_where_they_run(monkeypatch, switched_off):
    """Where `probs_unsupported` names no reason the fused forward and backward are the kernels (recording
    stand-ins here); the bench switch `swigluprobs` and any reason keep the compiled functions, whose
    results the stand-ins return so the experts' gradients are unchanged either way."""
    h, probs, dscaled = _inputs(6, 4, torch.float32)
    compiled_fwd = moe_experts.fused_swiglu_probs(h, probs)
    compiled_bwd = moe_experts.fused_swiglu_probs_backward(h, probs, dscaled)
    seen = []
    monkeypatch.setattr(
        triton_swiglu, "swiglu_probs", lambda *t: (seen.append("swiglu_probs"), compiled_fwd)[1]
    )
    monkeypatch.setattr(
        triton_swiglu, "swiglu_probs_back", lambda *t: (seen.append("swiglu_probs_back"), compiled_bwd)[1]
    )
    if switched_off:
        monkeypatch.setenv(fused.TRAIN_KERNELS_OFF_ENV, "foreach,swigluprobs")
    for runs in (True, False):
        seen.clear()
        monkeypatch.setattr(triton_swiglu, "probs_unsupported", lambda *a, ok=runs: None if ok else "no")
        assert torch.equal(moe_experts.fused_swiglu_probs(h, probs), compiled_fwd)
        for got, want in zip(
            moe_experts.fused_swiglu_probs_backward(h, probs, dscaled), compiled_bwd, strict=True
        ):
            assert torch.equal(got, want)
        assert seen == (["swiglu_probs", "swiglu_probs_back"] if runs and not switched_off else [])


def _fp32_math(h, probs, dscaled):
    """What the compiled functions compute (inductor keeps the activation in fp32 between SwiGLU and the
    probability product and rounds each output once): (fc2's input, dh, dp), each op in fp32. The
    reference, not the compiled functions themselves: past torch's recompile limit (a process compiling many
    widths, as this module's tests do) `compiled_or_eager` runs them eagerly, which rounds the activation."""
    gate, up = h.float().chunk(2, dim=-1)
    p, ds = probs.float().unsqueeze(-1), dscaled.float()
    sig = torch.sigmoid(gate)
    silu = gate * sig
    act = silu * up
    dact = ds * p
    dh = torch.cat([dact * up * (sig * (1 + gate * (1 - sig))), dact * silu], dim=-1)
    return (act * p).to(h.dtype), dh.to(h.dtype), (ds * act).sum(-1).to(probs.dtype)


def _check_kernels(h, probs, dscaled, exact_rounding: bool) -> None:
    """The kernels against `_fp32_math`: the same fp32 ops, so they differ by fp32 rounding (the sigmoid's
    implementation, a few fp32 steps of the terms' magnitudes: the gate's gradient cancels where silu'
    crosses zero) plus, where that crosses a rounding boundary, one step of the output's dtype; the backward's
    fc2 input equals the forward's bit for bit; dp sums F products in another order (2F fp32 steps of the sum
    of magnitudes). `exact_rounding`: 16-bit stores round to nearest (the GPU; triton's interpreter
    truncates), so almost all elements are equal."""
    dtype, ffn = h.dtype, dscaled.shape[1]
    got = triton_swiglu.swiglu_probs(h, probs)
    scaled, dh, dp = triton_swiglu.swiglu_probs_back(h, probs, dscaled)
    w_scaled, w_dh, w_dp = _fp32_math(h, probs, dscaled)
    assert torch.equal(scaled, got), "the backward's recomputed fc2 input is not the forward's"
    gate, up = h.double().chunk(2, dim=-1)
    sig, ds, p = torch.sigmoid(gate), dscaled.double(), probs.double().unsqueeze(-1)
    act = (gate * sig * up).abs()
    dgate_terms = (ds * p * up * sig).abs() * (1 + gate.abs() * (1 - sig))
    magnitudes = (act * p, torch.cat([dgate_terms, (ds * p * gate * sig).abs()], dim=-1))
    for a, b, terms in zip((got, dh), (w_scaled, w_dh), magnitudes, strict=True):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape
        diff = (a.double() - b.double()).abs()
        bound = 2 * torch.finfo(dtype).eps * torch.maximum(a.double().abs(), b.double().abs())
        bound += 16 * torch.finfo(torch.float32).eps * terms
        assert (diff <= bound).all(), float((diff - bound).max())
        if exact_rounding and a.numel() and dtype != torch.float32:
            assert (a == b).double().mean() > 0.99
    assert dp.dtype == w_dp.dtype == probs.dtype and dp.shape == w_dp.shape
    sums = (ds.abs() * act).sum(-1)
    assert (
        (dp.double() - w_dp.double()).abs() <= 2 * ffn * torch.finfo(torch.float32).eps * sums + 1e-30
    ).all()


def test_the_reference_math_is_what_the_compiled_functions_compute():
    """`_fp32_math` is the compiled functions' math (one graph per width and dtype here, under the limit), to
    the sigmoid's last fp32 bit: the kernels' reference is the path they replace. Eager torch, which rounds
    the activation to the input's dtype, is not (bf16: dp differs by that rounding)."""
    for dtype in (torch.float32, torch.bfloat16):
        h, probs, dscaled = _inputs(37, 24, dtype)
        want = _fp32_math(h, probs, dscaled)
        torch.testing.assert_close(moe_experts.fused_swiglu_probs(h, probs), want[0], **tolerance(dtype, 1))
        scaled, dh, dp = moe_experts.fused_swiglu_probs_backward(h, probs, dscaled)
        torch.testing.assert_close(scaled, want[0], **tolerance(dtype, 1))
        torch.testing.assert_close(dh, want[1], **tolerance(dtype, 1))
        torch.testing.assert_close(
            dp, want[2], **tolerance(torch.float32, 24, magnitude=float(dp.abs().max()))
        )


SHAPES = [(0, 8), (1, 1), (37, 512), (300, 130), (17, 1536)]


@pytest.mark.parametrize("where", ["cuda", "interpreter"])
def test_the_kernels_compute_the_compiled_functions_math(where):
    """On a GPU, and in triton's interpreter where triton is installed without one (a developer's CPU
    machine): every dtype the kernels take, the shapes above."""
    check_kernels_where(where, __name__)


def _check_all(device: str, exact_rounding: bool) -> None:
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for rows, ffn in SHAPES:
            h, probs, dscaled = _inputs(rows, ffn, dtype, device)
            assert triton_swiglu.probs_unsupported(h, probs) is None or device == "cpu"
            _check_kernels(h, probs, dscaled, exact_rounding)
