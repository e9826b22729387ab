"""metrics.jsonl on resume (rltrain/metrics_file.py): a torn last line is removed with a warning, a malformed
line is exit 2 naming the file and the line (not "internal error: TypeError"), and rewrites are atomic. The
command-line cases run the real `rltrain` on a run folder; they stop before Ray starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlconf.errors import ConfigError
from rltrain import metrics_file
from rltrain.metrics import MetricsLogger, read_metrics


def _lines(*steps: int) -> str:
    return "".join(json.dumps({"step": s, "reward/mean": 0.1 * s}) + "\n" for s in steps)


def rltrain(out, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", "rltrain.cli", "tiny-grpo", "--trainer.output_dir", str(out),
                           "--trainer.total_steps", "2", *flags], capture_output=True, text=True, timeout=300,
                          env=env)  # fmt: skip


@pytest.mark.parametrize(
    ("body", "line", "why"),
    [
        (_lines(1) + "42\n" + _lines(2), 2, "not a JSON object (int)"),
        (_lines(1) + '{"step": 2, "re\n' + _lines(3), 2, "not JSON"),
        (_lines(1, 2) + '{"reward/mean": 1}\n', 3, "no integer `step`"),
        (_lines(1) + '{"step": "2"}\n', 2, "no integer `step`"),
        (_lines(1) + "[" * 100000 + "\n", 2, "not JSON"),
    ],
    ids=["a-number", "invalid-json-in-the-middle", "no-step", "a-string-step", "deeply-nested"],
)
def test_a_malformed_line_is_an_error_naming_file_and_line(tmp_path, body, line, why):
    path = tmp_path / "metrics.jsonl"
    path.write_text(body)
    with pytest.raises(ConfigError) as err:
        metrics_file.repair(path)
    text = err.value.format()
    assert f"{path}:{line}: {why}" in text, text
    assert path.read_text() == body  # nothing is rewritten


def test_the_command_exits_2_naming_the_line(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text(_lines(1) + "42\n")
    result = rltrain(out)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"{out / 'metrics.jsonl'}:2: not a JSON object (int)" in result.stderr
    assert "internal error" not in result.stderr and "Traceback" not in result.stderr


def test_a_torn_last_line_is_removed_with_a_warning(tmp_path):
    """A folder whose two steps are logged, the second line cut off: the same command (2 steps) removes the
    torn line with a warning naming its step, and the next append starts on a line of its own."""
    out = tmp_path / "run"
    out.mkdir()
    path = out / "metrics.jsonl"
    path.write_text(_lines(1, 2) + '{"step": 3, "reward/me')
    result = rltrain(out)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"warning: {path}:3: the line of step 3 was cut off" in result.stderr
    assert path.read_text() == _lines(1, 2)
    log = MetricsLogger(out, ("jsonl",))
    log.log(3, {"reward/mean": 0.3})
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]


def test_truncation_is_atomic(tmp_path, monkeypatch):
    """A crash during the rewrite (here: os.replace fails) leaves the old file whole, and no temporary file
    is mistaken for it; a rewrite that completes replaces the file in one step (a new inode)."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(_lines(1, 2, 3))
    before = path.stat().st_ino

    def crash(src, dst):
        raise OSError("killed")

    with monkeypatch.context() as m:
        m.setattr(os, "replace", crash)
        with pytest.raises(OSError):
            MetricsLogger(tmp_path, ("jsonl",)).truncate_after(1)
    assert path.read_text() == _lines(1, 2, 3)
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]
    MetricsLogger(tmp_path, ("jsonl",)).truncate_after(1)
    assert path.read_text() == _lines(1) and path.stat().st_ino != before
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary file left
