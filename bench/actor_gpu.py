"""Megatron actor update vs raw Hugging Face and raw megatron-core, side by side on one GPU (issue 10).

One process, one run, for each shape in `--shapes` (Qwen2.5-0.5B and -1.5B, random init, bf16):

  dense batch  B x S tokens (default 4 x 2048, the DESIGN.md anchor), every token trained:
    hf_dense        transformers AutoModelForCausalLM (sdpa) forward + backward of the token loss
    mcore_dense     raw megatron-core: the same GPTModel our actor builds (SDPA core attention), forward
                    with labels (megatron's vocab-parallel cross entropy) + backward, no optimizer
    ours_dense      rlplan `MegatronActor.update_policy`: PPO loss on the second half, one optimizer step
  GRPO-shaped batch  `--rows` rows of a 256-token prompt + a response drawn from a clipped log-normal
                     (median ~500, up to 2048 tokens), seeded:
    hf_grpo         transformers fwd+bwd over the rows in micro-batches of `--hf-micro`, each padded to its
                    longest row (what a padded trainer does)
    ours_grpo       `update_policy` with dynamic batching by a `--budget`-token budget (rows regrouped by
                    length, no padding computed) and one optimizer step
    ours_logprob    `compute_log_prob` (log-prob + entropy from vocab-parallel logits, chunked)
    opt_step        the megatron optimizer step alone (fp32 master weights, fused AdamW, grad clip)
    opt_step_foreach  the same with torch's multi-tensor (foreach) AdamW, megatron's own fallback

Tokens/s count real tokens (padding HF computes shows as lost throughput). MFU = (6N + 6·L·h·s̄) flops
per trained token (2N + 2·L·h·s̄ forward only) over the H200's 989 TFLOP/s dense bf16 spec and the
~760 TFLOP/s measured matmul peak. Peak memory per case. A case that fails is recorded and the rest run.

Run on the GPU machine (bench/device_setup.sh first):
    python3 bench/actor_gpu.py --shapes 0.5b,1.5b --out $OUT
Prints a table per shape and writes actor_gpu.json to --out. `--profile` adds a torch.profiler table of
`ours_dense` (top kernels and ops by device time) as profile_<shape>.txt.

Several GPUs (`--layouts tp2,dp2` on a 2-GPU machine): one spawn per layout runs `update_policy` on the
same dense and GRPO rows at that layout (DP ranks each take their share of the rows) and reports tokens/s
of the whole layout and its scaling efficiency against the 1-GPU `ours_*` figure of the same run
(tokens/s / (GPUs x 1-GPU tokens/s)). Written to actor_gpu_layouts.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.megatron._common import actor_of, actor_plan, init_groups

SPEC_PEAK, MATMUL_PEAK = 989e12, 760e12


def timed(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Seconds per call after `warmup` calls, synchronised around the timed loop."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def grpo_rows(
    rows: int, prompt: int, max_response: int, vocab: int, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Right-padded rows of prompt + response with a realistic spread of response lengths."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(rows, generator=gen) * 0.8 + 6.2).round().long().clamp(16, max_response)
    s = prompt + max_response
    ids = torch.randint(0, vocab, (rows, s), generator=gen)
    attn = torch.zeros(rows, s, dtype=torch.long)
    resp_mask = torch.zeros(rows, max_response, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        attn[i, : prompt + n] = 1
        resp_mask[i, :n] = 1
    ids = ids * attn
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
        "responses": ids[:, prompt:],
        "response_mask": resp_mask,
    }


def dense_rows(b: int, s: int, vocab: int) -> dict[str, torch.Tensor]:
    """B full rows of S tokens; the response is the second half."""
    ids = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(1))
    r = s // 2
    return {
        "input_ids": ids,
        "attention_mask": torch.ones(b, s, dtype=torch.long),
        "position_ids": torch.arange(s).expand(b, s).clone(),
        "responses": ids[:, s - r :],
        "response_mask": torch.ones(b, r, dtype=torch.long),
    }


class Cases:
    """Runs named cases, records seconds per iteration and peak memory, keeps going after a failure."""

    def __init__(self) -> None:
        self.results: dict[str, dict[str, float]] = {}
        self.errors: dict[str, str] = {}

    def run(self, name: str, fn: Callable[[], object], warmup: int, iters: int, tokens: int) -> None:
        torch.cuda.reset_peak_memory_stats()
        try:
            secs = timed(fn, warmup, iters)
        except Exception as exc:  # one failure must not lose the other cases
            traceback.print_exc()
            self.errors[name] = f"{type(exc).__name__}: {exc}"
            return
        self.results[name] = {
            "s_per_iter": secs,
            "tokens": tokens,
            "tokens_per_s": tokens / secs,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        }


def hf_cases(cases: Cases, arch, dense: dict, grpo: dict, args) -> int:
    """Raw transformers fwd+bwd on the dense rows and on padded micro-batches of the GRPO rows."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rltrain.megatron.hf_weights import hf_config_from_arch

    hf_cfg = Qwen2Config(**hf_config_from_arch(arch, torch.bfloat16))
    hf_cfg._attn_implementation = "sdpa"
    hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16).cuda()
    n_params = sum(p.numel() for p in hf.parameters())
    ids = dense["input_ids"].cuda()

    def dense_step() -> None:
        hf(input_ids=ids, labels=ids).loss.backward()
        hf.zero_grad(set_to_none=True)

    cases.run("hf_dense", dense_step, 2, args.iters, ids.numel())
    micro = []
    rows = grpo["input_ids"].shape[0]
    for i in range(0, rows, args.hf_micro):
        attn = grpo["attention_mask"][i : i + args.hf_micro]
        width = int(attn.sum(-1).max())
        m_ids = grpo["input_ids"][i : i + args.hf_micro, :width].cuda()
        m_attn = attn[:, :width].cuda()
        micro.append((m_ids, m_attn, m_ids.masked_fill(m_attn == 0, -100)))

    def grpo_step() -> None:
        for m_ids, m_attn, labels in micro:
            hf(input_ids=m_ids, attention_mask=m_attn, labels=labels).loss.backward()
        hf.zero_grad(set_to_none=True)

    cases.run("hf_grpo", grpo_step, 1, args.grpo_iters, int(grpo["attention_mask"].sum()))
    cases.results.get("hf_grpo", {})["computed_tokens"] = sum(m[0].numel() for m in micro)
    return n_params


def our_cases(cases: Cases, arch, dense: dict, grpo: dict, args) -> None:
    from megatron.core import parallel_state

    from rlconf.config import ActorConfig, MegatronConfig, ModelConfig, Optim

    b = dense["input_ids"].shape[0]
    rows = grpo["input_ids"].shape[0]
    model_cfg = ModelConfig(arch=arch, params_dtype="bfloat16", attention_backend="sdpa")
    cfg = ActorConfig(
        megatron=MegatronConfig(),
        optim=Optim(lr=1e-6),
        ppo_mini_batch_size=b,
        ppo_micro_batch_size_per_gpu=b,
        log_prob_micro_batch_size_per_gpu=b,
        shuffle=False,
    )
    actor = actor_of(model_cfg, cfg, "cuda", total_steps=100, rollout_n=1)
    assert parallel_state.get_data_parallel_world_size() == 1

    # raw megatron-core: the model's own forward with labels (vocab-parallel CE) and backward
    chunk = actor.chunks[0]
    ids = dense["input_ids"].cuda()
    pos = dense["position_ids"].cuda()

    def mcore_step() -> None:
        loss = chunk(ids, pos, None, labels=ids)
        loss.float().mean().backward()
        chunk.zero_grad_buffer()

    actor.train()
    cases.run("mcore_dense", mcore_step, 2, args.iters, ids.numel())

    def rl_batch(batch: dict) -> dict:
        old = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
        adv = torch.randn(old.shape[0], 1).expand_as(old).contiguous() * batch["response_mask"]
        return {**batch, "old_log_probs": old, "advantages": adv}

    rl = rl_batch(dense)
    cases.run("ours_dense", lambda: actor.update_policy(rl), 2, args.iters, ids.numel())
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                actor.update_policy(rl)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
        Path(args.out, f"profile_{args.shape_name}.txt").write_text(table)
        print(table[:6000])
    cases.run("opt_step", lambda: actor.optimizer.step(), 1, args.iters, ids.numel())
    # The same step on torch's foreach AdamW (megatron's fallback before model.use_fused_torch_adam).
    groups = [g for sub in actor._sub_optimizers() for g in sub.optimizer.param_groups]
    for g in groups:
        g["fused"], g["foreach"] = False, True
    cases.run("opt_step_foreach", lambda: actor.optimizer.step(), 1, args.iters, ids.numel())
    for g in groups:
        g["fused"], g["foreach"] = True, False

    # GRPO-shaped: dynamic batching by token budget, one optimizer step per update
    actor.use_batch_settings(
        actor_plan(
            model_cfg,
            ActorConfig(
                megatron=cfg.megatron,
                optim=cfg.optim,
                ppo_mini_batch_size=rows,
                use_dynamic_bsz=True,
                ppo_max_token_len_per_gpu=args.budget,
                shuffle=False,
            ),
            "cuda",
        )
    )
    real = int(grpo["attention_mask"].sum())
    rl = rl_batch(grpo)
    cases.run("ours_grpo", lambda: actor.update_policy(rl), 1, args.grpo_iters, real)
    cases.run("ours_logprob", lambda: actor.compute_log_prob(grpo), 1, args.grpo_iters, real)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="0.5b,1.5b")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--budget", type=int, default=16384)
    parser.add_argument("--hf-micro", type=int, default=8)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--grpo-iters", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--layouts", default="", help="comma list of tpN / dpN layouts on N GPUs")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()

    from presets.gpu import QWEN25_05B, QWEN25_15B
    from rlconf.config import MegatronConfig
    from rltrain.megatron.parallel import destroy_parallel, free_port

    archs = {"0.5b": QWEN25_05B, "1.5b": QWEN25_15B}
    report: dict[str, object] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "args": vars(args),
        "shapes": {},
    }
    port = free_port()
    for shape in args.shapes.split(","):
        arch = archs[shape]
        dense = dense_rows(args.batch, args.seq, arch.vocab_size)
        grpo = grpo_rows(args.rows, 256, 2048, arch.vocab_size)
        cases = Cases()
        args.shape_name = shape
        n_params = hf_cases(cases, arch, dense, grpo, args)
        gc.collect()  # the HF model goes before ours is built
        torch.cuda.empty_cache()
        init_groups(MegatronConfig(), "cuda", rank=0, world_size=1, master_port=port)
        our_cases(cases, arch, dense, grpo, args)
        destroy_parallel(destroy_process_group=False)
        gc.collect()
        torch.cuda.empty_cache()
        mean_len = {"dense": args.seq, "grpo": float(grpo["attention_mask"].sum(-1).float().mean())}
        for name, res in cases.results.items():
            if name.startswith("opt_step"):
                continue
            attn_len = mean_len["grpo" if name.endswith(("grpo", "logprob")) else "dense"]
            per_token = 6 * n_params + 6 * arch.num_layers * arch.hidden_size * attn_len
            if name == "ours_logprob":
                per_token /= 3
            res["mfu_spec"] = res["tokens_per_s"] * per_token / SPEC_PEAK
            res["mfu_matmul"] = res["tokens_per_s"] * per_token / MATMUL_PEAK
        r = cases.results
        ratios = {}
        for ours, ref in (
            ("ours_dense", "hf_dense"),
            ("mcore_dense", "hf_dense"),
            ("ours_grpo", "hf_grpo"),
        ):
            if ours in r and ref in r:
                ratios[f"{ours}/{ref}"] = r[ours]["tokens_per_s"] / r[ref]["tokens_per_s"]
        report["shapes"][shape] = {  # type: ignore[index]
            "params": n_params,
            "grpo_rows": args.rows,
            "grpo_real_tokens": int(grpo["attention_mask"].sum()),
            "cases": r,
            "ratios": ratios,
            "errors": cases.errors,
        }
        print(f"\n== {shape} ({n_params / 1e9:.2f}B params) ==")
        print(f"{'case':14s} {'s/iter':>8s} {'tok/s':>10s} {'MFU spec':>9s} {'MFU mm':>8s} {'peak GiB':>9s}")
        for name, res in r.items():
            print(
                f"{name:14s} {res['s_per_iter']:8.3f} {res['tokens_per_s']:10.0f} "
                f"{res.get('mfu_spec', float('nan')):9.3f} {res.get('mfu_matmul', float('nan')):8.3f} "
                f"{res['peak_gib']:9.1f}"
            )
        print("ratios:", json.dumps(ratios), "errors:", json.dumps(cases.errors))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "actor_gpu.json").write_text(json.dumps(report, indent=2))
    if args.layouts:
        destroy_parallel()
        run_layouts(args, report)
    return 0


def layout_worker(rank: int, world: int, port: int, shape: str, tp: int, args, queue) -> None:
    """One rank of a multi-GPU layout: update_policy on this rank's share of the dense and GRPO rows."""
    os.environ["LOCAL_RANK"] = str(rank)
    from dataclasses import replace

    from presets.gpu import QWEN25_05B, QWEN25_15B
    from rlconf.config import ActorConfig, MegatronConfig, ModelConfig, Optim
    from rltrain.megatron.parallel import destroy_parallel, init_distributed

    arch = {"0.5b": QWEN25_05B, "1.5b": QWEN25_15B}[shape]
    init_distributed("cuda", rank=rank, world_size=world, master_port=port)
    mcfg = MegatronConfig(tensor_model_parallel_size=tp, sequence_parallel=tp > 1)
    init_groups(mcfg, "cuda")
    dp = world // tp
    dense = dense_rows(args.batch * dp, args.seq, arch.vocab_size)
    grpo = grpo_rows(args.rows, 256, 2048, arch.vocab_size)
    model_cfg = ModelConfig(arch=arch, params_dtype="bfloat16", attention_backend="sdpa")
    b = args.batch * dp
    cfg = ActorConfig(
        megatron=mcfg, optim=Optim(lr=1e-6), ppo_mini_batch_size=b, ppo_micro_batch_size_per_gpu=args.batch,
        log_prob_micro_batch_size_per_gpu=args.batch, shuffle=False,
    )  # fmt: skip
    actor = actor_of(model_cfg, cfg, "cuda", total_steps=100, rollout_n=1)
    dp_rank = rank // tp
    result: dict[str, float] = {}
    for name, batch, tokens, kw in (
        ("dense", dense, dense["input_ids"].numel(), {}),
        (
            "grpo",
            grpo,
            int(grpo["attention_mask"].sum()),
            dict(ppo_mini_batch_size=args.rows, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=args.budget),
        ),
    ):
        actor.use_batch_settings(actor_plan(model_cfg, replace(cfg, **kw), "cuda"))
        mine = {k: v[dp_rank::dp] for k, v in batch.items()}
        old = actor.compute_log_prob(mine, with_entropy=False)["log_probs"]
        adv = torch.randn(old.shape[0], 1).expand_as(old).contiguous() * mine["response_mask"]
        rl = {**mine, "old_log_probs": old, "advantages": adv}
        secs = timed(
            lambda rl=rl: actor.update_policy(rl), 1, args.iters if name == "dense" else args.grpo_iters
        )
        result[f"{name}_tokens_per_s"] = tokens / secs
        result[f"{name}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if rank == 0:
        queue.put(result)
    destroy_parallel()


def run_layouts(args, report: dict) -> None:
    from rltrain.megatron.parallel import free_port

    world = torch.cuda.device_count()
    ctx = torch.multiprocessing.get_context("spawn")
    layouts: dict[str, object] = {"gpus": world}
    for shape in args.shapes.split(","):
        single = report["shapes"][shape]["cases"]  # type: ignore[index]
        for layout in args.layouts.split(","):
            kind, n = layout[:2], int(layout[2:])
            if n > world:
                layouts[f"{shape}/{layout}"] = {"error": f"needs {n} GPUs, {world} present"}
                continue
            tp = n if kind == "tp" else 1
            queue = ctx.SimpleQueue()
            try:
                torch.multiprocessing.spawn(
                    layout_worker, args=(n, free_port(), shape, tp, args, queue), nprocs=n, join=True
                )
                res = queue.get()
                for name in ("dense", "grpo"):
                    one = single.get(f"ours_{name}", {}).get("tokens_per_s")
                    if one:
                        res[f"{name}_scaling"] = res[f"{name}_tokens_per_s"] / (n * one)
            except Exception as exc:  # record and go on with the next layout
                traceback.print_exc()
                res = {"error": f"{type(exc).__name__}: {exc}"}
            layouts[f"{shape}/{layout}"] = res
            print(f"{shape} {layout}: {json.dumps(res)}")
    Path(args.out, "actor_gpu_layouts.json").write_text(json.dumps(layouts, indent=2))


if __name__ == "__main__":
    sys.exit(main())
