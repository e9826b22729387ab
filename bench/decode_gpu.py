"""Where a GRPO rollout's decode time goes, and the log-prob pass's, on one GPU (issue 22).

One process, a random-init model of the chosen shape (default Qwen2.5-1.5B, bf16, SDPA core attention),
the preset's rollout shape (64 prompts x 8 samples, 1,024 new tokens, sampling at T = 1, EOS ignored so
every row decodes to the end). Every case runs side by side in the two kernel modes the plan can choose
(`model.fused_kernels`): "eager" (one torch op at a time) and "fused" (torch.compile'd SwiGLU, RoPE and
log-prob reductions), switched on the same engine. Reported:

  sample_ms                    `sample_tokens` alone on [rows, V] fp32 logits
  step_ms[bucket][mode]        one captured decode step (StaticDecodeStep replay: forward, logits, sampling)
                               with `bucket` cached key columns
  profile_<mode>.txt           torch.profiler's top kernels of one eager static step at the middle bucket
  generate[mode]               `MegatronActor.generate(cuda_graph=True)` of the whole rollout: s, tokens/s
  logprob[budget][mode]        `compute_log_prob` of the generated rows at each token budget: s, tokens/s
                               (prompt + response tokens / s), profile_logprob_<mode>.txt for the first

Run on the GPU machine (bench/device_setup.sh first):
    python3 bench/decode_gpu.py --out $OUT
CPU smoke: OMP_NUM_THREADS=1 .venv/bin/python bench/decode_gpu.py --arch tiny --device cpu --rows 8 \
               --groups 2 --prompt 8 --new-tokens 16 --buckets 8,16 --budgets 64 --out /tmp/decode_gpu
Writes decode_gpu.json to --out.
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
from bench.rollout_gpu import get_arch
from tests.megatron._common import actor_of, actor_plan, init_groups

MODES = ("eager", "fused")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def per_call_ms(fn, device: str, iters: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / iters * 1e3


def graph_us_per_call(fn, calls: int, iters: int = 20) -> float:
    """Microseconds per call of `fn` (CUDA) with `calls` calls captured in one CUDA graph, as a decode step
    repeats a layer's kernel: the launch gaps of a replayed graph, not of Python."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return per_call_ms(graph.replay, "cuda", iters=iters) * 1e3 / calls


def timed_generate(actor, ids: torch.Tensor, n_new: int, device: str, eos_id: int | None = None) -> dict:
    """One `generate(cuda_graph=True)` of `ids` (T = 1, seed 3), timed: s, tokens, tokens/s and the batch."""
    sync(device)
    t0 = time.perf_counter()
    out = actor.generate(ids, n_new, temperature=1.0, eos_id=eos_id, pad_id=0,
                         prompt_mask=torch.ones_like(ids), cuda_graph=True, seed=3)  # fmt: skip
    sync(device)
    s = time.perf_counter() - t0
    tokens = int(out["response_mask"].sum())
    return {"s": s, "tokens": tokens, "tokens_per_s": tokens / s, "batch": out}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen15b", choices=["qwen05b", "qwen15b", "tiny"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument(
        "--groups", type=int, default=64, help="distinct prompts (rows / groups samples each)"
    )
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--buckets", default="256,768,1024")
    parser.add_argument("--budgets", default="12288,32768")
    parser.add_argument("--skip-generate", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    dev = args.device
    dtype_name = "bfloat16" if dev == "cuda" else "float32"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    from rlconf.config import ActorConfig, MegatronConfig, ModelConfig
    from rltrain.megatron import inference
    from rltrain.megatron.model import use_compiled_rope
    from rltrain.megatron.parallel import free_port

    init_groups(MegatronConfig(), dev, rank=0, world_size=1, master_port=free_port())
    b, p, n_new = args.rows, args.prompt, args.new_tokens
    arch = get_arch(args.arch, p + n_new)
    model_cfg = ModelConfig(arch=arch, params_dtype=dtype_name, attention_backend="sdpa")  # type: ignore[arg-type]
    actor = actor_of(model_cfg, ActorConfig(megatron=MegatronConfig()), dev, trainable=False)
    report: dict = {
        "arch": args.arch,
        "rows": b,
        "prompt": p,
        "new_tokens": n_new,
        "torch": torch.__version__,
    }
    report["device"] = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    errors: dict[str, str] = {}
    report["errors"] = errors

    def attempt(name: str, fn):
        try:
            return fn()
        except Exception as exc:  # one failing case must not lose the others
            traceback.print_exc()
            errors[name] = f"{type(exc).__name__}: {exc}"
            return None

    buckets = [int(x) for x in args.buckets.split(",")]
    max_len = p + n_new

    def use(mode: str) -> None:
        """Switch the engine between the eager ops and model.fused_kernels (what the plan sets at build)."""
        fused = mode == "fused"
        actor.spec = replace(actor.spec, settings=replace(actor.spec.settings, fused_kernels=fused))
        if fused:
            use_compiled_rope()
        for chunk in actor.modules():
            chunk.config.bias_activation_fusion = fused  # megatron's compiled SwiGLU
            chunk.config.apply_rope_fusion = fused  # served by the compiled rope_bshd

    # ---- sampling alone
    logits = torch.randn(
        (b, actor.vocab_size), device=dev, generator=torch.Generator(device=dev).manual_seed(1)
    )
    uniform = torch.rand(b, device=dev)
    report["sample_ms"] = attempt(
        "sample",
        lambda lg=logits: per_call_ms(lambda: inference.sample_tokens(lg, 1.0, uniform=uniform), dev),
    )
    print(f"sample_ms {report['sample_ms']}", flush=True)
    del logits

    # ---- one captured decode step per bucket, and a profile of the eager step
    report["step_ms"] = {}
    positions = torch.arange(max_len, device=dev).expand(b, max_len).contiguous()

    def steps(mode: str) -> None:
        use(mode)
        with actor._ctx(), inference.sequence_parallel_off(actor.modules()), torch.no_grad():
            actor.eval()
            engine = inference.KVCacheGenerator(actor, positions, zero_cache=True)
            engine._allocate(b)
            key_masked = torch.zeros((b, max_len), dtype=torch.bool, device=dev)
            key_masked[:, p:] = True
            rows = torch.arange(b, device=dev)
            step = inference.StaticDecodeStep(
                engine, rows, key_masked, (1.0, 1.0, -1, 0.0), inference.devices.graph_pool(dev)
            )
            tokens = torch.randint(0, actor.vocab_size, (b,), device=dev)
            for bucket in buckets:
                ms = per_call_ms(lambda st=step, col=bucket - 1: st(tokens, col, uniform), dev)
                report["step_ms"].setdefault(bucket, {})[mode] = ms
                print(f"step bucket {bucket} {mode}: {ms:.2f} ms ({b / ms * 1e3:.0f} tokens/s)", flush=True)
            if dev == "cuda":
                from torch.profiler import ProfilerActivity, profile

                mid = buckets[len(buckets) // 2]
                step._body(mid)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        step._body(mid)
                    torch.cuda.synchronize()
                table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
                (out_dir / f"profile_{mode}.txt").write_text(table)
                print(table[:3500], flush=True)
            del step, engine

    for mode in MODES:
        attempt(f"steps_{mode}", lambda mode=mode: steps(mode))
        if dev == "cuda":
            torch.cuda.empty_cache()

    # ---- the whole rollout, and the log-prob pass over it
    gen = torch.Generator().manual_seed(2)
    prompts = torch.randint(1, actor.vocab_size, (args.groups, p), generator=gen)
    ids = prompts.repeat_interleave(b // args.groups, 0)
    report["generate"] = {}
    batch = None
    if not args.skip_generate:
        for mode in MODES:
            use(mode)

            res = attempt(f"generate_{mode}", lambda: timed_generate(actor, ids, n_new, dev))
            if res is not None:
                batch = res.pop("batch")
                report["generate"][mode] = res
                print(f"generate {mode}: {res}", flush=True)
            if dev == "cuda":
                torch.cuda.empty_cache()
    report["logprob"] = {}
    if batch is not None:
        budgets = [int(x) for x in args.budgets.split(",")]
        tokens = int(batch["attention_mask"].sum())
        for i, (budget, mode) in enumerate((b_, m) for b_ in budgets for m in MODES):

            def logprob(budget: int = budget, mode: str = mode, profile_it: bool = i < len(MODES)) -> dict:
                actor.use_batch_settings(
                    actor_plan(
                        model_cfg,
                        ActorConfig(
                            megatron=MegatronConfig(), use_dynamic_bsz=True, ppo_max_token_len_per_gpu=budget
                        ),
                        dev,
                    )
                )
                use(mode)
                actor.compute_log_prob(batch, with_entropy=False)  # warm-up
                sync(dev)
                t0 = time.perf_counter()
                actor.compute_log_prob(batch, with_entropy=False)
                sync(dev)
                s = time.perf_counter() - t0
                if profile_it and dev == "cuda":
                    from torch.profiler import ProfilerActivity, profile

                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        actor.compute_log_prob(batch, with_entropy=False)
                        torch.cuda.synchronize()
                    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
                    (out_dir / f"profile_logprob_{mode}.txt").write_text(table)
                    print(table[:3500], flush=True)
                return {"s": s, "tokens_per_s": tokens / s}

            res = attempt(f"logprob_{budget}_{mode}", logprob)
            if res is not None:
                report["logprob"].setdefault(budget, {})[mode] = res
                print(f"logprob budget {budget} {mode}: {res}", flush=True)
    (out_dir / "decode_gpu.json").write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps({k: v for k, v in report.items() if k != "errors"}, default=str))
    print("errors:", errors)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
