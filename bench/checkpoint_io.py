"""Checkpoint I/O on the CPU: save and load throughput of a Qwen2.5-0.5B-shaped actor (bf16 parameters, fp32
main parameters and Adam state under the distributed optimizer, as the GPU presets train it), next to the
raw write bandwidth of the same disk measured by `dd` in the same run, and the training stall of an async
save (the time the caller is blocked) against a sync save.

What is timed is `rltrain.checkpoint.save_engine` / `load_engine` on a gloo world of one: the dist checkpoint
(torch_dist), RNG and extra files, fsync of every file, the manifest (sha256 of small files, sampled digests
of large ones). Loads are timed cold: the checkpoint's pages are evicted from the page cache first
(posix_fadvise DONTNEED after the data is on disk), so they read the disk, as a resume after a restart does;
a warm load (page cache) is timed too. The optimizer state is what a first step creates (zero moments, same
bytes as a trained one): a 0.5B training step on a 2-core CPU would only add minutes.

Run: OMP_NUM_THREADS=2 .venv/bin/python bench/checkpoint_io.py [--dir DIR] [--layers 24] [--repeat 3]
DIR (default /tmp/rlplan-checkpoint-bench) must be on the disk to measure; it is removed afterwards unless
--keep. Needs ~16 GB of memory and ~3 x 7 GB of disk at the full 24 layers. Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.megatron._common import actor_of, init_groups

CONTENTS = ("model", "optimizer", "extra")


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def evict(folder: Path) -> None:
    """Drop the folder's pages from the page cache (clean pages only: the save fsynced them)."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def dd_write(folder: Path, mb: int) -> dict[str, Any]:
    """Sequential write bandwidth of the disk under `folder`: O_DIRECT if the filesystem takes it, and
    through the page cache with an fdatasync at the end (what a checkpoint save does)."""
    out: dict[str, Any] = {}
    target = folder / "dd.bin"
    for name, flag in (("direct", "oflag=direct"), ("fdatasync", "conv=fdatasync")):
        t0 = time.perf_counter()
        proc = subprocess.run(
            ["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={mb}", flag],
            capture_output=True,
            text=True,
        )
        seconds = time.perf_counter() - t0
        target.unlink(missing_ok=True)
        if proc.returncode != 0:
            out[name] = {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
            continue
        # dd's own clock when it prints one ("..., 2.1 s, 1.0 GB/s"), else ours.
        m = re.search(r"copied, ([0-9.]+) s", proc.stderr)
        seconds = float(m.group(1)) if m else seconds
        out[name] = {"bytes": mb << 20, "seconds": seconds, "gb_s": (mb << 20) / seconds / 1e9}
    return out


def build_actor(layers: int, dtype: str, distributed: bool = True):
    from dataclasses import replace

    from presets.gpu import QWEN25_05B
    from rlconf.config import ActorConfig, MegatronConfig, ModelConfig, Optim

    arch = replace(QWEN25_05B, num_layers=layers)
    model = ModelConfig(arch=arch, params_dtype=dtype, attention_backend="sdpa")  # type: ignore[arg-type]
    actor = ActorConfig(megatron=MegatronConfig(use_distributed_optimizer=distributed), optim=Optim(lr=1e-6))
    return actor_of(model, actor, "cpu", total_steps=10)


def params_of(actor) -> int:
    return sum(p.numel() for m in actor.modules() for p in m.parameters())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/tmp/rlplan-checkpoint-bench")
    parser.add_argument("--layers", type=int, default=24, help="24 = Qwen2.5-0.5B; fewer for a quick look")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument(
        "--optimizer",
        default="distributed",
        choices=["distributed", "plain"],
        help="distributed: megatron's distributed optimizer, saved fully_reshardable (what runs use); plain: "
        "the non-distributed one, saved in parameter space (same bytes, no gather: less memory and time)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="saves and loads of each kind")
    parser.add_argument("--dd-mb", type=int, default=2048)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()

    import warnings

    warnings.filterwarnings("ignore")
    from rlconf.config import MegatronConfig
    from rltrain import checkpoint as ck
    from rltrain.megatron.parallel import destroy_parallel, free_port

    root = Path(args.dir)
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    results: dict[str, Any] = {
        "dir": str(root),
        "layers": args.layers,
        "dtype": args.dtype,
        "optimizer": args.optimizer,
    }
    try:
        results["dd"] = dd_write(root, args.dd_mb)
        init_groups(
            MegatronConfig(), "cpu", rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port()
        )
        t0 = time.perf_counter()
        actor = build_actor(args.layers, args.dtype, args.optimizer == "distributed")
        results["build_s"] = time.perf_counter() - t0
        results["params"] = params_of(actor)
        extra = {"step": 1, "dataloader": {"epoch": 0, "index": 0}}

        # Sync saves: the first one in a process also starts megatron's helper process (reported apart).
        sync = []
        for i in range(args.repeat):
            folder = root / f"sync_{i}" / "actor"
            t0 = time.perf_counter()
            ck.save_engine(actor, folder, CONTENTS, extra)
            sync.append(
                {"seconds": time.perf_counter() - t0, "bytes": folder_bytes(folder), **ck.last_timings()}
            )
            if i:
                shutil.rmtree(root / f"sync_{i}")  # keep one on disk to load; the others only cost space
        results["save_sync"] = sync
        nbytes = sync[0]["bytes"]

        loads = []
        folder = root / "sync_0" / "actor"
        for _ in range(args.repeat):
            evict(folder)
            t0 = time.perf_counter()
            ck.load_engine(actor, folder, CONTENTS)
            loads.append({"seconds": time.perf_counter() - t0, "cold": True, **ck.last_timings()})
        t0 = time.perf_counter()
        ck.load_engine(actor, folder, CONTENTS)
        loads.append({"seconds": time.perf_counter() - t0, "cold": False, **ck.last_timings()})
        results["load"] = loads

        # Async saves: the caller is blocked until save_engine returns; afterwards a training loop calls
        # finalize_pending(blocking=False) once per step (a collective in a real run): those calls count too.
        asyncs = []
        for i in range(args.repeat):
            folder = root / f"async_{i}" / "actor"
            t0 = time.perf_counter()
            ck.save_engine(actor, folder, CONTENTS, extra, async_save=True)
            blocked = time.perf_counter() - t0
            polls = 0
            while ck.has_pending():
                time.sleep(0.25)  # "a training step"
                t1 = time.perf_counter()
                ck.finalize_pending(blocking=False)
                blocked += time.perf_counter() - t1
                polls += 1
            total = time.perf_counter() - t0
            asyncs.append(
                {"stall_s": blocked, "total_s": total, "polls": polls, "bytes": folder_bytes(folder)}
            )
            shutil.rmtree(root / f"async_{i}")
        results["save_async"] = asyncs
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        destroy_parallel()

    steady = sync[1:] or sync
    save_s = min(s["seconds"] for s in steady)
    cold = [x["seconds"] for x in loads if x["cold"]]
    warm = [x["seconds"] for x in loads if not x["cold"]]
    stall = statistics.median(a["stall_s"] for a in asyncs)
    async_total = statistics.median(a["total_s"] for a in asyncs)
    summary = {
        "checkpoint_gb": nbytes / 1e9,
        "params_m": results["params"] / 1e6,
        "save_sync_s": save_s,
        "save_sync_first_s": sync[0]["seconds"],
        "save_gb_s": nbytes / save_s / 1e9,
        "load_cold_s": min(cold),
        "load_gb_s": nbytes / min(cold) / 1e9,
        "load_warm_s": min(warm),
        "load_warm_gb_s": nbytes / min(warm) / 1e9,
        "dd_direct_gb_s": results["dd"].get("direct", {}).get("gb_s"),
        "dd_fdatasync_gb_s": results["dd"].get("fdatasync", {}).get("gb_s"),
        "async_stall_s": stall,
        "async_total_s": async_total,
        "async_stall_vs_sync": stall / save_s,
    }
    results["summary"] = summary

    def f(x: float | None, unit: str = "") -> str:
        return "-" if x is None else f"{x:.2f}{unit}"

    rows = [
        ("model", f"Qwen2.5-0.5B shape, {args.layers} layers, {summary['params_m']:.0f}M params, {args.dtype} + fp32 Adam ({args.optimizer} optimizer)"),
        ("checkpoint size", f(summary["checkpoint_gb"], " GB") + f" ({', '.join(CONTENTS)})"),
        ("dd write, O_DIRECT", f(summary["dd_direct_gb_s"], " GB/s")),
        ("dd write, fdatasync", f(summary["dd_fdatasync_gb_s"], " GB/s")),
        ("sync save", f"{f(summary['save_gb_s'], ' GB/s')} ({save_s:.2f} s; first in process {sync[0]['seconds']:.2f} s)"),
        ("load, cold cache", f"{f(summary['load_gb_s'], ' GB/s')} ({min(cold):.2f} s)"),
        ("load, warm cache", f"{f(summary['load_warm_gb_s'], ' GB/s')} ({min(warm):.2f} s)"),
        ("async save: caller blocked", f"{stall:.2f} s = {summary['async_stall_vs_sync']:.0%} of a sync save"),
        ("async save: until complete", f"{async_total:.2f} s"),
    ]  # fmt: skip
    width = max(len(r[0]) for r in rows)
    print(
        f"checkpoint I/O in {root} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}, {os.cpu_count()} CPUs)"
    )
    for name, value in rows:
        print(f"  {name.ljust(width)}  {value}")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
