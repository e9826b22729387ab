"""Rules of what a run loads beside the model: the reward function (built-in name or user code, its file), the tokenizer, multi-turn tools and their sandbox.

Each rule registers itself in rlconf.rules with `@rule(name, fields...)` when this module is imported
(rlconf.validate imports every check module, in the order the docs list the rules).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from functools import cache

from rlconf.config import (
    BUILTIN_REWARDS,
    BUILTIN_TOOLS,
    MultiTurnConfig,
    RLConfig,
)
from rlconf.errors import Issue, error, warning
from rlconf.reward_file import RULE as REWARD_FILE_RULE
from rlconf.reward_file import file_spec_issues, split_file_spec
from rlconf.rules import rule
from rlconf.tokenizer_check import RULE as TOKENIZER_RULE
from rlconf.tokenizer_check import tokenizer_issues

USER_FN = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")


@rule("reward-function", "reward.function", "reward.reward_model.enable")
def reward_function(c: RLConfig) -> Iterator[Issue]:
    """reward.function is a built-in name, an importable `package.module:function` path or a
    `path/to/file.py:function` (verl's custom_reward_function); `none` only beside a reward model."""
    fn = c.reward.function
    if fn == "math_verify" and importlib.util.find_spec("math_verify") is None:
        yield error(
            "reward.function",
            "math_verify scores with Hugging Face's math-verify package, which is not installed",
            "pip install 'rlplan[math]' (or `math-verify`), or use reward.function: math (normalised "
            "strings, verl's default for MATH)",
            "reward-function",
        )
        return
    if fn == "none" and not c.reward.reward_model.enable:
        yield error("reward.function", "none scores every response 0 and no reward model scores them",
                    "choose a reward function, or enable reward.reward_model", "reward-function")  # fmt: skip
        return
    if fn in BUILTIN_REWARDS or USER_FN.match(fn):
        return
    if split_file_spec(fn) is not None:
        yield from file_spec_issues(fn, filesystem=False)
        return
    import difflib

    hint = difflib.get_close_matches(fn, BUILTIN_REWARDS, n=1)
    yield error(
        "reward.function",
        f"{fn!r} is neither a built-in reward, a `module:function` path nor a `file.py:function`",
        (f"did you mean `{hint[0]}`? " if hint else "") + f"built-ins: {', '.join(BUILTIN_REWARDS)}",
        "reward-function",
    )


@rule(REWARD_FILE_RULE, "reward.function", filesystem=True)
def reward_function_file(c: RLConfig) -> Iterator[Issue]:
    """A `path/to/file.py:function` reward is a regular Python file of bounded size that parses and
    defines the function at its top level (checked with `ast`: the file is never run here)."""
    if split_file_spec(c.reward.function) is not None:
        yield from file_spec_issues(c.reward.function, filesystem=True)


@rule(TOKENIZER_RULE, "model.path", "model.tokenizer_path", filesystem=True)
def tokenizer_load(c: RLConfig) -> Iterator[Issue]:
    """The model folder's tokenizer loads: the packages are installed, the folder has tokenizer files,
    tokenizer.json loads, tokenizer_config.json parses and the chat template compiles (rlconf.tokenizer_check:
    no torch, bounded reads)."""
    yield from tokenizer_issues(c.model)


@rule("multi-turn", "rollout.multi_turn.*", "rollout.max_response_length")
def multi_turn(c: RLConfig) -> Iterator[Issue]:
    """rollout.multi_turn: turns, lengths and tool limits are positive, max_total_tokens fits in
    rollout.max_response_length (the plan sizes sequences by it), tools are built-in names or
    `module:function` paths and there is at least one when the agent loop is on."""
    mt, path = c.rollout.multi_turn, "rollout.multi_turn"
    for name in ("max_assistant_turns", "max_tool_response_length", "tool_memory_mib", "max_parallel_tools"):
        if getattr(mt, name) < 1:
            yield error(f"{path}.{name}", f"must be >= 1, got {getattr(mt, name)}",
                        f"use the default {getattr(MultiTurnConfig(), name)}", "multi-turn")  # fmt: skip
    if mt.tool_timeout_s <= 0:
        yield error(f"{path}.tool_timeout_s", f"must be > 0, got {mt.tool_timeout_s}", "use e.g. 5.0",
                    "multi-turn")  # fmt: skip
    limit = c.rollout.max_response_length
    if mt.max_total_tokens is not None and not 1 <= mt.max_total_tokens <= limit:
        yield error(f"{path}.max_total_tokens",
                    f"must be 1..rollout.max_response_length = {limit} (the plan sizes sequences by it), got "
                    f"{mt.max_total_tokens}",
                    "raise rollout.max_response_length, or leave max_total_tokens null to use it", "multi-turn")  # fmt: skip
    if mt.enable and not mt.tools and mt.interaction is None:
        yield error(f"{path}.tools", "the agent loop is on but has no tool and no interaction",
                    "list tools, e.g. [calculator], or set rollout.multi_turn.enable: false", "multi-turn")  # fmt: skip
    for i, spec in enumerate(mt.tools):
        if spec not in BUILTIN_TOOLS and not USER_FN.match(spec):
            yield error(f"{path}.tools[{i}]", f"{spec!r} is neither a built-in tool nor a `module:function` path",
                        f"built-ins: {', '.join(BUILTIN_TOOLS)}; user tools: package.module:function",
                        "multi-turn")  # fmt: skip
    if mt.interaction is not None and not USER_FN.match(mt.interaction):
        yield error(f"{path}.interaction", f"{mt.interaction!r} is not a `module:Class` path",
                    "name an importable class, e.g. my_envs.math:Checker", "multi-turn")  # fmt: skip


@cache
def sandbox_problem() -> str | None:
    """What keeps this machine from building the python tool's sandbox, or None. It runs the sandbox itself
    once per process on a probe program (`python -I -S rltrain/tools/sandbox.py --probe`): the check is the
    mechanism, not a guess about it. rlconf imports nothing of rltrain; it only runs that file."""
    spec = importlib.util.find_spec("rltrain")
    if spec is None or not spec.submodule_search_locations:
        return "rltrain is not installed"
    script = os.path.join(next(iter(spec.submodule_search_locations)), "tools", "sandbox.py")
    exe = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    try:
        done = subprocess.run([exe, "-I", "-S", script, "--probe"], capture_output=True, text=True, timeout=30,
                              stdin=subprocess.DEVNULL)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the sandbox probe did not run: {exc}"
    answer = (done.stdout.strip().splitlines() or [done.stderr.strip() or f"exit code {done.returncode}"])[-1]
    return None if done.returncode == 0 and answer == "ok" else answer


@rule("tool-sandbox", "rollout.multi_turn.tools", "rollout.multi_turn.sandbox", filesystem=True)
def tool_sandbox(c: RLConfig) -> Iterator[Issue]:
    """The python tool runs model-written code: with rollout.multi_turn.sandbox isolated (the default) this
    machine must be able to build the sandbox (user, mount, PID and network namespaces, seccomp); the check
    builds it once. sandbox none is allowed, with a warning."""
    mt = c.rollout.multi_turn
    if not mt.enable or "python" not in mt.tools:
        return
    if mt.sandbox == "none":
        yield warning("rollout.multi_turn.sandbox",
                      "none: the python tool runs model-written code without isolation (your files, your network)",
                      "use sandbox: isolated unless you trust every line the model writes", "tool-sandbox")  # fmt: skip
        return
    if (problem := sandbox_problem()) is not None:
        yield error("rollout.multi_turn.tools",
                    f"the python tool needs a sandbox this machine cannot build: {problem}",
                    "enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 / "
                    "user.max_user_namespaces > 0; in Docker run with a seccomp profile that allows unshare, or "
                    "--privileged), install libseccomp (Debian: libseccomp2), or drop `python` from the tools; "
                    "`rollout.multi_turn.sandbox: none` runs it unisolated for code you trust", "tool-sandbox")  # fmt: skip
