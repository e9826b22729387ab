"""Host time of megatron's distributed-optimizer copies around a step, megatron's per-parameter loops against
rltrain/megatron/multi_tensor.py's (one foreach copy of the updated shards into the parameter buffer, the
gradient views found once per optimizer), and of a whole guarded optimizer step (norm, clipping, guard, fused
AdamW, copies) decided on the host as megatron decides it against decided on the device
(rltrain/megatron/model.py `steps_on_device`), on a qwen3-moe-routed model of tiny widths (24 layers x 64
experts: 3,243 parameters, the preset's count) in bf16 on the CPU: the Python these cost per step is the same
on a GPU host, where the update waits for it (docs/benchmarks.md). On the CPU no step waits for a device, so
the whole-step rows measure the host's own work only, not the waits the device path removes, and they run
inside the CPU's cuda->cpu TorchFunctionMode (rltrain/megatron/cpu_compat.py), which adds to every torch
call: their torch-call counts are the figure that carries over to a GPU host.

    OMP_NUM_THREADS=1 .venv/bin/python bench/optimizer_host.py [--layers 24] [--repeat 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=20, help="steps timed per measurement (5 measurements)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from presets.gpu import QWEN3_MOE_3B
    from rlconf.config import ActorConfig, ModelConfig
    from rltrain.megatron import multi_tensor
    from rltrain.megatron.parallel import GroupSizes, free_port, init_parallel
    from tests.megatron._common import actor_of

    init_parallel(GroupSizes(), "cpu", rank=0, world_size=1, master_port=free_port())
    arch = replace(QWEN3_MOE_3B, num_layers=a.layers, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                   num_query_groups=2, kv_channels=16, vocab_size=128, moe_ffn_hidden_size=32)  # fmt: skip
    model = ModelConfig(arch=arch, params_dtype="bfloat16", attention_backend="sdpa", moe_grouped_gemm=True)
    actor = actor_of(model, ActorConfig(ppo_mini_batch_size=4, use_dynamic_bsz=False), "cpu", total_steps=2)
    optimizers = [o for o in actor.optimizer.chained_optimizers if isinstance(o, DistributedOptimizer)]
    ways = {
        "params megatron": multi_tensor.megatron_method("_copy_main_params_to_model_params"),
        "params foreach": multi_tensor.copy_main_params_to_model_params,
        "grads megatron": multi_tensor.megatron_method("_copy_model_grads_to_main_grads"),
        "grads cached": multi_tensor.copy_model_grads_to_main_grads,
    }
    report: dict = {
        "parameters": sum(len(g) for o in optimizers for g in (*o.model_float16_groups, *o.model_fp32_groups))
    }
    for name, method in ways.items():
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(a.repeat):
                for o in optimizers:
                    method(o)
            runs.append((time.perf_counter() - start) / a.repeat * 1e3)
        report[f"{name} ms per step"] = {"median": round(statistics.median(runs), 2),
                                         "min": round(min(runs), 2), "max": round(max(runs), 2)}  # fmt: skip
    import os

    from rltrain.megatron.fused import TRAIN_KERNELS_OFF_ENV
    from tests.megatron._common import fuse_adam_on_cpu

    fuse_adam_on_cpu(actor)  # torch's fused AdamW, as on an accelerator
    for c in actor.chunks:
        for p in c.parameters():
            if getattr(p, "main_grad", None) is not None:
                p.main_grad.normal_(std=1e-3)
    from torch.overrides import TorchFunctionMode

    class CountCalls(TorchFunctionMode):
        """Counts the torch calls of a step (tensor methods included): on a GPU host each is a dispatch, most
        of them a launch."""

        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            CountCalls.calls += 1
            return func(*args, **(kwargs or {}))

    for name, off in (("step decided on the host", "deviceguard"), ("step decided on the device", "")):
        os.environ[TRAIN_KERNELS_OFF_ENV] = off
        runs = []
        with actor._ctx():
            actor.optimizer_step(True)  # warm-up: the optimizer's state and cached lists
            CountCalls.calls = 0
            with CountCalls():
                actor.optimizer_step(True)
            report[f"{name}: torch calls"] = CountCalls.calls
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(a.repeat):
                    actor.optimizer_step(True)
                runs.append((time.perf_counter() - start) / a.repeat * 1e3)
        report[f"{name}: ms (inside the CPU's cuda->cpu mode)"] = {"median": round(statistics.median(runs), 2),
                                "min": round(min(runs), 2), "max": round(max(runs), 2)}  # fmt: skip
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
