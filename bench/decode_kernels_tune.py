"""Launch parameters of the decode step's Triton kernels (rltrain/megatron/decode_kernels.py), swept on the
device: microseconds per call, each call repeated as a step repeats it (28 layers of the 1.5B for the
attention, 24 of qwen3-moe for the experts) inside one CUDA graph.

  attention  decode_attention at (rows, column written, KV groups, query heads per group) of the 1.5B's and
             qwen3-moe's layers (d 128) per (columns per iteration, warps, stages, splits), against SDPA
             over the engine's key bucket
  experts    expert_swiglu over qwen3-moe's layer (64 experts, hidden 1,024, FFN 512, top 8) at T tokens per
             (EXPERT_BLOCK_N, EXPERT_BLOCK_K, warps, stages), against two torch._grouped_mm and the SwiGLU

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


def experts(report: dict, token_counts: list[int]) -> None:
    from rltrain.megatron import decode_kernels as dk
    from rltrain.megatron import moe_experts

    dt, e, h, f, k = torch.bfloat16, 64, 1024, 512, 8
    gen = torch.Generator(device="cuda").manual_seed(1)
    w1 = (torch.randn(e, 2 * f, h, device="cuda", generator=gen) * h**-0.5).to(dt)
    w2 = (torch.randn(e, h, f, device="cuda", generator=gen) * f**-0.5).to(dt)
    res = report.setdefault("experts_us", {})
    for tokens in token_counts:
        index = torch.randint(0, e, (tokens * k,), device="cuda", generator=gen).sort().values
        offsets = torch.bincount(index, minlength=e).cumsum(0).to(torch.int32)
        rows = torch.randn(tokens * k, h, device="cuda", generator=gen).to(dt)
        p = torch.rand(tokens * k, device="cuda", generator=gen)

        def grouped(rows=rows, p=p, offsets=offsets):
            hid = moe_experts.grouped_mm(rows, w1.transpose(1, 2), offsets)
            return moe_experts.grouped_mm(moe_experts.swiglu_probs(hid, p), w2.transpose(1, 2), offsets)

        row = res.setdefault(str(tokens), {"grouped_mm": graph_us_per_call(grouped, 24)})
        for block_n, block_k, warps, stages in itertools.product((32, 64, 128), (64, 128), (4,), (3, 4)):
            dk.EXPERT_BLOCK_N, dk.EXPERT_BLOCK_K, dk.EXPERT_WARPS, dk.EXPERT_STAGES = (
                block_n,
                block_k,
                warps,
                stages,
            )
            try:
                fn = functools.partial(dk.expert_swiglu, rows, w1, w2, p, offsets)
                row[f"n{block_n} k{block_k} w{warps} s{stages}"] = graph_us_per_call(fn, 24)
            except Exception as exc:
                row[f"n{block_n} k{block_k} w{warps} s{stages}"] = f"{type(exc).__name__}"
        best = sorted((v, k) for k, v in row.items() if isinstance(v, float))[:6]
        print(f"experts {tokens} tokens: grouped_mm {row['grouped_mm']:.1f} us; best {best}", flush=True)
    dk.EXPERT_BLOCK_N, dk.EXPERT_BLOCK_K, dk.EXPERT_WARPS, dk.EXPERT_STAGES = 64, 128, 4, 3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attention", default="512x1000x2x6,256x700x2x6,64x300x2x6,256x250x4x4,256x1000x4x4",
                    help="rows x column written x KV groups x query heads per group")  # fmt: skip
    ap.add_argument("--experts", default="512,256,64")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    report: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.attention.split(",") if s]
    attention(report, shapes)  # type: ignore[arg-type]
    experts(report, [int(x) for x in a.experts.split(",") if x])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_kernels_tune.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
