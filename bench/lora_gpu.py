"""LoRA vs full fine-tuning on one GPU preset (issue 34 item 7): the same GRPO steps twice, once as the
preset is (full fine-tuning, KL loss with a ref worker) and once with `--actor.lora.rank R` (adapters only,
the ref = the actor with its adapters off); one JSON report with, per variant, seconds per step, tokens/s per
device, every phase's time, and the plan's memory estimate of each phase of the policy pool next to the
measured peak of that role call (`perf/max_memory_allocated_gib/<phase>`), with measured / estimate and
whether it is within +-15%. Built on bench/grpo_step_gpu.py's runner (each variant is an `rltrain` process).

On the GPU machine (bench/device_setup.sh first):
    python3 bench/lora_gpu.py --preset qwen2.5-1.5b-grpo --rank 64 --steps 4 --out $OUT
A 7B shape on one H200 if it fits (LoRA only; the full run is refused by the plan's memory check):
    python3 bench/lora_gpu.py --preset qwen2.5-7b-grpo-tp4pp2 --variants lora --set cluster.gpus_per_node=1 \
        --set actor.megatron.tensor_model_parallel_size=1 --set actor.megatron.pipeline_model_parallel_size=1 ...
CPU smoke test (tiny model, no memory numbers):
    .venv/bin/python bench/lora_gpu.py --preset tiny-grpo --rank 8 --steps 3 --out /tmp/lora_bench
Writes lora.json to --out and prints one summary line per variant.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo_step_gpu import PHASES, preset_config, run_rlplan


def variant_flags(name: str, rank: int, alpha: float | None) -> list[str]:
    if name == "full":
        return []
    if name == "lora":
        return [
            "--actor.lora.rank",
            str(rank),
            "--actor.lora.alpha",
            str(alpha if alpha is not None else 2.0 * rank),
        ]
    raise SystemExit(f"unknown variant {name!r}: expected full or lora")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-1.5b-grpo")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--alpha", type=float, default=None, help="default: 2 x rank")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--variants", default="full,lora")
    parser.add_argument("--set", action="append", default=[], metavar="PATH=VALUE", help="extra rltrain flag")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/lora_bench"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = preset_config(args.preset)
    extra = [f for kv in args.set for f in (f"--{kv.split('=', 1)[0]}", kv.split("=", 1)[1])]
    if cfg.cluster.device == "cuda":
        extra = ["--cluster.cpus_per_worker", "4", *extra]
    report: dict[str, Any] = {"preset": args.preset, "rank": args.rank, "steps": args.steps}
    try:
        import torch

        report["torch"] = torch.__version__
        report["device_name"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except ImportError:
        pass
    for variant in args.variants.split(","):
        result = run_rlplan(
            args.preset, variant, variant_flags(variant, args.rank, args.alpha) + extra, args.steps, out
        )
        plan_path = out / f"rlplan_{variant}" / "plan.json"
        if plan_path.exists():
            plan = json.loads(plan_path.read_text())
            policy = plan["models"]["policy"]
            result["params_total"], result["params_trainable"] = (
                policy["params_total"],
                policy["params_trainable"],
            )
            result["roles"] = plan["roles"]
        report[variant] = result
        s = result.get("summary_steps_2_n", {})
        if s:
            phases = ", ".join(
                f"{p} {s[f'timing/{p}_s']['median']:.3g}" for p in PHASES if s.get(f"timing/{p}_s")
            )
            mem = ", ".join(
                f"{m['phase']} {m['estimate_gib']:.1f}"
                + (f"/{m['measured_gib']:.1f}" if m["measured_gib"] is not None else "")
                for m in result["memory"]
            )
            print(f"{variant}: {s['timing/step_s']['median']:.3g} s/step, {s['perf/throughput']['median']:.4g} tokens/s "
                  f"per device; {phases}; memory GiB estimate/measured: {mem}", flush=True)  # fmt: skip
        else:
            print(f"{variant}: failed (see rlplan_{variant}.log)", flush=True)
    full, lora = report.get("full", {}), report.get("lora", {})
    if full.get("summary_steps_2_n") and lora.get("summary_steps_2_n"):
        f, lo = full["summary_steps_2_n"], lora["summary_steps_2_n"]
        report["lora_over_full_throughput"] = lo["perf/throughput"]["median"] / f["perf/throughput"]["median"]
        print(f"lora / full tokens/s: {report['lora_over_full_throughput']:.2f}")
    (out / "lora.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out / 'lora.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
