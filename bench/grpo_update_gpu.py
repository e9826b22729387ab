"""Actor update on a GRPO-shaped batch, next to Hugging Face on the same rows, in one process on one GPU.

Rows: `--rows` responses with 256-token prompts and response lengths drawn from a clipped log-normal spread
(median ~500, up to 2048 tokens), seeded. Ours: `MegatronActor.update_policy` with dynamic batching by token
budget (`--budget` tokens per micro-batch, rows regrouped by length, one optimizer step) and
`compute_log_prob`. HF: transformers fwd+bwd over the same rows in micro-batches of `--hf-micro` rows in
order, each padded to its longest row (what a padded trainer does). Tokens/s count real tokens only, so the
padding HF computes shows up as lost throughput.
Run on the GPU machine: python3 bench/grpo_update_gpu.py [--shape 0.5b] [--out DIR].
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from bench.actor_update_gpu import MATMUL_PEAK, SPEC_PEAK, free_port, timed


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="0.5b", choices=["0.5b", "1.5b"])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--budget", type=int, default=16384)
    parser.add_argument("--hf-micro", type=int, default=8)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, Qwen2Config

    from presets.gpu import QWEN25_05B, QWEN25_15B
    from rlconf.config import ActorConfig, MegatronConfig, ModelConfig, Optim
    from rltrain.megatron.actor import MegatronActor
    from rltrain.megatron.hf_weights import hf_config_from_arch
    from rltrain.megatron.parallel import init_distributed

    arch = QWEN25_15B if args.shape == "1.5b" else QWEN25_05B
    batch = grpo_rows(args.rows, 256, 2048, arch.vocab_size)
    real_tokens = int(batch["attention_mask"].sum())
    results: dict[str, dict[str, float]] = {}

    hf = AutoModelForCausalLM.from_config(
        Qwen2Config(**hf_config_from_arch(arch, torch.bfloat16)), dtype=torch.bfloat16
    ).cuda()
    n_params = sum(p.numel() for p in hf.parameters())
    padded = 0
    micro = []
    for i in range(0, args.rows, args.hf_micro):
        attn = batch["attention_mask"][i : i + args.hf_micro]
        width = int(attn.sum(-1).max())
        ids = batch["input_ids"][i : i + args.hf_micro, :width].cuda()
        labels = ids.masked_fill(attn[:, :width].cuda() == 0, -100)
        micro.append((ids, attn[:, :width].cuda(), labels))
        padded += ids.numel()

    def hf_step() -> None:
        for ids, attn, labels in micro:
            hf(input_ids=ids, attention_mask=attn, labels=labels).loss.backward()
        hf.zero_grad(set_to_none=True)

    results["hf_padded"] = {"s_per_iter": timed(hf_step, 1, args.iters)}
    micro.clear()
    hf.cpu()
    torch.cuda.empty_cache()

    init_distributed("cuda", rank=0, world_size=1, master_port=free_port())
    cfg = ActorConfig(
        megatron=MegatronConfig(),
        optim=Optim(lr=1e-6),
        ppo_mini_batch_size=args.rows,
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=args.budget,
        shuffle=False,
    )
    actor = MegatronActor(
        ModelConfig(arch=arch, params_dtype="bfloat16", attention_backend="sdpa"),
        cfg,
        "cuda",
        total_steps=100,
    )
    old = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
    adv = torch.randn(args.rows, 1).expand_as(old).contiguous() * batch["response_mask"]
    rl = {**batch, "old_log_probs": old, "advantages": adv}
    torch.cuda.reset_peak_memory_stats()
    results["ours_update"] = {"s_per_iter": timed(lambda: actor.update_policy(rl), 1, args.iters)}
    results["ours_logprob"] = {"s_per_iter": timed(lambda: actor.compute_log_prob(batch), 1, args.iters)}
    peak = torch.cuda.max_memory_allocated() / 2**30

    mean_len = real_tokens / args.rows
    per_token = 6 * n_params + 6 * arch.num_layers * arch.hidden_size * mean_len
    for name, res in results.items():
        tok_s = real_tokens / res["s_per_iter"]
        flops = per_token / (3 if name == "ours_logprob" else 1)
        res.update(
            tokens_per_s=tok_s, mfu_spec=tok_s * flops / SPEC_PEAK, mfu_matmul=tok_s * flops / MATMUL_PEAK
        )
    summary = {
        "shape": args.shape,
        "rows": args.rows,
        "real_tokens": real_tokens,
        "hf_padded_tokens": padded,
        "budget": args.budget,
        "peak_gib_ours": peak,
        **results,
    }
    print(f"{args.rows} rows, {real_tokens} real tokens (HF pads to {padded}), token budget {args.budget}")
    print(f"{'case':14s} {'tok/s':>10s} {'MFU(spec)':>10s} {'MFU(matmul)':>12s}")
    for name, res in results.items():
        print(f"{name:14s} {res['tokens_per_s']:10.0f} {res['mfu_spec']:10.3f} {res['mfu_matmul']:12.3f}")
    ratio = results["ours_update"]["tokens_per_s"] / results["hf_padded"]["tokens_per_s"]
    print(f"ours/hf update ratio: {ratio:.2f}; peak {peak:.1f} GiB")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "grpo_update.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
