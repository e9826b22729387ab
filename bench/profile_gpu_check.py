"""GPU check of the per-role profiler (run on the lent H200): is nsys on the image, does a torch-tool
profile of a CUDA role call hold the role range and its CUDA kernels, and do NVTX calls run.

Run: python3 bench/profile_gpu_check.py; prints a JSON report (also written to $OUT/profile_gpu.json).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from presets import PRESETS
from rlconf.load import load_config
from rlconf.plan import compile_plan
from rltrain.profiling import Profiler


def main() -> None:
    out = tempfile.mkdtemp()
    cfg = load_config(
        None,
        preset="tiny-grpo",
        presets=PRESETS,
        overrides=[
            "cluster.device=cuda",
            "profile.tool=torch",
            "profile.steps=[2]",
            f"trainer.output_dir={out}",
        ],
    )
    plan = compile_plan(cfg)
    prof = Profiler(plan.profile, worker="actor", rank=0, device="cuda")
    prof.set_step(2)
    a = torch.randn(2048, 2048, device="cuda")
    with prof.profiled("actor_update"):
        for _ in range(3):
            a = a @ a / 2048
        torch.cuda.synchronize()
    prof.close()
    trace = Path(plan.profile.save_path) / "step_2" / "actor_update" / "rank_0" / "trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    torch.cuda.nvtx.range_push("actor_update/step_2")
    torch.cuda.nvtx.range_pop()
    report = {
        "nsys": shutil.which("nsys"),
        "trace": str(trace),
        "role_range_in_trace": any(e.get("name") == "actor_update" for e in events),
        "cuda_kernels": sum(1 for e in events if e.get("cat") == "kernel"),
        "nvtx_calls_ok": True,
    }
    print(json.dumps(report, indent=2))
    Path(os.environ.get("OUT", ".")).joinpath("profile_gpu.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
