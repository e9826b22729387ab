"""The newcomer path, as a newcomer meets it: every command block of README.md and docs/quickstart.md runs
as written (no activated venv) and exits as documented; the main job's output is quiet and shows its speed;
and the docs' recorded run (docs/_generated/tiny-grpo-run.json) is still what today's code does.

One short run of the README's main job (`.venv/bin/rltrain tiny-grpo`, 4 steps) in a fresh folder serves
every test: the commands that read the main job's `outputs/tiny-grpo` read it. A block preceded by
`<!-- skip-test: REASON -->` is not run (installs, long runs). A command exits 0 unless its comment says
`(exit N)`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("README.md", "docs/quickstart.md", "docs/concepts.md", "docs/checkpoints.md")
"""Pages whose commands run here, in this order, in one folder (README's my_run.yaml serves concepts.md, the
short run's checkpoints serve checkpoints.md); every other page's commands are marked skip-test with the
reason (tests/test_docs_excerpts.py checks that)."""
RECORD = ROOT / "docs" / "_generated" / "tiny-grpo-run.json"
SHORT_STEPS = 4
# The main job saves its last step; the short run's last checkpoint stands in for the full run's.
STEP_STAND_IN = ("global_step_100", f"global_step_{SHORT_STEPS}")
_FENCE = re.compile(r"^```(\w*)\s*$")
_SKIP = re.compile(r"<!--\s*skip-test:")
_HEREDOC = re.compile(r"<<-?\s*'?(\w+)'?")
_EXIT = re.compile(r"#.*\(exit (\d+)\)")


def command_blocks(page: Path) -> list[tuple[int, list[str], bool]]:
    """(line number, lines, skipped) of every bash block of a markdown page."""
    blocks, lines = [], page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        if m.group(1) in ("bash", "sh"):
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            blocks.append((i + 1, lines[i + 1 : end], bool(_SKIP.search(before))))
        i = end + 1
    return blocks


def split_commands(lines: list[str]) -> list[str]:
    """Logical commands: continuation lines joined, a heredoc kept with its body."""
    commands, i = [], 0
    while i < len(lines):
        command = lines[i]
        while command.endswith("\\") and i + 1 < len(lines):
            i += 1
            command = command[:-1] + lines[i]
        if m := _HEREDOC.search(command):
            while i + 1 < len(lines) and lines[i].strip() != m.group(1):
                i += 1
                command += "\n" + lines[i]
        if command.strip() and not command.lstrip().startswith("#"):
            commands.append(command)
        i += 1
    return commands


def _newcomer_env() -> dict[str, str]:
    """The caller's environment without the virtual environment on PATH (as after the set-up commands)."""
    venv_bin = str(Path(sys.prefix) / "bin")
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p != venv_bin)
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    return {**env, "PATH": path, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> dict[str, object]:
    """The README's main job for 4 steps in a fresh folder holding only `.venv` (this test's venv)."""
    if not (Path(sys.prefix) / "bin" / "rltrain").exists():
        pytest.skip("run from the project's venv (.venv/bin/pytest): it provides .venv/bin/rltrain")
    work = tmp_path_factory.mktemp("newcomer")
    (work / ".venv").symlink_to(Path(sys.prefix))
    command = f".venv/bin/rltrain tiny-grpo --trainer.total_steps {SHORT_STEPS}"
    result = subprocess.run(command, shell=True, cwd=work, env=_newcomer_env(), capture_output=True, text=True,
                            timeout=600, check=False)  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    out = work / "outputs" / "tiny-grpo"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"work": work, "stdout": result.stdout, "stderr": result.stderr, "rows": rows}


@pytest.mark.parametrize("page", PAGES)
def test_commands_run_as_written(short_run, page):
    """Each command of the page's bash blocks, in order, in the main job's folder: its documented exit."""
    failures, ran = [], 0
    for line, lines, skipped in command_blocks(ROOT / page):
        if skipped:
            continue
        for command in split_commands(lines):
            expected = int(m.group(1)) if (m := _EXIT.search(command.splitlines()[-1])) else 0
            result = subprocess.run(command.replace(*STEP_STAND_IN), shell=True, executable="/bin/bash",
                                    cwd=short_run["work"], env=_newcomer_env(), capture_output=True, text=True,
                                    timeout=300, check=False)  # fmt: skip
            ran += 1
            if result.returncode != expected:
                failures.append(f"{page}:{line}: `{command}` exited {result.returncode}, documented "
                                f"{expected}\n{result.stderr[-1500:]}")  # fmt: skip
    assert ran > 0, f"{page}: no command ran"
    assert not failures, "\n\n".join(failures)


def test_block_parser_reads_heredocs_continuations_and_skips(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "```bash\ncat > a.yaml <<'EOF'\nx: 1\nEOF\nls \\\n  -l   # listing (exit 2)\n```\n\n"
        "<!-- skip-test: long -->\n```bash\nsleep 100\n```\n```text\nnot a command\n```\n"
    )
    (line, lines, skipped), (_, slow, slow_skipped) = command_blocks(page)
    assert (line, skipped, slow, slow_skipped) == (1, False, ["sleep 100"], True)
    commands = split_commands(lines)
    assert commands == ["cat > a.yaml <<'EOF'\nx: 1\nEOF", "ls   -l   # listing (exit 2)"]
    assert _EXIT.search(commands[1]).group(1) == "2"


def test_main_job_output_is_quiet_and_shows_speed(short_run):
    """No megatron / Ray noise and no rlplan UserWarning; one note on what is missing; tokens/s and ETA."""
    text = short_run["stdout"] + short_run["stderr"]
    te_lines = [line for line in text.splitlines() if "Transformer Engine" in line]
    assert len(te_lines) <= 1 and all(line.startswith("note: ") for line in te_lines), te_lines
    assert "Apex is not installed" not in text and "full scope is deprecated" not in text
    assert "Token authentication is enabled" not in text and "Started a local Ray instance" not in text
    assert not re.search(r"rltrain/\S+\.py:\d+: \w*Warning", text), text[-3000:]
    steps = [line for line in short_run["stdout"].splitlines() if line.startswith("step ")]
    assert len(steps) == SHORT_STEPS, short_run["stdout"]
    for line in steps:
        assert re.search(r"tokens/s \d+  ETA \d+[smh]", line), line


def test_recorded_run_starts_like_todays_code(short_run):
    """The docs quote a recorded 100-step run; today's code must still produce its first steps. Sampling is
    seeded, so on one machine they are equal; across CPUs a rare flipped token can change one response,
    which moves a step's mean reward by at most 1/64 (8 prompts x 8 responses)."""
    record = json.loads(RECORD.read_text())
    rows = short_run["rows"]
    assert [r["reward/mean"] for r in rows] == pytest.approx(record["rewards"][:SHORT_STEPS], abs=1 / 64), (
        "the recorded run is stale: run `.venv/bin/python bench/docs_run.py`"
    )
    assert rows[0]["val_before/reward/mean"] == pytest.approx(record["val_before"], abs=1 / 64)


def test_every_logged_metric_is_explained(short_run):
    """Each key the run logs has a row in the quickstart's metrics table."""
    table = "\n".join(
        line for line in (ROOT / "docs/quickstart.md").read_text().splitlines() if line.startswith("| `")
    )
    timing_row = next(line for line in table.splitlines() if line.startswith("| `timing/*_s`"))
    missing = []
    for key in sorted({k for row in short_run["rows"] for k in row}):
        if key.startswith("timing/"):
            ok = f"`{key.removeprefix('timing/').removesuffix('_s')}`" in timing_row
        elif key.startswith("val_before/"):
            ok = "`val_before/...`" in table
        else:
            ok = f"`{key}`" in table
        if not ok:
            missing.append(key)
    assert not missing, f"add to the metrics table of docs/quickstart.md: {missing}"
