"""`rltrain --help` and `rltrain PRESET --help [TOPIC]` as a user reads them: wrapped to the terminal, each
flag once, every field reachable, short enough to scroll, and saying what `rlconf schema` says."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from presets import get_preset
from rlconf.config import RLConfig
from rlconf.fields import field_docs, iter_leaves, section_paths
from rltrain.cli_help import preset_help

LEAVES = list(iter_leaves(RLConfig))
HEADER = re.compile(
    r"^  (--[a-z_]+\.[\w.]+)(?: |$)"
)  # a field entry's first line: `  --section.field TYPE = VALUE`


def rltrain(*args: str, columns: int = 80) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": str(columns)}
    return subprocess.run(
        [sys.executable, "-m", "rltrain.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )


def entries(text: str) -> dict[str, tuple[list[str], list[str]]]:
    """Each field's entry: its flag lines (the first, then any wrapped 8 columns in) and its text lines
    (6 columns in)."""
    out: dict[str, tuple[list[str], list[str]]] = {}
    current: tuple[list[str], list[str]] | None = None
    for line in text.splitlines():
        if m := HEADER.match(line):
            current = out.setdefault(m[1][2:], ([line], []))
        elif current is not None and re.match(r"^ {8}\S", line) and not current[1]:
            current[0].append(line)
        elif current is not None and re.match(r"^ {6}\S", line):
            current[1].append(line.strip())
        else:
            current = None
    return out


def too_wide(text: str, width: int) -> list[str]:
    """Lines over `width` that are more than one unbreakable token (a long flag name may stick out)."""
    return [line for line in text.splitlines() if len(line) > width and len(line.split()) > 1]


@pytest.fixture(scope="module")
def help80() -> str:
    result = rltrain("tiny-grpo", "--help")
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_preset_help_fits_80_columns_and_lists_every_flag_once(help80):
    assert too_wide(help80, 80) == []
    flags = [m[1] for line in help80.splitlines() if (m := HEADER.match(line))]
    assert sorted(flags) == sorted(f"--{leaf.path}" for leaf in LEAVES)  # every field, none twice
    assert help80.count("-h, --help") == 1 and help80.count("--help [TOPIC]") == 1


def test_preset_help_is_a_size_a_person_can_scroll(help80):
    # Each field takes a flag line and a one-line summary: two lines of at most ~75 characters, so 150
    # bytes per field on average (section titles and the intro fit in what shorter lines leave). tyro's
    # help was ~135 KB (~370 bytes per field) with each docstring in full.
    assert len(help80.encode()) <= 150 * len(LEAVES)
    for path, (flag_lines, text_lines) in entries(help80).items():
        # the flag line wraps only for a long name or long choices; the text is one line
        assert len(flag_lines) <= 3 and len(text_lines) == 1, path


def test_preset_help_says_first_how_to_narrow_it(help80):
    head = "\n".join(help80.splitlines()[:16])
    assert (
        re.search(r"--help actor\.optim\s", head) and "--help all" in head and "--help actor.optim.lr" in head
    )
    assert "--model.path" not in head


def test_values_are_the_commands_own(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("actor:\n  optim:\n    min_lr: 1e-5\n")
    result = rltrain("tiny-ppo", "--config", str(f), "--actor.optim.lr", "2e-4", "--help", "actor.optim")
    assert result.returncode == 0, result.stderr
    assert "--actor.optim.lr FLOAT = 0.0002\n" in result.stdout
    assert "--actor.optim.min_lr FLOAT = 1e-05\n" in result.stdout
    assert f"--critic.enable BOOL = {get_preset('tiny-ppo').critic.enable}" not in result.stdout


def test_a_topic_narrows_to_a_section_or_a_field_in_full():
    text = rltrain("tiny-grpo", "--help", "actor.optim").stdout
    fields = [m[1] for line in text.splitlines() if (m := HEADER.match(line))]
    assert fields == [f"--{leaf.path}" for leaf in LEAVES if leaf.path.startswith("actor.optim.")]
    text = rltrain("tiny-grpo", "--help=lr").stdout  # every field named lr
    assert list(entries(text)) == ["actor.optim.lr", "critic.optim.lr"]
    result = rltrain("tiny-grpo", "--help", "actr")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("command line: invalid config: 1 error\nerror [usage] actr:")
    assert "did you mean `actor`?" in result.stderr


@pytest.mark.parametrize("width", [60, 80, 120])
def test_full_help_is_each_docstring_reflowed_as_the_schema_publishes_it(width):
    """`--help all`: each field's text is its docstring (what `rlconf schema` and docs/reference say),
    filled to the width: no line ends where the next line's first word would still have fit."""
    text = preset_help("rltrain tiny-grpo", get_preset("tiny-grpo"), "all", width=width)
    assert too_wide(text, width) == []
    docs = entries(text)
    for leaf in LEAVES:
        lines = docs[leaf.path][1]
        assert " ".join(lines) == field_docs(leaf.owner)[leaf.path.rpartition(".")[2]], leaf.path
        for line, nxt in itertools.pairwise(lines):
            assert len(line) + 1 + len(nxt.split()[0]) > width - 6, (leaf.path, line, nxt)


def test_a_long_value_with_spaces_wraps_too():
    from rlconf.fields import replace_paths

    config = replace_paths(RLConfig(), {"trainer.output_dir": "runs/" + "a long folder name " * 8})
    text = preset_help("rltrain --config run.yaml", config, "trainer.output_dir", width=60)
    assert too_wide(text, 60) == [] and "a long folder name" in text


def test_every_section_is_a_topic():
    for path in section_paths(RLConfig):
        text = preset_help("rltrain tiny-grpo", RLConfig(), path, width=80)
        assert f"\n{path}" in text or not any(leaf.path.startswith(path + ".") for leaf in LEAVES)


@pytest.mark.parametrize("columns", [40, 100, 200])
def test_general_help_fits_the_terminal(columns):
    result = rltrain("--help", columns=columns)
    assert result.returncode == 0
    assert too_wide(result.stdout, min(columns, 120)) == []
    assert "rltrain PRESET --help [SECTION | FIELD | all]" in result.stdout.replace("\n         ", " ")


def test_bare_rltrain_prints_usage_and_exits_2():
    result = rltrain()
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("usage: rltrain PRESET") and "presets:" in result.stderr


def test_help_imports_no_torch_ray_or_megatron():
    code = (
        "import sys, contextlib, io\n"
        "from rltrain.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['tiny-grpo', '--help']) == 0\n"
        "print(sorted(m for m in ('torch', 'ray', 'megatron', 'transformers') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@settings(max_examples=25, deadline=None)
@given(width=st.integers(20, 160), topic=st.sampled_from([None, "all", "actor", "rollout.multi_turn", "lr"]))
def test_help_fits_any_width(width, topic):
    """Any width (clamped to 40..120): no line longer than that but a single unbreakable token."""
    text = preset_help("rltrain tiny-grpo", get_preset("tiny-grpo"), topic, width=width)
    assert too_wide(text, max(40, min(width, 120))) == []


WORDS = st.lists(st.text(alphabet="abcdefghij,-./", min_size=1, max_size=30), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(words=WORDS, width=st.integers(20, 100))
def test_wrap_keeps_every_word_and_fills_lines(words, width):
    from rltrain.cli_help import wrap

    lines = wrap(" ".join(words), width, "  ")
    assert " ".join(line.strip() for line in lines).split() == words
    for line, nxt in itertools.pairwise(lines):
        assert len(line) <= width or len(line.split()) == 1
        assert len(line) + 1 + len(nxt.split()[0]) > width  # the next word did not fit


def test_a_summary_is_the_first_sentence_cut_at_a_clause_or_a_word():
    from rltrain.cli_help import summary

    assert summary("Peak learning rate.", 74) == "Peak learning rate."
    doc = "Number of key/value heads (grouped-query attention); equal to num_attention_heads for MHA."
    assert summary(doc, 60) == "Number of key/value heads (grouped-query attention)..."
    assert summary("Warmup steps. None derives them from the ratio x total steps.", 30) == "Warmup steps."
    assert summary("one two three four five six seven", 20) == "one two three..."  # 20 columns at most
