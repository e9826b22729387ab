"""Refit time of the rollout in its own layout (rltrain/rollout/reshard.py): the actor's weights at TP = a
(x PP = p) resharded into a rollout replica at TP = r on the same devices, as before every generation.

Per rank: the replica is built once (timed: `build_s`), then `--repeats` refits are timed, each followed by
`release()` (the storage is freed after every generation in a run, so each refit allocates it again).
Reported from rank 0 (max over ranks of each repeat's time, with synchronisation around it):

  refit_s_min / refit_s_median  seconds per refit (target for the 1.5B shape, TP=2 -> TP=1 on two H200: < 0.5)
  bytes_per_rank, buckets       full tensors loaded and collective rounds of one refit
  extra_gib                     device memory held by the replica while generating (its weights)
  peak_extra_gib                torch.cuda.max_memory_allocated during a refit minus before it (weights +
                                the bucket in flight)
  plan_estimate_s               what `rlconf plan` estimates for the same refit
  check                         a short greedy generation through the replica, and the max |sampler log-prob
                                - actor log-prob| over its tokens (bf16 on GPU: rounding-sized, not 0)

Random-init weights of the chosen shape (default the Qwen2.5-1.5B shape, bf16); the actor is frozen (no
optimizer: the refit reads parameters only).

GPU (lead):  torchrun --nproc-per-node 2 bench/refit_gpu.py --arch qwen15b --actor-tp 2 --rollout-tp 1 --out $OUT
             (or without torchrun: python3 bench/refit_gpu.py --nproc 2 ...: spawns the ranks itself)
CPU smoke:   OMP_NUM_THREADS=1 .venv/bin/python bench/refit_gpu.py --nproc 2 --arch tiny --device cpu \
                 --dtype float32 --repeats 2 --out /tmp/refit_gpu
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.megatron._common import actor_of, init_groups


def get_arch(name: str):
    from rlconf.config import ModelArch

    if name == "qwen15b":
        from presets.gpu import QWEN25_15B

        return QWEN25_15B
    if name == "qwen05b":
        return ModelArch(
            num_layers=24, hidden_size=896, ffn_hidden_size=4864, num_attention_heads=14, num_query_groups=2,
            vocab_size=151936, max_position_embeddings=32768, rotary_base=1000000.0,
            share_embeddings_and_output_weights=True,
        )  # fmt: skip
    return ModelArch(num_layers=4, vocab_size=100, max_position_embeddings=128)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def max_over_ranks(x: float, device: str) -> float:
    t = torch.tensor([x], dtype=torch.float64, device="cuda" if device == "cuda" else "cpu")
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())


def plan_estimate(args: argparse.Namespace, world: int) -> float | None:
    """The plan's refit estimate for this shape and layout (None if the config does not plan)."""
    try:
        from rlconf.config import (
            ActorConfig,
            ClusterConfig,
            MegatronConfig,
            ModelConfig,
            RLConfig,
            RolloutConfig,
        )
        from rlconf.plan import compile_plan

        cfg = RLConfig(
            model=ModelConfig(arch=get_arch(args.arch), params_dtype=args.dtype),
            actor=ActorConfig(megatron=MegatronConfig(tensor_model_parallel_size=args.actor_tp,
                                                      pipeline_model_parallel_size=args.actor_pp)),
            rollout=RolloutConfig(tensor_model_parallel_size=args.rollout_tp),
            cluster=ClusterConfig(gpus_per_node=world, device=args.device),
        )  # fmt: skip
        return compile_plan(cfg).refit.estimated_s
    except Exception:  # the estimate is a side note; the measurement is the point
        return None


def run(args: argparse.Namespace) -> dict:
    from rlconf.config import ActorConfig, MegatronConfig, ModelConfig
    from rltrain.rollout.reshard import RolloutReplica

    mcfg = MegatronConfig(
        tensor_model_parallel_size=args.actor_tp, pipeline_model_parallel_size=args.actor_pp
    )
    init_groups(mcfg, args.device)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model_cfg = ModelConfig(arch=get_arch(args.arch), params_dtype=args.dtype, attention_backend="sdpa")
    actor = actor_of(model_cfg, ActorConfig(megatron=mcfg), args.device, trainable=False)
    out: dict = {"arch": args.arch, "dtype": args.dtype, "world": world, "actor_tp": args.actor_tp,
                 "actor_pp": args.actor_pp, "rollout_tp": args.rollout_tp, "bucket_mib": args.bucket_mib}  # fmt: skip
    sync(args.device)
    t0 = time.perf_counter()
    replica = RolloutReplica(actor, args.rollout_tp, args.bucket_mib * 2**20)
    sync(args.device)
    out["build_s"] = max_over_ranks(time.perf_counter() - t0, args.device)
    times = []
    for i in range(args.repeats + 1):  # the first refit warms the allocator and NCCL: not counted
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        torch.distributed.barrier()
        stats = replica.refit()
        dt = max_over_ranks(stats.seconds, args.device)
        if args.device == "cuda":
            out["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - before) / 2**30
        out["extra_gib"] = replica.allocated_bytes() / 2**30
        out["bytes_per_rank"], out["buckets"] = stats.bytes, stats.buckets
        replica.release()
        if i:
            times.append(dt)
    out["refit_s"] = times
    out["refit_s_min"], out["refit_s_median"] = min(times), statistics.median(times)
    out["plan_estimate_s"] = plan_estimate(args, world)
    try:  # a short greedy generation through the replica, against the actor's own log-probs
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(1, min(get_arch(args.arch).vocab_size, 1000), (4 * world, 16), generator=g)
        batch = replica.generate(prompts, torch.ones_like(prompts), seed=0, actor_dp_rank=_dp_rank(),
                                 max_new_tokens=16, temperature=1.0)  # fmt: skip
        lp = actor.compute_log_prob(batch, temperature=1.0, with_entropy=False)["log_probs"]
        gap = ((batch["rollout_log_probs"] - lp).abs() * batch["response_mask"]).max().item()
        out["check"] = {"rows": int(batch["responses"].shape[0]), "logprob_diff_max": gap}
    except Exception as exc:
        out["check"] = {"error": f"{type(exc).__name__}: {exc}"}
        if rank == 0:
            traceback.print_exc()
    return out


def _dp_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank()


def main_rank(args: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))
    out = run(args)
    if torch.distributed.get_rank() == 0:
        print(json.dumps(out, indent=2))
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "refit_gpu.json").write_text(json.dumps(out, indent=2))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _spawned(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    if args.device == "cpu":
        torch.set_num_threads(1)
    main_rank(args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="qwen15b", choices=["qwen15b", "qwen05b", "tiny"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--actor-tp", type=int, default=2)
    p.add_argument("--actor-pp", type=int, default=1)
    p.add_argument("--rollout-tp", type=int, default=1)
    p.add_argument("--bucket-mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not started by torchrun")
    p.add_argument("--out", default=os.environ.get("OUT"))
    args = p.parse_args()
    if "RANK" in os.environ:  # torchrun
        main_rank(args)
        return
    from rltrain.megatron.parallel import free_port

    torch.multiprocessing.spawn(_spawned, args=(args, free_port()), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
