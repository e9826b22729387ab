"""Program output quoted in docs/ is today's output: each excerpt is regenerated from the command that
produced it and must appear in its page verbatim (a change of wording, rules or presets shows up here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# (page, file name, file text, command after the program name)
TROUBLESHOOTING = (
    ("typo.yaml", "preset: tiny-grpo\nactor:\n  optim:\n    learning_rate: 1e-6\n  loss_agg_mode: token_mean\n"
     "trainer:\n  total_steps: ten\n"),
    ("syntax.yaml", "preset: tiny-grpo\nrollout:\n  n: [1, 2\n\n\n"),
    ("preset.yaml", "preset: tiny-grpoo\n"),
)  # fmt: skip


def _run(tmp_path: Path, module: str, *args: str) -> str:
    result = subprocess.run([sys.executable, "-m", module, *args], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    return result.stderr.strip()


@pytest.mark.parametrize(("name", "text"), TROUBLESHOOTING, ids=[n for n, _ in TROUBLESHOOTING])
def test_troubleshooting_validate_excerpts_are_current(tmp_path: Path, name: str, text: str) -> None:
    (tmp_path / name).write_text(text)
    out = _run(tmp_path, "rlconf.cli", "validate", name)
    assert out in (ROOT / "docs" / "troubleshooting.md").read_text(), out


def test_troubleshooting_flag_value_excerpt_is_current(tmp_path: Path) -> None:
    out = _run(tmp_path, "rltrain.cli", "tiny-grpo", "--actor.optim.lr", "abc")
    assert out in (ROOT / "docs" / "troubleshooting.md").read_text(), out
