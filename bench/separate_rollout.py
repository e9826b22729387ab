"""Colocated vs separate rollout placement, side by side on the same devices (issue 24).

Runs `rltrain PRESET` in three placements on D devices, alternating them `--repeats` times so that load
drift on the machine hits all of them alike, and reports per placement the median step time over steps
`--skip`+1.. (the first steps pay start-up and the first checkpoint-helper spawn), its spread over the
repeats, and the whole-step throughput (perf/throughput: tokens per second per device):

  colocated      all D devices train and generate in turn (DP = D)
  separate/0     D - R devices train, R generate; on-policy: each batch waits for the push
  separate/1     the same with algorithm.off_policy_steps 1: generation of step s + 1 overlaps step s

    python bench/separate_rollout.py --preset tiny-grpo --devices 2 --rollout-devices 1 --steps 30
    python bench/separate_rollout.py --preset qwen2.5-1.5b-grpo --devices 2 --rollout-devices 1 \
        --steps 8 --skip 2 -- --trainer.test_freq 0 --trainer.val_before_train false   # nvidia-h200-x2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(preset: str, extra: list[str], out: Path) -> list[dict]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    cmd = [sys.executable, "-m", "rltrain.cli", preset, "--trainer.output_dir", str(out),
           "--trainer.save_freq", "0", *extra]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny-grpo")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--rollout-devices", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("rest", nargs="*", help="more rltrain flags for every run (after --)")
    args = ap.parse_args()
    common = [
        "--cluster.gpus_per_node",
        str(args.devices),
        "--trainer.total_steps",
        str(args.steps),
        *args.rest,
    ]
    sep = ["--rollout.placement", "separate", "--rollout.num_devices", str(args.rollout_devices)]
    variants = {
        "colocated": common,
        "separate/0": [*common, *sep],
        "separate/1": [*common, *sep, "--algorithm.off_policy_steps", "1"],
    }
    step_s: dict[str, list[float]] = {k: [] for k in variants}
    tput: dict[str, list[float]] = {k: [] for k in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for name, extra in variants.items():
                rows = run(args.preset, extra, Path(tmp) / f"{name.replace('/', '_')}_{r}")[args.skip :]
                step_s[name].append(statistics.median(x["timing/step_s"] for x in rows))
                tput[name].append(statistics.median(x["perf/throughput"] for x in rows))
    base = statistics.median(tput["colocated"])
    print(f"{args.preset} on {args.devices} devices ({args.rollout_devices} for a separate rollout), "
          f"steps {args.skip + 1}-{args.steps}, {args.repeats} repeats (median [min-max] over repeats)")  # fmt: skip
    print(f"{'placement':<12} {'s/step':>24} {'tokens/s/device':>28} {'vs colocated':>13}")
    for name in variants:
        s, t = step_s[name], tput[name]
        print(f"{name:<12} {statistics.median(s):>8.3f} [{min(s):.3f}-{max(s):.3f}]"
              f" {statistics.median(t):>12.0f} [{min(t):.0f}-{max(t):.0f}]"
              f" {statistics.median(t) / base:>12.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
