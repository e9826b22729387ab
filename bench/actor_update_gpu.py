"""Actor update throughput on one GPU, side by side with raw Hugging Face fwd+bwd in the same process.

Random-init Qwen2.5-shaped models in bf16, batch B x S tokens (default the DESIGN.md anchor: 1.5B shape,
B=4, S=2048). Measures tokens/s and MFU (6N + 6·L·h·S causal-attention flops per token, against the H200's
989 TFLOP/s dense bf16 spec and the ~760 TFLOP/s measured matmul peak) of:
  hf        transformers AutoModelForCausalLM (sdpa) forward + backward of the mean token loss
  ours      MegatronActor.update_policy (PPO loss over the response half, one optimizer step)
  logprob   MegatronActor.compute_log_prob (forward only)
Run on the GPU machine: python3 bench/actor_update_gpu.py [--shape 1.5b|0.5b] [--out DIR]. Prints a table and
writes actor_update.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path

import torch

SPEC_PEAK, MATMUL_PEAK = 989e12, 760e12


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def timed(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def bench_hf(arch, b: int, s: int, iters: int) -> tuple[dict[str, float], int, torch.Tensor]:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rltrain.megatron.hf_weights import hf_config_from_arch

    hf_cfg = Qwen2Config(**hf_config_from_arch(arch, torch.bfloat16))
    hf_cfg._attn_implementation = "sdpa"
    hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16).cuda()
    n_params = sum(p.numel() for p in hf.parameters())
    ids = torch.randint(0, arch.vocab_size, (b, s), device="cuda")

    def hf_step() -> None:
        out = hf(input_ids=ids, labels=ids)
        out.loss.backward()
        hf.zero_grad(set_to_none=True)

    return {"s_per_iter": timed(hf_step, 2, iters)}, n_params, ids


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1.5b", choices=["0.5b", "1.5b"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()

    from presets.gpu import QWEN25_05B, QWEN25_15B
    from rlconf.config import ActorConfig, MegatronConfig, ModelConfig, Optim
    from rltrain.megatron.actor import MegatronActor
    from rltrain.megatron.parallel import init_distributed

    arch = QWEN25_15B if args.shape == "1.5b" else QWEN25_05B
    b, s = args.batch, args.seq
    tokens = b * s
    results: dict[str, dict[str, float]] = {}

    # --- raw HF forward + backward (its own function so the model is freed before ours is built)
    results["hf"], n_params, ids = bench_hf(arch, b, s, args.iters)
    torch.cuda.empty_cache()

    # --- ours: the actor's update and log-prob on an RL-shaped batch (response = second half)
    init_distributed("cuda", rank=0, world_size=1, master_port=free_port())
    actor_cfg = ActorConfig(
        megatron=MegatronConfig(),
        optim=Optim(lr=1e-6),
        ppo_mini_batch_size=b,
        ppo_micro_batch_size_per_gpu=b,
        log_prob_micro_batch_size_per_gpu=b,
        shuffle=False,
    )
    model_cfg = ModelConfig(arch=arch, params_dtype="bfloat16", attention_backend="sdpa")
    actor = MegatronActor(model_cfg, actor_cfg, "cuda", total_steps=100, rollout_n=1)
    r = s // 2
    batch = {
        "input_ids": ids.cpu(),
        "attention_mask": torch.ones(b, s, dtype=torch.long),
        "position_ids": torch.arange(s).expand(b, s).clone(),
        "responses": ids[:, s - r :].cpu(),
        "response_mask": torch.ones(b, r, dtype=torch.long),
    }
    old = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
    rl = {**batch, "old_log_probs": old, "advantages": torch.randn(b, 1).expand(b, r).contiguous()}
    results["ours_update"] = {"s_per_iter": timed(lambda: actor.update_policy(rl), 2, args.iters)}
    results["ours_logprob"] = {"s_per_iter": timed(lambda: actor.compute_log_prob(batch), 1, args.iters)}
    peak_gib = torch.cuda.max_memory_allocated() / 2**30

    flops_per_token_train = 6 * n_params + 6 * arch.num_layers * arch.hidden_size * s
    for name, res in results.items():
        tok_s = tokens / res["s_per_iter"]
        per_token = flops_per_token_train / (3 if name == "ours_logprob" else 1)
        res.update(
            tokens_per_s=tok_s,
            mfu_spec=tok_s * per_token / SPEC_PEAK,
            mfu_matmul=tok_s * per_token / MATMUL_PEAK,
        )
    summary = {"shape": args.shape, "batch": b, "seq": s, "params": n_params, "peak_gib": peak_gib, **results}
    print(f"{'case':14s} {'tok/s':>10s} {'MFU(spec)':>10s} {'MFU(matmul)':>12s}")
    for name, res in results.items():
        print(f"{name:14s} {res['tokens_per_s']:10.0f} {res['mfu_spec']:10.3f} {res['mfu_matmul']:12.3f}")
    print(
        f"ours/hf update ratio: {results['ours_update']['tokens_per_s'] / results['hf']['tokens_per_s']:.2f}"
    )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "actor_update.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
