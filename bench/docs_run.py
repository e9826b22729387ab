"""The run records the docs quote: the README's main job and the verl walk-through, run as written.

    .venv/bin/python bench/docs_run.py [--install] [--verl]

Runs `.venv/bin/rltrain tiny-grpo` in a fresh temporary folder (with `.venv` linked in, so the command and
the `outputs/tiny-grpo/...` paths are the README's), then writes `docs/_generated/tiny-grpo-run.json`: the
command, its wall time, this machine, the printed lines, the per-step rewards, the validation rewards and
the last metrics line; copies the run's reward curve to `docs/img/tiny-grpo-reward-curve.png`; and
regenerates the docs (`rlconf docs`), whose generated regions quote the record. `--install` also times the
README's install command in a fresh virtual environment (otherwise the record keeps its last measurement).

`--verl` instead runs docs/migrating-from-verl.md's GSM8K walk-through (its bash block, as printed, in a fresh
folder) and writes `docs/_generated/verl-gsm8k-small-run.json`: each command's printed lines, the per-step
rewards and the validation rewards, which the page quotes.

tests/test_readme_commands.py checks that a short run of today's code still starts like the main job's
record; tests/test_verl_quickstart.py runs the walk-through and checks it prints and scores like its record.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "docs" / "_generated" / "tiny-grpo-run.json"
CURVE = ROOT / "docs" / "img" / "tiny-grpo-reward-curve.png"
VERL_RECORD = ROOT / "docs" / "_generated" / "verl-gsm8k-small-run.json"
VERL_PAGE = ROOT / "docs" / "migrating-from-verl.md"
VERL_SECTION = "## verl's GSM8K quickstart, in small"
COMMAND = ".venv/bin/rltrain tiny-grpo"
INSTALL = "python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e ."


def _machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())  # fmt: skip
    return f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}"


def time_install() -> float:
    """Seconds for the README's install command in an empty folder (the repository installed editable)."""
    with tempfile.TemporaryDirectory() as tmp:
        command = INSTALL.replace("-e .", f"-e {ROOT}")
        t0 = time.perf_counter()
        subprocess.run(command, shell=True, cwd=tmp, check=True)
        return time.perf_counter() - t0


def run_main_job() -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / ".venv").symlink_to(ROOT / ".venv")
        t0 = time.perf_counter()
        result = subprocess.run(COMMAND, shell=True, cwd=tmp, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t0
        if result.returncode != 0:
            sys.exit(f"{COMMAND} failed ({result.returncode}):\n{result.stderr[-3000:]}")
        out = Path(tmp) / "outputs" / "tiny-grpo"
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        shutil.copyfile(out / "reward_curve.png", CURVE)
    return {
        "command": COMMAND,
        "wall_s": round(wall, 1),
        "stdout": result.stdout.splitlines(),
        "rewards": [r["reward/mean"] for r in rows],
        "val_before": rows[0].get("val_before/reward/mean"),
        "val": {str(r["step"]): r["val/reward/mean"] for r in rows if r.get("val/reward/mean") is not None},
        "last": rows[-1],
    }


def verl_walkthrough(page: str) -> list[str]:
    """The commands of the page's GSM8K walk-through (its first bash block), continuation lines joined."""
    section = page[page.index(VERL_SECTION) :]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]


def run_verl_walkthrough(work: Path, env: dict[str, str] | None = None) -> dict[str, object]:
    """The walk-through's commands in `work` (holding `.venv` and `bench`): each command with its printed
    lines, the run's per-step rewards and validation rewards. Exits on the first failing command."""
    commands = []
    for command in verl_walkthrough(VERL_PAGE.read_text()):
        t0 = time.perf_counter()
        # RLPLAN_HEAVY_LOCK: a lock file the run (Ray, megatron) queues on when machines are shared.
        lock = os.environ.get("RLPLAN_HEAVY_LOCK") if command.startswith(".venv/bin/rltrain") else None
        shell = f"flock {lock} {command}" if lock else command
        result = subprocess.run(shell, shell=True, executable="/bin/bash", cwd=work, env=env,
                                capture_output=True, text=True, check=False)  # fmt: skip
        if result.returncode != 0:
            sys.exit(
                f"{command} failed ({result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
            )
        commands.append({"command": command, "wall_s": round(time.perf_counter() - t0, 1),
                         "stdout": result.stdout.splitlines()})  # fmt: skip
    rows = [
        json.loads(line) for line in (work / "outputs" / "rlplan" / "metrics.jsonl").read_text().splitlines()
    ]
    return {
        "commands": commands,
        "rewards": [r["reward/mean"] for r in rows],
        "val_before": rows[0].get("val_before/reward/mean"),
        "val": {str(r["step"]): r["val/reward/mean"] for r in rows if r.get("val/reward/mean") is not None},
    }


def record_verl() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / ".venv").symlink_to(ROOT / ".venv")
        (work / "bench").symlink_to(ROOT / "bench")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        record = {
            "date": datetime.date.today().isoformat(),
            "machine": _machine(),
            **run_verl_walkthrough(work, env),
        }
    VERL_RECORD.parent.mkdir(parents=True, exist_ok=True)
    VERL_RECORD.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {VERL_RECORD}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--install", action="store_true", help="also time the install command")
    parser.add_argument("--verl", action="store_true", help="record the verl walk-through instead")
    args = parser.parse_args()
    if args.verl:
        record_verl()
        subprocess.run(
            [str(ROOT / ".venv" / "bin" / "rlconf"), "docs", "docs/reference"], cwd=ROOT, check=True
        )
        return 0
    old = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    record = {
        "date": datetime.date.today().isoformat(),
        "machine": _machine(),
        "install_command": INSTALL,
        "install_s": round(time_install(), 1) if args.install else old.get("install_s"),
        "install_date": datetime.date.today().isoformat() if args.install else old.get("install_date"),
        **run_main_job(),
    }
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {RECORD} and {CURVE}")
    subprocess.run([str(ROOT / ".venv" / "bin" / "rlconf"), "docs", "docs/reference"], cwd=ROOT, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
