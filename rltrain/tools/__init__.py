"""Tools a multi-turn rollout's model may call, and the runner that executes their calls.

A tool is anything with a `name`, a `schema` (the OpenAI / Hugging Face function schema: {"type":
"function", "function": {"name", "description", "parameters"}}, what a chat template shows the model) and
`__call__(arguments: dict) -> str`. Built-ins: `calculator` (rltrain/tools/calculator.py) and `python`
(rltrain/tools/python_sandbox.py, code in a sandboxed subprocess). User tools are named in
`rollout.multi_turn.tools` as `package.module:function` (a function with a `schema` attribute; its name is
the function's) or `package.module:Class` (instantiated once with no arguments); they are imported like
`reward.function`, never evaluated, and trusted like it: they run in the rollout's process.

`ToolRunner` runs calls in a thread pool, each under its own wall-clock limit counted from its submission:
`submit` starts a call and returns at once, `poll` gives the result of a call that finished (or ran past its
limit), `wait` blocks until some call of a set is back. The agent loop submits every call of a turn at once
and lets rows whose tools are back take their next turn while slower tools still run; `run_many` is the
all-at-once form. A call that raises, times out or prints more than the output limit gives a `ToolResult`
with `error` set (the model sees a short error text, the row is marked in the metrics) and the rollout goes
on; a timed-out Python call cannot be killed, only abandoned (its thread stays busy until it returns; the
python tool's own limits kill its subprocess).
"""

from __future__ import annotations

import concurrent.futures
import importlib
import inspect
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rlconf.config import BUILTIN_TOOLS, MultiTurnConfig
from rlconf.errors import ConfigError, error

CONFIG_PATH = "rollout.multi_turn.tools"


@runtime_checkable
class Tool(Protocol):
    """What the agent loop needs from a tool."""

    name: str
    schema: dict[str, Any]

    def __call__(self, arguments: dict[str, Any]) -> str: ...


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolResult:
    """What a call gave: the text the model sees and how it went."""

    text: str
    error: bool = False
    """The call failed: unknown tool, bad arguments, raised, timed out, crashed or printed too much."""
    truncated: bool = False
    """The output was cut to the configured length."""
    seconds: float = 0.0


def first_string_parameter(schema: dict[str, Any]) -> str:
    """Name of the first required parameter of a tool's schema (the one a bare-text call fills)."""
    params = schema.get("function", schema).get("parameters", {})
    required = params.get("required") or list(params.get("properties", {}))
    if not required:
        raise ValueError(f"tool schema {schema!r} has no parameter to pass a bare argument to")
    return str(required[0])


@dataclass
class _FunctionTool:
    """A plain function `fn(**arguments) -> str` with a `schema` attribute, as a Tool."""

    fn: Callable[..., Any]
    name: str
    schema: dict[str, Any] = field(default_factory=dict)

    def __call__(self, arguments: dict[str, Any]) -> str:
        return str(self.fn(**arguments))


_SPEC = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


def _tool_error(message: str, fix: str, rule: str = "multi-turn-tools") -> ConfigError:
    return ConfigError([error(CONFIG_PATH, message, fix, rule=rule)])


def load_tool(spec: str, cfg: MultiTurnConfig) -> Tool:
    """The tool named by `spec`: a built-in name or `package.module:function|Class` (ConfigError on
    `rollout.multi_turn.tools` naming the spec and the fix when it cannot be used)."""
    if spec == "calculator":
        from rltrain.tools.calculator import Calculator

        return Calculator()
    if spec == "python":
        from rltrain.tools.python_sandbox import PythonSandbox

        return PythonSandbox(timeout_s=cfg.tool_timeout_s, memory_mib=cfg.tool_memory_mib)
    if not _SPEC.match(spec):
        raise _tool_error(
            f"{spec!r} is neither a built-in tool nor a package.module:function path",
            f"use one of {', '.join(BUILTIN_TOOLS)} or package.module:function",
        )
    module_name, attr = spec.split(":")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except Exception as exc:  # import errors of any kind, or a missing attribute: report them as they are
        raise _tool_error(
            f"cannot load tool {spec!r}: {type(exc).__name__}: {exc}",
            "install the package or add its folder to PYTHONPATH, and check the spelling",
        ) from exc
    tool = obj() if inspect.isclass(obj) else obj
    schema = getattr(tool, "schema", None)
    if not callable(tool) or not isinstance(schema, dict):
        raise _tool_error(
            f"tool {spec!r} has no `schema` dict (the JSON function schema shown to the model)",
            "give the function a `schema` attribute ({'type': 'function', 'function': {'name': ..., "
            "'description': ..., 'parameters': {...}}}), or use a class with name, schema and __call__",
        )
    if inspect.isclass(obj):
        return tool  # type: ignore[return-value]
    name = schema.get("function", {}).get("name", getattr(obj, "__name__", attr))
    return _FunctionTool(obj, name, schema)


def load_tools(cfg: MultiTurnConfig) -> list[Tool]:
    """Every tool of `rollout.multi_turn.tools`, in order (the char tokenizer's bare calls use the first)."""
    return [load_tool(spec, cfg) for spec in cfg.tools]


@dataclass(frozen=True)
class PendingCall:
    """A submitted call: its future and the time (perf_counter) it is cut off at."""

    call: ToolCall
    future: concurrent.futures.Future
    deadline: float


class ToolRunner:
    """Runs tool calls concurrently under a wall-clock limit and an output limit."""

    def __init__(self, tools: Sequence[Tool], timeout_s: float, max_chars: int, max_parallel: int) -> None:
        self.tools = {t.name: t for t in tools}
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        # Threads: a tool that hangs in Python code cannot be killed, only abandoned; the pool keeps working
        # with its other threads (the python tool's own limits kill its subprocess).
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, max_parallel))

    def _call(self, call: ToolCall) -> ToolResult:
        """Run one call in a pool thread; `seconds` is its own run time (not the wait for others)."""
        t0 = time.perf_counter()
        res = self._call_untimed(call)
        return ToolResult(res.text, res.error, res.truncated, time.perf_counter() - t0)

    def _call_untimed(self, call: ToolCall) -> ToolResult:
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(
                f"error: unknown tool {call.name!r}; tools: {', '.join(self.tools)}", error=True
            )
        try:
            text = tool(call.arguments)
        except Exception as exc:  # any failure of the tool is shown to the model, never ends the run
            return ToolResult(f"error: {type(exc).__name__}: {exc}", error=True)
        failed = getattr(text, "error", False)  # a ToolResult-like answer (the python sandbox) says itself
        return ToolResult(str(text), error=bool(failed))

    def submit(self, call: ToolCall) -> PendingCall:
        """Start `call` in the pool; its time limit runs from now."""
        # A grace of 0.5 s past the limit: a tool that enforces the limit itself (the python sandbox) reports
        # its own timeout, with its output, rather than this runner's bare one.
        return PendingCall(
            call, self._pool.submit(self._call, call), time.perf_counter() + self.timeout_s + 0.5
        )

    def poll(self, pending: PendingCall) -> ToolResult | None:
        """The call's result when it is back or past its limit (then a timeout error); None while it runs."""
        if pending.future.done():
            res = pending.future.result()
        elif time.perf_counter() >= pending.deadline:
            pending.future.cancel()  # not started yet (a full pool): never runs; running: abandoned
            res = ToolResult(f"error: timed out after {self.timeout_s:g} s", True, False, self.timeout_s)
        else:
            return None
        text, truncated = res.text, False
        if len(text) > self.max_chars:
            text, truncated = text[: self.max_chars] + "...", True
        return ToolResult(text, res.error, truncated or res.truncated, res.seconds)

    def wait(self, pending: Sequence[PendingCall], timeout: float | None = None) -> None:
        """Block until one of `pending` is back, the earliest limit among them passes, or `timeout` (s)."""
        if not pending:
            return
        limit = min(p.deadline for p in pending) - time.perf_counter()
        limit = max(limit if timeout is None else min(limit, timeout), 0.0)
        concurrent.futures.wait([p.future for p in pending], limit, concurrent.futures.FIRST_COMPLETED)

    def run_many(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Run `calls` at once; results in the same order."""
        pending = [self.submit(c) for c in calls]
        results: list[ToolResult | None] = [None] * len(pending)
        while any(r is None for r in results):
            waiting = [p for p, r in zip(pending, results, strict=True) if r is None]
            self.wait(waiting)
            for i, p in enumerate(pending):
                if results[i] is None:
                    results[i] = self.poll(p)
        return [r for r in results if r is not None]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
