"""Launch parameters of the decode step's Triton kernels (rltrain/megatron/decode_kernels.py), swept on the
device: microseconds per call, each call repeated as a step repeats it (28 layers of the 1.5B for the
attention, 24 of qwen3-moe for the experts) inside one CUDA graph.

  attention  decode_attention at (rows, column written, KV groups, query heads per group) of the 1.5B's and
             qwen3-moe's layers (d 128) per (columns per iteration, warps, stages, splits), against SDPA
             over the engine's key bucket
  experts    expert_swiglu over qwen3-moe's layer (64 experts, hidden 1,024, FFN 512, top 8) at T tokens per
             fc1's and fc2's ExpertTiles and the row tile, against the dispatch's gather, two
             torch._grouped_mm and the SwiGLU
  swiglu     (--swiglu ROWS) megatron's compiled SwiGLU and its backward with the widths static and symbolic
             (dynamic=True), and as triton_swiglu's kernels (rlplan's on CUDA; parity against both)

    python3 bench/decode_kernels_tune.py --out $OUT     (decode_kernels_tune.json; needs a GPU with triton)
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.decode_gpu import graph_us_per_call


def attention(report: dict, shapes: list[tuple[int, ...]]) -> None:
    from rltrain.megatron import decode_kernels as dk
    from rltrain.megatron import inference

    dt, d, max_len = torch.bfloat16, 128, 1088
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = report.setdefault("attention_us", {})
    # (columns per iteration, warps, stages, splits)
    configs = list(itertools.product((32, 64, 128), (4, 8), (2, 3), (1, 2)))
    for rows, col, groups, per_group in shapes:
        q = torch.randn(rows, groups * per_group, d, device="cuda", generator=gen).to(dt)
        k, v = (torch.randn(max_len, rows, groups, d, device="cuda", generator=gen).to(dt) for _ in range(2))
        masked = torch.zeros(rows, max_len, dtype=torch.bool, device="cuda")
        masked[:, col + 1 :] = True
        first = torch.zeros(rows, dtype=torch.long, device="cuda")
        column = torch.tensor([col], device="cuda")
        width = inference.key_bucket(rows)
        keys = min(-(-(col + 1) // width) * width, max_len)
        additive = torch.zeros(masked.shape, dtype=dt, device="cuda").masked_fill_(masked, float("-inf"))
        sdpa = functools.partial(
            torch.nn.functional.scaled_dot_product_attention,
            q[:, :, None], k[:keys].permute(1, 2, 0, 3), v[:keys].permute(1, 2, 0, 3),
            attn_mask=additive[:, None, None, :keys], scale=0.1, enable_gqa=True,
        )  # fmt: skip
        row = res.setdefault(
            f"{rows}x{col} g{groups}x{per_group}", {"sdpa_bucket": graph_us_per_call(sdpa, 28)}
        )
        chosen = dk.attention_splits
        for block_n, warps, stages, splits in configs:
            dk.BLOCK_N, dk.ATTENTION_WARPS, dk.ATTENTION_STAGES = block_n, warps, stages
            dk.attention_splits = lambda r, g, sms, s=splits: s
            name = f"n{block_n} w{warps} s{stages} x{splits}"
            try:
                fn = functools.partial(dk.decode_attention, q, k, v, masked, first, column, 0.1)
                row[name] = graph_us_per_call(fn, 28)
            except Exception as exc:  # a config past the device's shared memory
                row[name] = f"{type(exc).__name__}"
            finally:
                dk.attention_splits = chosen
        best = sorted((v, k) for k, v in row.items() if isinstance(v, float))[:6]
        print(f"attention {rows}x{col} g{groups}x{per_group}: sdpa {row['sdpa_bucket']:.1f} us; "
              f"default {row.get('n64 w4 s2 x1')}; best {best}", flush=True)  # fmt: skip
    dk.BLOCK_N, dk.ATTENTION_WARPS, dk.ATTENTION_STAGES = 64, 4, 2


def experts(report: dict, token_counts: list[int], out: Path | None = None) -> None:
    """expert_swiglu at each token count: fc1's launch parameters (and the row tile: 1 or 2 x the mean rows
    per expert) swept with fc2's at their default, then fc2's with fc1's best; at the first token count all
    of them, at the others the default, the best of the first and the best five of each sweep again."""
    from rltrain.megatron import decode_kernels as dk
    from rltrain.megatron import moe_experts

    dt, e, h, f, k = torch.bfloat16, 64, 1024, 512, 8
    gen = torch.Generator(device="cuda").manual_seed(1)
    w1 = (torch.randn(e, 2 * f, h, device="cuda", generator=gen) * h**-0.5).to(dt)
    w2 = (torch.randn(e, h, f, device="cuda", generator=gen) * f**-0.5).to(dt)
    res = report.setdefault("experts_us", {})
    default = (dk.FC1_TILES, dk.FC2_TILES, dk.EXPERT_ROWS_OVER_MEAN)
    tiles = [dk.ExpertTiles(n, kk, w, st) for n, kk, w, st in itertools.product((32, 64, 128), (64, 128), (4, 8), (3, 4))]  # fmt: skip
    fc2_tiles = [dk.ExpertTiles(n, kk, w, 3) for n, kk, w in itertools.product((32, 64, 128, 256), (64, 128), (4, 8))]  # fmt: skip

    def name(fc1, fc2, scale):
        return f"fc1 n{fc1.block_n} k{fc1.block_k} w{fc1.warps} s{fc1.stages} | fc2 n{fc2.block_n} k{fc2.block_k} w{fc2.warps} s{fc2.stages} | rows x{scale}"  # fmt: skip

    def timed(row, args, fc1, fc2, scale):
        dk.FC1_TILES, dk.FC2_TILES, dk.EXPERT_ROWS_OVER_MEAN = fc1, fc2, scale
        key = name(fc1, fc2, scale)
        try:
            row[key] = graph_us_per_call(functools.partial(dk.expert_swiglu, *args), 24)
        except Exception as exc:  # a config past the device's shared memory
            row[key] = f"{type(exc).__name__}"
        finally:
            dk.FC1_TILES, dk.FC2_TILES, dk.EXPERT_ROWS_OVER_MEAN = default
        return row[key]

    first: list = []
    for tokens in token_counts:
        index = torch.randint(0, e, (tokens * k,), device="cuda", generator=gen).sort().values
        offsets = torch.bincount(index, minlength=e).cumsum(0).to(torch.int32)
        x = torch.randn(tokens, h, device="cuda", generator=gen).to(dt)
        token = torch.randint(0, tokens, (tokens * k,), device="cuda", generator=gen)
        p = torch.rand(tokens * k, device="cuda", generator=gen)

        def grouped(x=x, token=token, p=p, offsets=offsets):
            hid = moe_experts.grouped_mm(x.index_select(0, token), w1.transpose(1, 2), offsets)
            return moe_experts.grouped_mm(moe_experts.swiglu_probs(hid, p), w2.transpose(1, 2), offsets)

        args = (x, token, w1, w2, p, offsets)
        row = res.setdefault(str(tokens), {"grouped_mm": graph_us_per_call(grouped, 24)})
        timed(row, args, *default)
        if not first:
            fc1_runs = sorted(
                (t, fc1, scale)
                for fc1, scale in itertools.product(tiles, (1, 2))
                if isinstance(t := timed(row, args, fc1, default[1], scale), float)
            )
            _, best1, scale = fc1_runs[0]
            fc2_runs = sorted(
                (t, fc2) for fc2 in fc2_tiles if isinstance(t := timed(row, args, best1, fc2, scale), float)
            )
            first = [(best1, fc2_runs[0][1], scale)]
            first += [(c1, default[1], sc) for _, c1, sc in fc1_runs[1:6]]
            first += [(best1, c2, scale) for _, c2 in fc2_runs[1:6]]
        else:
            for fc1, fc2, scale in first:
                timed(row, args, fc1, fc2, scale)
        if out is not None:  # after each token count: a call cut short keeps what it measured
            (out / "decode_kernels_tune.json").write_text(json.dumps(report, indent=1))
        best = sorted((v, key) for key, v in row.items() if isinstance(v, float))[:6]
        print(f"experts {tokens} tokens: grouped_mm {row['grouped_mm']:.1f} us; default "
              f"{row[name(*default)]:.1f}; best {best}", flush=True)  # fmt: skip


def swiglu(report: dict, row_counts: list[int]) -> None:
    """megatron's SwiGLU and its backward (`fused_bias_swiglu.swiglu` / `swiglu_back`) compiled as rlplan
    serves them (`fused.use_unbacked_swiglu`: the row count unbacked, the widths static) against the widths
    symbolic too (dynamic=True, as before): microseconds per call at the 1.5B's width (2 x 8,960), at decode
    row counts (28 calls in a graph, as a step) and a training micro-batch's (4 calls)."""
    from megatron.core.fusions import fused_bias_swiglu as fbs

    from rltrain.megatron import fused, triton_swiglu

    def symbolic(fn):
        whole = torch.compile(fn, dynamic=True, fullgraph=True)

        def call(*tensors):
            rows = []
            for t in tensors:
                r = t.reshape(-1, t.shape[-1]).detach().contiguous()
                torch._dynamo.decorators.mark_unbacked(r, 0)
                rows.append(r)
            return whole(*rows)

        return call

    gen = torch.Generator(device="cuda").manual_seed(2)
    res = report.setdefault("swiglu_us", {})
    for name in ("swiglu", "swiglu_back"):
        fn = getattr(fbs, name)
        fn = getattr(fn, "_torchdynamo_orig_callable", fn)
        ways = {"static widths": fused._unbacked_rows(fn), "symbolic widths": symbolic(fn)}
        ways["triton kernel"] = getattr(triton_swiglu, name)
        for rows in row_counts:
            y = torch.randn(rows, 2 * 8960, device="cuda", generator=gen).mul(3).to(torch.bfloat16)
            args = (
                (y,)
                if name == "swiglu"
                else (torch.randn(rows, 8960, device="cuda", generator=gen).to(y.dtype), y)
            )
            calls = 28 if rows <= 4096 else 4
            # the kernel against the compiled function and an fp64 truth
            got, want = ways["triton kernel"](*args), ways["static widths"](*args)
            truth = fn(*(a.double() for a in args))
            res[f"{name} parity {rows} rows"] = {
                "equal_share": float((got == want).float().mean()),
                "max_abs_err_kernel": float((got.double() - truth).abs().max()),
                "max_abs_err_compiled": float((want.double() - truth).abs().max()),
            }
            print(name, "parity", rows, res[f"{name} parity {rows} rows"], flush=True)
            for way, f in ways.items():
                res[f"{name} {rows} rows, {way}"] = graph_us_per_call(functools.partial(f, *args), calls)
            print(
                name,
                rows,
                {k: round(v, 2) for k, v in res.items() if k.startswith(f"{name} {rows} ")},
                flush=True,
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attention", default="512x1000x2x6,256x700x2x6,64x300x2x6,256x250x4x4,256x1000x4x4",
                    help="rows x column written x KV groups x query heads per group")  # fmt: skip
    ap.add_argument("--experts", default="256,64,512,8")
    ap.add_argument("--swiglu", default="", help="row counts of the SwiGLU comparison, e.g. 8,256,512,16384")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    report: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.attention.split(",") if s]
    attention(report, shapes)  # type: ignore[arg-type]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    experts(report, [int(x) for x in a.experts.split(",") if x], out)
    if a.swiglu:
        swiglu(report, [int(x) for x in a.swiglu.split(",")])
    (out / "decode_kernels_tune.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
