"""Where the realistic-length rollout's decode time goes, and what the packed attention costs (issue 36).

One process, a random-init model (default Qwen2.5-1.5B shape, bf16, SDPA core attention, fused kernels).
Reported (decode_tail_gpu.json in --out):

  varlen         packed causal attention fwd+bwd on 8 rows of 400..4096 tokens (12 query / 2 KV heads):
                 torch's varlen flash kernel with the KV heads as they are (grouped) against repeated
                 (what packing.packed_attention did), and whether both give the same output
  step_ms        one captured decode step (forward, logits, sampling) per (rows, cache columns read: the
                 fixed 256-column bucket holding --grid-keys, glue unfused / fused): the cost that
                 compaction and key buckets trade against
  capture_s      one graph capture of the step (--captures, with a torch profile of the eager step and its
                 kernels per step, glue unfused / fused)
  generate       `MegatronActor.generate(cuda_graph=True)` of the preset's rollout with every row ending at
                 a long-tailed length (RLPLAN_BENCH_FORCE_EOS, mean 40% of the maximum): seconds, tokens/s,
                 number of compactions and graph captures and the seconds they took, with the step's
                 glue (attention inputs, mask, sampler) as megatron's modules one by one and fused, side by
                 side, and the fused rollout again (its shapes seen before in the process)

  triton_inputs  (--only-triton-inputs, nothing else runs) the static step's attention inputs as the Triton
                 kernel (inference.KVCacheGenerator.triton_attention_inputs on) against torch.compile's
                 kernels (off): the kernel's outputs (query, both cache columns, the rest of the caches)
                 against `fused.decode_attention_inputs` eager and compiled on random bf16 inputs (q/k norm on
                 and off, several head counts and dims, partial rotary), each against an fp64 truth, and
                 replayed in a CUDA graph with a new column; 28 calls of each captured and timed; the captured
                 step per (rows, columns) of --triton-grid and its kernels per step; the full-length and
                 the realistic rollout off / on; greedy tokens off against on

  triton_attention  (--only-triton-attention, nothing else runs) the static step's attention as the Triton
                 kernel over each row's own columns (KVCacheGenerator.triton_decode_attention on) against
                 SDPA over key buckets (off), reported as triton_inputs is: the kernel against an fp32 truth
                 and SDPA's error beside it, a graph replay with a moved column, microseconds per call, then
                 the same steps, kernels per step, rollouts and token parity

  add_norm       (--only-add-norm, nothing else runs) each residual add with the norm after it as one Triton
                 kernel (KVCacheGenerator.fuse_add_norm on) against megatron's add and norm (off):
                 the sum and the norm against eager and an fp64 truth at the 1.5B's width, microseconds per
                 layer (two calls), then the same steps, kernels per step, rollouts and token parity

  floor          (--only-floor, nothing else runs) where a captured step's time goes at few and many rows
                 (--floor-grid): its replay time, the device time of its kernels (a torch profile of graph
                 replays) and so the idle time between them, the kernels per step and a table of the top
                 kernels (the step's keys: the prompt's columns, or with --floor-all-columns every
                 column up to the one written, as in a rollout); each graph capture split into its warm-up
                 run and the capture itself, for a shape new to the process and one seen before; the
                 full-length and the realistic rollout with their captures' and compactions' seconds

Run on the GPU machine:  python3 bench/decode_tail_gpu.py --out $OUT
Floor profile:  python3 bench/decode_tail_gpu.py --only-floor --out $OUT
Triton attention inputs:  python3 bench/decode_tail_gpu.py --only-triton-inputs --out $OUT
Triton decode attention:  python3 bench/decode_tail_gpu.py --only-triton-attention --out $OUT
Add and norm fused:  python3 bench/decode_tail_gpu.py --only-add-norm --out $OUT
CPU smoke:  OMP_NUM_THREADS=1 .venv/bin/python bench/decode_tail_gpu.py --arch tiny --device cpu --rows 8 \
                --groups 2 --prompt 8 --new-tokens 32 --grid-rows 8,4 --grid-keys 16,40 --out /tmp/tail
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback
import warnings
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.decode_gpu import graph_us_per_call, per_call_ms, sync, timed_generate
from bench.rollout_gpu import get_arch
from tests.megatron._common import actor_of, init_groups

# The static step's glue (inference.KVCacheGenerator.fuse_step_glue): megatron's modules one by one, or the
# fused attention inputs and one additive mask per step.
GLUE = ("unfused", "fused")


def varlen_case(report: dict) -> None:
    """Packed attention fwd+bwd: grouped KV heads against repeated ones (torch's varlen flash kernel)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    from rltrain.megatron.packing import varlen_causal

    names = frozenset(inspect.signature(varlen_attn).parameters)
    causal = varlen_causal(names)
    report["varlen_signature"] = sorted(names)
    report["flash_forward_schema"] = str(torch.ops.aten._flash_attention_forward.default._schema)
    report["flash_backward_schema"] = str(torch.ops.aten._flash_attention_backward.default._schema)
    print(report["flash_forward_schema"], report["flash_backward_schema"], sep="\n", flush=True)
    lens = [400, 4096, 1200, 800, 3000, 2500, 600, 3788]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    t, hq, hkv, d = sum(lens), 12, 2, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    v = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    dout = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    m = max(lens)

    def grouped():
        return varlen_attn(q, k, v, cu, cu, m, m, **causal)

    def repeated():
        return varlen_attn(
            q, k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1), cu, cu, m, m, **causal
        )

    for op in ("_cudnn_attention_forward", "_cudnn_attention_backward"):
        try:
            report[op] = str(getattr(torch.ops.aten, op).default._schema)
        except Exception as exc:
            report[op] = f"{type(exc).__name__}: {exc}"
        print(op, report[op], flush=True)

    def cudnn_ragged():
        out = torch.ops.aten._cudnn_attention_forward(
            q,
            k.repeat_interleave(hq // hkv, 1),
            v.repeat_interleave(hq // hkv, 1),
            None,
            cu,
            cu,
            m,
            m,
            True,
            0.0,
            True,
            False,
            scale=None,
        )
        return out[0]

    res: dict = {}
    for name, fn in (("repeated", repeated), ("grouped", grouped)):
        try:
            out = fn()
            out.backward(dout)
            grads = [x.grad.clone() for x in (q, k, v)]
            for x in (q, k, v):
                x.grad = None
            res[name] = {"out": out.detach(), "grads": grads}

            def fb(fn=fn):
                fn().backward(dout)

            res[name]["ms"] = per_call_ms(fb, "cuda", iters=20)
            for x in (q, k, v):
                x.grad = None
        except Exception as exc:  # torch without GQA in varlen: say so
            res[name] = {"error": f"{type(exc).__name__}: {exc}"}
    summary = {n: {"ms": r.get("ms"), "error": r.get("error")} for n, r in res.items()}
    try:
        with torch.no_grad():
            got = cudnn_ragged()
            ref = repeated()
            fwd_cudnn = per_call_ms(cudnn_ragged, "cuda", iters=20)
            fwd_flash = per_call_ms(grouped, "cuda", iters=20)
        summary["cudnn_ragged_fwd"] = {
            "ms": fwd_cudnn, "flash_fwd_ms": fwd_flash,
            "max_diff": float((got.float() - ref.float()).abs().max()),
        }  # fmt: skip
    except Exception as exc:
        summary["cudnn_ragged_fwd"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    if "out" in res.get("grouped", {}) and "out" in res.get("repeated", {}):
        a, b = res["grouped"], res["repeated"]
        summary["max_out_diff"] = float((a["out"].float() - b["out"].float()).abs().max())
        summary["max_grad_diff"] = [
            float((x.float() - y.float()).abs().max()) for x, y in zip(a["grads"], b["grads"], strict=True)
        ]
    report["varlen"] = summary
    print("varlen", summary, flush=True)


# (rows, KV groups, query heads per group, head dim, rotary dim, q/k norm) of the kernel's parity cases: the
# 1.5B's layer, Qwen3-MoE's, partial rotary, one row, one query head per group, a head dim no power of two.
TRITON_CASES = (
    (512, 2, 6, 128, 128, False),
    (512, 4, 8, 128, 128, True),
    (7, 2, 6, 128, 64, True),
    (1, 1, 4, 64, 64, False),
    (33, 8, 1, 128, 128, True),
    (16, 2, 7, 80, 80, True),
    (64, 2, 6, 128, 32, False),
)


def _truth(mixed, cos, sin, d, weights, eps):
    """`fused.decode_attention_inputs`'s math in float64: (query, key, value) [n, heads or groups, d]."""
    n, _, width = mixed.shape
    x = mixed.double()
    q, k, v = x.split([width - 2 * d, d, d], dim=-1)
    q = q.reshape(n, -1, d)
    for i, w in enumerate(weights):
        if w is not None:
            t = (q, k)[i]
            t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w.double()
            q, k = (t, k) if i == 0 else (q, t)
    c, s = cos.double(), sin.double()
    rot = c.shape[-1]

    def rope(t):
        a, rest = t[..., :rot], t[..., rot:]
        a1, a2 = a.chunk(2, dim=-1)
        return torch.cat((a * c + torch.cat((-a2, a1), -1) * s, rest), -1)

    return rope(q), rope(k), v


def triton_parity(report: dict) -> None:
    """The Triton kernel against `fused.decode_attention_inputs` eager and compiled on random bf16 inputs:
    max abs differences and the share of equal elements against each, and each one's error against an fp64
    truth. Asserts the values exact, the rest of the caches untouched, and every query / key element within
    bf16 rounding of the truth (half an ulp: 2^-8 of its magnitude, plus 2^-16 of the tensor's largest for
    the fp32 arithmetic before the one rounding, where outputs cancel to near zero)."""
    from rltrain.megatron import decode_kernels, fused

    gen = torch.Generator(device="cuda").manual_seed(5)
    dt, eps, max_len, col = torch.bfloat16, 1e-6, 12, 5
    res = report.setdefault("triton_parity", {})
    for n, groups, per_group, d, rot, norms in TRITON_CASES:
        why = decode_kernels.unsupported(torch.device("cuda"), dt, d, per_group, rot)
        assert why is None, why
        mixed = torch.randn(n, groups, (per_group + 2) * d, device="cuda", generator=gen).mul(3).to(dt)
        weights = tuple(
            torch.randn(d, device="cuda", generator=gen).mul(0.3).add(1).to(dt) if norms else None
            for _ in range(2)
        )
        freqs = torch.rand(n, 1, rot, device="cuda", generator=gen) * 1000
        cos, sin = freqs.cos().to(dt), freqs.sin().to(dt)
        caches = [torch.randn(max_len, n, groups, d, device="cuda", generator=gen).to(dt) for _ in range(2)]
        column = torch.tensor([col], device="cuda")
        outs = {}
        for name, fn in (("eager", fused.decode_attention_inputs), ("compiled", fused.fused_decode_attention_inputs),
                         ("triton", decode_kernels.attention_inputs)):  # fmt: skip
            kv = [c.clone() for c in caches]
            with torch.no_grad():
                query = fn(mixed, cos, sin, *kv, column, *weights, eps)
            others = torch.arange(max_len, device="cuda") != col
            for c, old in zip(kv, caches, strict=True):
                assert torch.equal(c[others], old[others]), f"{name} wrote outside column {col}"
            outs[name] = (query, kv[0][col], kv[1][col])
        truth = _truth(mixed, cos, sin, d, weights, eps)
        key = f"n{n} g{groups} p{per_group} d{d} rot{rot} norm{int(norms)}"
        row: dict = {}
        for i, part in enumerate(("query", "key", "value")):
            tri = outs["triton"][i].float()
            err = {name: float((o[i].double() - truth[i]).abs().max()) for name, o in outs.items()}
            row[part] = {
                "max_abs_diff_vs_eager": float((tri - outs["eager"][i].float()).abs().max()),
                "max_abs_diff_vs_compiled": float((tri - outs["compiled"][i].float()).abs().max()),
                "equal_share_vs_eager": float((outs["triton"][i] == outs["eager"][i]).float().mean()),
                "equal_share_vs_compiled": float((outs["triton"][i] == outs["compiled"][i]).float().mean()),
                "max_abs_err_vs_fp64": err,
            }
            if part == "value":
                assert torch.equal(outs["triton"][i], outs["eager"][i]), (
                    f"{key}: values are copied as they are"
                )
            else:
                gap = (outs["triton"][i].double() - truth[i]).abs()
                bound = 2**-8 * truth[i].abs() * 1.001 + 2**-16 * truth[i].abs().max()
                row[part]["worst_error_over_half_ulp"] = float((gap / bound).max())
                assert bool((gap <= bound).all()), (key, part, row[part])
        # The QKV bias added in the kernel (megatron's add: the sum rounded to bf16) against the kernel on
        # the sum made first by torch: bit for bit.
        bias = torch.randn(mixed.shape[1] * mixed.shape[2], device="cuda", generator=gen).to(dt)
        pair = []
        for m, b in ((mixed, bias), (mixed + bias.view(mixed.shape[1:]), None)):
            kv = [c.clone() for c in caches]
            with torch.no_grad():
                pair.append(
                    (decode_kernels.attention_inputs(m, cos, sin, *kv, column, *weights, eps, b), *kv)
                )
        row["bias_in_kernel_bit_identical"] = all(torch.equal(a, b) for a, b in zip(*pair, strict=True))
        assert row["bias_in_kernel_bit_identical"], key
        res[key] = row
        print("triton parity", key, json.dumps(row), flush=True)

    # In a CUDA graph: the column is read on the device, so a replay after the column changed writes there.
    n, groups, per_group, d, rot, _ = TRITON_CASES[0]
    mixed = torch.randn(n, groups, (per_group + 2) * d, device="cuda", generator=gen).to(dt)
    freqs = torch.rand(n, 1, rot, device="cuda", generator=gen) * 1000
    cos, sin = freqs.cos().to(dt), freqs.sin().to(dt)
    kv = [torch.zeros(max_len, n, groups, d, device="cuda", dtype=dt) for _ in range(2)]
    column = torch.tensor([1], device="cuda")
    call_args = (mixed, cos, sin, *kv, column, None, None, eps)
    decode_kernels.attention_inputs(*call_args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        query = decode_kernels.attention_inputs(*call_args)
    column.fill_(9)
    graph.replay()
    ref_kv = [torch.zeros_like(c) for c in kv]
    ref_q = decode_kernels.attention_inputs(mixed, cos, sin, *ref_kv, column, None, None, eps)
    for c, ref in zip(kv, ref_kv, strict=True):
        assert torch.equal(c[9], ref[9]) and bool(c[9].any()), (
            "the replay writes the column set after capture"
        )
    assert torch.equal(query, ref_q)
    report["triton_graph_replay_column"] = "ok"

    # 28 calls (a 1.5B step's layers) captured in one graph: microseconds per call, compiled vs Triton.
    calls = {
        name: graph_us_per_call(functools.partial(fn, *call_args), 28)
        for name, fn in (
            ("compiled", fused.fused_decode_attention_inputs),
            ("triton", decode_kernels.attention_inputs),
        )
    }
    report["triton_us_per_call_512x2x6x128"] = calls
    print("attention inputs, us per call (512 rows, 1.5B layer):", calls, flush=True)


# (rows, KV groups, query heads per group, head dim, cache columns, column written, splits: None = the kernel's
# own choice): the 1.5B's and Qwen3-MoE's layers at full and few rows, MQA, a head dim that is no power of two.
ATTENTION_CASES = (
    (512, 2, 6, 128, 1088, 1000, None),
    (256, 4, 4, 128, 1088, 700, None),
    (8, 2, 6, 128, 1088, 900, None),
    (8, 2, 6, 128, 1088, 900, 1),
    (64, 1, 8, 64, 300, 130, None),
    (16, 2, 7, 80, 300, 63, 4),
    (3, 2, 6, 128, 200, 0, None),
)


def attention_parity(report: dict) -> None:
    """The Triton decode attention against SDPA on random bf16 caches whose rows start after prompt pads of
    their own (0 to 63 columns) and hold a hidden hole: each one's error against an fp32 truth over each row's
    visible columns (the kernel's bound: 2^-7 of the largest |output| plus 2^-8 of each, the rounding of the
    probabilities and of the output in bf16), the columns past the written one filled with NaN (the kernel
    must not read them); a CUDA graph replayed after the column moved; then microseconds per call, 28 calls
    (a 1.5B step's layers) in one graph, the kernel over each row's columns against SDPA over the engine's
    key bucket (inference.key_bucket), as the static step calls them."""
    from rltrain.megatron import decode_kernels, inference

    gen = torch.Generator(device="cuda").manual_seed(6)
    dt = torch.bfloat16
    res = report.setdefault("attention_parity", {})

    def case(n, groups, per_group, d, max_len, col):
        q = torch.randn(n, groups * per_group, d, device="cuda", generator=gen).to(dt)
        k, v = (
            torch.randn(max_len, n, groups, d, device="cuda", generator=gen).mul(2).to(dt) for _ in range(2)
        )
        pads = torch.randint(0, min(64, col + 1), (n,), device="cuda", generator=gen)
        cols = torch.arange(max_len, device="cuda")
        masked = (cols < pads[:, None]) | (cols > col)
        if col > 8:
            masked[0, pads[0] + 1] = True  # a hole
        return q, k, v, masked, (~masked).int().argmax(1), torch.tensor([col], device="cuda")

    def sdpa(q, k, v, masked, keys, scale):
        return torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None], k[:keys].permute(1, 2, 0, 3), v[:keys].permute(1, 2, 0, 3),
            attn_mask=~masked[:, None, None, :keys], scale=scale, enable_gqa=True,
        ).reshape(q.shape[0], -1)  # fmt: skip

    for n, groups, per_group, d, max_len, col, splits in ATTENTION_CASES:
        why = decode_kernels.attention_unsupported(torch.device("cuda"), dt, d, per_group)
        assert why is None, why
        q, k, v, masked, first, column = case(n, groups, per_group, d, max_len, col)
        scale = d**-0.5
        truth = decode_kernels.decode_attention_reference(
            q.float(), k.float(), v.float(), masked, first, column, scale
        )
        base = sdpa(q, k, v, masked, col + 1, scale)  # SDPA over exactly the written columns
        k[col + 1 :], v[col + 1 :] = float("nan"), float("nan")
        chosen = decode_kernels.attention_splits
        if splits is not None:
            decode_kernels.attention_splits = lambda rows, g, sms, s=splits: s
        try:
            out = decode_kernels.decode_attention(q, k, v, masked, first, column, scale)
        finally:
            decode_kernels.attention_splits = chosen
        gap = (out.float() - truth).abs()
        bound = 2**-7 * truth.abs().max() + 2**-8 * truth.abs()
        key = f"n{n} g{groups} p{per_group} d{d} col{col} splits{splits or chosen(n, groups, 132)}"
        res[key] = {
            "max_abs_err_kernel": float(gap.max()),
            "max_abs_err_sdpa": float((base.float() - truth).abs().max()),
            "worst_error_over_bound": float((gap / bound).max()),
        }
        print("attention parity", key, res[key], flush=True)
        assert not out.isnan().any() and bool((gap <= bound).all()), (key, res[key])

    # A CUDA graph: first / col are read on the device, so a replay after the column moved reads up to it.
    n, groups, per_group, d, max_len, _, _ = ATTENTION_CASES[0]
    q, k, v, masked, first, column = case(n, groups, per_group, d, max_len, max_len - 1)
    masked[:, 100:] = True
    column.fill_(99)
    decode_kernels.decode_attention(q, k, v, masked, first, column, 0.1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_kernels.decode_attention(q, k, v, masked, first, column, 0.1)
    masked[:, 100:600] = False
    column.fill_(599)
    graph.replay()
    want = decode_kernels.decode_attention_reference(
        q.float(), k.float(), v.float(), masked, first, column, 0.1
    )
    assert float((out.float() - want).abs().max()) <= 2**-6 * float(want.abs().max()), (
        "replay reads to the new column"
    )
    report["attention_graph_replay_column"] = "ok"

    # Microseconds per call: 28 calls (a 1.5B step's layers) in one graph, kernel vs SDPA over the bucket.
    calls: dict = {}
    for rows, col in ((512, 1000), (512, 500), (256, 700), (64, 300), (8, 200)):
        q, k, v, masked, first, column = case(rows, 2, 6, 128, 1088, col)
        width = inference.key_bucket(rows)
        keys = min(-(-(col + 1) // width) * width, 1088)
        additive = torch.zeros(masked.shape, dtype=dt, device="cuda").masked_fill_(masked, float("-inf"))
        fns = {
            "sdpa_bucket": functools.partial(
                torch.nn.functional.scaled_dot_product_attention,
                q[:, :, None], k[:keys].permute(1, 2, 0, 3), v[:keys].permute(1, 2, 0, 3),
                attn_mask=additive[:, None, None, :keys], scale=0.1, enable_gqa=True,
            ),
            "triton": functools.partial(decode_kernels.decode_attention, q, k, v, masked, first, column, 0.1),
        }  # fmt: skip
        for name, fn in fns.items():
            calls[f"{rows} rows col {col} ({name}, sdpa reads {keys})"] = graph_us_per_call(fn, 28)
    report["attention_us_per_call_1.5b_layer"] = calls
    print("decode attention, us per call (1.5B layer):", json.dumps(calls, indent=1), flush=True)


def step_kernels(step, cols: int, table_path: Path, row_limit: int) -> tuple[float, str]:
    """Device kernels per call of a static decode step's body (torch.profiler over 3 eager calls after a
    warm-up) and the profile's table, also written to `table_path`."""
    from torch.profiler import ProfilerActivity, profile

    step._body(cols)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step._body(cols)
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type.name == "CUDA") / 3
    table = events.table(sort_by="cuda_time_total", row_limit=row_limit)
    table_path.write_text(table)
    return kernels, table


def floor_case(
    args, report: dict, actor, static_step, uniform, out_dir: Path, dev: str, max_len: int
) -> None:
    """`--only-floor`: per (rows x columns) of --floor-grid the captured step's replay time against its
    kernels' device time (profiled over graph replays), the kernels per step and their table, and its
    captures' warm-up and capture seconds (a first and a repeated capture of the shape)."""
    from torch.profiler import ProfilerActivity, profile

    from rltrain import device as devices
    from rltrain.megatron import inference

    split: list[tuple[float, float]] = []
    real_capture = devices.capture_graph

    def timed_capture(device, fn, pool=None, warm_up=True):
        """devices.capture_graph, its warm-up (the first call of `fn`, eager) timed apart from the capture."""
        warmed: list[float] = []

        def marked():
            out = fn()
            if warm_up and not warmed:
                torch.cuda.synchronize()
                warmed.append(time.perf_counter())
            return out

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = real_capture(device, marked, pool, warm_up)
        torch.cuda.synchronize()
        t1 = warmed[0] if warmed else t0
        split.append((t1 - t0, time.perf_counter() - t1))
        return out

    devices.capture_graph = timed_capture  # type: ignore[assignment]
    floor: dict = {}
    report["floor"] = floor
    try:
        with actor._ctx(), inference.sequence_parallel_off(actor.modules()), torch.no_grad():
            actor.eval()
            for item in (x for x in args.floor_grid.split(",") if x):
                rows, keys = (int(x) for x in item.split("x"))
                keys = min(keys, max_len)
                tokens = torch.randint(0, actor.vocab_size, (rows,), device=dev)
                entry: dict = {"captures_warmup_s_capture_s": []}
                for repeat in (False, True):  # a shape new to the process, then the same shape again
                    step = static_step(rows)
                    if args.floor_all_columns:  # every column up to the one written holds a key to read
                        step.key_masked[:, :keys] = False
                    split.clear()
                    step(tokens, keys - 1, uniform[:rows])
                    entry["captures_warmup_s_capture_s"] += split
                    if not repeat:
                        del step
                ms = per_call_ms(
                    lambda st=step, tk=tokens, r=rows, k=keys: st(tk, k - 1, uniform[:r]), dev, iters=30
                )
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        step(tokens, keys - 1, uniform[:rows])
                    torch.cuda.synchronize()
                events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
                kernel_us = sum(e.self_device_time_total for e in events) / 5
                entry.update(
                    step_ms=ms,
                    kernel_us=kernel_us,
                    idle_us=ms * 1e3 - kernel_us,
                    kernels=sum(e.count for e in events) / 5,
                    top={
                        e.key[:90]: {"us_per_step": e.self_device_time_total / 5, "per_step": e.count / 5}
                        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:30]
                    },
                )
                floor[item] = entry
                table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=40)
                (out_dir / f"profile_floor_{item}.txt").write_text(table)
                print(
                    f"floor {item}: step {ms:.3f} ms, kernels {kernel_us:.0f} us, {entry['kernels']:.0f} kernels,"
                    f" captures {entry['captures_warmup_s_capture_s']}",
                    flush=True,
                )
                print(table[:5000], flush=True)
                del step
                torch.cuda.empty_cache()
    finally:
        devices.capture_graph = real_capture  # type: ignore[assignment]


def _token_parity(a: dict, b: dict) -> dict:
    """Share of equal response tokens of two rollouts of the same prompts, and per row the first step
    where they differ (the response length where none does)."""
    ta, tb = a["responses"], b["responses"]
    both = (a["response_mask"] > 0) & (b["response_mask"] > 0)
    differ = (ta != tb) & both
    first = torch.where(
        differ.any(1), differ.int().argmax(1), torch.full_like(differ[:, 0], ta.shape[1], dtype=torch.long)
    )
    return {
        "equal_token_share": float(((ta == tb) & both).sum() / both.sum().clamp(min=1)),
        "rows_identical_share": float((~differ.any(1)).float().mean()),
        "mean_first_difference": float(first.float().mean()),
        "same_lengths_share": float((a["response_mask"].sum(1) == b["response_mask"].sum(1)).float().mean()),
    }


def add_norm_parity(report: dict) -> None:
    """`decode_kernels.add_rms_norm` (the Triton kernel) against megatron's residual add and torch.nn.RMSNorm
    (eager) on random bf16 rows of the 1.5B's width (1,536): the sum must be equal; the norm's error against
    an fp64 truth (from the rounded sum) beside eager's, the share of equal elements; then microseconds per
    layer (the two calls a layer makes, 28 layers in one graph), eager's four kernels against two."""
    from rltrain.megatron import decode_kernels

    gen = torch.Generator(device="cuda").manual_seed(8)
    dt, h = torch.bfloat16, 1536
    norm = torch.nn.RMSNorm(h, eps=1e-6, device="cuda", dtype=dt)
    with torch.no_grad():
        norm.weight.uniform_(0.2, 2.0, generator=gen)
    res = report.setdefault("add_norm_parity", {})
    calls = {}
    for rows in (512, 64, 8, 1):
        x, residual = (torch.randn(1, rows, h, device="cuda", generator=gen).mul(4).to(dt) for _ in range(2))
        hidden, normed = decode_kernels.add_rms_norm(x, residual, norm.weight, norm.eps)
        eager = norm(residual + x)
        assert torch.equal(hidden, residual + x), "the sum is megatron's"
        s = hidden.double()
        truth = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
        res[str(rows)] = {
            "max_abs_err_kernel": float((normed.double() - truth).abs().max()),
            "max_abs_err_eager": float((eager.double() - truth).abs().max()),
            "equal_share": float((normed == eager).float().mean()),
            "max_abs_diff": float((normed.float() - eager.float()).abs().max()),
        }
        print("add_norm parity", rows, res[str(rows)], flush=True)
        assert res[str(rows)]["max_abs_err_kernel"] <= 2**-7 * float(truth.abs().max()), res[str(rows)]

        def megatron(x=x, residual=residual):
            a = residual + x
            b = norm(a)
            return norm(a + b)

        def kernel(x=x, residual=residual):
            a, n = decode_kernels.add_rms_norm(x, residual, norm.weight, norm.eps)
            return decode_kernels.add_rms_norm(n, a, norm.weight, norm.eps)

        calls[f"{rows} rows eager (4 kernels)"] = graph_us_per_call(megatron, 28)
        calls[f"{rows} rows kernel (2 kernels)"] = graph_us_per_call(kernel, 28)
    report["add_norm_us_per_layer"] = calls
    print("add and norm, us per layer:", json.dumps(calls, indent=1), flush=True)


# The class switches --only-triton-inputs / --only-triton-attention / --only-add-norm time off against on: (the switch, the
# kernel's parity function, the engine's attributes holding its choice and the reason it names).
SWITCHES = {
    "triton_inputs": (
        "triton_attention_inputs",
        triton_parity,
        "attention_inputs",
        "triton_inputs_unsupported",
    ),
    "triton_attention": (
        "triton_decode_attention",
        attention_parity,
        "decode_attention",
        "triton_attention_unsupported",
    ),
    "add_norm": ("fuse_add_norm", add_norm_parity, "add_norm", "add_norm_unsupported"),
}


def switch_side_by_side(
    args, report, attempt, actor, static_step, columns_read, uniform, out_dir, tag
) -> None:
    """One of SWITCHES (`KVCacheGenerator.<switch>`) off against on: kernel parity, captured steps and their
    kernels per step, rollouts, greedy token parity."""
    from rltrain.megatron import inference

    dev, b, p, n_new = args.device, args.rows, args.prompt, args.new_tokens
    name, parity, chosen, reason = SWITCHES[tag]
    gen_cls = inference.KVCacheGenerator
    if dev == "cuda":
        attempt(f"{tag}_parity", lambda: parity(report))
    switch = {"off": False, "on": True}
    engine = inference.KVCacheGenerator(actor, torch.arange(8, device=dev).expand(1, 8))
    picked = getattr(engine, chosen)
    report[f"{tag}_engine_choice"] = {
        "function": getattr(picked, "__qualname__", None),
        "unsupported": getattr(engine, reason),
    }
    print("engine's choice:", report[f"{tag}_engine_choice"], flush=True)
    assert dev != "cuda" or getattr(engine, reason) is None

    def steps() -> None:
        inference.BUCKET_ROWS = 1  # fixed KEY_BUCKET-column buckets, as the grid's
        with actor._ctx(), inference.sequence_parallel_off(actor.modules()), torch.no_grad():
            actor.eval()
            for rows, keys in (tuple(int(v) for v in x.split("x")) for x in args.triton_grid.split(",") if x):
                rows, keys = min(rows, b), min(keys, p + n_new)
                tokens = torch.randint(0, actor.vocab_size, (rows,), device=dev)
                for label, on in switch.items():
                    setattr(gen_cls, name, on)
                    step = static_step(rows)
                    ms = per_call_ms(
                        lambda st=step, tk=tokens, k=keys, r=rows: st(tk, k - 1, uniform[:r]), dev, iters=20
                    )
                    cols = columns_read(rows, keys)
                    report.setdefault(f"{tag}_step_ms", {})[f"{rows}x{cols} {label}"] = ms
                    print(f"step rows {rows} columns {cols} {tag} {label}: {ms:.3f} ms", flush=True)
                    del step
            rows, keys = min(256, b), min(576, p + n_new)
            for label, on in switch.items() if dev == "cuda" else ():
                setattr(gen_cls, name, on)
                step = static_step(rows, pool=False)
                cols = columns_read(rows, keys)
                kernels, table = step_kernels(step, cols, out_dir / f"profile_step_{tag}_{label}.txt", 30)
                report.setdefault(f"{tag}_kernels_per_step", {})[label] = kernels
                print("kernels per step,", tag, label, kernels, flush=True)
                print(table[:4000], flush=True)
        setattr(gen_cls, name, True)

    attempt(f"{tag}_steps", steps)

    gen = torch.Generator().manual_seed(2)
    prompts = torch.randint(1, actor.vocab_size, (args.groups, p), generator=gen)
    ids = prompts.repeat_interleave(b // args.groups, 0)
    inference.BUCKET_ROWS = 256
    for share in (None, args.share):
        if share is None:
            os.environ.pop(inference.FORCE_EOS_ENV, None)
        else:
            os.environ[inference.FORCE_EOS_ENV] = str(share)
        eos = None if share is None else 1
        batches = {}
        # The first call compiles and captures; then off and on side by side, twice each.
        for label in ["warm-up", "off", "on", "off", "on"] if share is None else ["off", "on", "off", "on"]:
            setattr(gen_cls, name, label != "off")
            res = attempt(
                f"{tag}_generate_{share}_{label}",
                lambda eos=eos: timed_generate(actor, ids, n_new, dev, eos),
            )
            if res is None:
                continue
            batches[label] = res.pop("batch")
            report.setdefault(f"{tag}_generate", {}).setdefault(f"{share} {label}", []).append(res)
            print(f"generate share {share} {tag} {label}: {res}", flush=True)
        if "off" in batches and "on" in batches:  # the same seed's uniforms: tokens differ only by the kernel
            parity = _token_parity(batches["off"], batches["on"])
            report.setdefault(f"{tag}_sampled_parity", {})[str(share)] = parity
            print(f"sampled tokens share {share}, off vs on:", parity, flush=True)
    os.environ.pop(inference.FORCE_EOS_ENV, None)

    def greedy() -> None:
        out = {}
        for label, on in switch.items():
            setattr(gen_cls, name, on)
            out[label] = actor.generate(ids, n_new, temperature=0.0, pad_id=0, prompt_mask=torch.ones_like(ids),
                                        cuda_graph=True, seed=3)  # fmt: skip
        report[f"{tag}_greedy_parity"] = _token_parity(out["off"], out["on"])
        print("greedy tokens, off vs on:", report[f"{tag}_greedy_parity"], flush=True)

    attempt(f"{tag}_greedy", greedy)
    setattr(gen_cls, name, True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen15b", choices=["qwen05b", "qwen15b", "tiny"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--grid-rows", default="512,256,128,64,32,16,8")
    parser.add_argument("--grid-keys", default="128,320,576,1088")
    parser.add_argument("--share", type=float, default=0.4)
    parser.add_argument("--captures", action="store_true", help="time graph captures, profile one step")
    parser.add_argument("--logprob", action="store_true", help="log-prob packed vs padded")
    parser.add_argument("--varlen", action="store_true", help="packed attention kernels")
    parser.add_argument(
        "--only-triton-inputs",
        action="store_true",
        help="the Triton attention inputs against the compiled ones (parity, steps, rollouts)",
    )
    parser.add_argument(
        "--only-triton-attention",
        action="store_true",
        help="the Triton decode attention against SDPA over key buckets (parity, steps, rollouts)",
    )
    parser.add_argument(
        "--only-add-norm",
        action="store_true",
        help="each residual add with its norm as one Triton kernel against megatron's two (parity, steps, rollouts)",
    )
    parser.add_argument(
        "--only-floor",
        action="store_true",
        help="where a captured step's time goes (replay vs kernel time, top kernels, capture split), rollouts",
    )
    parser.add_argument("--floor-grid", default="512x1088,128x1088,64x1088,8x1088", help="rows x columns")
    parser.add_argument(
        "--floor-all-columns",
        action="store_true",
        help="the floor's steps see every column up to the one written (a rollout's attention), not the prompt's",
    )
    parser.add_argument(
        "--triton-grid",
        default="512x1088,256x576,64x320,8x128",
        help="rows x cache columns of the steps timed with --only-triton-inputs / --only-triton-attention",
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    dev = args.device
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {"torch": torch.__version__, "args": vars(args)}
    errors: dict[str, str] = {}
    report["errors"] = errors

    def attempt(name: str, fn):
        try:
            return fn()
        except Exception as exc:
            traceback.print_exc()
            errors[name] = f"{type(exc).__name__}: {exc}"
            return None

    if dev == "cuda" and args.varlen:
        attempt("varlen", lambda: varlen_case(report))

    from rlconf.config import ActorConfig, MegatronConfig, ModelConfig
    from rltrain import device as devices
    from rltrain.megatron import inference
    from rltrain.megatron.model import use_compiled_rope
    from rltrain.megatron.parallel import free_port

    init_groups(MegatronConfig(), dev, rank=0, world_size=1, master_port=free_port())
    b, p, n_new = args.rows, args.prompt, args.new_tokens
    arch = get_arch(args.arch, p + n_new)
    dtype_name = "bfloat16" if dev == "cuda" else "float32"
    model_cfg = ModelConfig(arch=arch, params_dtype=dtype_name, attention_backend="sdpa")  # type: ignore[arg-type]
    actor = actor_of(model_cfg, ActorConfig(megatron=MegatronConfig()), dev, trainable=False)
    actor.spec = replace(actor.spec, settings=replace(actor.spec.settings, fused_kernels=True))
    use_compiled_rope()
    for chunk in actor.modules():
        chunk.config.bias_activation_fusion = True
        chunk.config.apply_rope_fusion = True
    max_len = p + n_new

    positions = torch.arange(max_len, device=dev).expand(b, max_len).contiguous()
    uniform = torch.rand(b, device=dev)

    def static_step(rows: int, pool: bool = True):
        """A zeroed cache of `rows` rows (prompt columns visible) and a static decode step over it."""
        engine = inference.KVCacheGenerator(actor, positions[:rows], zero_cache=True)
        engine._allocate(rows)
        key_masked = torch.zeros((rows, max_len), dtype=torch.bool, device=dev)
        key_masked[:, p:] = True
        return inference.StaticDecodeStep(
            engine, torch.arange(rows, device=dev), key_masked, (1.0, 1.0, -1, 0.0),
            devices.graph_pool(dev) if pool else None,
        )  # fmt: skip

    def columns_read(rows: int, keys: int) -> int:
        """The cache columns a step writing column keys - 1 attends over (the whole bucket holding it)."""
        width = inference.key_bucket(rows)
        return min(-(-keys // width) * width, max_len)

    tag = (
        "triton_inputs"
        if args.only_triton_inputs
        else "triton_attention"
        if args.only_triton_attention
        else "add_norm"
        if args.only_add_norm
        else None
    )
    if tag is not None:
        switch_side_by_side(args, report, attempt, actor, static_step, columns_read, uniform, out_dir, tag)
        (out_dir / "decode_tail_gpu.json").write_text(json.dumps(report, indent=1, default=str))
        print("errors:", errors)
        return 0
    if args.only_floor and dev == "cuda":
        attempt("floor", lambda: floor_case(args, report, actor, static_step, uniform, out_dir, dev, max_len))

    # ---- the step cost model: captured step per (rows, columns read), fixed 256-column buckets
    report["step_ms"] = {}

    def grid() -> None:
        with actor._ctx(), inference.sequence_parallel_off(actor.modules()), torch.no_grad():
            actor.eval()
            for rows in (int(x) for x in args.grid_rows.split(",") if x):
                tokens = torch.randint(0, actor.vocab_size, (rows,), device=dev)
                for keys, glue in ((int(x), g) for x in args.grid_keys.split(",") for g in GLUE):
                    inference.KVCacheGenerator.fuse_step_glue = glue == "fused"
                    step = static_step(rows)  # a new step: its first call captures this bucket's graph
                    keys, cols = min(keys, max_len), columns_read(rows, min(keys, max_len))
                    t0 = time.perf_counter()
                    step(tokens, keys - 1, uniform[:rows])
                    sync(dev)
                    capture_s = time.perf_counter() - t0
                    ms = per_call_ms(
                        lambda st=step, tk=tokens, k=keys, r=rows: st(tk, k - 1, uniform[:r]), dev, iters=10
                    )
                    report["step_ms"][f"{rows}x{cols} {glue}"] = {"ms": ms, "first_call_s": capture_s}
                    print(
                        f"step rows {rows} columns {cols} glue {glue}: {ms:.2f} ms (first call {capture_s:.3f} s)",
                        flush=True,
                    )
                t0 = time.perf_counter()
                step.engine.select_rows(torch.arange(rows // 2, device=dev))
                sync(dev)
                report.setdefault("select_rows_s", {})[rows] = time.perf_counter() - t0
                del step
                if dev == "cuda":
                    torch.cuda.empty_cache()

    inference.BUCKET_ROWS = 1  # the grid and the capture timings: fixed KEY_BUCKET-column buckets
    if not args.only_floor:
        attempt("grid", grid)

    def captures() -> None:
        rows, keys = min(256, b), min(576, max_len)
        with actor._ctx(), inference.sequence_parallel_off(actor.modules()), torch.no_grad():
            actor.eval()
            tokens = torch.randint(0, actor.vocab_size, (rows,), device=dev)
            res: list[float] = []
            for _ in range(3):  # one graph capture each (the first also compiles)
                step = static_step(rows)
                sync(dev)
                t0 = time.perf_counter()
                step(tokens, keys - 1, uniform[:rows])
                sync(dev)
                res.append(time.perf_counter() - t0)
                del step
            report["capture_s"] = res
            print("capture_s", res, flush=True)
            for glue in GLUE if dev == "cuda" else ():
                inference.KVCacheGenerator.fuse_step_glue = glue == "fused"
                step = static_step(rows, pool=False)
                cols = columns_read(rows, keys)
                kernels, table = step_kernels(step, cols, out_dir / f"profile_step_{glue}.txt", 45)
                report.setdefault("kernels_per_step", {})[glue] = kernels
                print("kernels per step", glue, kernels, flush=True)
                print(table[:6000], flush=True)
            inference.KVCacheGenerator.fuse_step_glue = True

    if args.captures and not args.only_floor:
        attempt("captures", captures)

    # ---- the realistic rollout, with compactions and captures counted and timed
    counts = {"compactions": 0, "compaction_s": 0.0, "captures": 0, "capture_s": 0.0}
    real_select, real_capture = inference.KVCacheGenerator.select_rows, devices.capture_graph

    def select_rows(self, rows):
        sync(dev)
        t0 = time.perf_counter()
        real_select(self, rows)
        sync(dev)
        counts["compactions"] += 1
        counts["compaction_s"] += time.perf_counter() - t0

    def capture_graph(device, fn, pool=None, warm_up=True):
        sync(dev)
        t0 = time.perf_counter()
        out = real_capture(device, fn, pool, warm_up)
        sync(dev)
        counts["captures"] += 1
        counts["capture_s"] += time.perf_counter() - t0
        return out

    inference.KVCacheGenerator.select_rows = select_rows  # type: ignore[method-assign]
    devices.capture_graph = capture_graph  # type: ignore[assignment]

    def logprob(batch: dict, share) -> None:
        """compute_log_prob of the rollout, packed (THD) and padded, side by side."""
        tokens = int(batch["attention_mask"].sum())
        from tests.megatron._common import actor_plan

        # The 1.5B preset's log-prob budget (use_dynamic_bsz, 16,384 tokens per micro-batch).
        actor.use_batch_settings(
            actor_plan(
                model_cfg,
                ActorConfig(megatron=MegatronConfig(), use_dynamic_bsz=True, ppo_max_token_len_per_gpu=16384),
                dev,
            )
        )
        for packed in (True, False, True, False):
            actor.spec = replace(actor.spec, settings=replace(actor.spec.settings, remove_padding=packed))
            actor.compute_log_prob(batch, with_entropy=False)
            sync(dev)
            t0 = time.perf_counter()
            actor.compute_log_prob(batch, with_entropy=False)
            sync(dev)
            sec = time.perf_counter() - t0
            key = "packed" if packed else "padded"
            report.setdefault("logprob", {}).setdefault(str(share), {}).setdefault(key, []).append(
                {"s": sec, "tokens_per_s": tokens / sec}
            )
            print(f"logprob share {share} {key}: {sec:.3f} s, {tokens / sec:.0f} tokens/s", flush=True)
        for packed in (True, False):
            if dev != "cuda" or share is not None:
                break
            from torch.profiler import ProfilerActivity, profile

            actor.spec = replace(actor.spec, settings=replace(actor.spec.settings, remove_padding=packed))
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                actor.compute_log_prob(batch, with_entropy=False)
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
            name = "packed" if packed else "padded"
            (out_dir / f"profile_logprob_{name}.txt").write_text(table)
            print(name, table[:5000], flush=True)

    gen = torch.Generator().manual_seed(2)
    prompts = torch.randint(1, actor.vocab_size, (args.groups, p), generator=gen)
    ids = prompts.repeat_interleave(b // args.groups, 0)
    report["generate"] = {}
    for share in (None, args.share):
        if share is None:
            os.environ.pop(inference.FORCE_EOS_ENV, None)
        else:
            os.environ[inference.FORCE_EOS_ENV] = str(share)
        eos = None if share is None else 1
        # The first call compiles; then the step's glue as megatron's modules one by one against fused
        # (inference.KVCacheGenerator.fuse_step_glue), side by side; key buckets widen as rows leave.
        inference.BUCKET_ROWS = 256
        # "fused again": the same rollout once more, its graphs' shapes seen before in this process (what
        # every rollout after a run's first one pays).
        glues = ("fused",) if args.only_floor else GLUE
        for label in ["warm-up", *glues] if share is None else [*glues, "fused again"]:
            inference.KVCacheGenerator.fuse_step_glue = label != "unfused"
            res = attempt(
                f"generate_{share}_{label}", lambda eos=eos: timed_generate(actor, ids, n_new, dev, eos)
            )
            if res is not None and label == "fused" and args.logprob:
                batch = res.pop("batch")
                attempt(f"logprob_{share}", lambda batch=batch, share=share: logprob(batch, share))
            elif res is not None:
                res.pop("batch", None)
            if res is not None:
                res.update(counts)
                report["generate"][f"{share} {label}"] = res
                print(f"generate share {share} {label}: {res}", flush=True)
            for key in counts:
                counts[key] = 0
    (out_dir / "decode_tail_gpu.json").write_text(json.dumps(report, indent=1, default=str))
    print("errors:", errors)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
