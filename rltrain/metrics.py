"""Run metrics: one JSON object per step in `metrics.jsonl`, a console line, and the reward-curve PNG."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlconf.errors import ConfigError, error
from rltrain import metrics_file

METRICS_FILE = "metrics.jsonl"
VAL_GENERATIONS_FILE = "val_generations.jsonl"
"""logging.val_generations' samples: one line per validation, {"step": N, "samples": [...]}."""
REWARD_PLOT = "reward_curve.png"
CONSOLE_KEYS = (
    "reward/mean",
    "actor/loss",
    "actor/lr",
    "critic/vf_loss",
    "response/length_mean",
    "timing/step_s",
)
THROUGHPUT_KEY = "perf/total_num_tokens"
"""Tokens (prompts + responses, padding excluded) of a step; the console line turns it into tokens/s."""


SHARE_PHASES = (
    "generate",
    "wait_rollout",
    "old_log_prob",
    "ref",
    "values",
    "update_critic",
    "update_actor",
    "weight_push",
    "save_checkpoint",
)
"""Phases of a step (timing/<phase>_s) whose share of timing/step_s is logged as perf/share/<phase>; the
reward is scored inside `generate` (timing/reward_s is part of it) and is not a share of its own. With a
separate rollout pool generation overlaps the step: its share is the time the step waited for the batch
(wait_rollout), not the generation's own time."""
GUARD_CAUSE_KEY = "guard/cause"
"""Metric of a bad step (rltrain/guard.py): the first quantity that was not finite; on the step line too."""
MEMORY_KEY = "perf/max_memory_allocated_gib"
"""Peak device memory of the step over all roles and ranks; `MEMORY_KEY/<profile role>` per role call."""


def flops_per_token(params_active: int, num_layers: int, attention_width: int, mean_seq_len: float,
                    training: bool) -> float:  # fmt: skip
    """Model FLOPs per token: 6 x active params + 6·L·d·s (attention scores and values over a sequence of
    mean length s, d = heads x head dim) for forward + backward, a third of that for a forward pass
    (bench/actor_gpu.py's count); `params_active` as `matmul_params` counts them."""
    train = 6.0 * params_active + 6.0 * num_layers * attention_width * mean_seq_len
    return train if training else train / 3.0


def matmul_params(arch: Any, params_active: int) -> int:
    """The active parameters a token's activations are multiplied by: all of `params_active` (one token's
    routed experts, not every expert) but the input embedding, a lookup, unless it is also the output
    layer (tied)."""
    lookup = 0 if arch.share_embeddings_and_output_weights else arch.vocab_size * arch.hidden_size
    return params_active - lookup


def attention_width(arch: Any) -> int:
    """heads x head dim: the width of the attention products (not the hidden size where kv_channels is
    set apart from hidden / heads, as in Qwen3)."""
    return arch.num_attention_heads * (arch.kv_channels or arch.hidden_size // arch.num_attention_heads)


def model_flops_utilization(
    flops: float, seconds: float, peak_flops: float | None, devices: int
) -> float | None:
    """Model FLOPs over what `devices` devices at `peak_flops` could do in `seconds`; None without a peak
    (cpu, an unlisted device) or a time."""
    if not peak_flops or seconds <= 0 or devices <= 0:
        return None
    return flops / (seconds * peak_flops * devices)


def phase_shares(metrics: Mapping[str, Any]) -> dict[str, float]:
    """perf/share/<phase> = timing/<phase>_s / timing/step_s for the step's phases (SHARE_PHASES), and
    perf/share/other for the rest of the step (dispatch, reward outside generation, logging)."""
    step_s = metrics.get("timing/step_s")
    if not step_s:
        return {}
    overlapped = "timing/wait_rollout_s" in metrics  # generation ran beside the step
    shares = {f"perf/share/{p}": metrics[f"timing/{p}_s"] / step_s for p in SHARE_PHASES
              if f"timing/{p}_s" in metrics and not (overlapped and p == "generate")}  # fmt: skip
    shares["perf/share/other"] = max(0.0, 1.0 - sum(shares.values()))
    return shares


def memory_metrics(per_rank: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The step's peak device memory per role call (max over ranks) and over all of them (MEMORY_KEY);
    empty when nothing was measured (cpu)."""
    peaks: dict[str, float] = {}
    for rank in per_rank:
        for phase, gib in rank.items():
            peaks[phase] = max(peaks.get(phase, 0.0), gib)
    if not peaks:
        return {}
    return {MEMORY_KEY: max(peaks.values()), **{f"{MEMORY_KEY}/{p}": v for p, v in sorted(peaks.items())}}


def format_eta(seconds: float) -> str:
    """`42s`, `3m05s`, `1h02m`: short enough for a progress line."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _plain(value: Any) -> Any:
    """JSON-safe scalars (tensors and numpy numbers become floats; NaN becomes null)."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Sends each step's metrics to the configured backends.

    jsonl: appends to output_dir/metrics.jsonl (appending means a resumed run continues the same file;
    `truncate_after(step)` drops lines of steps a resume will redo, so no step appears twice).
    console: a rich progress bar on a terminal, plain lines otherwise (CI logs, files).
    tensorboard: event files in output_dir/tensorboard. wandb: offline unless WANDB_API_KEY is set.
    """

    def __init__(
        self,
        output_dir: str | Path,
        backends: Sequence[str],
        total_steps: int = 0,
        project: str = "rlplan",
        experiment: str = "run",
    ) -> None:
        self.path = Path(output_dir) / METRICS_FILE
        self.backends = tuple(backends)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self._step_seconds: list[float] = []  # this process's steps: the ETA ignores a resumed run's past
        self._tb = self._wandb = self._progress = None
        if "tensorboard" in self.backends:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError(
                    [
                        error(
                            "logging.backends",
                            "tensorboard is not installed",
                            "pip install tensorboard, or remove tensorboard from logging.backends",
                            "logging",
                        )
                    ]
                ) from None
            self._tb = SummaryWriter(str(Path(output_dir) / "tensorboard"))
        if "wandb" in self.backends:
            try:
                import wandb
            except ImportError:
                raise ConfigError(
                    [
                        error(
                            "logging.backends",
                            "wandb is not installed",
                            "pip install wandb, or remove wandb from logging.backends",
                            "logging",
                        )
                    ]
                ) from None
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            self._wandb = wandb.init(project=project, name=experiment, dir=str(output_dir), mode=mode)
        if "console" in self.backends and sys.stdout.isatty() and total_steps:
            from rich.progress import Progress

            self._progress = Progress(*progress_columns(), expand=True)
            self._task = self._progress.add_task("", total=total_steps)
            self._progress.start()

    def truncate_after(self, step: int) -> None:
        """Drop the lines of steps after `step`, atomically (rltrain.metrics_file: a torn last line goes
        too, a malformed line is a ConfigError naming the file and the line)."""
        metrics_file.truncate_after(self.path, step)
        metrics_file.truncate_after(self.path.with_name(VAL_GENERATIONS_FILE), step)
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        if "jsonl" in self.backends:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        numbers = {k: v for k, v in record.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        if self._tb is not None:
            for key, value in numbers.items():
                if key != "step":
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)
        if "console" in self.backends:
            parts = [f"{key} {record[key]:.4g}" for key in CONSOLE_KEYS if record.get(key) is not None]
            if record.get(GUARD_CAUSE_KEY):
                parts.append(f"bad step: {record[GUARD_CAUSE_KEY]} not finite, update not applied")
            speed = self._speed(step, record)
            if self._progress is not None:
                self._progress.update(
                    self._task, completed=step, description="  ".join(parts[:3] + speed[:1])
                )
            else:
                print(f"step {step:4d}  " + "  ".join(parts + speed), file=sys.stdout, flush=True)

    def log_generations(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        """A validation's recorded samples (logging.val_generations): a line of val_generations.jsonl
        (replacing one of the same step: a resumed run validating the step again), a wandb table, a
        tensorboard text. Each sample: input, output, gts, score, data_source, row."""
        path = self.path.with_name(VAL_GENERATIONS_FILE)
        records = metrics_file.parse(path).records
        if any(record["step"] >= step for _, _, record in records):
            metrics_file.write_lines(path, [line for _, line, record in records if record["step"] < step])
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "samples": list(samples)}, default=str) + "\n")
        columns = ("row", "input", "output", "gts", "score")
        if self._wandb is not None:
            import wandb

            table = wandb.Table(columns=["step", *columns])
            for sample in samples:
                table.add_data(step, *(str(sample[c]) if c != "score" else sample[c] for c in columns))
            self._wandb.log({"val/generations": table}, step=step)
        if self._tb is not None:
            text = "\n\n".join(
                f"**row {s['row']}**, score {s['score']:.4g}\n\n```\n{s['input']}\n```\n\n```\n{s['output']}\n```"
                for s in samples
            )  # markdown: tensorboard renders a text summary as markdown
            self._tb.add_text("val/generations", text, step)
            self._tb.flush()

    def _speed(self, step: int, record: Mapping[str, Any]) -> list[str]:
        """`tokens/s N` of this step and `ETA` from the mean step time of this process's steps so far."""
        step_s = record.get("timing/step_s")
        if not step_s:
            return []
        self._step_seconds.append(step_s)
        out = []
        if record.get(THROUGHPUT_KEY):
            out.append(f"tokens/s {record[THROUGHPUT_KEY] / step_s:.0f}")
        if self.total_steps:
            mean = sum(self._step_seconds) / len(self._step_seconds)
            out.append(f"ETA {format_eta(mean * max(0, self.total_steps - step))}")
        return out

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def progress_columns() -> tuple[Any, ...]:
    """The console progress line's columns: on a narrow terminal (80 columns) the metrics text is cut with
    an ellipsis and the bar shrinks, never the step count or the time left."""
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
    from rich.table import Column

    return (
        TextColumn("[bold]train", table_column=Column(no_wrap=True)),
        BarColumn(bar_width=None, table_column=Column(ratio=1, min_width=10)),
        MofNCompleteColumn(table_column=Column(no_wrap=True, min_width=7)),
        TimeRemainingColumn(table_column=Column(no_wrap=True, min_width=7)),
        TextColumn("{task.description}", table_column=Column(ratio=3, no_wrap=True, overflow="ellipsis")),
    )


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The step records of metrics.jsonl (a torn last line left out; rltrain.metrics_file.parse)."""
    return [record for _, _, record in metrics_file.parse(path).records]


KL_KEYS = {
    "actor/kl_loss": "KL(policy || ref), the kl_loss estimator",
    "actor/reward_kl": "KL(policy || ref) in the reward",
    "actor/ppo_kl_k3": "KL(old policy || policy) per update, k3",
}
"""What the plot's KL panel draws, by metric: the KL to the reference policy where the run has one, else the
k3 estimate of each update's step (>= 0; actor/ppo_kl is a k1 mean that dips below 0, so it is not drawn)."""


def kl_series(rows: list[dict[str, Any]]) -> tuple[list[tuple[str, list[int], list[float]]], str]:
    """The KL panel's curves (metric, steps, values) and title: the KL to the reference when logged, else the
    per-update k3 KL."""
    ref = [key for key in KL_KEYS if key != "actor/ppo_kl_k3" and any(r.get(key) is not None for r in rows)]
    series = []
    for key in ref or ["actor/ppo_kl_k3"]:
        kl = [r for r in rows if r.get(key) is not None]
        if kl:
            series.append((key, [r["step"] for r in kl], [r[key] for r in kl]))
    return series, "KL to the reference" if ref else "KL per update"


def plot_reward_curve(metrics_path: str | Path, png_path: str | Path, title: str = "reward") -> Path | None:
    """Plot reward/mean (and val/reward/mean) and the KL against step into one PNG with two panels."""
    rows = read_metrics(metrics_path)
    train = [r for r in rows if r.get("reward/mean") is not None]
    if not train:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_kl) = plt.subplots(1, 2, figsize=(10, 3.5), dpi=120)
    ax_r.plot(
        [r["step"] for r in train], [r["reward/mean"] for r in train], marker=".", label="train reward/mean"
    )
    # Validation before training is logged with step 1 but measured before it: plot it at step 0.
    val = [(0, r["val_before/reward/mean"]) for r in rows if r.get("val_before/reward/mean") is not None]
    val += [(r["step"], r["val/reward/mean"]) for r in rows if r.get("val/reward/mean") is not None]
    if val:
        ax_r.plot([s for s, _ in val], [v for _, v in val], marker="o", label="val reward/mean")
    ax_r.set(xlabel="step", ylabel="reward", title=title)
    ax_r.grid(alpha=0.3)
    ax_r.legend()
    series, title = kl_series(rows)
    for key, steps, values in series:
        ax_kl.plot(steps, values, marker=".", label=f"{key}: {KL_KEYS[key]}")
    ax_kl.set(xlabel="step", ylabel="KL (nats per token)", title=title)
    ax_kl.grid(alpha=0.3)
    if ax_kl.lines:
        ax_kl.legend()
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path)
    plt.close(fig)
    return png_path
