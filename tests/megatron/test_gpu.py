"""The same engine on CUDA (NCCL, no CPU compatibility layer): skipped where no GPU is present (CI).

One spawn over min(2, GPUs) processes runs TP = world size in fp32 (log-probs against transformers on the
CPU, update, sampling) and bf16 (log-probs close, update finite). `RLPLAN_GPU_BENCH=1` adds a throughput
measurement of update_policy on a Qwen2.5-0.5B-shaped random model."""

from __future__ import annotations

import os
import time
import traceback

import pytest
import torch

from ._common import (
    actor_cfg,
    actor_of,
    free_port,
    hf_logits,
    init_groups,
    make_batch,
    reference_log_probs,
    tiny_model_cfg,
)

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.multiproc,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]


def _gpu_worker(rank: int, world: int, port: int, hf_path: str, ref: torch.Tensor) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        _gpu_checks(rank, world, port, hf_path, ref)
    except Exception:
        traceback.print_exc()
        raise


def _gpu_checks(rank: int, world: int, port: int, hf_path: str, ref: torch.Tensor) -> None:
    from dataclasses import replace

    from rlconf.config import Optim
    from rltrain.megatron import cpu_compat
    from rltrain.megatron.parallel import destroy_parallel, init_distributed

    init_distributed("cuda", rank=rank, world_size=world, master_port=port)
    assert not cpu_compat.is_enabled(), "the CPU layer must stay off on GPU"
    cfg = actor_cfg(tp=world, ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=4, optim=Optim(lr=1e-4))
    init_groups(cfg.megatron, "cuda")
    batch = make_batch(b=8)
    for dtype, tol in (("float32", 2e-3), ("bfloat16", 0.15)):
        mcfg = replace(tiny_model_cfg(hf_path), params_dtype=dtype)
        actor = actor_of(mcfg, cfg, "cuda", total_steps=4)
        assert next(actor.chunks[0].parameters()).is_cuda
        old = actor.compute_log_prob(batch)["log_probs"]
        torch.testing.assert_close(old, ref, atol=tol, rtol=tol, msg=dtype)
        sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(8)]).unsqueeze(1)
        rl = {**batch, "old_log_probs": old, "advantages": sign * batch["response_mask"]}
        t0 = time.perf_counter()
        metrics = actor.update_policy(rl)
        dt = time.perf_counter() - t0
        assert metrics["actor/grad_norm"] > 0 and metrics["actor/grad_norm"] == metrics["actor/grad_norm"]
        new = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
        if dtype == "float32":
            assert (((new - old) * sign)[batch["response_mask"].bool()]).mean() > 0
        gen = actor.generate(batch["input_ids"][:4, :6], 6, temperature=1.0, top_p=0.9, pad_id=0, seed=1)
        lp = actor.compute_log_prob(gen, with_entropy=False)["log_probs"]
        torch.testing.assert_close(lp, gen["rollout_log_probs"], atol=tol, rtol=tol, msg=dtype)
        if dtype == "float32":
            _check_cuda_graph_decode(actor, batch["input_ids"][:, :6])
        if rank == 0:
            print(f"[gpu] world={world} {dtype}: update {dt:.3f}s metrics={metrics}", flush=True)
        del actor
    destroy_parallel()


def _check_cuda_graph_decode(actor, prompts: torch.Tensor) -> None:
    """Decode captured in CUDA graphs (StaticDecodeStep) against the eager dynamic path, fp32: greedy and
    sampled tokens equal, log-probs close; small key buckets so the decode crosses two captured graphs,
    and stop tokens so a compaction rebuilds the step (with TP=2, NCCL all-reduces inside the graphs)."""
    from rltrain.megatron import inference

    inference.KEY_BUCKET, inference.BUCKET_ROWS = 16, 1
    greedy = actor.generate(prompts, 24, temperature=0.0, pad_id=0)
    eos = int(greedy["responses"][0, 3])
    for kw in (
        dict(temperature=0.0),
        dict(temperature=1.0, top_p=0.9, seed=2),
        dict(temperature=1.0, eos_id=eos, stop_token_ids=(int(greedy["responses"][1, 1]),), seed=3),
    ):
        eager = actor.generate(prompts, 24, pad_id=0, **kw)
        graphs = actor.generate(prompts, 24, pad_id=0, cuda_graph=True, **kw)
        for key in ("responses", "response_mask"):
            assert torch.equal(eager[key], graphs[key]), (kw, key)
        torch.testing.assert_close(
            eager["rollout_log_probs"], graphs["rollout_log_probs"], atol=1e-4, rtol=1e-4
        )


def test_gpu_engine_matches_transformers(tiny_hf):
    batch = make_batch(b=8)
    ref = reference_log_probs(hf_logits(tiny_hf, batch["input_ids"], batch["attention_mask"]), batch)
    world = min(2, torch.cuda.device_count())
    torch.multiprocessing.spawn(
        _gpu_worker, args=(world, free_port(), str(tiny_hf), ref), nprocs=world, join=True
    )


def _bench_worker(rank: int, world: int, port: int) -> None:
    from dataclasses import replace

    from presets.gpu import QWEN25_05B
    from rlconf.config import ModelConfig, Optim
    from rltrain.megatron.parallel import init_distributed

    os.environ["LOCAL_RANK"] = str(rank)
    init_distributed("cuda", rank=rank, world_size=world, master_port=port)
    arch = replace(QWEN25_05B, max_position_embeddings=4096)
    b, s, r = 16, 2048, 1024
    for backend in ("sdpa", "local"):
        mcfg = ModelConfig(arch=arch, params_dtype="bfloat16", attention_backend=backend)
        cfg = actor_cfg(tp=world, ppo_mini_batch_size=b, ppo_micro_batch_size_per_gpu=4, optim=Optim(lr=1e-6))
        init_groups(cfg.megatron, "cuda")
        actor = actor_of(mcfg, cfg, "cuda", total_steps=10)
        ids = torch.randint(0, 150000, (b, s))
        batch = {
            "input_ids": ids,
            "attention_mask": torch.ones(b, s, dtype=torch.long),
            "position_ids": torch.arange(s).expand(b, -1),
            "responses": ids[:, -r:],
            "response_mask": torch.ones(b, r, dtype=torch.long),
        }
        t0 = time.perf_counter()
        old = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
        torch.cuda.synchronize()
        t_lp = time.perf_counter() - t0
        batch.update(old_log_probs=old, advantages=torch.randn(b, r))
        actor.update_policy(batch)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = 3
        for _ in range(n):
            actor.update_policy(batch)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / n
        if rank == 0:
            print(
                f"[bench] {backend} tp={world} B={b} S={s}: update {b * s / dt:.0f} tok/s/rank-group, "
                f"log_prob {b * s / t_lp:.0f} tok/s (first call), mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB",
                flush=True,
            )
        del actor


@pytest.mark.skipif(os.environ.get("RLPLAN_GPU_BENCH") != "1", reason="set RLPLAN_GPU_BENCH=1 to measure")
def test_gpu_update_throughput():
    world = 1
    torch.multiprocessing.spawn(_bench_worker, args=(world, free_port()), nprocs=world, join=True)
