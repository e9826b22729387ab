"""Whole-process wall time of the CLI entry points (targets: rlconf < 0.5 s, rltrain --help < 1.5 s).

Run: .venv/bin/python bench/cli_startup.py [--repeat 10]. Prints a table and a JSON line; exits 1 when a
target is missed. Timings are medians over fresh processes, as a user experiences them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def wall(cmd: list[str], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = os.path.join(tmp, "run.yaml")
        Path(cfg).write_text("preset: tiny-ppo\nactor:\n  optim:\n    lr: 1e-6\n")
        cases = [
            ("rlconf --help", [str(BIN / "rlconf"), "--help"], 0.5),
            ("rlconf validate FILE", [str(BIN / "rlconf"), "validate", cfg], 0.5),
            (
                "rlconf plan --preset 7B",
                [str(BIN / "rlconf"), "plan", "--preset", "qwen2.5-7b-grpo-tp4pp2"],
                0.5,
            ),
            ("rltrain --help", [str(BIN / "rltrain"), "--help"], 1.5),
            ("rltrain tiny-grpo --help", [str(BIN / "rltrain"), "tiny-grpo", "--help"], 1.5),
            ("rltrain tiny-grpo --dry-run", [str(BIN / "rltrain"), "tiny-grpo", "--dry-run"], 1.5),
        ]
        results = {name: (wall(cmd, args.repeat), target) for name, cmd, target in cases}
    ok = True
    print(f"{'command':32s} {'median s':>9s} {'target s':>9s}")
    for name, (seconds, target) in results.items():
        ok &= seconds < target
        print(f"{name:32s} {seconds:9.3f} {target:9.1f}{'' if seconds < target else '  MISSED'}")
    print(json.dumps({name: round(s, 4) for name, (s, _) in results.items()}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
