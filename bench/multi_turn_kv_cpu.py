"""Multi-turn generation on CPU with and without the KV cache kept across turns.

A rollout of several turns as the agent loop runs it (rltrain/rollout/agent.py): every turn each row still
talking generates up to --new tokens through the rollout worker's `generate_turn`
(rltrain/rollout/generation.py), then gets a 5-token observation ("=123" and a newline, what a tool answer
looks like in the built-in tokenizer) appended; rows that sample EOS end. `cache`: the worker keeps each
row's KV cache between turns (a session: a turn prefills only its last sampled token and the observation);
`prefill`: every turn prefills the whole context. Both sample the same tokens (each row draws from its own
seeded stream); the script checks that. Reported: generation seconds per rollout (median and range of
--repeat runs, the two modes interleaved) and the ratio prefill / cache.

Run: OMP_NUM_THREADS=1 .venv/bin/python bench/multi_turn_kv_cpu.py [--repeat 3] [--cases tiny-tool,wide]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, replace
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
    rows: int  # prompts x 2 samples
    prompt: int  # longest prompt (shortest: half)
    turns: int
    new_tokens: int  # per turn


CASES = {
    # The tiny-tool preset's model shape (rlconf presets: 2 layers, width 64, the char vocabulary).
    "tiny-tool": Case("tiny-tool", 2, 64, 176, 4, 2, 32, 32, 64, 6, 16),
    # Wider and deeper, still CPU-sized (bench/rollout_cpu.py's `wide`).
    "wide": Case("wide", 4, 256, 704, 8, 4, 1024, 32, 128, 6, 16),
}


class Worker:
    """The rollout worker's generation (`RolloutServer`) on an in-process actor."""

    def __new__(cls, actor):
        from presets.tiny import tiny_tool
        from rltrain.rollout.generation import RolloutServer

        class _W(RolloutServer):
            pass

        w = _W()
        cfg = tiny_tool()
        w.cfg = replace(cfg, rollout=replace(cfg.rollout, temperature=1.0))
        w.plan = type("Plan", (), {"refit": None})()
        w.actor, w.vllm = actor, None
        w.measured = lambda name: contextlib.nullcontext()
        return w


def build_actor(case: Case):
    from rlconf.config import ActorConfig, MegatronConfig, ModelArch, ModelConfig
    from rltrain.megatron.parallel import seed_parallel_rng

    arch = ModelArch(
        num_layers=case.num_layers, hidden_size=case.hidden, ffn_hidden_size=case.ffn,
        num_attention_heads=case.heads, num_query_groups=case.groups, vocab_size=case.vocab,
        max_position_embeddings=case.prompt + case.turns * (case.new_tokens + 5) + 8,
    )  # fmt: skip
    seed_parallel_rng(1)
    model_cfg = ModelConfig(arch=arch, attention_backend="sdpa", init_method_std=0.1)  # type: ignore[arg-type]
    return actor_of(model_cfg, ActorConfig(megatron=MegatronConfig()), "cpu", trainable=False)


def rollout(worker, case: Case, cache: bool) -> tuple[float, list[list[int]]]:
    """Generation seconds of one rollout and every row's final context."""
    from rltrain.data import left_pad

    g = torch.Generator().manual_seed(0)
    prompts = []
    for _ in range(case.rows // 2):
        length = int(torch.randint(case.prompt // 2, case.prompt + 1, (1,), generator=g))
        prompts.append(torch.randint(4, min(case.vocab, 32), (length,), generator=g).tolist())
    contexts = [list(p) for p in prompts for _ in range(2)]
    observation = [int(t) for t in worker._tokenizer().encode("=123\n")]
    eos = worker._tokenizer().eos_token_id
    talking = list(range(case.rows))
    session = "bench" if cache else None
    seconds = 0.0
    for turn in range(case.turns):
        if not talking:
            break
        ids, mask = left_pad([contexts[i] for i in talking], 0)
        batch = {"prompt_ids": ids, "prompt_mask": mask, "row_ids": torch.tensor(talking),
                 "row_seeds": torch.tensor([1000 * turn + i for i in talking])}  # fmt: skip
        t0 = time.perf_counter()
        out = worker.generate_turn(batch, False, case.new_tokens, (), session, ())
        seconds += time.perf_counter() - t0
        still = []
        for k, i in enumerate(talking):
            new = out["responses"][k][out["response_mask"][k].bool()].tolist()
            contexts[i] += new
            if new and new[-1] == eos:
                continue
            contexts[i] += observation
            still.append(i)
        talking = still
    if cache:
        worker.end_kv_session(session)
    return seconds, contexts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cases", default="tiny-tool,wide")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from rlconf.config import MegatronConfig
    from rltrain.megatron.parallel import free_port

    init_groups(MegatronConfig(), "cpu", rank=0, world_size=1, master_port=free_port())
    results = {}
    for name in args.cases.split(","):
        case = CASES[name]
        worker = Worker(build_actor(case))
        rollout(worker, case, True)  # warm-up
        times: dict[str, list[float]] = {"cache": [], "prefill": []}
        for _ in range(args.repeat):
            for mode in ("prefill", "cache"):
                s, ctx = rollout(worker, case, mode == "cache")
                times[mode].append(s)
                if mode == "prefill":
                    ref = ctx
                else:
                    assert ctx == ref, "the kept cache sampled other tokens than the re-prefill path"
        ratios = [p / c for p, c in zip(times["prefill"], times["cache"], strict=True)]
        final = sum(len(c) for c in ref) / len(ref)
        results[name] = {"times": times, "ratios": ratios, "mean_final_context": final}
        print(f"{name}: rows {case.rows}, {case.turns} turns x {case.new_tokens} new + 5 observation tokens, "
              f"mean final context {final:.0f} tokens")  # fmt: skip
        for mode, ts in times.items():
            print(
                f"  {mode:8s} {statistics.median(ts):.3f} s per rollout (range {min(ts):.3f}-{max(ts):.3f})"
            )
        print(
            f"  prefill / cache: median {statistics.median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f})"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
