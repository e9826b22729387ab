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

Run on the GPU machine:  python3 bench/decode_tail_gpu.py --out $OUT
CPU smoke:  OMP_NUM_THREADS=1 .venv/bin/python bench/decode_tail_gpu.py --arch tiny --device cpu --rows 8 \
                --groups 2 --prompt 8 --new-tokens 32 --grid-rows 8,4 --grid-keys 16,40 --out /tmp/tail
"""

from __future__ import annotations

import argparse
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
from bench.decode_gpu import per_call_ms, sync, timed_generate
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
                from torch.profiler import ProfilerActivity, profile

                inference.KVCacheGenerator.fuse_step_glue = glue == "fused"
                step = static_step(rows, pool=False)
                cols = columns_read(rows, keys)
                step._body(cols)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        step._body(cols)
                    torch.cuda.synchronize()
                events = prof.key_averages()
                kernels = sum(e.count for e in events if e.device_type.name == "CUDA") / 3
                report.setdefault("kernels_per_step", {})[glue] = kernels
                table = events.table(sort_by="cuda_time_total", row_limit=45)
                (out_dir / f"profile_step_{glue}.txt").write_text(table)
                print("kernels per step", glue, kernels, flush=True)
                print(table[:6000], flush=True)
            inference.KVCacheGenerator.fuse_step_glue = True

    if args.captures:
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

    def capture_graph(device, fn, pool=None):
        sync(dev)
        t0 = time.perf_counter()
        out = real_capture(device, fn, pool)
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
        for label in ["warm-up", *GLUE] if share is None else [*GLUE, "fused again"]:
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
