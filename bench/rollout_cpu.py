"""Rollout throughput on CPU: the no-cache sampler vs the KV-cache engine (and the design it beat).

Ways to generate greedy responses with the same megatron weights (single process, TP = PP = 1, fp32):

* `nocache`:  `MegatronActor.generate(use_cache=False)`, the full sequence re-run for every new token (one
  micro-batch holding the whole batch, so it is not penalised by micro-batching);
* `engine`:   `MegatronActor.generate()`, the engine of rltrain/megatron/inference.py (design 2: our own
  per-layer KV cache through megatron's submodules, keys cached after RoPE at per-row positions);
* `owncache`: design 2 as a bare greedy loop (no sampling, dedupe or compaction), the like-for-like
  counterpart of the design-1 prototype;
* `megatron`: a prototype of design 1 written here: megatron-core's `StaticInferenceContext` passed to
  `GPTModel.forward` (keys cached before RoPE and re-rotated every step; one position per column);
* `megatron_rowpos`: design 1 with per-row RoPE positions (the rotary module returns [S, B, 1, D]).

The cached paths must produce the no-cache path's tokens (`identical`; design 1 can differ at fp32
near-ties because of its position shift, `agree` gives its share of equal tokens). Reported: generated
tokens per second (batch x new tokens / wall time, best of --repeat) and the speed-up over `nocache`.

Run: OMP_NUM_THREADS=1 .venv/bin/python bench/rollout_cpu.py [--repeat 3] [--cases tiny,wide,grpo]
Prints a table and one JSON line. The same comparison on a GPU: --device cuda --dtype bfloat16 --cases
qwen05b (a Qwen2.5-0.5B-shaped random model; in bf16 the cached paths may differ from the no-cache path at
near-ties, `agree` then says how often).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.megatron._common import actor_of, init_groups


@dataclass(frozen=True)
class Case:
    name: str
    num_layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    vocab: int
    batch: int  # rows
    prompt: int  # longest prompt
    new_tokens: int
    n: int = 1  # samples per prompt (rows = batch, prompts = batch / n)


CASES = {
    # The tests' tiny Qwen2 shape.
    "tiny": Case("tiny", 4, 64, 176, 4, 2, 100, 64, 16, 32),
    "wide": Case("wide", 4, 256, 704, 8, 4, 1024, 64, 32, 64),
    # GRPO-like: 8 prompts x 8 samples (the cache of each prompt is prefilled once and copied).
    "grpo": Case("grpo", 4, 256, 704, 8, 4, 1024, 64, 128, 32, n=8),
    # Qwen2.5-0.5B shape (random weights): for --device cuda.
    "qwen05b": Case("qwen05b", 24, 896, 4864, 14, 2, 151936, 64, 128, 128),
}
DEVICE = "cpu"
DTYPE = "float32"


def build_actor(case: Case):
    """A random-init actor of the case's shape on DEVICE in DTYPE."""
    from rlconf.config import ActorConfig, MegatronConfig, ModelArch, ModelConfig
    from rltrain.megatron.parallel import seed_parallel_rng

    arch = ModelArch(
        num_layers=case.num_layers,
        hidden_size=case.hidden,
        ffn_hidden_size=case.ffn,
        num_attention_heads=case.heads,
        num_query_groups=case.groups,
        vocab_size=case.vocab,
        max_position_embeddings=case.prompt + case.new_tokens,
    )
    seed_parallel_rng(1)
    model_cfg = ModelConfig(arch=arch, attention_backend="sdpa", init_method_std=0.1, params_dtype=DTYPE)  # type: ignore[arg-type]
    actor_cfg = ActorConfig(megatron=MegatronConfig(), log_prob_micro_batch_size_per_gpu=case.batch)
    return actor_of(model_cfg, actor_cfg, DEVICE, trainable=False)


def make_prompts(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of lengths between prompt/2 and prompt, each repeated n times."""
    g = torch.Generator().manual_seed(0)
    n_prompts = case.batch // case.n
    ids = torch.zeros(n_prompts, case.prompt, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i in range(n_prompts):
        length = int(torch.randint(case.prompt // 2, case.prompt + 1, (1,), generator=g))
        ids[i, case.prompt - length :] = torch.randint(1, case.vocab, (length,), generator=g)
        mask[i, case.prompt - length :] = 1
    return ids.repeat_interleave(case.n, 0), mask.repeat_interleave(case.n, 0)


# ------------------------------------------------------------------------------------ design 1 prototype
@torch.no_grad()
def megatron_static_generate(
    actor, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, new_tokens: int, row_positions: bool = False
) -> torch.Tensor:
    """Greedy responses [B, N] through megatron's StaticInferenceContext (TP = PP = 1: a prototype)."""
    from megatron.core.inference.contexts import StaticInferenceContext

    from rltrain.megatron.inference import left_pad, prefill_mask
    from rltrain.megatron.model import unwrap

    model = actor.chunks[0]
    rope = unwrap(model).rotary_pos_emb
    dev = actor.torch_device
    prompt_ids, prompt_mask = prompt_ids.to(dev), prompt_mask.to(dev)
    left, valid_l = left_pad(prompt_ids, prompt_mask, 0)
    valid = valid_l.bool()
    b, p = left.shape
    total = p + new_tokens
    positions = (torch.arange(total, device=dev).view(1, -1) - (p - valid_l.sum(-1)).view(-1, 1)).clamp(min=0)
    if row_positions:
        inner = rope.forward

        def forward(max_seq_len: int, *args, **kwargs) -> torch.Tensor:
            return inner(max_seq_len, *args, **kwargs)[:, 0][positions[:, :max_seq_len].t()]

        rope.forward = forward
    ctx = StaticInferenceContext(max_batch_size=b, max_sequence_length=total)
    out = torch.zeros(b, new_tokens, dtype=torch.long, device=dev)
    try:
        with actor._ctx():
            actor.eval()
            kw = {"inference_context": ctx, "runtime_gather_output": True}
            logits = model(
                input_ids=left, position_ids=positions[:, :p], attention_mask=prefill_mask(valid), **kw
            )
            ctx.sequence_len_offset += p
            for t in range(new_tokens):
                tok = logits[:, -1, : actor.vocab_size].argmax(-1)
                out[:, t] = tok
                if t == new_tokens - 1:
                    break
                key_valid = torch.ones(b, p + t + 1, dtype=torch.bool, device=dev)
                key_valid[:, :p] = valid
                mask = None if bool(valid.all()) else ~key_valid[:, None, None, :]
                pos = positions[:, p + t : p + t + 1]
                logits = model(input_ids=tok[:, None], position_ids=pos, attention_mask=mask, **kw)
                ctx.sequence_len_offset += 1
    finally:
        if row_positions:
            del rope.forward
    return out.cpu()


# ------------------------------------------------------------------------------------ design 2, bare
@torch.no_grad()
def owncache_generate(
    actor, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, new_tokens: int
) -> torch.Tensor:
    """Greedy responses [B, N] with the bare design-2 loop (TP = PP = 1; no sampling, dedupe or compaction:
    the same work as `megatron_static_generate`, for a like-for-like comparison of the two designs)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import apply_rotary_pos_emb

    from rltrain.megatron.inference import left_pad, prefill_mask
    from rltrain.megatron.model import unwrap

    model = unwrap(actor.chunks[0])
    config = model.config
    layers = model.decoder.layers
    dev = actor.torch_device
    prompt_ids, prompt_mask = prompt_ids.to(dev), prompt_mask.to(dev)
    left, valid_l = left_pad(prompt_ids, prompt_mask, 0)
    valid = valid_l.bool()
    b, p = left.shape
    total = p + new_tokens
    pad = p - valid.sum(-1)
    freqs = model.rotary_pos_emb(total)[:, 0, 0, :]  # [S, D]
    groups, dim = layers[0].self_attention.num_query_groups_per_partition, config.kv_channels
    kw = {"dtype": config.params_dtype, "device": dev}
    cache = [
        (torch.zeros(total, b, groups, dim, **kw), torch.zeros(total, b, groups, dim, **kw)) for _ in layers
    ]
    out = torch.zeros(b, new_tokens, dtype=torch.long, device=dev)

    def step(tokens: torch.Tensor, start: int, mask: torch.Tensor | None) -> torch.Tensor:
        s = tokens.shape[1]
        pos = (start + torch.arange(s, device=dev).view(1, s) - pad.view(b, 1)).clamp(min=0)  # [b, s]
        rot = freqs[pos.t()].unsqueeze(2)  # [s, b, 1, D]
        h = model.embedding(input_ids=tokens, position_ids=None)
        for layer, (kc, vc) in zip(layers, cache, strict=True):
            attn = layer.self_attention
            q, k, v = attn.get_query_key_value_tensors(layer.input_layernorm(h), None)
            q = apply_rotary_pos_emb(q, rot, config=config)
            kc[start : start + s] = apply_rotary_pos_emb(k, rot, config=config)
            vc[start : start + s] = v
            ctx = attn.core_attention(q, kc[: start + s], vc[: start + s], mask)
            h = h + attn.linear_proj(ctx)[0]
            h = h + layer.mlp(layer.pre_mlp_layernorm(h))[0]
        h = model.decoder.final_layernorm(h[-1:])
        logits, _ = model.output_layer(h, weight=model.shared_embedding_or_output_weight())
        return logits[0, :, : actor.vocab_size]

    with actor._ctx():
        actor.eval()
        tok = step(left, 0, prefill_mask(valid)).argmax(-1)
        out[:, 0] = tok
        for t in range(1, new_tokens):
            key_valid = torch.ones(b, p + t, dtype=torch.bool, device=dev)
            key_valid[:, :p] = valid
            mask = None if bool(valid.all()) else ~key_valid[:, None, None, :]
            tok = step(tok.unsqueeze(1), p + t - 1, mask).argmax(-1)
            out[:, t] = tok
    return out.cpu()


# ------------------------------------------------------------------------------------ timing
def best_time(fn, repeat: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def run_case(case: Case, repeat: int) -> dict[str, float]:
    actor = build_actor(case)
    ids, mask = make_prompts(case)
    n = case.new_tokens

    def nocache():
        return actor.generate(ids, n, temperature=0.0, prompt_mask=mask, use_cache=False)["responses"]

    def engine():
        return actor.generate(ids, n, temperature=0.0, prompt_mask=mask)["responses"]

    def megatron():
        return megatron_static_generate(actor, ids, mask, n)

    def megatron_rowpos():
        return megatron_static_generate(actor, ids, mask, n, row_positions=True)

    def owncache():
        return owncache_generate(actor, ids, mask, n)

    result: dict[str, float] = {}
    outputs = {}
    for name, fn in paths_of(engine, owncache, megatron, megatron_rowpos, nocache):
        # The no-cache path is slow and steady: one run is enough for it.
        secs, outputs[name] = best_time(fn, 1 if name == "nocache" else repeat)
        result[f"{name}_tok_s"] = case.batch * n / secs
    for name in ("engine", "owncache", "megatron", "megatron_rowpos"):
        result[f"{name}_identical"] = float(torch.equal(outputs["nocache"], outputs[name]))
        result[f"{name}_agree"] = float((outputs["nocache"] == outputs[name]).float().mean())
    return result


def paths_of(*fns):
    return [(fn.__name__, fn) for fn in fns]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cases", default="tiny,wide,grpo")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    from rlconf.config import MegatronConfig
    from rltrain.megatron.parallel import free_port

    global DEVICE, DTYPE
    DEVICE, DTYPE = args.device, args.dtype
    init_groups(MegatronConfig(), DEVICE, rank=0, world_size=1, master_port=free_port())
    report = {}
    names = ("nocache", "engine", "owncache", "megatron", "megatron_rowpos")
    print(f"{'case':<6} {'B':>3} {'P':>4} {'N':>3} {'n':>2} " + " ".join(f"{k:>15}" for k in names))
    print(f"  generated tok/s (x over nocache) [identical to nocache], threads={torch.get_num_threads()}")
    for name in args.cases.split(","):
        case = CASES[name]
        r = run_case(case, args.repeat)
        report[name] = {**case.__dict__, **r}
        cells = [f"{r['nocache_tok_s']:>15.0f}"]
        for k in names[1:]:
            cell = f"{r[f'{k}_tok_s']:.0f} ({r[f'{k}_tok_s'] / r['nocache_tok_s']:.1f}x) {'=' if r[f'{k}_identical'] else '~'}"
            cells.append(f"{cell:>15}")
        print(
            f"{name:<6} {case.batch:>3} {case.prompt:>4} {case.new_tokens:>3} {case.n:>2} " + " ".join(cells),
            flush=True,
        )
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
