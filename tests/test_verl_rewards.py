"""verl's reward interface as is: a reward file named `path.py:function` with verl's signature, dict
results, the built-in scorers (GSM8K strict / flexible, MATH boxed, DAPO-math / AIME) dispatched on each
row's data_source, read from a verl-format parquet; validate checks the file without running it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlconf.config import DataConfig, RewardConfig, RLConfig
from rlconf.validate import check_config
from rltrain.data import load_prompt_files
from rltrain.reward_scores import default_compute_score, gsm8k, gsm8k_answer, math, math_dapo
from rltrain.rewards import REWARD_FUNCTIONS, RewardFunctionError, load_reward_function, score_rows
from rltrain.tokenizer import CharTokenizer

REWARD_FILE = """
import re

CALLS = []


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    CALLS.append((data_source, extra_info))
    found = re.findall(r"-?\\d+", solution_str)
    correct = bool(found) and found[-1] == ground_truth
    return {"score": 1.0 if correct else 0.0, "acc": correct, "pred": found[-1] if found else ""}


def plain(data_source, solution_str, ground_truth, extra_info=None):
    return 0.5
"""


def _verl_parquet(path: Path, rows: list[tuple[str, str, str]]) -> Path:
    """A parquet file shaped like verl's examples/data_preprocess output: data_source, chat prompt,
    reward_model.{style, ground_truth}, extra_info."""
    table = pa.Table.from_pylist(
        [
            {
                "data_source": source,
                "prompt": [{"role": "user", "content": question}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": truth},
                "extra_info": {"split": "train", "index": i},
            }
            for i, (source, question, truth) in enumerate(rows)
        ]
    )
    pq.write_table(table, path)
    return path


# ------------------------------------------------------------------------------------------ scorers
@pytest.mark.parametrize(
    ("response", "method", "expected"),
    [
        ("so 3 + 4 = 7\n#### 7", "strict", "7"),
        ("#### 1,234", "strict", "1234"),  # commas dropped
        ("the answer is 7", "strict", None),  # strict needs the marker
        ("the answer is 7.", "flexible", "7."),  # verl's flexible keeps the trailing dot: not "7"
        ("first 5, then 12", "flexible", "12"),
        ("no number here", "flexible", None),
        ("#### 9 " + "x" * 400, "strict", None),  # only the last 300 characters are searched
    ],
)
def test_gsm8k_extraction(response, method, expected):
    assert gsm8k_answer(response, method) == expected


def test_gsm8k_scores_like_verl():
    assert gsm8k("openai/gsm8k", "... #### 72", "72") == 1.0
    assert gsm8k("openai/gsm8k", "... #### 71", "72") == 0.0
    assert gsm8k("openai/gsm8k", "72", "72") == 0.0  # strict: no marker, no score
    assert REWARD_FUNCTIONS["gsm8k_flexible"]("it is 72", "72") == 1.0


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("so \\boxed{\\frac{1}{2}}", "\\frac12", 1.0),  # \frac12 -> \frac{1}{2}
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),  # dfrac and a/b
        ("\\boxed{ 10 }", "10", 1.0),  # spaces
        ("\\boxed{x = 5}", "5", 1.0),  # a short `k =` prefix goes
        ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
        ("\\boxed{90^\\circ}", "90", 1.0),
        ("\\boxed{6}", "7", 0.0),
        ("the answer is 7", "7", 0.0),  # no box, no score
        ("\\boxed{7", "7", 0.0),  # unclosed box
    ],
)
def test_math_boxed_answers_with_normalisation(response, truth, expected):
    assert math("lighteval/MATH", response, truth) == expected


def test_math_dapo_answer_line_and_minerva_normalisation():
    good = math_dapo("math_dapo", "reasoning...\nAnswer: $\\boxed{204}$", "204")
    assert good == {"score": 1.0, "acc": True, "pred": "204"}
    assert math_dapo("aime_2024", "Answer: 1,000 degrees", "1000")["score"] == 1.0
    bad = math_dapo("math_dapo", "I think 204", "204")  # no `Answer:` line
    assert bad["score"] == -1.0 and bad["acc"] is False


def test_default_compute_score_dispatches_on_data_source():
    assert default_compute_score("openai/gsm8k", "#### 3", "3") == 1.0
    assert default_compute_score("HuggingFaceH4/MATH-500", "\\boxed{3}", "3") == 1.0
    assert default_compute_score("aime_2025", "Answer: 3", "3")["score"] == 1.0
    # The same text scores differently by source: gsm8k needs ####, MATH a box.
    assert default_compute_score("openai/gsm8k", "\\boxed{3}", "3") == 0.0
    fn = load_reward_function("default_compute_score")
    with pytest.raises(RewardFunctionError) as info:
        score_rows(fn, ["#### 3"], ["3"], [""], ["codecontests"], [None])
    assert "codecontests" in str(info.value) and "path/to/reward.py:compute_score" in str(info.value)


def test_dict_results_give_the_score_and_numeric_extras_as_metrics():
    fn = load_reward_function("math_dapo")
    scores, extras = score_rows(
        fn, ["Answer: 1", "Answer: 2"], ["1", "1"], ["", ""], ["math_dapo"] * 2, [None] * 2
    )
    assert scores == [1.0, -1.0]
    assert extras == {"reward_extra/acc": 0.5}  # `pred` is a string: not a metric


# ------------------------------------------------------------------------------- verl reward files
def test_reward_file_with_verl_signature_scores_a_verl_parquet(tmp_path, monkeypatch):
    reward = tmp_path / "reward_function.py"
    reward.write_text(REWARD_FILE)
    data = _verl_parquet(
        tmp_path / "train.parquet", [("openai/gsm8k", "1+2=", "3"), ("my_source", "2*3=", "6")]
    )
    monkeypatch.chdir(tmp_path)
    cfg = DataConfig(train_files=("train.parquet",), answer_key="reward_model.ground_truth")
    examples = load_prompt_files([str(data)], cfg, CharTokenizer())
    assert [e.data_source for e in examples] == ["openai/gsm8k", "my_source"]
    assert examples[1].extra_info == {"split": "train", "index": 1}
    fn = load_reward_function("./reward_function.py:compute_score")  # relative to the run's directory
    scores, extras = score_rows(
        fn,
        ["so 3", "it is 5"],
        [e.ground_truth for e in examples],
        [e.prompt for e in examples],
        [e.data_source for e in examples],
        [e.extra_info for e in examples],
    )
    assert scores == [1.0, 0.0] and extras == {"reward_extra/acc": 0.5}
    module = sys.modules[fn.fn.__module__]
    assert module.CALLS == [
        ("openai/gsm8k", {"split": "train", "index": 0}),
        ("my_source", {"split": "train", "index": 1}),
    ]
    assert score_rows(load_reward_function(f"{reward}:plain"), ["x"], ["y"], [""])[0] == [0.5]


def test_reward_file_errors_name_the_cause(tmp_path):
    (tmp_path / "broken.py").write_text("def compute_score(:\n")
    (tmp_path / "raises.py").write_text(
        "raise RuntimeError('boom at import')\ndef compute_score(a, b, c): return 1\n"
    )
    (tmp_path / "wrong.py").write_text(
        "def compute_scor(data_source, solution_str, ground_truth, extra_info=None):\n  return 1\n"
    )
    cases = {
        f"{tmp_path}/missing.py:compute_score": "does not exist",
        f"{tmp_path}/broken.py:compute_score": "does not parse",
        f"{tmp_path}/wrong.py:compute_score": "did you mean `compute_scor`",
        f"{tmp_path}/raises.py:compute_score": "boom at import",
        f"{tmp_path}:compute_score": "not of the form",
    }
    for spec, expected in cases.items():
        with pytest.raises(RewardFunctionError) as info:
            load_reward_function(spec)
        assert expected in str(info.value), (spec, str(info.value))


def test_validate_checks_the_reward_file_without_running_it(tmp_path, monkeypatch):
    """Trust model: validate parses the file (ast) but never imports it; the attack file would write a
    marker when run."""
    marker = tmp_path / "ran"
    (tmp_path / "reward.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
    )
    monkeypatch.chdir(tmp_path)

    def issues(spec: str) -> list[str]:
        c = RLConfig(reward=RewardConfig(function=spec))
        return [f"{i.rule}: {i.message}" for i in check_config(c, filesystem=True) if i.severity == "error"]

    assert issues("reward.py:compute_score") == []
    assert not marker.exists(), "validate ran the reward file"
    assert any("defines no top-level 'nope'" in m for m in issues("reward.py:nope"))
    assert any("does not exist" in m for m in issues("other.py:compute_score"))
    assert any("not a Python function name" in m for m in issues("reward.py:1bad"))
    big = tmp_path / "big.py"
    big.write_bytes(b"#" * (5 << 20))
    assert any("more than a reward file holds" in m for m in issues("big.py:compute_score"))
    # Without the filesystem (a config checked elsewhere) only the form is checked.
    c = RLConfig(reward=RewardConfig(function="elsewhere/reward.py:compute_score"))
    assert not [i for i in check_config(c) if i.severity == "error"]


def test_rlconf_validate_reports_a_missing_reward_file_with_exit_2(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("reward:\n  function: ./my_reward.py:compute_score\n")
    result = subprocess.run(
        [sys.executable, "-m", "rlconf.cli", "validate", str(f)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    out = result.stdout + result.stderr
    assert "reward.function" in out and "reward-function-file" in out and "Traceback" not in out


def test_import_verl_maps_custom_reward_function_and_the_default_scorer(tmp_path):
    from rlconf.verl import translate

    tr = translate(
        None,
        ["custom_reward_function.path=./reward_function.py", "custom_reward_function.name=my_score"],
    )
    assert tr.settings["reward.function"] == "./reward_function.py:my_score"
    tr = translate(None, ["custom_reward_function.path=./reward_function.py"])
    assert tr.settings["reward.function"] == "./reward_function.py:compute_score"  # verl's default name
    tr = translate(None, ["data.train_files=train.parquet"])
    assert tr.settings["reward.function"] == "default_compute_score"
    assert not [u for u in tr.unmapped if u.verl.startswith("custom_reward_function")]


def test_rows_no_builtin_scorer_can_score_stop_before_the_run():
    from rltrain.rewards import check_data_sources

    fn = load_reward_function("default_compute_score")
    check_data_sources(fn, ["openai/gsm8k", "lighteval/MATH", "aime_2024", "math_dapo"])
    with pytest.raises(RewardFunctionError) as info:
        check_data_sources(fn, ["openai/gsm8k", "codecontests", "numina_olympiads"])
    assert info.value.issues[0].rule == "reward-function-data-source"
    assert "'codecontests', 'numina_olympiads'" in str(info.value)
    check_data_sources(load_reward_function("gsm8k"), ["anything"])  # a fixed scorer takes any source


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),  # equal values, different forms
        ("so the answer is \\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("we get $x = 2\\sqrt{2}$", "\\sqrt{8}", 1.0),  # symbolic, not string, equality
        ("\\boxed{(x+1)^2}", "x^2 + 2x + 1", 1.0),
        ("\\boxed{3}", "4", 0.0),
        ("no answer here", "4", 0.0),
    ],
)
def test_math_verify_scores_symbolic_equivalence(response, truth, expected):
    """reward.function math_verify (the `math` extra): equal values in different forms score 1, which the
    string comparison of `math` cannot do for sqrt(8) vs 2 sqrt(2)."""
    fn = load_reward_function("math_verify")
    scores, _ = score_rows(fn, [response], [truth], [""], ["lighteval/MATH"], [None])
    assert scores == [expected]


def test_math_verify_is_bounded_on_hostile_text_off_the_main_thread():
    """A reward runs wherever its worker calls it: off the main thread Math-Verify cannot set its alarm, so
    the 300-character clip bounds the work. A megabyte of nested LaTeX still scores (0) in a few seconds."""
    import threading
    import time

    from rltrain.reward_scores import math_verify

    hostile = "\\frac{" * 200_000 + "1" + "}" * 200_000 + " \\boxed{" + "(" * 100_000
    result: list[float] = []
    t0 = time.perf_counter()
    worker = threading.Thread(target=lambda: result.append(math_verify("x", hostile, "1")))
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive() and result == [0.0]
    assert time.perf_counter() - t0 < 30


def test_validate_names_the_math_extra_when_math_verify_is_missing(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "math_verify" else real(n, *a)
    )
    c = RLConfig(reward=RewardConfig(function="math_verify"))
    errors = [i for i in check_config(c) if i.severity == "error"]
    assert [(i.rule, i.path) for i in errors] == [("reward-function", "reward.function")]
    assert "rlplan[math]" in errors[0].fix
    monkeypatch.undo()
    assert not [i for i in check_config(c) if i.severity == "error"]
