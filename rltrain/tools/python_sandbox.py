"""The built-in `python` tool: run a model's code in the sandbox (rltrain/tools/sandbox.py) and return what it
printed.

Each call is a fresh `python -I -S` process tree in its own user, mount, PID, network, IPC and UTS namespaces
(sandbox.py says exactly what it sees and may do): a read-only root with only the interpreter and its standard
library, a private `/tmp` capped at `scratch_mib` that is its working folder and is gone after the call, no
network and no new sockets of any family, no view of host files or processes, a seccomp filter, and limits:
  - wall clock `timeout_s` (the launcher's process group is killed, the namespace dies with it) and CPU time
    (RLIMIT_CPU, a second more);
  - address space `memory_mib` (RLIMIT_AS); at most `max_processes` processes and threads (RLIMIT_NPROC);
  - output: stdout and stderr go to host files limited by RLIMIT_FSIZE (`max_output_bytes`, which also caps
    each scratch file): a write past it fails, and only the first bytes are read back.
The model is shown an error text for code that hangs, crashes, runs out of memory, prints without end or
tries what the sandbox refuses; the rollout goes on.

`isolate=False` (`rollout.multi_turn.sandbox: none`, for code you trust) runs the same process with the limits
but without namespaces or seccomp: only an audit hook stands between the code and the machine, and every run
prints a warning saying so (`ToolRunner`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from rltrain.tools import sandbox

# Defence in depth only (the namespaces and seccomp are the boundary): refuse networking and programs early,
# with a readable message.
_PRELUDE = r"""
import sys
def _rlplan_sandbox(event, args):
    if event.startswith(("socket.", "subprocess.", "os.exec", "os.posix_spawn", "os.spawn")) or event in ("os.system", "pty.spawn"):
        raise PermissionError(f"sandbox: {event} is not allowed")
sys.addaudithook(_rlplan_sandbox)
del _rlplan_sandbox
"""


@dataclass(frozen=True)
class SandboxOutput:
    """What a sandboxed run gave: its output text (stdout, then stderr) and whether it failed."""

    text: str
    error: bool
    reason: str = ""

    def __str__(self) -> str:
        return self.text


def _unisolated(work: Path, timeout_s: float, memory_mib: int, max_output_bytes: int,
                out: int, err: int) -> tuple[int | None, bool]:  # fmt: skip
    """`sandbox: none`: the same interpreter and limits in a plain child process (trusted code only)."""
    import resource

    def limit() -> None:
        cpu = int(timeout_s) + 1
        for which, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, memory_mib * 2**20),
                             (resource.RLIMIT_FSIZE, max_output_bytes), (resource.RLIMIT_CORE, 0)):  # fmt: skip
            resource.setrlimit(which, (value, value))

    env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8"}
    proc = subprocess.Popen([sandbox.interpreter(), "-I", "-S", "main.py"], cwd=work, env=env,
                            stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
                            preexec_fn=limit)  # fmt: skip
    return sandbox.wait_or_kill_group(proc, timeout_s)


def run_python(
    code: str,
    timeout_s: float = 5.0,
    memory_mib: int = 256,
    max_output_bytes: int = 65536,
    *,
    scratch_mib: int = 16,
    max_processes: int = 16,
    isolate: bool = True,
) -> SandboxOutput:
    """Run `code` in the sandbox (module docstring); its printed output or an error text."""
    work = Path(tempfile.mkdtemp(prefix="rlplan-tool-"))
    try:
        (work / "root").mkdir()
        (work / "main.py").write_text(_PRELUDE + "\n" + code, encoding="utf-8", errors="replace")
        out_path, err_path = work / "stdout.txt", work / "stderr.txt"
        t0 = time.perf_counter()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            if isolate:
                spec = sandbox.SandboxSpec(
                    argv=[sandbox.interpreter(), "-I", "-S", sandbox.MAIN_PATH],
                    workdir=str(work),
                    files={sandbox.MAIN_PATH: str(work / "main.py")},
                    env={
                        "PATH": "/usr/bin:/bin",
                        "HOME": "/tmp",
                        "TMPDIR": "/tmp",
                        "LANG": "C.UTF-8",
                        "PYTHONHASHSEED": "0",
                    },
                    memory_mib=memory_mib,
                    cpu_s=int(timeout_s) + 1,
                    max_file_bytes=max_output_bytes,
                    scratch_mib=scratch_mib,
                    max_processes=max_processes,
                    parent_pid=os.getpid(),
                )
                code_, timed_out = sandbox.run_isolated(spec, out.fileno(), err.fileno(), timeout_s)
            else:
                code_, timed_out = _unisolated(work, timeout_s, memory_mib, max_output_bytes,
                                               out.fileno(), err.fileno())  # fmt: skip
        with open(out_path, "rb") as f:
            stdout = f.read(max_output_bytes).decode("utf-8", "replace")
        with open(err_path, "rb") as f:
            stderr = f.read(max_output_bytes).decode("utf-8", "replace")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    reason = f"timed out after {timeout_s:g} s" if timed_out else ""
    if not reason and code_ == sandbox.SETUP_FAILED and sandbox.SETUP_PREFIX in stderr:
        line = next(ln for ln in stderr.splitlines() if ln.startswith(sandbox.SETUP_PREFIX))
        reason = "the sandbox could not start: " + line.removeprefix(sandbox.SETUP_PREFIX)
    elif not reason and code_ != 0 and code_ is not None:
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


UNISOLATED_WARNING = (
    "warning: rollout.multi_turn.sandbox is none: the python tool runs model-written code WITHOUT isolation "
    "(no namespaces, no seccomp; it can read and write your files and reach the network). Use it only for "
    "code you trust."
)


class PythonSandbox:
    """Tool `python(code)`: run Python code in the sandbox, return what it printed."""

    name = "python"
    schema: ClassVar[dict[str, Any]] = {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code (standard library only) in a sandbox with no network and no "
            "files kept, under time and memory limits, and return what it prints.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "Python source; print the result"}},
                "required": ["code"],
            },
        },
    }

    def __init__(
        self,
        timeout_s: float = 5.0,
        memory_mib: int = 256,
        max_output_bytes: int = 65536,
        isolate: bool = True,
    ) -> None:
        self.timeout_s, self.memory_mib, self.max_output_bytes = timeout_s, memory_mib, max_output_bytes
        self.isolate = isolate

    def __call__(self, arguments: dict[str, Any]) -> SandboxOutput:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ValueError("argument `code` (a string) is missing")
        return run_python(code, self.timeout_s, self.memory_mib, self.max_output_bytes, isolate=self.isolate)
