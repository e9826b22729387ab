"""Metrics backends: metrics.jsonl lines, truncation on resume, tensorboard events, the reward/KL PNG."""

from __future__ import annotations

import json

import pytest

from rlconf.errors import ConfigError
from rltrain.metrics import MetricsLogger, kl_series, plot_reward_curve, progress_columns, read_metrics


def test_jsonl_appends_and_truncates(tmp_path, capsys):
    log = MetricsLogger(tmp_path, ("console", "jsonl"), total_steps=3)
    for step in (1, 2, 3):
        log.log(step, {"reward/mean": 0.1 * step, "actor/lr": 1e-3, "note": "x", "nan": float("nan")})
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["nan"] is None  # NaN is not valid JSON
    assert "step    2  reward/mean 0.2" in capsys.readouterr().out  # not a terminal: plain lines
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "rew')  # a run killed mid-write
    log.truncate_after(1)  # a resume from step 1 redoes steps 2 and 3
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]


def test_tensorboard_writes_events(tmp_path):
    pytest.importorskip("tensorboard")
    log = MetricsLogger(tmp_path, ("tensorboard",))
    log.log(1, {"reward/mean": 0.5})
    log.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_missing_wandb_is_a_config_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("no wandb")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ConfigError) as exc:
        MetricsLogger(tmp_path, ("wandb",))
    assert exc.value.path == "logging.backends"


def test_plot_has_reward_and_kl(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [
        {"step": 1, "reward/mean": 0.1, "actor/reward_kl": 0.0, "val_before/reward/mean": 0.05},
        {"step": 2, "reward/mean": 0.3, "actor/reward_kl": 0.01, "val/reward/mean": 0.2},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = plot_reward_curve(path, tmp_path / "curve.png")
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_reward_curve(tmp_path / "missing.jsonl", tmp_path / "none.png") is None


def test_kl_panel_plots_a_kl_never_the_k1_ppo_kl():
    # ppo_kl is a k1 mean: it dips below 0. The panel shows the KL to the reference when there is one, else
    # the k3 per-update KL (>= 0), each labelled with what it is.
    rows = [{"step": s, "actor/ppo_kl": -0.01, "actor/ppo_kl_k3": 0.002} for s in (1, 2)]
    series, title = kl_series(rows)
    assert [key for key, _, _ in series] == ["actor/ppo_kl_k3"] and title == "KL per update"
    assert all(v >= 0 for _, _, values in series for v in values)
    rows = [{**r, "actor/kl_loss": 0.01} for r in rows]
    series, title = kl_series(rows)
    assert [key for key, _, _ in series] == ["actor/kl_loss"] and title == "KL to the reference"


@pytest.mark.parametrize("width", [80, 60])
def test_progress_line_keeps_step_count_and_eta_on_a_narrow_terminal(width):
    import io

    from rich.console import Console
    from rich.progress import Progress

    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=True, color_system=None)
    progress = Progress(*progress_columns(), console=console, auto_refresh=False, expand=True)
    task = progress.add_task("reward/mean 0.1234  actor/loss 0.5432  critic/vf_loss 0.0012  tokens/s 1234",
                             total=100)  # fmt: skip
    progress.update(task, completed=37)
    progress.start()
    progress.refresh()
    progress.stop()
    line = out.getvalue().split("\x1b[2K")[-1].splitlines()[0]
    assert "37/100" in line and "-:--:--" in line and len(line.rstrip()) <= width
    assert "reward/mean 0.1234" in line  # the metrics are cut at the end, with an ellipsis


LOG_STEPS = """
import sys
from rltrain.metrics import MetricsLogger

log = MetricsLogger(sys.argv[1], ("console",), total_steps=100)
for step in (1, 2, 3):
    log.log(step, {"reward/mean": 0.123456, "actor/loss": -0.0533, "actor/lr": 1e-3, "critic/vf_loss": 0.5,
                   "response/length_mean": 12.72, "timing/step_s": 3.5, "perf/total_num_tokens": 4096})
log.close()
"""


def _log_steps(tmp_path, **popen) -> str:
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", LOG_STEPS, str(tmp_path)], env=env, **popen)
    return proc


def test_progress_lines_in_a_pipe_keep_the_step_and_eta(tmp_path):
    """stdout a pipe (CI, `| tee`), COLUMNS=80: plain lines, each with its step first and the ETA (3.5 s x
    the steps left) last."""
    import subprocess

    proc = _log_steps(tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    import re

    lines = out.splitlines()
    found = [re.fullmatch(r"step +(\d+)  reward/mean .*  ETA (\d+m\d\ds)", line) for line in lines]
    assert [m and (m[1], m[2]) for m in found] == [("1", "5m46s"), ("2", "5m43s"), ("3", "5m40s")], lines
    assert "\x1b" not in out  # no terminal control codes in a log file


def test_progress_bar_on_a_real_80_column_terminal_keeps_the_count_and_time_left(tmp_path):
    """A real pty with COLUMNS=80: the bar's last frame fits 80 columns and still shows `3/100` and the time
    left, the metrics cut with an ellipsis instead."""
    import os
    import pty
    import re

    master, slave = pty.openpty()
    proc = _log_steps(tmp_path, stdout=slave, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=60) == 0, b"".join(chunks)[-2000:]
    text = b"".join(chunks).decode("utf-8", "replace")
    frames = [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", f) for f in re.split(r"\r|\n|\x1b\[2K", text)]
    last = [f for f in frames if "train" in f][-1].rstrip()
    assert "3/100" in last and re.search(r"\d:\d\d:\d\d", last), last
    assert len(last) <= 80, last
