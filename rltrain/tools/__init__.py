"""Tools a multi-turn rollout's model may call, and the runner that executes their calls.

A tool is anything with a `name`, a `schema` (the OpenAI / Hugging Face function schema: {"type":
"function", "function": {"name", "description", "parameters"}}, what a chat template shows the model) and
`__call__(arguments: dict) -> str`. Built-ins: `calculator` (rltrain/tools/calculator.py) and `python`
(rltrain/tools/python_sandbox.py, code in a sandboxed subprocess). User tools are named in
`rollout.multi_turn.tools` as `package.module:function` (a function with a `schema` attribute; its name is
the function's) or `package.module:Class` (instantiated once with no arguments); they are imported like
`reward.function`, never evaluated, and trusted like it (your code, with your files and network).

No tool runs in the training driver. `ToolRunner` keeps a pool of `rollout.multi_turn.max_parallel_tools`
worker processes (rltrain/tools/worker.py, JSON lines over pipes) and runs each call on one of them, under its
own wall-clock limit counted from its submission: `submit` starts a call and returns at once, `poll` gives
the result of a call that finished (or ran past its limit), `wait` blocks until some call of a set is back.
The agent loop submits every call of a turn at once and lets rows whose tools are back take their next turn
while slower tools still run; `run_many` is the all-at-once form. A call that raises, times out, prints more
than the output limit, or crashes or kills its worker gives a `ToolResult` with `error` set (the model sees a
short error text, the row is marked in the metrics) and the rollout goes on: a worker that hung or died is
killed and replaced, so it costs that one call. The `python` tool's code runs one level further in, in the
sandbox (rltrain/tools/sandbox.py).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import importlib
import inspect
import json
import os
import queue
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rlconf.errors import ConfigError, error
from rlconf.plan.run import ToolPlan
from rlconf.profile_vocab import BUILTIN_TOOLS

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


def load_tool(spec: str, plan: ToolPlan) -> Tool:
    """The tool named by `spec`: a built-in name or `package.module:function|Class` (ConfigError on
    `rollout.multi_turn.tools` naming the spec and the fix when it cannot be used)."""
    if spec == "calculator":
        from rltrain.tools.calculator import Calculator

        return Calculator()
    if spec == "python":
        from rltrain.tools.python_sandbox import PythonSandbox

        return PythonSandbox(timeout_s=plan.tool_timeout_s, memory_mib=plan.tool_memory_mib,
                             isolate=plan.isolated)  # fmt: skip
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


def load_tools(plan: ToolPlan) -> list[Tool]:
    """Every tool of `rollout.multi_turn.tools`, in order (the char tokenizer's bare calls use the first)."""
    return [load_tool(spec, plan) for spec in plan.tools]


@dataclass(frozen=True)
class PendingCall:
    """A submitted call: its future and the time (perf_counter) it is cut off at."""

    call: ToolCall
    future: concurrent.futures.Future
    deadline: float


class _WorkerGone(Exception):
    """The worker process died, hung past the call's limit or broke the protocol."""


class _Worker:
    """One tool worker process (rltrain/tools/worker.py) and the pipe to it."""

    def __init__(self, command: list[str]) -> None:
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     start_new_session=True)  # fmt: skip
        self._buf = b""
        self.ready = False

    def read(self, deadline: float, max_bytes: int) -> dict[str, Any]:
        """The worker's next message; _WorkerGone when it dies, goes past `deadline` or sends too much."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.perf_counter()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise _WorkerGone("timeout")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise _WorkerGone("exited")
            self._buf += chunk
            if len(self._buf) > max_bytes:
                raise _WorkerGone("sent more than the protocol allows")
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            message = json.loads(line)
        except ValueError as exc:
            raise _WorkerGone("broke the protocol") from exc
        if not isinstance(message, dict):
            raise _WorkerGone("broke the protocol")
        return message

    def call(self, call: ToolCall, deadline: float, max_bytes: int) -> dict[str, Any]:
        if not self.ready:
            hello = self.read(deadline, max_bytes)
            if "error" in hello:
                return {"text": f"error: the tools could not be loaded: {hello['error']}", "error": True}
            self.ready = True
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(
                (json.dumps({"tool": call.name, "arguments": call.arguments}) + "\n").encode()
            )
            self.proc.stdin.flush()
        except OSError as exc:  # BrokenPipeError: it died
            raise _WorkerGone("exited") from exc
        return self.read(deadline, max_bytes)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                pipe.close()  # type: ignore[union-attr]


class ToolRunner:
    """Runs the tool calls of `rollout.multi_turn` in a pool of worker processes (rltrain/tools/worker.py),
    never in the driver, concurrently, under a wall-clock limit and an output limit per call."""

    def __init__(self, plan: ToolPlan, timeout_s: float | None = None) -> None:
        self.plan = plan
        self.tool_list = load_tools(plan)  # here only for the names and schemas the prompt shows
        self.tools = {t.name: t for t in self.tool_list}
        self.timeout_s = plan.tool_timeout_s if timeout_s is None else timeout_s
        self.max_chars = plan.max_tool_response_length
        self._max_bytes = 8 * self.max_chars + 4096  # a JSON line of max_chars + 16 characters, escaped
        if not plan.isolated and "python" in plan.tools:
            from rltrain.tools.python_sandbox import UNISOLATED_WARNING

            print(UNISOLATED_WARNING, file=sys.stderr, flush=True)
        self._command = [sys.executable, "-m", "rltrain.tools.worker", json.dumps({
            "parent_pid": os.getpid(), "sys_path": list(sys.path), "max_chars": self.max_chars,
            "multi_turn": {**dataclasses.asdict(plan), "tools": list(plan.tools)},
        })]  # fmt: skip
        n = plan.max_parallel_tools
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._all: list[_Worker] = []
        for _ in range(n):  # started now, so their imports are done before the first turn's calls
            self._idle.put(self._spawn())
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=n)

    def _spawn(self) -> _Worker:
        worker = _Worker(self._command)
        with self._lock:
            self._all.append(worker)
        return worker

    def _call(self, call: ToolCall, deadline: float) -> ToolResult:
        """Run one call on an idle worker; `seconds` is its own run time (not the wait for others)."""
        t0 = time.perf_counter()
        if call.name not in self.tools:
            return ToolResult(
                f"error: unknown tool {call.name!r}; tools: {', '.join(self.tools)}", error=True
            )
        worker = self._idle.get()  # one per pool thread: never waits
        try:
            reply = worker.call(call, deadline, self._max_bytes)
        except _WorkerGone as gone:
            # Killed, crashed or hung: this call fails, a fresh worker takes the dead one's place.
            worker.kill()
            with self._lock:
                self._all.remove(worker)
            self._idle.put(self._spawn())
            text = (f"error: timed out after {self.timeout_s:g} s" if str(gone) == "timeout"
                    else f"error: the tool's process {gone}")  # fmt: skip
            return ToolResult(text, True, False, time.perf_counter() - t0)
        self._idle.put(worker)
        return ToolResult(
            str(reply.get("text", "")), bool(reply.get("error")), False, time.perf_counter() - t0
        )

    def submit(self, call: ToolCall) -> PendingCall:
        """Start `call` in the pool; its time limit runs from now."""
        # A grace of 0.5 s past the limit: a tool that enforces the limit itself (the python sandbox) reports
        # its own timeout, with its output, rather than this runner's bare one.
        deadline = time.perf_counter() + self.timeout_s + 0.5
        return PendingCall(call, self._pool.submit(self._call, call, deadline), deadline)

    def poll(self, pending: PendingCall) -> ToolResult | None:
        """The call's result when it is back or past its limit (then a timeout error); None while it runs."""
        if pending.future.done():
            res = pending.future.result()
        elif time.perf_counter() >= pending.deadline:
            pending.future.cancel()  # not started yet (a full pool): never runs; running: its worker is killed
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
        with self._lock:
            workers, self._all = self._all, []
        for worker in workers:
            worker.kill()
