"""Decode attention kernels on one GPU: one query token per row against a KV cache (issue 36 item 2).

The Qwen2.5-1.5B layer shape (12 query heads, 2 KV heads, head dim 128, bf16). Per (rows, keys): the time of
one layer's attention and its effective bandwidth (bytes of keys and values read / time), for

  sdpa_bucket    what the decode step does today: SDPA (enable_gqa, cuDNN) over the sequence-first cache
                 [max_len, rows, kv, d] cut to a 256-column bucket, with a key-padding mask
  flash_seqused  torch's flash kernel (`aten._flash_attention_forward`, varlen form) over a batch-first
                 cache [rows, max_len, kv, d] with each row's own length (`seqused_k`): reads real columns
                 only, no bucket, no mask, grouped KV heads as they are

and whether the two agree. Writes decode_attention_gpu.json to --out.

    python3 bench/decode_attention_gpu.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.decode_gpu import per_call_ms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="512,256,64")
    parser.add_argument("--keys", default="320,576,1088")
    parser.add_argument("--max-len", type=int, default=1088)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    h, g, d, max_len = args.heads, args.kv_heads, args.head_dim, args.max_len
    dt = torch.bfloat16
    report: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "cases": {}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows in (int(x) for x in args.rows.split(",")):
        cache_sf = torch.randn(max_len, rows, g, d, 2, device="cuda", dtype=dt, generator=gen)
        k_sf, v_sf = cache_sf[..., 0], cache_sf[..., 1]
        # the same keys / values batch-first
        k_bf = k_sf.transpose(0, 1).contiguous()
        v_bf = v_sf.transpose(0, 1).contiguous()
        q = torch.randn(rows, h, d, device="cuda", dtype=dt, generator=gen)
        for keys in (int(x) for x in args.keys.split(",")):
            # each row's real length: up to `keys`, a spread like a rollout's (all rows at the same step
            # share it; the prompt pads are what differs, up to 64 columns)
            lengths = keys - torch.randint(0, 64, (rows,), device="cuda", generator=gen)
            bucket = min(-(-keys // 256) * 256, max_len)
            col = torch.arange(bucket, device="cuda")
            # sdpa: the row's real keys sit at the end of its prompt-padded span; hide the pads in front
            # and the unwritten columns after (True = attend)
            start = keys - lengths
            allowed = (col[None, :] >= start[:, None]) & (col[None, :] < keys)

            def sdpa_bucket(bucket=bucket, allowed=allowed, q=q, k_sf=k_sf, v_sf=v_sf):
                qq = q.unsqueeze(2)  # [rows, h, 1, d]
                kk = k_sf[:bucket].permute(1, 2, 0, 3)
                vv = v_sf[:bucket].permute(1, 2, 0, 3)
                return F.scaled_dot_product_attention(
                    qq, kk, vv, attn_mask=allowed[:, None, None, :], enable_gqa=True
                ).squeeze(2)

            # flash: the row's real keys left-aligned at column 0 of its batch-first row
            idx = (start[:, None] + torch.arange(max_len, device="cuda")[None, :]).clamp(max=max_len - 1)
            k_al = torch.gather(k_bf, 1, idx[:, :, None, None].expand(-1, -1, g, d))
            v_al = torch.gather(v_bf, 1, idx[:, :, None, None].expand(-1, -1, g, d))
            k_flat, v_flat = k_al.view(rows * max_len, g, d), v_al.view(rows * max_len, g, d)
            cu_q = torch.arange(rows + 1, device="cuda", dtype=torch.int32)
            cu_k = cu_q * max_len
            used = lengths.to(torch.int32)

            def flash_seqused(k_flat=k_flat, v_flat=v_flat, cu_k=cu_k, used=used, q=q, cu_q=cu_q):
                o = torch.ops.aten._flash_attention_forward(
                    q, k_flat, v_flat, cu_q, cu_k, 1, max_len, 0.0, False, False, seqused_k=used
                )[0]
                return o

            case: dict = {"bucket": bucket}
            ref = sdpa_bucket()
            for name, fn in (("sdpa_bucket", sdpa_bucket), ("flash_seqused", flash_seqused)):
                try:
                    got = fn()
                    ms = per_call_ms(fn, "cuda", iters=50)
                    real_bytes = int(lengths.sum()) * g * d * 2 * 2
                    case[name] = {
                        "ms": ms,
                        "real_GBps": real_bytes / ms / 1e6,
                        "max_diff": float((got.float() - ref.float()).abs().max()),
                    }
                except Exception as exc:
                    case[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            try:  # a graph replay of the flash call (the decode step is captured)
                graph = torch.cuda.CUDAGraph()
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    flash_seqused()
                torch.cuda.current_stream().wait_stream(s)
                with torch.cuda.graph(graph):
                    flash_seqused()
                case["flash_seqused_graph_ms"] = per_call_ms(graph.replay, "cuda", iters=50)
            except Exception as exc:
                case["flash_seqused_graph"] = f"{type(exc).__name__}: {exc}"[:300]
            report["cases"][f"{rows}x{keys}"] = case
            print(rows, keys, json.dumps(case), flush=True)
        del cache_sf, k_bf, v_bf
        torch.cuda.empty_cache()
    (out / "decode_attention_gpu.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
