"""The training passes' kernels on the device, each against what it replaces, at a 1.5B micro-batch's shapes
(bf16; writes train_kernels.json in --out):

  rope     megatron's RoPE hook as `triton_rope`'s kernel (fused.triton_rope_hook: cos / sin once per table)
           against the torch.compile'd function (fused.compiled_rope), forward and backward, query (12 heads)
           and key (2 heads) of d 128 at --tokens packed tokens, padded [s, b] rows and a partial rotary
           dimension: device microseconds per call (a torch profile's kernel time: the Python of
           this loop would otherwise set the pace), forward and forward + backward, and each one's largest
           error against megatron's unfused RoPE in fp64, and the share of elements the
           kernel and the compiled function give equal
  wgrad    one weight's gradient accumulated into its fp32 main_grad: megatron's unfused way (a bf16 product,
           then DDP's hook adds it) against `wgrad.accumulate_wgrad` (one addmm with an fp32 result into
           main_grad), for the 1.5B's four products: microseconds and the error against fp64
  grouped  whether torch._grouped_mm takes out_dtype=float32 (the experts' weight gradients straight in fp32)
  maingrad a MoE layer's expert weight gradients (qwen3-moe: 64 experts, fc1 [1024, 1024], fc2 [1024, 512],
           bf16) added into fp32 main_grads laid out as megatron DDP's buffer (reverse order, fc1 / fc2
           interleaved): `triton_grad_add`'s kernel against the foreach cast-and-add it replaces, device
           microseconds per layer and whether the sums are bit-identical
  rmsnorm  torch's RMSNorm against `triton_rms_norm`'s kernels (bf16) at qwen3-moe's hidden (24,576 x 1,024),
           query-head (x 16 x 128) and key-head (x 4 x 128) norms and the 1.5B's hidden (16,384 x 1,536):
           device microseconds forward and forward + backward, equal shares and largest relative
           differences of y, dx and dw
  rmsnorm-tune  the RMSNorm backward kernel's launch shapes (tile elements, tiles per program, warps) at
           the two hidden widths: device microseconds of each, the best, and the bytes' time at 4.3 TB/s
  swigluprobs the MoE experts' SwiGLU times each row's probability and its backward (qwen3-moe at 24,576
           tokens, top 8: 196,608 rows, F 512, bf16): `triton_swiglu.swiglu_probs` / `swiglu_probs_back`
           against the torch.compile'd functions they replace (bench switch `swigluprobs`), device
           microseconds, equal shares, dp's largest relative difference and the kernels' GB/s
  gathersum each token's k expert rows gathered and summed in fp32 (a MoE layer's combine and its rows'
           gradient; qwen3-moe: 12,288 tokens, top 8, H 1,024, bf16): `triton_gather_sum`'s kernel against
           torch's gather, sum and cast, device microseconds, the share of equal elements and the largest
           difference in units of bf16's rounding of the fp64 sum

    python3 bench/train_kernels_gpu.py --out $OUT           (needs a GPU with triton)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def per_call_us(fn, iters: int = 50) -> float:
    """Microseconds per call of fn on the current stream (events around iters calls after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def device_us(fn, iters: int = 20) -> float:
    """Microseconds of device time (the kernels' own, summed from a torch profile) per call of fn: what a
    training pass whose host runs ahead of the device pays, free of this benchmark's Python launch gaps."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.events() if e.device_type.name == "CUDA") / iters


def rope(report: dict, tokens: int) -> None:
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from rltrain.megatron import fused

    gen = torch.Generator(device="cuda").manual_seed(0)
    res = report.setdefault("rope", {})
    # (name, s, b, rot): packed (one row of all tokens), padded rows, a partial rotary dimension
    for name, s, b, rot in (("packed", tokens, 1, 128), ("padded 8 rows", tokens // 8, 8, 128),
                            ("partial rot 64", tokens, 1, 64)):  # fmt: skip
        freqs = torch.rand(s, 1, 1, rot, device="cuda", generator=gen) * 2048
        row = {}
        for heads in (12, 2):
            t = torch.randn(s, b, heads, 128, device="cuda", generator=gen).to(torch.bfloat16)
            g = torch.randn(s, b, heads, 128, device="cuda", generator=gen).to(torch.bfloat16)
            truth = _apply_rotary_pos_emb_bshd(t.double(), freqs.double())
            t64 = t.double().requires_grad_()
            (truth_grad,) = torch.autograd.grad(
                _apply_rotary_pos_emb_bshd(t64, freqs.double()), t64, g.double()
            )
            outs = {}
            for way, hook in (("triton", fused.triton_rope_hook), ("compiled", fused.compiled_rope)):
                x = t.clone().requires_grad_()
                out = hook(x, freqs)
                (grad,) = torch.autograd.grad(out, x, g)
                outs[way] = (out, grad)
                row[f"{way} fwd device us, {heads} heads"] = device_us(lambda h=hook, x=x, f=freqs: h(x, f))
                row[f"{way} fwd+bwd device us, {heads} heads"] = device_us(
                    lambda h=hook, x=x, f=freqs, g=g: torch.autograd.grad(h(x, f), x, g)
                )
                row[f"{way} max err fwd / bwd, {heads} heads"] = (
                    float((out.double() - truth).abs().max()),
                    float((grad.double() - truth_grad).abs().max()),
                )
            row[f"equal share fwd / bwd, {heads} heads"] = (
                float((outs["triton"][0] == outs["compiled"][0]).float().mean()),
                float((outs["triton"][1] == outs["compiled"][1]).float().mean()),
            )
        res[name] = row
        print("rope", name, json.dumps(row), flush=True)


def wgrad(report: dict, tokens: int) -> None:
    from rltrain.megatron.wgrad import accumulate_wgrad

    gen = torch.Generator(device="cuda").manual_seed(1)
    res = report.setdefault("wgrad", {})
    for name, out_f, in_f in (
        ("qkv", 2048, 1536),
        ("proj", 1536, 1536),
        ("fc1", 17920, 1536),
        ("fc2", 1536, 8960),
    ):
        x = torch.randn(tokens, in_f, device="cuda", generator=gen).to(torch.bfloat16)
        g = torch.randn(tokens, out_f, device="cuda", generator=gen).to(torch.bfloat16)
        start = torch.randn(out_f, in_f, device="cuda", generator=gen)
        truth = start.double() + g.double().t() @ x.double()
        main = {"unfused": start.clone(), "fused": start.clone()}

        def unfused(m=main["unfused"], x=x, g=g):
            m.add_(g.t().matmul(x))  # megatron without the fusion: bf16 wgrad, DDP's hook adds it

        def fused(m=main["fused"], x=x, g=g):
            accumulate_wgrad(x, g, m)

        unfused()
        fused()
        row = {
            "max err unfused": float((main["unfused"].double() - truth).abs().max()),
            "max err fused": float((main["fused"].double() - truth).abs().max()),
            "unfused us": per_call_us(unfused, 20),
            "fused us": per_call_us(fused, 20),
        }
        res[name] = row
        print("wgrad", name, json.dumps(row), flush=True)


def grouped(report: dict) -> None:
    a = torch.randn(1024, 4096, device="cuda").to(torch.bfloat16)
    b = torch.randn(4096, 512, device="cuda").to(torch.bfloat16)
    offs = torch.arange(512, 4097, 512, device="cuda", dtype=torch.int32)
    try:
        out = torch._grouped_mm(a, b, offs=offs, out_dtype=torch.float32)
        want = torch.stack(
            [a[:, i * 512 : (i + 1) * 512].float() @ b[i * 512 : (i + 1) * 512].float() for i in range(8)]
        )
        report["grouped_mm_out_fp32"] = {"ok": True, "dtype": str(out.dtype),
                                         "max_abs_diff": float((out - want).abs().max())}  # fmt: skip
    except Exception as exc:  # the probe reports whatever torch raises
        report["grouped_mm_out_fp32"] = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    print("grouped", report["grouped_mm_out_fp32"], flush=True)


def maingrad(report: dict, experts: int = 64, hidden: int = 1024, ffn: int = 512) -> None:
    from rltrain.megatron import moe_experts, triton_grad_add
    from rltrain.megatron.fused import TRAIN_KERNELS_OFF_ENV

    n1, n2 = 2 * ffn * hidden, hidden * ffn
    buffer = torch.randn(experts * (n1 + n2) + 64, device="cuda")
    fc1, fc2 = [None] * experts, [None] * experts
    pos = 64
    for e in reversed(range(experts)):  # megatron DDP's buffer: reverse parameter order
        fc2[e] = buffer[pos : pos + n2].view(hidden, ffn)
        pos += n2
        fc1[e] = buffer[pos : pos + n1].view(2 * ffn, hidden)
        pos += n1
    dw1 = torch.randn(experts, 2 * ffn, hidden, device="cuda").to(torch.bfloat16)
    dw2 = torch.randn(experts, hidden, ffn, device="cuda").to(torch.bfloat16)
    fc1 = (fc1, triton_grad_add.destination(fc1))
    fc2 = (fc2, triton_grad_add.destination(fc2))
    assert not isinstance(fc1[1], str) and triton_grad_add.gradients_unsupported(fc1[1], dw1) is None
    assert not isinstance(fc2[1], str) and triton_grad_add.gradients_unsupported(fc2[1], dw2) is None
    start = buffer.clone()

    def foreach():
        os.environ[TRAIN_KERNELS_OFF_ENV] = "maingrad"
        try:
            moe_experts._add_into_main_grads(fc1, dw1)
            moe_experts._add_into_main_grads(fc2, dw2)
        finally:
            del os.environ[TRAIN_KERNELS_OFF_ENV]

    def kernel():
        moe_experts._add_into_main_grads(fc1, dw1)
        moe_experts._add_into_main_grads(fc2, dw2)

    sums = {}
    for name, fn in (("foreach", foreach), ("kernel", kernel)):
        buffer.copy_(start)
        fn()
        sums[name] = buffer.clone()
    row = {"bit_identical": bool(torch.equal(sums["foreach"], sums["kernel"])),
           "foreach_us": device_us(foreach), "kernel_us": device_us(kernel)}  # fmt: skip
    row["bytes_moved_gb_per_s_kernel"] = experts * (n1 + n2) * 10 / row["kernel_us"] / 1e3
    report["maingrad"] = row
    print("maingrad", row, flush=True)


def gathersum(report: dict, tokens: int = 12288, k: int = 8, hidden: int = 1024) -> None:
    from rltrain.megatron import triton_gather_sum

    g = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randn(tokens * k, hidden, device="cuda", generator=g).to(torch.bfloat16)
    index = torch.randperm(tokens * k, device="cuda", generator=g).view(tokens, k)
    assert triton_gather_sum.unsupported(src, index, torch.bfloat16) is None
    ref = triton_gather_sum.gather_sum_reference(src, index, torch.bfloat16)
    got = triton_gather_sum.gather_sum(src, index, torch.bfloat16)
    exact = src.double().index_select(0, index.reshape(-1)).view(tokens, k, hidden).sum(1)
    ulp = (exact.abs().clamp_min(1e-30).log2().floor() - 7).exp2()  # bf16's spacing at each value
    row = {
        "equal_share": float((ref == got).float().mean()),
        "max_err_ulp_kernel": float(((got.double() - exact).abs() / ulp).max()),
        "max_err_ulp_torch": float(((ref.double() - exact).abs() / ulp).max()),
        "torch_us": device_us(lambda: triton_gather_sum.gather_sum_reference(src, index, torch.bfloat16)),
        "kernel_us": device_us(lambda: triton_gather_sum.gather_sum(src, index, torch.bfloat16)),
    }
    row["kernel_gb_per_s"] = (src.numel() + tokens * hidden) * 2 / row["kernel_us"] / 1e3
    report["gathersum"] = row
    print("gathersum", row, flush=True)


def swigluprobs(report: dict, rows: int = 24576 * 8, ffn: int = 512) -> None:
    from rltrain.megatron import moe_experts, triton_swiglu
    from rltrain.megatron.fused import TRAIN_KERNELS_OFF_ENV

    g = torch.Generator(device="cuda").manual_seed(0)
    h = (2 * torch.randn(rows, 2 * ffn, device="cuda", generator=g)).to(torch.bfloat16)
    probs = torch.rand(rows, device="cuda", generator=g)
    dscaled = torch.randn(rows, ffn, device="cuda", generator=g).to(torch.bfloat16)
    assert triton_swiglu.probs_unsupported(h, probs) is None
    os.environ[TRAIN_KERNELS_OFF_ENV] = "swigluprobs"  # the compiled functions
    want = (
        moe_experts.fused_swiglu_probs(h, probs),
        *moe_experts.fused_swiglu_probs_backward(h, probs, dscaled),
    )
    row = {
        "compiled_fwd_us": device_us(lambda: moe_experts.fused_swiglu_probs(h, probs)),
        "compiled_bwd_us": device_us(lambda: moe_experts.fused_swiglu_probs_backward(h, probs, dscaled)),
    }
    del os.environ[TRAIN_KERNELS_OFF_ENV]
    got = (
        moe_experts.fused_swiglu_probs(h, probs),
        *moe_experts.fused_swiglu_probs_backward(h, probs, dscaled),
    )
    row["kernel_fwd_us"] = device_us(lambda: moe_experts.fused_swiglu_probs(h, probs))
    row["kernel_bwd_us"] = device_us(lambda: moe_experts.fused_swiglu_probs_backward(h, probs, dscaled))
    for name, a, b in zip(("fwd", "bwd_scaled", "bwd_dh"), got, want, strict=False):
        row[f"equal_share_{name}"] = float((a == b).float().mean())
    row["dp_max_rel"] = float(((got[3] - want[3]).abs() / want[3].abs().clamp_min(1e-6)).max())
    # bytes each must move: h and p in, fc2's input out; h, p and dscaled in, fc2's input, dh and dp out
    row["kernel_fwd_gb_per_s"] = rows * (3 * ffn * 2 + 4) / row["kernel_fwd_us"] / 1e3
    row["kernel_bwd_gb_per_s"] = rows * (6 * ffn * 2 + 8) / row["kernel_bwd_us"] / 1e3
    report["swigluprobs"] = row
    print("swigluprobs", row, flush=True)


def rmsnorm(report: dict) -> None:
    """torch's RMSNorm against `triton_rms_norm`'s kernels at the norms of a training micro-batch."""
    import torch.nn.functional as F

    from rltrain.megatron import triton_rms_norm

    shapes = {  # name: (rows, width)
        "qwen3moe_hidden": (24576, 1024), "qwen3moe_q_heads": (24576 * 16, 128),
        "qwen3moe_k_heads": (24576 * 4, 128), "qwen25_1.5b_hidden": (16384, 1536),
    }  # fmt: skip
    rows_out = {}
    for name, (rows, width) in shapes.items():
        g = torch.Generator(device="cuda").manual_seed(rows + width)
        x = torch.randn(rows, width, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
        w = (1 + 0.1 * torch.randn(width, device="cuda", generator=g)).to(torch.bfloat16).requires_grad_()
        dy = torch.randn(rows, width, device="cuda", generator=g).to(torch.bfloat16)
        assert triton_rms_norm.unsupported(x, w) is None

        def torchs(backward: bool, x=x, w=w, dy=dy, width=width):
            y = F.rms_norm(x, (width,), w, 1e-6)
            return (y, *torch.autograd.grad(y, (x, w), dy)) if backward else (y,)

        def kernels(backward: bool, x=x, w=w, dy=dy):
            y = triton_rms_norm.rms_norm(x, w, 1e-6)
            return (y, *torch.autograd.grad(y, (x, w), dy)) if backward else (y,)

        row = {}
        for label, fn in (("torch", torchs), ("kernel", kernels)):
            row[f"{label}_out"] = [t.detach() for t in fn(True)]
            with torch.no_grad():
                row[f"{label}_fwd_us"] = device_us(lambda fn=fn: fn(False))
            row[f"{label}_fwd_bwd_us"] = device_us(lambda fn=fn: fn(True))
        for i, part in enumerate(("y", "dx", "dw")):
            a, b = row["kernel_out"][i], row["torch_out"][i]
            row[f"equal_share_{part}"] = float((a == b).float().mean())
            row[f"max_rel_{part}"] = float((a.float() - b.float()).abs().max() / b.float().abs().max())
        del row["kernel_out"], row["torch_out"]
        rows_out[name] = row
        print("rmsnorm", name, row, flush=True)
    report["rmsnorm"] = rows_out


def rmsnorm_tune(report: dict) -> None:
    """`triton_rms_norm`'s backward kernel over launch shapes (elements of a tile, tiles per program, warps)
    at the hidden widths, device microseconds per call, printed as measured; the bytes' time beside them."""
    from rltrain.megatron import triton_rms_norm

    found = {}
    for name, (rows, width) in {
        "qwen3moe_hidden": (24576, 1024),
        "qwen25_1.5b_hidden": (16384, 1536),
    }.items():
        g = torch.Generator(device="cuda").manual_seed(rows + width)
        x = torch.randn(rows, width, device="cuda", generator=g).to(torch.bfloat16)
        w = (1 + 0.1 * torch.randn(width, device="cuda", generator=g)).to(torch.bfloat16)
        dy = torch.randn(rows, width, device="cuda", generator=g).to(torch.bfloat16)
        rstd = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)
        bytes_moved = 3 * x.numel() * x.element_size()  # x and dy read, dx written
        times = {}
        for tile_elements in (2048, 4096, 8192):
            for tiles in (2, 8):
                for warps in (4, 8, 16):
                    us = per_call_us(functools.partial(
                        triton_rms_norm._backward, x, w, rstd, dy, tile_elements, tiles, warps))  # fmt: skip
                    times[f"{tile_elements}x{tiles}w{warps}"] = round(us, 1)
                    print(name, tile_elements, tiles, warps, f"{us:.1f} us", flush=True)
        best = min(times, key=times.__getitem__)
        found[name] = {"us": times, "best": best, "bytes_us_at_4.3TBps": round(bytes_moved / 4.3e6, 1)}
        print(name, "best", best, times[best], "bytes' time", found[name]["bytes_us_at_4.3TBps"], flush=True)
    report["rmsnorm_tune"] = found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384, help="tokens of a micro-batch")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", default="", help="comma list of parts (default: all)")
    a = ap.parse_args()
    report: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "tokens": a.tokens}
    parts = {"rmsnorm": lambda: rmsnorm(report), "rmsnorm-tune": lambda: rmsnorm_tune(report), "swigluprobs": lambda: swigluprobs(report), "gathersum": lambda: gathersum(report),
             "maingrad": lambda: maingrad(report), "grouped": lambda: grouped(report),
             "wgrad": lambda: wgrad(report, a.tokens), "rope": lambda: rope(report, a.tokens)}  # fmt: skip
    for name, part in parts.items():
        if a.only and name not in a.only.split(","):
            continue
        try:
            part()
        except Exception as exc:  # one part failing still reports the others
            report.setdefault("errors", []).append(f"{type(exc).__name__}: {str(exc)[:500]}")
            print("error", report["errors"][-1], flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_kernels.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
