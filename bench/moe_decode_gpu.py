"""MoE generation on one GPU (issue 36 item 1): megatron's MoELayer on the dynamic decode path (before) vs the
engine's static-shape MoE layer (rltrain/megatron/moe_decode.py) on the dynamic path and in the captured
CUDA-graph decode step (after), side by side in one process, with the profile of each and their parity.

The model is qwen3-moe-grpo's (presets/gpu.py QWEN3_MOE_3B: 24 layers, 64 experts, top 8; random init,
bf16, SDPA, grouped-GEMM experts), the rollout shape its preset runs (32 prompts x 8 samples), EOS ignored
so every row decodes to the end. Reported (decode_moe.json in --out):

  generate[case]   MegatronActor.generate of --new-tokens (`before`, `dynamic` = static MoE layer without
                   graphs, `graph` = static MoE layer in the CUDA-graph step): s, tokens/s
  generate_full    `graph` over --full-tokens (the preset's 1,024) per variant: `glue_off`, `glue_on` (the MoE
                   decode glue, `KVCacheGenerator.fuse_moe_glue`: dispatch by rank, compiled
                   SwiGLU-times-probability and combine; megatron's router), `router_on` (the glue and the
                   static router, `KVCacheGenerator.fuse_moe_router`: gating GEMM, then the top-k routing as
                   one compiled function, no dense [T, E] probabilities), `triton_on` (and the Triton
                   experts and decode attention, `triton_moe_experts` / `triton_decode_attention`); s,
                   tokens/s, and each variant over the first
  step_ms[variant] one captured decode step (replay) at each --buckets count of cached columns, per variant
  step_kernels     per static decode step and variant, from torch.profiler over 3 eager steps (the
                   step the graph captures, run without capture): device kernels and launches on CUDA,
                   aten ops on the CPU; profile_step_{variant}.txt the tables
  parity           greedy tokens of `before` vs `graph` over --new-tokens: the first column where any row
                   differs, the share of equal tokens, the largest log-prob gap before the first difference
  parity_<v>_vs_<first>  the same, `graph` with variant v against the first variant
  experts_parity   (--only-triton) decode_kernels.expert_swiglu against two torch._grouped_mm and the SwiGLU
                   between them on random bf16 rows of one layer, each against fp64; experts_us_per_layer
                   both timed in a graph at decode row counts
  profile_*.txt    torch.profiler of 3 eager decode steps (host and device time; syncs show as
                   cudaStreamSynchronize / aten::item / aten::_local_scalar_dense)

    python3 bench/moe_decode_gpu.py --out $OUT
    python3 bench/moe_decode_gpu.py --only-glue --out $OUT    (only the glue off / on comparison)
    python3 bench/moe_decode_gpu.py --only-router --out $OUT  (only the router off / on comparison, glue on:
                                                               variants `router_off`, `router_on`)
    python3 bench/moe_decode_gpu.py --only-triton --out $OUT  (the Triton experts and decode attention, glue
                                                               and router on: `triton_off`, `experts_on`,
                                                               `attention_on`, `triton_on`)
CPU smoke: OMP_NUM_THREADS=1 .venv/bin/python bench/moe_decode_gpu.py --device cpu --tiny --groups 2 --samples 2 \
               --prompt 8 --new-tokens 8 --full-tokens 16 --buckets 16 --out /tmp/moe_decode
           (add --fused-kernels compiled to run the compiled glue on the CPU too)
"""

from __future__ import annotations

import argparse
import contextlib
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
from bench.decode_gpu import graph_us_per_call
from tests.megatron._common import actor_of, init_groups


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def experts_parity(report: dict) -> None:
    """`decode_kernels.expert_swiglu` against the path it replaces (two torch._grouped_mm and
    `moe_experts.swiglu_probs`) on random bf16 rows of qwen3-moe's layer (64 experts, hidden 1,024, expert
    FFN 512), routed at random (an expert with no row, one with 3x its share): each one's error against an
    fp64 truth, which must be the same order (the kernel's bound: 2^-6 of the largest |output|, a few bf16
    roundings of the intermediates); then microseconds per layer (24 calls captured in one graph) at the
    row counts of a decode step (T tokens x top 8)."""
    from rltrain.megatron import decode_kernels, moe_experts

    gen = torch.Generator(device="cuda").manual_seed(4)
    dt, experts, hidden, ffn, k = torch.bfloat16, 64, 1024, 512, 8
    w1 = (torch.randn(experts, 2 * ffn, hidden, device="cuda", generator=gen) * hidden**-0.5).to(dt)
    w2 = (torch.randn(experts, hidden, ffn, device="cuda", generator=gen) * ffn**-0.5).to(dt)

    def routed(tokens: int):
        index = torch.randint(0, experts, (tokens * k,), device="cuda", generator=gen)
        index[index == 5] = 6
        index[: tokens * k // 20] = 9
        counts = torch.bincount(index, minlength=experts)
        x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(dt)
        token = torch.randint(0, tokens, (tokens * k,), device="cuda", generator=gen)  # each row's token
        p = torch.rand(tokens * k, device="cuda", generator=gen)
        return x, token, p, counts.cumsum(0).to(torch.int32), counts

    def reference(x, token, p, offsets):  # the dispatch's gather, then the grouped products
        rows = x.index_select(0, token)
        h = moe_experts.grouped_mm(rows, w1.transpose(1, 2), offsets)
        return moe_experts.grouped_mm(moe_experts.swiglu_probs(h, p), w2.transpose(1, 2), offsets)

    res = report.setdefault("experts_parity", {})
    for tokens in (256, 32, 4):
        x, token, p, offsets, counts = routed(tokens)
        out = decode_kernels.expert_swiglu(x, token, w1, w2, p, offsets)
        ref = reference(x, token, p, offsets)
        rows = x.index_select(0, token)
        truth = torch.empty(rows.shape, dtype=torch.float64, device="cuda")
        start = 0
        for e, c in enumerate(counts.tolist()):
            gate, up = (rows[start : start + c].double() @ w1[e].double().T).chunk(2, -1)
            act = torch.nn.functional.silu(gate) * up * p[start : start + c, None].double()
            truth[start : start + c] = act @ w2[e].double().T
            start += c
        err, ref_err = (float((t.double() - truth).abs().max()) for t in (out, ref))
        res[f"{tokens}x{k}"] = {"max_abs_err_kernel": err, "max_abs_err_grouped_mm": ref_err,
                               "max_abs_diff": float((out.float() - ref.float()).abs().max()),
                               "truth_max": float(truth.abs().max())}  # fmt: skip
        print("experts parity", tokens, res[f"{tokens}x{k}"], flush=True)
        assert err <= 2**-6 * float(truth.abs().max()), res[f"{tokens}x{k}"]

    calls: dict = {}
    for tokens in (512, 256, 64, 8):
        x, token, p, offsets, _ = routed(tokens)
        calls[f"{tokens} tokens grouped_mm"] = graph_us_per_call(
            functools.partial(reference, x, token, p, offsets), 24
        )
        kernel = functools.partial(decode_kernels.expert_swiglu, x, token, w1, w2, p, offsets)
        calls[f"{tokens} tokens triton"] = graph_us_per_call(kernel, 24)
    report["experts_us_per_layer"] = calls
    print("MoE experts, us per layer:", json.dumps(calls, indent=1), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer, 8-expert model of the same family")
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--full-tokens", type=int, default=1024)
    ap.add_argument("--buckets", default="256,1024")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--fused-kernels", default="auto", choices=["auto", "compiled", "eager"],
                    help="model.fused_kernels (auto: compiled on cuda); the CPU smoke can compile the glue too")  # fmt: skip
    ap.add_argument("--only-glue", action="store_true",
                    help="skip megatron's MoELayer (`before`), the dynamic case, parity and their profiles")  # fmt: skip
    ap.add_argument("--only-router", action="store_true",
                    help="as --only-glue, the static router off / on (the glue on in both)")  # fmt: skip
    ap.add_argument("--only-triton", action="store_true",
                    help="as --only-glue, the Triton experts and decode attention off / on (glue and router on)")  # fmt: skip
    a = ap.parse_args()
    only = a.only_glue or a.only_router or a.only_triton
    # Variants of the static MoE step: the KVCacheGenerator class switches each turns off (the rest on).
    triton_off = {"triton_moe_experts": False, "triton_decode_attention": False}
    if a.only_triton:
        variants = {
            "triton_off": triton_off,
            "experts_on": {"triton_decode_attention": False},
            "attention_on": {"triton_moe_experts": False},
            "triton_on": {},
        }
    elif a.only_router:
        variants = {"router_off": {**triton_off, "fuse_moe_router": False}, "router_on": triton_off}
    elif a.only_glue:
        no_glue = {**triton_off, "fuse_moe_router": False}
        variants = {"glue_off": {**no_glue, "fuse_moe_glue": False}, "glue_on": no_glue}
    else:
        variants = {
            "glue_off": {**triton_off, "fuse_moe_router": False, "fuse_moe_glue": False},
            "glue_on": {**triton_off, "fuse_moe_router": False},
            "router_on": triton_off,
            "triton_on": {},
        }
    warnings.filterwarnings("ignore")
    dev = a.device
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    from presets.gpu import QWEN3_MOE_3B
    from rlconf.config import ActorConfig, MegatronConfig, ModelConfig
    from rltrain.megatron import inference
    from rltrain.megatron.moe_decode import GroupedMoELayer
    from rltrain.megatron.parallel import free_port

    init_groups(MegatronConfig(), dev, rank=0, world_size=1, master_port=free_port())
    b, p = a.groups * a.samples, a.prompt
    arch = QWEN3_MOE_3B
    if a.tiny:
        arch = replace(arch, num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                       num_query_groups=2, kv_channels=16, vocab_size=128, num_moe_experts=8,
                       moe_router_topk=2, moe_ffn_hidden_size=32)  # fmt: skip
    arch = replace(arch, max_position_embeddings=max(arch.max_position_embeddings, p + a.full_tokens))
    model_cfg = ModelConfig(arch=arch, params_dtype="bfloat16" if dev == "cuda" else "float32",
                            attention_backend="sdpa", moe_grouped_gemm=True,
                            fused_kernels=a.fused_kernels)  # type: ignore[arg-type]  # fmt: skip
    actor = actor_of(model_cfg, ActorConfig(megatron=MegatronConfig()), dev, trainable=False)
    report: dict = {"rows": b, "prompt": p, "new_tokens": a.new_tokens, "torch": torch.__version__,
                    "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                    "fused_kernels": actor.fused_kernels, "errors": {}}  # fmt: skip

    def attempt(name, fn):
        try:
            return fn()
        except Exception as exc:  # one failing case must not lose the others
            traceback.print_exc()
            report["errors"][name] = f"{type(exc).__name__}: {exc}"
            return None

    if a.only_triton and dev == "cuda":
        attempt("experts_parity", lambda: experts_parity(report))

    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(1, actor.vocab_size, (a.groups, p), generator=gen).repeat_interleave(a.samples, 0)
    cases = {"before": (False, False), "dynamic": (True, False), "graph": (True, True)}

    @contextlib.contextmanager
    def switched(off: dict):
        """The KVCacheGenerator class switches of `off` set (each read when an engine is built), all on after."""
        for name, value in off.items():
            setattr(inference.KVCacheGenerator, name, value)
        try:
            yield
        finally:
            for name in off:
                setattr(inference.KVCacheGenerator, name, True)

    def generate(case: str, n: int, temperature: float = 1.0, off: dict | None = None) -> tuple[dict, dict]:
        static_moe, graph = cases[case]
        GroupedMoELayer.static = static_moe  # before: megatron's MoELayer.forward (its token dispatcher)
        try:
            with switched({"static_moe": static_moe, **(off or {})}):
                sync(dev)
                t0 = time.perf_counter()
                out = actor.generate(ids, n, temperature=temperature, eos_id=None, pad_id=0,
                                     prompt_mask=torch.ones_like(ids), cuda_graph=graph, seed=3)  # fmt: skip
                sync(dev)
                s = time.perf_counter() - t0
        finally:
            GroupedMoELayer.static = True
        return {"s": s, "tokens_per_s": int(out["response_mask"].sum()) / s}, out

    report["generate"] = {}
    for case in [] if only else cases:
        attempt(f"warm_{case}", lambda case=case: generate(case, 4))  # compile, allocator, cuBLAS handles
        res = attempt(case, lambda case=case: generate(case, a.new_tokens)[0])
        report["generate"][case] = res
        print(f"generate {case} ({a.new_tokens} new): {res}", flush=True)
    g, before = report["generate"].get("graph"), report["generate"].get("before")
    if g and before:
        report["graph_over_before"] = g["tokens_per_s"] / before["tokens_per_s"]
        print(f"graph / before: {report['graph_over_before']:.2f}x", flush=True)

    def parity(want_case: str = "before", want_off: dict | None = None, got_off: dict | None = None) -> dict:
        """Greedy `want_case` with the switches `want_off` off against `graph` with `got_off` off."""
        _, want = generate(want_case, a.new_tokens, 0.0, want_off)
        _, got = generate("graph", a.new_tokens, 0.0, got_off)
        same = got["responses"] == want["responses"]
        cols = (~same).any(0).nonzero()
        first = int(cols[0]) if cols.numel() else a.new_tokens
        gap = (got["rollout_log_probs"][:, :first] - want["rollout_log_probs"][:, :first]).abs()
        return {"first_differing_column": first, "equal_token_share": float(same.float().mean()),
                "max_logprob_gap_before_first": float(gap.max()) if first else None}  # fmt: skip

    if not only:
        report["parity"] = attempt("parity", parity)
        print(f"parity: {report['parity']}", flush=True)
    # The glue against the argsort path, both in the graph step (compiled glue: bf16 roundings differ).
    # Each variant against the first, both in the graph step.
    first, *rest = variants
    for name in rest if not only or a.only_glue or a.only_router else rest[-1:]:
        key = f"parity_{name}_vs_{first}"
        report[key] = attempt(key, lambda name=name: parity("graph", variants[first], variants[name]))
        print(f"{key}: {report[key]}", flush=True)

    # One captured step per bucket for each variant (MoE decode glue, static router), the kernels of each
    # step, and the profiles of eager dynamic decode steps (before / after).
    def steps() -> None:
        from torch.profiler import ProfilerActivity, profile

        max_len = p + a.full_tokens
        positions = torch.arange(max_len, device=dev).expand(b, max_len).contiguous()
        report["step_ms"], report["step_kernels"] = {}, {}
        rows = torch.arange(b, device=dev)
        tokens = torch.randint(0, actor.vocab_size, (b,), device=dev)
        uniform = torch.rand(b, device=dev)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
        with actor._ctx(), inference.sequence_parallel_off(actor.modules()), torch.no_grad():
            actor.eval()
            for name, off in variants.items():
                with switched(off):  # read when the engine is built
                    engine = inference.KVCacheGenerator(actor, positions, zero_cache=True)
                assert (engine.moe_glue is not None) is off.get("fuse_moe_glue", True)
                assert (engine.moe_route is not None) is off.get("fuse_moe_router", True)
                print(f"{name}: experts {engine.triton_experts_unsupported or 'triton'}, attention "
                      f"{engine.triton_attention_unsupported or 'triton'}", flush=True)  # fmt: skip
                engine.forward(ids.to(dev), 0, rows, None)  # prefill: cache, stacked experts
                key_masked = torch.zeros((b, max_len), dtype=torch.bool, device=dev)
                key_masked[:, p:] = True
                step = inference.StaticDecodeStep(engine, rows, key_masked, (1.0, 1.0, -1, 0.0),
                                                  inference.devices.graph_pool(dev))  # fmt: skip
                report["step_ms"][name] = {}
                for bucket in [int(x) for x in a.buckets.split(",")]:
                    col = min(bucket, max_len) - 1
                    fn = lambda col=col, step=step: step(tokens, col, uniform)  # noqa: E731
                    for _ in range(3):
                        fn()
                    sync(dev)
                    t0 = time.perf_counter()
                    for _ in range(20):
                        fn()
                    sync(dev)
                    ms = (time.perf_counter() - t0) / 20 * 1e3
                    report["step_ms"][name][bucket] = ms
                    print(f"graph step, {name}, at {bucket} columns: {ms:.2f} ms ({b / ms * 1e3:.0f} tokens/s)",
                          flush=True)  # fmt: skip
                # The step the graph captures, run eagerly (no capture) at the first bucket: what it launches.
                keys = min(int(a.buckets.split(",")[0]), max_len)
                step.pos.copy_(engine.positions[rows, keys - 1 : keys])
                step.col.fill_(keys - 1)
                step._body(keys)
                sync(dev)
                with profile(activities=activities) as prof:
                    for _ in range(3):
                        step._body(keys)
                    sync(dev)
                avg = prof.key_averages()
                sort = "self_cuda_time_total" if dev == "cuda" else "self_cpu_time_total"
                (out_dir / f"profile_step_{name}.txt").write_text(avg.table(sort_by=sort, row_limit=40))
                device_kernels = sum(e.count for e in avg if e.device_type == torch.autograd.DeviceType.CUDA)
                launches = sum(e.count for e in avg if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                 "cudaLaunchKernelExC"))  # fmt: skip
                aten = sum(e.count for e in avg if e.key.startswith("aten::"))
                report["step_kernels"][name] = {"device_kernels": device_kernels / 3, "launches": launches / 3,
                                                "aten_ops": aten / 3}  # fmt: skip
                print(f"static step, {name}, per step: {report['step_kernels'][name]}", flush=True)
                del step, engine
                if dev == "cuda":
                    torch.cuda.empty_cache()
            if dev != "cuda" or only:
                return
            engine = inference.KVCacheGenerator(actor, positions, zero_cache=True)
            engine.forward(ids.to(dev), 0, rows, None)
            static_layers = set(engine.moe_static)
            for name, static_moe in (("before", False), ("after", True)):
                GroupedMoELayer.static = static_moe
                # Eager dynamic decode steps of 1 token over the prefilled rows (what `before` runs per token).
                engine.moe_static = static_layers if static_moe else set()
                run = lambda: engine.forward(tokens[:, None], p, rows, None)  # noqa: E731
                run()
                sync(dev)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        run()
                    sync(dev)
                avg = prof.key_averages()
                table = avg.table(sort_by="self_cpu_time_total", row_limit=25)
                table += "\n" + avg.table(sort_by="self_cuda_time_total", row_limit=25)
                (out_dir / f"profile_{name}.txt").write_text(table)
                syncs = {e.key: e.count for e in avg if e.key in ("cudaStreamSynchronize", "aten::item",
                         "aten::_local_scalar_dense", "cudaMemcpyAsync", "aten::nonzero")}  # fmt: skip
                launches = sum(e.count for e in avg if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                 "cudaLaunchKernelExC"))  # fmt: skip
                t0 = time.perf_counter()
                for _ in range(5):
                    run()
                sync(dev)
                eager_ms = (time.perf_counter() - t0) / 5 * 1e3
                report[f"eager_step_{name}"] = {
                    "ms": eager_ms,
                    "per_3_steps": syncs,
                    "launches_per_3": launches,
                }
                print(f"eager dynamic step {name}: {eager_ms:.1f} ms; per 3 steps {syncs}, {launches} launches",
                      flush=True)  # fmt: skip
                print(avg.table(sort_by="self_cpu_time_total", row_limit=12), flush=True)
            GroupedMoELayer.static = True

    attempt("steps", steps)
    if dev == "cuda":
        torch.cuda.empty_cache()

    report["generate_full"] = full_runs = {}
    for name, off in variants.items():
        full_runs[name] = res = attempt(
            f"full_{name}", lambda off=off: generate("graph", a.full_tokens, off=off)[0]
        )
        print(f"generate graph, {name} ({a.full_tokens} new): {res}", flush=True)
    # Each variant over the first (everything it turns on against none of it).
    first, *rest = variants
    for name in rest:
        if full_runs.get(first) and full_runs.get(name):
            ratio = full_runs[name]["tokens_per_s"] / full_runs[first]["tokens_per_s"]
            report[f"full_{name}_over_{first}"] = ratio
            print(f"{name} / {first} ({a.full_tokens} new): {ratio:.3f}x", flush=True)
    (out_dir / "decode_moe.json").write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
