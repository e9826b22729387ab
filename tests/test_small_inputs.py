"""Small hostile inputs of issue 31, each a named error instead of "internal error" or a silent surprise:
an empty trainer.output_dir, a .jsonl prompt file with invalid UTF-8 or a row nested too deeply, a model
folder whose config.json is nested too deeply (exit 2 naming file and line), and calculator results that are
not finite real numbers (an error text for the model, not `(inf+infj)`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlconf.config import MultiTurnConfig
from rlconf.errors import ConfigError
from rlconf.plan.run import tool_plan
from rltrain.tools import ToolCall, ToolRunner
from rltrain.tools.calculator import CalculatorError, evaluate


def rltrain(*flags: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", "rltrain.cli", "tiny-grpo", *flags], capture_output=True,
                          text=True, timeout=300, env=env)  # fmt: skip


def test_an_empty_output_dir_is_refused_before_anything_is_written(tmp_path):
    for value in ("", " "):
        result = subprocess.run([sys.executable, "-m", "rltrain.cli", "tiny-grpo", "--trainer.output_dir", value],
                                capture_output=True, text=True, timeout=300, cwd=tmp_path,
                                env={**os.environ, "RAY_AUTH_MODE": "disabled"})  # fmt: skip
        assert result.returncode == 2, result.stderr[-3000:]
        assert "error [trainer] trainer.output_dir: is empty" in result.stderr
        assert list(tmp_path.iterdir()) == []  # nothing written into the current directory


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"prompt": "1+1", "answer": "2"}\n{"prompt": "\xff\xfe", "answer": "3"}\n',
         ":2 is not UTF-8 text (byte 13 of the line: b'\\xff')"),
        (b'{"prompt": "1+1", "answer": "2"}\n' + b'{"prompt": ' + b"[" * 100_000 + b"\n",
         ":2 is JSON nested too deeply to read"),
    ],
    ids=["invalid-utf8", "deeply-nested-row"],
)  # fmt: skip
def test_a_bad_jsonl_row_is_exit_2_naming_file_and_line(tmp_path, content, message):
    data = tmp_path / "train.jsonl"
    data.write_bytes(content)
    result = rltrain("--data.train_files", f"[{data}]",
                     "--trainer.output_dir", str(tmp_path / "run"))  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"{data}{message}" in result.stderr, result.stderr[-3000:]
    assert "internal error" not in result.stderr and "Traceback" not in result.stderr


def test_a_deeply_nested_config_json_is_exit_2_naming_file_and_line(tmp_path):
    from rlconf.model_spec import read_model_arch

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{\n  "model_type": "qwen2",\n  "x": ' + "[" * 100_000 + "\n}")
    from rltrain.tokenizer import CharTokenizer

    CharTokenizer().save_pretrained(str(folder))  # only config.json is wrong (rule tokenizer-load is met)
    with pytest.raises(ConfigError) as err:
        read_model_arch(str(folder))
    assert f"{folder / 'config.json'}:3: JSON nested too deeply to read" in err.value.format()
    result = subprocess.run([sys.executable, "-m", "rlconf.cli", "validate", "--preset", "tiny-grpo",
                             "--set", f"model.path={folder}"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"{folder / 'config.json'}:3: JSON nested too deeply to read" in result.stdout + result.stderr
    assert "internal error" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    "expression",
    ["(-1)**0.5*1e308*1e308", "(-1)**0.5", "(-8)**(1/3)", "1e308*10", "-(1e308*10)", "2.0**1023*2"],
)
def test_the_calculator_returns_only_finite_real_numbers(expression):
    with pytest.raises(CalculatorError):
        evaluate(expression)
    runner = ToolRunner(tool_plan(MultiTurnConfig(tools=("calculator",), tool_timeout_s=5.0, max_tool_response_length=256,
                                        max_parallel_tools=1)))  # fmt: skip
    pending = runner.submit(ToolCall("calculator", {"expression": expression}))
    runner.wait([pending])
    result = runner.poll(pending)
    assert result is not None and result.error and result.text.startswith("error: CalculatorError"), result
    assert "j)" not in result.text and "(inf" not in result.text


def test_the_calculator_still_computes_real_powers():
    assert evaluate("(-8)**3") == "-512"
    assert evaluate("4**0.5") == "2"
    assert evaluate("-2**2") == "-4"
