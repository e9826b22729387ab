"""Tools of multi-turn rollouts: the calculator, the python sandbox's limits (a call that hangs, crashes,
allocates, prints megabytes or opens a socket is cut off with an error and the caller goes on), the
concurrent runner and user tool plugins."""

from __future__ import annotations

import textwrap
import time

import pytest

from rlconf.config import MultiTurnConfig
from rlconf.errors import ConfigError
from rlconf.plan.run import tool_plan
from rltrain.tools import ToolCall, ToolRunner, load_tool
from rltrain.tools.calculator import Calculator, CalculatorError, evaluate
from rltrain.tools.python_sandbox import run_python


def test_calculator_is_exact_and_refuses_everything_else():
    assert evaluate("47*8") == "376"
    assert evaluate("(2+3)**2 - 7//2") == "22"
    assert evaluate("1/4") == "0.25"
    assert evaluate("6/3") == "2"  # an integral float without ".0"
    for bad in ("__import__('os')", "x+1", "9**9**9", "1/0", "", "2*"):
        with pytest.raises(CalculatorError):
            evaluate(bad)
    assert Calculator()({"expression": "12*34"}) == "408"


def test_python_sandbox_runs_code_in_a_fresh_temporary_folder():
    out = run_python(
        "import os\nprint(6 * 7)\nprint(os.getcwd(), os.listdir('.'))\nopen('x.txt', 'w').write('k')"
    )
    assert not out.error
    assert out.text.split("\n")[:2] == ["42", "/tmp []"]
    again = run_python("import os\nprint(os.listdir('.'))")  # the last call's scratch is gone
    assert (again.text.strip(), again.error) == ("[]", False)


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        ("while True: pass", "timed out"),  # hangs (CPU)
        ("import time; time.sleep(60)", "timed out"),  # hangs (sleep: only the wall clock stops it)
        ("import ctypes; ctypes.string_at(0)", "killed by SIGSEGV"),  # crashes
        ("import os; os._exit(3)", "exited with code 3"),
        ("print('x' * 10_000_000)", "printed more than"),  # megabytes of output
        ("a = bytearray(2 ** 31)", "out of memory"),
        ("import socket; socket.create_connection(('127.0.0.1', 9))", "not allowed"),  # no network
        ("import subprocess; subprocess.run(['true'])", "not allowed"),
    ],
)
def test_python_sandbox_cuts_off_bad_code_with_an_error(code, reason):
    # Only the hanging cases wait for the clock: the others get time enough for a fresh interpreter on a
    # loaded 2-core machine (CI's two test processes), which once took the socket case past 1.5 s there.
    timeout_s = 1.5 if reason == "timed out" else 30.0
    t0 = time.perf_counter()
    out = run_python(code, timeout_s=timeout_s, memory_mib=256, max_output_bytes=4096)
    assert out.error
    assert reason in out.text, out.text
    assert len(out.text) < 4096 + 200
    assert time.perf_counter() - t0 < timeout_s + 8.5


def test_runner_cuts_off_a_hanging_tool_without_holding_up_the_others(tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text(
        textwrap.dedent("""
        import time

        def slow(seconds):
            time.sleep(float(seconds))
            return "woke"

        slow.schema = {"type": "function", "function": {"name": "slow", "parameters": {"type": "object",
                       "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]}}}

        def crash(expression):
            raise RuntimeError("tool bug")

        crash.schema = {"type": "function", "function": {"name": "crash", "parameters": {"type": "object",
                        "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}

        def loud(expression):
            return "y" * 5_000_000

        loud.schema = {"type": "function", "function": {"name": "loud", "parameters": {"type": "object",
                       "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tool_plan(MultiTurnConfig(tools=("my_tools:slow", "my_tools:crash", "my_tools:loud", "calculator"),
                          tool_timeout_s=3.0, max_tool_response_length=64, max_parallel_tools=4))  # fmt: skip
    runner = ToolRunner(cfg)
    t0 = time.perf_counter()
    hang, crash, loud, ok, unknown = runner.run_many([
        ToolCall("slow", {"seconds": 30}), ToolCall("crash", {"expression": "1"}),
        ToolCall("loud", {"expression": "1"}), ToolCall("calculator", {"expression": "47*8"}),
        ToolCall("nope", {}),
    ])  # fmt: skip
    elapsed = time.perf_counter() - t0
    runner.close()
    assert elapsed < 20  # the hanging call's worker is killed at its deadline (3 s), not after its 30 s
    assert hang.error and "timed out" in hang.text
    assert crash.error and "RuntimeError: tool bug" in crash.text
    assert loud.truncated and not loud.error and len(loud.text) <= 64 + 3
    assert (ok.text, ok.error) == ("376", False)
    # Not held up by the hanging call: done before the hanging call's deadline (a loaded machine may take
    # a second to start a sandbox, so the deadline is 3 s, not 1).
    assert ok.seconds < cfg.tool_timeout_s
    assert unknown.error and "unknown tool" in unknown.text


def test_user_tool_without_schema_is_a_config_error(tmp_path, monkeypatch):
    (tmp_path / "bare_tools.py").write_text("def f(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as exc:
        load_tool("bare_tools:f", tool_plan(MultiTurnConfig()))
    assert exc.value.issues[0].path == "rollout.multi_turn.tools"
    with pytest.raises(ConfigError):
        load_tool("not_a_module_xyz:f", tool_plan(MultiTurnConfig()))
    with pytest.raises(ConfigError):
        load_tool("calc", tool_plan(MultiTurnConfig()))


def test_python_tool_through_the_runner():
    cfg = tool_plan(
        MultiTurnConfig(
            tools=("python",), tool_timeout_s=4.0, max_tool_response_length=256, max_parallel_tools=2
        )
    )
    # The good call's limit leaves room for a fresh sandboxed interpreter on a loaded 2-core machine.
    runner = ToolRunner(cfg, timeout_s=6.0)
    good, bad = runner.run_many([ToolCall("python", {"code": "print(sum(range(10)))"}),
                                 ToolCall("python", {"code": "while True: pass"})])  # fmt: skip
    runner.close()
    assert (good.text.strip(), good.error) == ("45", False)
    assert bad.error and "timed out" in bad.text
