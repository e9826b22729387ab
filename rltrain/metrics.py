"""Run metrics: one JSON object per step in `metrics.jsonl`, a console line, and the reward-curve PNG."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
REWARD_PLOT = "reward_curve.png"
CONSOLE_KEYS = (
    "reward/mean",
    "actor/loss",
    "actor/lr",
    "critic/vf_loss",
    "response/length_mean",
    "timing/step_s",
)


def _plain(value: Any) -> Any:
    """JSON-safe scalars (tensors and numpy numbers become floats; NaN becomes null)."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Appends each step's metrics to output_dir/metrics.jsonl and prints a compact console line.

    Appending (not rewriting) means a resumed run continues the same file; `truncate_after(step)` drops
    lines of steps that a resume will redo, so the file never holds a step twice.
    """

    def __init__(self, output_dir: str | Path, backends: Sequence[str]) -> None:
        self.path = Path(output_dir) / METRICS_FILE
        self.backends = tuple(backends)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = [
            line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step
        ]
        self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        if "jsonl" in self.backends:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        if "console" in self.backends:
            parts = [f"step {step:4d}"]
            for key in CONSOLE_KEYS:
                if record.get(key) is not None:
                    parts.append(f"{key} {record[key]:.4g}")
            print("  ".join(parts), file=sys.stdout, flush=True)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_reward_curve(metrics_path: str | Path, png_path: str | Path, title: str = "reward") -> Path | None:
    """Plot reward/mean (and val/reward/mean when present) against step into a PNG."""
    rows = [r for r in read_metrics(metrics_path) if r.get("reward/mean") is not None]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(
        [r["step"] for r in rows], [r["reward/mean"] for r in rows], marker=".", label="train reward/mean"
    )
    val = [r for r in read_metrics(metrics_path) if r.get("val/reward/mean") is not None]
    if val:
        ax.plot(
            [r["step"] for r in val], [r["val/reward/mean"] for r in val], marker="o", label="val reward/mean"
        )
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path)
    plt.close(fig)
    return png_path
