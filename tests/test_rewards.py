"""Built-in rule rewards, the reward registry, `reward.function` resolution and batch scoring."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rlconf.config import BUILTIN_REWARDS
from rlconf.errors import ConfigError
from rltrain.rewards import (
    REWARD_FUNCTIONS,
    RewardFunctionError,
    digit_match,
    exact_match,
    extract_last_number,
    format_reward,
    load_reward_function,
    numeric_match,
    score_batch,
    score_rows,
)


def test_registry_is_exactly_the_builtin_names():
    assert tuple(REWARD_FUNCTIONS) == BUILTIN_REWARDS
    for name in BUILTIN_REWARDS:
        assert load_reward_function(name) is REWARD_FUNCTIONS[name]
        # verl's scorers get each row's data_source (default_compute_score dispatches on it).
        scores, _ = score_rows(REWARD_FUNCTIONS[name], ["#### 1"], ["1"], [""], ["openai/gsm8k"], [None])
        assert isinstance(scores[0], float)


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("6 7 8", "6 7 8", 1.0),
        ("  6  7 8\n", "6 7 8", 1.0),  # whitespace runs collapse
        ("<answer>42</answer>", "42", 1.0),  # the tagged final answer is compared
        ("so #### 42", "reasoning... #### 42", 1.0),
        ("678", "6 7 8", 0.0),  # exact: spacing inside the answer matters
        ("6 7 9", "6 7 8", 0.0),
    ],
)
def test_exact_match(response, truth, expected):
    assert exact_match(response, truth, "prompt") == expected


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("The answer is 1,234.", "1234", 1.0),  # thousands comma, sentence period
        ("She sold 48 + 24 = 72 clips.\n#### 72", "Natalia sold 48/2 = 24 ... #### 72", 1.0),
        ("#### 12\nbut wait, maybe 99", "12", 1.0),  # the #### marker wins over later numbers
        ("so \\boxed{3.0} it is", "3", 1.0),
        ("<answer>-3</answer>", "-3", 1.0),
        ("first 5, then 7", "5", 0.0),  # the last number counts
        ("no idea", "5", 0.0),
        ("5", "no number here", 0.0),
    ],
)
def test_numeric_match(response, truth, expected):
    assert numeric_match(response, truth, "q") == expected


def test_extract_last_number():
    assert extract_last_number("a 1,000,000 b 2.5") == 2.5
    assert extract_last_number("\\boxed{\\frac{1}{4}} and 9") == 4.0  # boxed part searched first
    assert extract_last_number("none") is None


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("<answer>7</answer>", 1.0),
        ("think...\n<answer> 12 apples </answer>", 1.0),
        ("work\n#### 7", 1.0),
        ("<answer></answer>", 0.0),  # empty answer
        ("<answer>7", 0.0),  # unclosed tag
        ("####", 0.0),
        ("7", 0.0),
    ],
)
def test_format_reward(response, expected):
    assert format_reward(response, "unused", "q") == expected
    assert REWARD_FUNCTIONS["format"] is format_reward


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("6 7 8", "6 7 8", 1.0),
        ("678", "6 7 8", 1.0),  # spaces ignored on both sides
        ("6 9 8", "678", 2 / 3),  # positions 0 and 2 match
        ("6", "6 7 8", 1 / 3),  # a short response scores its matching prefix
        ("6789999", "678", 1.0),  # characters past the truth's length are ignored
        ("x678", "678", 0.0),  # position-wise: a shifted answer scores 0
        ("", "678", 0.0),
        ("", "", 1.0),
        ("1", "", 0.0),
    ],
)
def test_digit_match(response, truth, expected):
    assert digit_match(response, truth, "1 2 3") == pytest.approx(expected)


# ------------------------------------------------------------------------------------- user funcs
def _write_module(tmp_path, monkeypatch, name: str, source: str) -> None:
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_user_function_by_path(tmp_path, monkeypatch):
    _write_module(
        tmp_path,
        monkeypatch,
        "user_rewards_ok",
        "def length_bonus(response, ground_truth, prompt):\n"
        "    return len(response) / 10\n"
        "class Scorers:\n"
        "    @staticmethod\n"
        "    def same(response, ground_truth, prompt, weight=1.0):\n"
        "        return weight * (response == ground_truth)\n",
    )
    fn = load_reward_function("user_rewards_ok:length_bonus")
    assert fn("abcde", "", "") == 0.5
    nested = load_reward_function(" user_rewards_ok:Scorers.same ")  # dotted attribute, spaces stripped
    assert score_batch(nested, ["a", "b"], ["a", "a"], ["", ""]) == [1.0, 0.0]


def _error(spec: str) -> RewardFunctionError:
    with pytest.raises(RewardFunctionError) as info:
        load_reward_function(spec)
    err = info.value
    assert isinstance(err, ConfigError)  # the CLI reports it as an invalid config (exit 2)
    assert err.path == "reward.function"
    assert "reward.function" in str(err)
    assert "fix:" in str(err)
    return err


def test_unknown_name_lists_builtins_and_suggests():
    err = _error("digit_mach")
    for name in BUILTIN_REWARDS:
        assert name in err.message
    assert "did you mean 'digit_match'" in err.fix


def test_dotted_name_without_colon_hints_at_module_syntax():
    err = _error("my_pkg.rewards.score")
    assert "my_pkg.rewards:score" in err.fix


@pytest.mark.parametrize("spec", ["", "   ", "a:b:c", ":fn", "mod:", "1mod:fn", "mod:fn()"])
def test_malformed_specs(spec):
    _error(spec)


def test_module_not_importable():
    err = _error("no_such_module_rlplan_xyz:score")
    assert "no_such_module_rlplan_xyz" in err.message
    assert "PYTHONPATH" in err.fix


def test_module_raising_on_import(tmp_path, monkeypatch):
    _write_module(tmp_path, monkeypatch, "user_rewards_broken", "raise RuntimeError('boom at import')\n")
    err = _error("user_rewards_broken:score")
    assert "RuntimeError" in err.message and "boom at import" in err.message


def test_missing_attribute_suggests_close_name(tmp_path, monkeypatch):
    _write_module(
        tmp_path,
        monkeypatch,
        "user_rewards_attr",
        "def my_score(response, ground_truth, prompt):\n    return 1.0\n",
    )
    err = _error("user_rewards_attr:my_scor")
    assert "has no attribute 'my_scor'" in err.message
    assert "did you mean 'my_score'" in err.fix
    assert "my_score" in err.fix


def test_not_callable(tmp_path, monkeypatch):
    _write_module(tmp_path, monkeypatch, "user_rewards_const", "SCORE = 3\n")
    err = _error("user_rewards_const:SCORE")
    assert "not a function" in err.message


def test_wrong_signature(tmp_path, monkeypatch):
    _write_module(
        tmp_path, monkeypatch, "user_rewards_sig", "def two(response, ground_truth):\n    return 1.0\n"
    )
    err = _error("user_rewards_sig:two")
    assert "(response, ground_truth, prompt)" in err.message


def test_spec_is_never_evaluated():
    # Something that would have side effects if eval'd is just an unknown name.
    _error("__import__('os').getcwd()")


# ------------------------------------------------------------------------------------ score_batch
def test_score_batch_accepts_numbers():
    assert score_batch(digit_match, ["6 7 8", "6"], ["678", "678"], ["", ""]) == pytest.approx([1.0, 1 / 3])
    assert score_batch(lambda r, g, p: r == g, ["a"], ["a"], [""]) == [1.0]  # bools become floats
    number_likes = [np.float32(0.5), np.int64(2), np.bool_(True), torch.tensor(0.25), -3]
    scores = score_batch(lambda r, g, p: number_likes[int(r)], ["0", "1", "2", "3", "4"], [""] * 5, [""] * 5)
    assert scores == [0.5, 2.0, 1.0, 0.25, -3.0] and all(type(s) is float for s in scores)
    with pytest.raises(ValueError, match="equally long"):
        score_batch(digit_match, ["a"], [], [""])


def none_for_x(response, ground_truth, prompt):
    return None if response == "x" else 1.0


@pytest.mark.parametrize(
    ("bad", "shown"),
    [
        (None, "None (NoneType)"),
        (math.nan, "nan (float)"),
        (math.inf, "inf (float)"),
        (np.float64("nan"), "(float64)"),
        ("1.0", "'1.0' (str)"),  # float() would parse it, but a string reward is a bug
        ([1.0], "[1.0] (list)"),
        (torch.tensor([1.0, 2.0]), "(Tensor)"),
    ],
)
def test_non_number_reward_is_a_config_error_naming_function_and_row(bad, shown):
    def scorer(response, ground_truth, prompt):
        return bad if response.startswith("bad") else 0.5

    long_prompt = "count on: " + "1 2 3 " * 40
    with pytest.raises(RewardFunctionError) as info:
        score_batch(scorer, ["fine", "bad " + "9" * 200], ["", ""], ["short", long_prompt])
    err = info.value
    assert isinstance(err, ConfigError) and err.path == "reward.function"  # exit 2, not a crash
    assert err.issues[0].rule == "reward-function-value"
    assert f"{__name__}:{scorer.__qualname__}" in err.message  # module:function
    assert "row 1" in err.message and shown in err.message
    assert "'count on: 1 2 3" in err.message and "'bad 999" in err.message  # the row's prompt and response
    assert long_prompt not in err.message and "9" * 100 not in err.message  # ... shortened
    assert "finite" in err.fix


def test_module_level_function_named_as_in_the_config():
    with pytest.raises(RewardFunctionError, match=rf"{__name__}:none_for_x returned None .* row 2"):
        score_batch(none_for_x, ["a", "b", "x"], [""] * 3, [""] * 3)


def test_reward_function_that_raises_is_a_config_error_with_its_location():
    def divide(response, ground_truth, prompt):
        return 1 / len(response)

    with pytest.raises(RewardFunctionError) as info:
        score_batch(divide, ["ok", ""], ["", ""], ["p0", "p1"])
    err = info.value
    assert err.issues[0].rule == "reward-function-raised" and err.path == "reward.function"
    assert "ZeroDivisionError" in err.message and "row 1 (prompt 'p1', response '')" in err.message
    assert f"{Path(__file__).name}:" in err.message  # where it raised
    assert isinstance(err.__cause__, ZeroDivisionError)


@pytest.mark.slow
@pytest.mark.multiproc
def test_run_stops_with_exit_2_on_a_bad_reward(tmp_path):
    """A user reward returning NaN mid-run: `rltrain` exits 2 with the reward.function error, no traceback."""
    (tmp_path / "nan_reward_mod.py").write_text(
        "def score(response, ground_truth, prompt):\n    return float('nan') if len(response) > 3 else 0.0\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "rltrain.cli", "tiny-grpo", "--trainer.total_steps", "2",
         "--trainer.val_before_train", "false", "--trainer.output_dir", str(tmp_path / "run"),
         "--reward.function", "nan_reward_mod:score"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert "reward.function" in result.stderr and "nan_reward_mod:score returned nan" in result.stderr
    assert "row " in result.stderr and "Traceback" not in result.stderr


def test_none_is_no_rule_reward_and_needs_a_reward_model():
    """`none` (verl's reward with a reward model: its score alone) scores 0 and is refused without a model."""
    from rlconf.config import RewardConfig, RewardModelConfig, RLConfig
    from rlconf.validate import check_config

    fn = load_reward_function("none")
    assert fn("#### 42", "42", "") == 0.0 == fn("", "", "")
    alone = RLConfig(reward=RewardConfig(function="none"))
    assert [(i.rule, i.path) for i in check_config(alone) if i.severity == "error"] == [
        ("reward-function", "reward.function")
    ]
    with_model = RLConfig(reward=RewardConfig(function="none", reward_model=RewardModelConfig(enable=True)))
    assert not [i for i in check_config(with_model) if i.path == "reward.function"]
