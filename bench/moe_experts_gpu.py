"""Forward + backward time of one MoE layer's routed experts: megatron SequentialMLP's math (two linears per
expert, in a loop) vs rltrain's grouped-GEMM experts (per-expert weights stacked, then
`moe_experts.GroupedSwiGLU` over torch._grouped_mm), on a Qwen3-MoE-shaped layer.

Both run on the same per-expert parameters (the layout both modules keep), the same expert-sorted rows and
probabilities; the grouped time includes stacking the weights (a copy each call, the price of keeping
SequentialMLP's checkpoint layout). Outputs and gradients are compared before timing.

`update_ms` times the training path of one layer (`moe_experts.expert_swiglu`) over `--micro-batches`
micro-batches of one optimizer step, with megatron DDP's gradient protocol emulated (an fp32 main_grad per
expert weight and DDP's per-parameter backward hook, `_make_backward_post_hook`'s add_), side by side:
`off` (moe_experts.ExpertUpdate all off: weights stacked through autograd per micro-batch, the hooks add
each gradient), `on` (main_grad by one multi-tensor add, stacks cached for the step, elementwise compiled
with `--fused`, the weights held without autograd accumulators or hooks as rlplan's DDP without overlapped
reduction allows), `on_with_accumulators` (the same with the weights as autograd inputs, their hooks
firing), and the first three switches alone. The main_grads of `off` and `on` are compared before timing.

    python bench/moe_experts_gpu.py                      # Qwen3-30B-A3B layer: 128 experts, top 8, H 2048, F 768
    python bench/moe_experts_gpu.py --tokens 4096 --experts 64 --device cpu --dtype float32 --hidden 256 --ffn 128
    python bench/moe_experts_gpu.py --tokens 4096 --experts 64 --hidden 1024 --ffn 512 --micro-batches 4  # qwen3-moe-grpo

`--products`: each of the six grouped products of a micro-batch (fc1 and fc2 forward; the backward's dscaled,
dW2, dW1, dx) timed alone, with its TFLOP/s: how fast torch._grouped_mm is at this shape, apart from the glue.
`--profile`: a torch profile of the `on` update step, its top kernels by device time (printed and in the json).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from rltrain.megatron.moe_experts import ExpertUpdate, GroupedSwiGLU, cached_expert_stacks, expert_swiglu


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


class _Config:
    """The TransformerConfig fields expert_swiglu reads."""

    def __init__(self, fused: bool) -> None:
        self.bias_activation_fusion = fused
        self.recompute_granularity = None


def _ddp_experts(w1s, w2s) -> list[torch.nn.Module]:
    """Experts holding the given weights (as parameters) with megatron DDP's gradient protocol: a main_grad
    (fp32) per weight, the grad_added_to_main_grad flag and DDP's backward post-hook on the gradient
    accumulator (add param.grad unless the flag is set, then drop it)."""
    experts = []
    for a, b in zip(w1s, w2s, strict=True):
        e = torch.nn.Module()
        e.linear_fc1, e.linear_fc2 = torch.nn.Module(), torch.nn.Module()
        e.linear_fc1.weight = torch.nn.Parameter(a.detach().clone())
        e.linear_fc2.weight = torch.nn.Parameter(b.detach().clone())
        e.accumulators = []  # the gradient accumulators whose hooks these are, kept alive
        for param in (e.linear_fc1.weight, e.linear_fc2.weight):
            param.main_grad = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
            param.grad_added_to_main_grad = False
            param.ddp_hook_needed = False  # rlplan's DDP does not overlap its gradient reduction

            def hook(*_unused, param=param):
                if param.grad is not None and not param.grad_added_to_main_grad:
                    param.main_grad.add_(param.grad.data)
                param.grad = None

            acc = param.expand_as(param).grad_fn.next_functions[0][0]
            acc.register_hook(hook)
            e.accumulators.append(acc)
        experts.append(e)
    return experts


def update_step(experts, batches, config) -> None:
    """One optimizer step's forward + backward of the layer's experts: zero_grad_buffer, then the
    micro-batches inside the engine's stack cache (run_schedule enters it)."""
    for e in experts:
        for p in (e.linear_fc1.weight, e.linear_fc2.weight):
            p.main_grad.zero_()
            p.grad_added_to_main_grad = False
    with cached_expert_stacks():
        for x, probs, groups, dy in batches:
            x, probs = x.detach().requires_grad_(), probs.detach().requires_grad_()
            expert_swiglu(experts, x, probs, groups, config).backward(dy)


def micro_batches(a, dtype, dev, g) -> list[tuple[torch.Tensor, ...]]:
    """--micro-batches of (rows x, probabilities, device offsets as moe_forward passes them, dy), each routed
    top-k at random."""
    batches = []
    for _ in range(a.micro_batches):
        choice = torch.rand(a.tokens, a.experts, generator=g).argsort(-1)[:, : a.topk].flatten()
        counts = torch.bincount(choice, minlength=a.experts)
        rows = int(counts.sum())
        batches.append((
            (torch.randn(rows, a.hidden, generator=g) * 0.5).to(dev, dtype),
            torch.rand(rows, generator=g).to(dev),
            counts.cumsum(0).to(dev, torch.int32),
            torch.randn(rows, a.hidden, generator=g).to(dev, dtype),
        ))  # fmt: skip
    return batches


def update_path(a, w1s, w2s, dtype, dev, g) -> dict:
    """`update_ms` (see the module docstring): switch settings side by side, main_grads compared first."""
    batches = micro_batches(a, dtype, dev, g)
    experts = _ddp_experts(w1s, w2s)
    params = [p for e in experts for p in (e.linear_fc1.weight, e.linear_fc2.weight)]
    settings = {  # (fuse, main_grad, cache, no_accumulators)
        "off": (False, False, False, False),
        "on": (a.fused, True, True, True),
        "on_with_accumulators": (a.fused, True, True, False),
        "fuse_only": (a.fused, False, False, False),
        "main_grad_only": (False, True, False, False),
        "cache_only": (False, False, True, False),
    }
    names = ("fuse", "main_grad", "cache", "no_accumulators")
    before = [getattr(ExpertUpdate, n) for n in names]
    config = _Config(a.fused)
    grads, ms = {}, {}
    try:
        for name, switches in settings.items():
            for n, v in zip(names, switches, strict=True):
                setattr(ExpertUpdate, n, v)
            update_step(experts, batches, config)
            grads[name] = [p.main_grad.clone() for p in params]

            def step(_e=experts, _b=batches, _c=config):
                update_step(_e, _b, _c)

            ms[name] = timed_step(step, a.device, a.repeat)
    finally:
        for n, v in zip(names, before, strict=True):
            setattr(ExpertUpdate, n, v)
    scale = max(float(t.abs().max()) for t in grads["off"]) or 1.0
    diff = max(float((x - y).abs().max()) for x, y in zip(grads["off"], grads["on"], strict=True)) / scale
    return {"update_ms": ms, "update_speedup": ms["off"] / ms["on"], "update_main_grad_max_rel_diff": diff}


def products(a, w1s, w2s, dtype, dev, g) -> dict:
    """`--products`: each grouped product of one micro-batch alone, ms and TFLOP/s (2 x rows x K x N)."""
    from rltrain.megatron.moe_experts import grouped_mm, grouped_mm_weight

    choice = torch.rand(a.tokens, a.experts, generator=g).argsort(-1)[:, : a.topk].flatten()
    counts = torch.bincount(choice, minlength=a.experts)
    rows = int(counts.sum())
    offs = counts.cumsum(0).to(dev, torch.int32)
    w1, w2 = torch.stack([w.detach() for w in w1s]), torch.stack([w.detach() for w in w2s])
    x = torch.randn(rows, a.hidden, generator=g).to(dev, dtype)
    h = torch.randn(rows, 2 * a.ffn, generator=g).to(dev, dtype)
    scaled = torch.randn(rows, a.ffn, generator=g).to(dev, dtype)
    dy = torch.randn(rows, a.hidden, generator=g).to(dev, dtype)
    cases = {  # name: (call, flops)
        "fc1_fwd": (lambda: grouped_mm(x, w1.transpose(1, 2), offs), 2 * rows * a.hidden * 2 * a.ffn),
        "fc2_fwd": (lambda: grouped_mm(scaled, w2.transpose(1, 2), offs), 2 * rows * a.ffn * a.hidden),
        "dscaled": (lambda: grouped_mm(dy, w2, offs), 2 * rows * a.hidden * a.ffn),
        "dw2": (lambda: grouped_mm_weight(dy.t(), scaled, offs), 2 * rows * a.hidden * a.ffn),
        "dw1": (lambda: grouped_mm_weight(h.t(), x, offs), 2 * rows * 2 * a.ffn * a.hidden),
        "dx": (lambda: grouped_mm(h, w1, offs), 2 * rows * 2 * a.ffn * a.hidden),
    }
    out = {}
    for name, (call, flops) in cases.items():
        ms = timed_step(call, a.device, a.repeat * 5)
        out[name] = {"ms": ms, "tflops": flops / ms / 1e9}
    total_ms = sum(v["ms"] for v in out.values())
    total_flops = sum(f for _, f in cases.values())
    out["all_six"] = {"ms": total_ms, "tflops": total_flops / total_ms / 1e9}
    return out


def profile_on(a, w1s, w2s, dtype, dev, g) -> str:
    """`--profile`: the top kernels (device time) of the `on` update step, one step profiled."""
    from torch.profiler import ProfilerActivity, profile

    batches = micro_batches(a, dtype, dev, g)
    experts = _ddp_experts(w1s, w2s)
    config = _Config(a.fused)
    before = (ExpertUpdate.fuse, ExpertUpdate.main_grad, ExpertUpdate.cache, ExpertUpdate.no_accumulators)
    ExpertUpdate.set(True)
    ExpertUpdate.fuse = a.fused
    try:
        for _ in range(3):
            update_step(experts, batches, config)
        if a.device == "cuda":
            torch.cuda.synchronize()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
        with profile(activities=activities) as prof:
            update_step(experts, batches, config)
            if a.device == "cuda":
                torch.cuda.synchronize()
    finally:
        ExpertUpdate.fuse, ExpertUpdate.main_grad, ExpertUpdate.cache, ExpertUpdate.no_accumulators = before
    sort = "cuda_time_total" if a.device == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=30)


def timed_step(fn, device: str, repeat: int) -> float:
    for _ in range(2):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
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
    ap.add_argument("--micro-batches", type=int, default=4, help="micro-batches of one step (update_ms)")
    ap.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None,
                    help="compiled elementwise work in update_ms's 'on' (default: on cuda)")  # fmt: skip
    ap.add_argument("--products", action="store_true", help="time each grouped product alone")
    ap.add_argument("--profile", action="store_true", help="profile the 'on' update step's kernels")
    a = ap.parse_args()
    if a.fused is None:
        a.fused = a.device == "cuda"
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
    update = update_path(a, w1s, w2s, dtype, dev, g)
    if a.products:
        update["products"] = products(a, w1s, w2s, dtype, dev, g)
    if a.profile:
        table = profile_on(a, w1s, w2s, dtype, dev, g)
        print(table)
        update["profile"] = table.splitlines()
    print(json.dumps({
        "shape": {"tokens": a.tokens, "experts": a.experts, "topk": a.topk, "hidden": a.hidden, "ffn": a.ffn,
                  "rows": rows, "dtype": a.dtype, "device": a.device},
        "fwd_bwd_ms": ms, "speedup": ms["sequential"] / ms["grouped"],
        "max_rel_diff": {"output": out_err, "grads": grad_err},
        "grouped_kernel": a.device == "cuda" and dtype == torch.bfloat16,
        "micro_batches": a.micro_batches, "fused": a.fused, **update,
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
