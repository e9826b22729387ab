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
    ("algo.yaml", "preset: tiny-grpo\nalgorithm:\n  adv_estimator: gae\nactor:\n  optim:\n    lr: 0.0\n"
     "  checkpoint:\n    save_contents: [model]\ntrainer:\n  resume_mode: resume_path\n"),
    ("reward.yaml", "preset: tiny-grpo\nreward:\n  function: exact-match\ndata:\n  train_files: [data/train.csv]\n"),
    ("prof.yaml", "preset: tiny-grpo\nprofile:\n  tool: nsys\n  ranks: [3]\n  steps: [0, 200]\n"
     "  roles: [critic_update]\n"),
)  # fmt: skip


# (file name, file text, rule): the rule's lines of `rlconf validate FILE` (the issue and its fix) are quoted in
# troubleshooting.md's blocks verbatim; the other issues the same file raises are not quoted.
TROUBLESHOOTING_RULES = (
    ("world.yaml", "preset: tiny-grpo\ncluster:\n  gpus_per_node: 4\nactor:\n  megatron:\n"
     "    tensor_model_parallel_size: 3\n", "world-divisible-by-model-parallel"),
    ("sp.yaml", "preset: tiny-grpo\nactor:\n  megatron:\n    sequence_parallel: true\n", "sequence-parallel-needs-tp"),
    ("mb.yaml", "preset: tiny-grpo\nactor:\n  ppo_mini_batch_size: 3\n", "mini-batch-divides-batch"),
)  # fmt: skip


@pytest.mark.parametrize(
    ("name", "text", "rule"), TROUBLESHOOTING_RULES, ids=[r for _, _, r in TROUBLESHOOTING_RULES]
)
def test_troubleshooting_rule_excerpts_are_current(tmp_path: Path, name: str, text: str, rule: str) -> None:
    (tmp_path / name).write_text(text)
    result = subprocess.run([sys.executable, "-m", "rlconf.cli", "validate", name], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = (result.stdout + result.stderr).splitlines()
    quoted = [f"{line}\n{lines[i + 1]}" for i, line in enumerate(lines) if f"[{rule}]" in line]
    assert quoted, lines
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    for excerpt in quoted:
        assert excerpt in page, excerpt


def _run(tmp_path: Path, module: str, *args: str) -> str:
    result = subprocess.run([sys.executable, "-m", module, *args], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    return result.stderr.strip()


@pytest.mark.parametrize(("name", "text"), TROUBLESHOOTING, ids=[n for n, _ in TROUBLESHOOTING])
def test_troubleshooting_validate_excerpts_are_current(tmp_path: Path, name: str, text: str) -> None:
    (tmp_path / name).write_text(text)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.csv").write_text("prompt,answer\n")
    out = _run(tmp_path, "rlconf.cli", "validate", name)
    assert out in (ROOT / "docs" / "troubleshooting.md").read_text(), out


def test_troubleshooting_flag_value_excerpt_is_current(tmp_path: Path) -> None:
    out = _run(tmp_path, "rltrain.cli", "tiny-grpo", "--actor.optim.lr", "abc")
    assert out in (ROOT / "docs" / "troubleshooting.md").read_text(), out


def test_quickstart_names_every_top_level_key_of_plan_json() -> None:
    import re

    from presets import get_preset
    from rlconf.plan import compile_plan, plan_to_dict

    page = (ROOT / "docs" / "quickstart.md").read_text()
    sentence = page.split("Its top-level keys are", 1)[1].split("Every value is\nresolved", 1)[0]
    named = re.findall(r"`(\w+)`", sentence)
    assert named == list(plan_to_dict(compile_plan(get_preset("tiny-grpo"))))


def test_docs_cite_only_files_the_repository_has() -> None:
    # The design notes live outside the repository: a page citing them sends the reader nowhere.
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    citing = [p.name for p in pages if "DESIGN.md" in p.read_text() and not (ROOT / "DESIGN.md").exists()]
    assert citing == []


def test_every_command_block_runs_in_a_test_or_says_why_not() -> None:
    from tests.test_readme_commands import PAGES, command_blocks

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    unmarked = [f"{page.relative_to(ROOT)}:{line}" for page in pages if str(page.relative_to(ROOT)) not in PAGES
                for line, _, skipped in command_blocks(page) if not skipped]  # fmt: skip
    assert unmarked == [], "run these in tests/test_readme_commands.py or mark them <!-- skip-test: why -->"
