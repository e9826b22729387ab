"""Forward + backward time of one MoE layer's routed experts: megatron SequentialMLP's math (two linears per
expert, in a loop) vs rltrain's grouped-GEMM experts (per-expert weights stacked, then
`moe_experts.GroupedSwiGLU` over torch._grouped_mm), on a Qwen3-MoE-shaped layer.

Both run on the same per-expert parameters (the layout both modules keep), the same expert-sorted rows and
probabilities; the grouped time includes stacking the weights (a copy each call, the price of keeping
SequentialMLP's checkpoint layout). Outputs and gradients are compared before timing.

    python bench/moe_experts_gpu.py                      # Qwen3-30B-A3B layer: 128 experts, top 8, H 2048, F 768
    python bench/moe_experts_gpu.py --tokens 4096 --experts 64 --device cpu --dtype float32 --hidden 256 --ffn 128
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from rltrain.megatron.moe_experts import GroupedSwiGLU


def sequential(x, w1s, w2s, probs, counts):
    """SequentialMLP's math: per expert, fc1, SwiGLU, x probability, fc2 (megatron's order and dtypes)."""
    outs, start = [], 0
    for w1, w2, n in zip(w1s, w2s, counts, strict=True):
        gate, up = F.linear(x[start : start + n], w1).chunk(2, -1)
        act = F.silu(gate) * up
        outs.append(F.linear((act * probs[start : start + n, None]).to(act.dtype), w2))
        start += n
    return torch.cat(outs)


def grouped(x, w1s, w2s, probs, counts):
    return GroupedSwiGLU.apply(x, torch.stack(list(w1s)), torch.stack(list(w2s)), probs, counts)


def timed(fn, args, dy, device: str, repeat: int) -> float:
    def once():
        out = fn(*args)
        out.backward(dy)

    for _ in range(3):
        once()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        once()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeat * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens entering the layer (before top-k)")
    ap.add_argument("--experts", type=int, default=128, help="local experts (num_moe_experts / EP)")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768, help="moe_ffn_hidden_size")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeat", type=int, default=10)
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    dev = torch.device(a.device)
    g = torch.Generator().manual_seed(0)
    # Random top-k routing: rows per expert as the dispatcher hands them over (sorted by expert).
    choice = torch.rand(a.tokens, a.experts, generator=g).argsort(-1)[:, : a.topk].flatten()
    counts = torch.bincount(choice, minlength=a.experts).tolist()
    rows = sum(counts)
    x = (torch.randn(rows, a.hidden, generator=g) * 0.5).to(dev, dtype).requires_grad_()
    probs = torch.rand(rows, generator=g).to(dev).requires_grad_()
    w1s = [
        (torch.randn(2 * a.ffn, a.hidden, generator=g) * 0.02).to(dev, dtype).requires_grad_() for _ in counts
    ]
    w2s = [(torch.randn(a.hidden, a.ffn, generator=g) * 0.02).to(dev, dtype).requires_grad_() for _ in counts]
    dy = torch.randn(rows, a.hidden, generator=g).to(dev, dtype)
    params = [x, probs, *w1s, *w2s]

    results = {}
    for name, fn in (("sequential", sequential), ("grouped", grouped)):
        for p in params:
            p.grad = None
        out = fn(x, w1s, w2s, probs, counts)
        out.backward(dy)
        results[name] = (out.detach().float(), [p.grad.float().clone() for p in params])
    (o1, g1), (o2, g2) = results["sequential"], results["grouped"]
    scale = lambda t: float(t.abs().max()) or 1.0  # noqa: E731
    out_err = float((o1 - o2).abs().max()) / scale(o1)
    grad_err = max(float((a_ - b_).abs().max()) / scale(a_) for a_, b_ in zip(g1, g2, strict=True))

    ms = {name: timed(fn, (x, w1s, w2s, probs, counts), dy, a.device, a.repeat)
          for name, fn in (("sequential", sequential), ("grouped", grouped))}  # fmt: skip
    print(json.dumps({
        "shape": {"tokens": a.tokens, "experts": a.experts, "topk": a.topk, "hidden": a.hidden, "ffn": a.ffn,
                  "rows": rows, "dtype": a.dtype, "device": a.device},
        "fwd_bwd_ms": ms, "speedup": ms["sequential"] / ms["grouped"],
        "max_rel_diff": {"output": out_err, "grads": grad_err},
        "grouped_kernel": a.device == "cuda" and dtype == torch.bfloat16,
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
