"""The built-in `python` tool: run a model's code in a sandboxed subprocess and return what it printed.

Each call gets a fresh `python -I` process (isolated: no user site, no PYTHONPATH, no current folder on the
path) in a new temporary working directory that is removed afterwards, with a minimal environment, and these
limits, so a call that hangs, crashes, allocates or prints without end is cut off and the rollout goes on:
  - wall clock `timeout_s` (the process group is killed) and CPU time (RLIMIT_CPU, a second more);
  - address space `memory_mib` (RLIMIT_AS); no new processes (RLIMIT_NPROC 0 where the kernel counts them);
  - output: stdout and stderr go to files limited by RLIMIT_FSIZE (`max_output_bytes`): a process that writes
    more is killed by SIGXFSZ, and only the first bytes are read back;
  - no network: the process first tries to enter new user and network namespaces (unshare; no interfaces but
    loopback), and in any case a Python audit hook installed before the code runs refuses sockets,
    subprocesses and os.system / exec.
This is a sandbox against accidents and runaway code of a policy being trained, not against a determined
attacker (CPython has no in-process security boundary); run untrusted models' tools in a container.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

# Installed before the model's code: refuse the audit events of networking and of starting programs.
_PRELUDE = r"""
import sys
def _rlplan_sandbox(event, args):
    if event.startswith(("socket.", "subprocess.", "os.exec", "os.posix_spawn", "os.spawn", "os.fork")) or event in ("os.system", "pty.spawn"):
        raise PermissionError(f"sandbox: {event} is not allowed")
sys.addaudithook(_rlplan_sandbox)
del _rlplan_sandbox
"""
_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000


@dataclass(frozen=True)
class SandboxOutput:
    """What a sandboxed run gave: its output text (stdout, then stderr) and whether it failed."""

    text: str
    error: bool
    reason: str = ""

    def __str__(self) -> str:
        return self.text


def _limit_child(timeout_s: float, memory_bytes: int, max_output_bytes: int) -> None:
    """Runs in the child between fork and exec: namespaces and resource limits."""
    try:  # no network: a fresh network namespace has no interfaces (needs unprivileged user namespaces)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET)
    except Exception:  # the audit hook still refuses sockets
        pass
    cpu = int(timeout_s) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_output_bytes, max_output_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_python(
    code: str, timeout_s: float = 5.0, memory_mib: int = 256, max_output_bytes: int = 65536
) -> SandboxOutput:
    """Run `code` in a sandboxed subprocess (module docstring); its printed output or an error text."""
    with tempfile.TemporaryDirectory(prefix="rlplan-tool-") as tmp:
        work = Path(tmp)
        (work / "main.py").write_text(_PRELUDE + "\n" + code, encoding="utf-8")
        out_path, err_path = work / "stdout.txt", work / "stderr.txt"
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "PYTHONHASHSEED": "0", "LANG": "C.UTF-8"}
        t0 = time.perf_counter()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "main.py"],
                cwd=tmp,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,  # its own process group: a timeout kills everything it started
                preexec_fn=lambda: _limit_child(timeout_s, memory_mib * 2**20, max_output_bytes),
            )
            try:
                code_ = proc.wait(timeout=timeout_s)
                reason = ""
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                code_, reason = proc.returncode, f"timed out after {timeout_s:g} s"
        stdout = out_path.read_bytes()[:max_output_bytes].decode("utf-8", "replace")
        stderr = err_path.read_bytes()[:max_output_bytes].decode("utf-8", "replace")
        if not reason and code_ != 0:
            # Python ignores SIGXFSZ: a write past the limit raises OSError (EFBIG) instead.
            if code_ == -signal.SIGXFSZ or "File too large" in stderr:
                reason = f"printed more than {max_output_bytes} bytes"
            elif code_ == -signal.SIGXCPU:
                reason = f"ran out of CPU time ({time.perf_counter() - t0:.1f} s)"
            elif code_ < 0:
                reason = f"killed by {signal.Signals(-code_).name}"
            elif "MemoryError" in stderr:
                reason = f"ran out of memory ({memory_mib} MiB)"
            else:
                reason = f"exited with code {code_}"
    text = stdout + (stderr if stderr else "")
    if reason:
        # Keep the end of stderr (the exception line) within what the model will be shown.
        tail = stderr.strip().splitlines()[-1:] if stderr.strip() else []
        return SandboxOutput(f"error: {reason}" + (f": {tail[0]}" if tail else ""), True, reason)
    return SandboxOutput(text, False)


class PythonSandbox:
    """Tool `python(code)`: run Python code in a sandboxed subprocess, return what it printed."""

    name = "python"
    schema: ClassVar[dict[str, Any]] = {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code in a sandbox (no network, no files kept, time and memory limits) "
            "and return what it prints.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "Python source; print the result"}},
                "required": ["code"],
            },
        },
    }

    def __init__(self, timeout_s: float = 5.0, memory_mib: int = 256, max_output_bytes: int = 65536) -> None:
        self.timeout_s, self.memory_mib, self.max_output_bytes = timeout_s, memory_mib, max_output_bytes

    def __call__(self, arguments: dict[str, Any]) -> SandboxOutput:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ValueError("argument `code` (a string) is missing")
        return run_python(code, self.timeout_s, self.memory_mib, self.max_output_bytes)
