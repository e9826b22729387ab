"""The python tool's sandbox, attacked the way model-written code would attack it (issue 29): every attack runs
for real in the sandbox and the test checks, from outside, that it failed. Then the pool that keeps tools out
of the driver, and the `tool-sandbox` rule on a machine that cannot isolate (Docker's default seccomp profile,
reproduced by a real seccomp filter around `rlconf validate`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from rlconf.config import MultiTurnConfig
from rlconf.plan.run import tool_plan
from rltrain.tools import ToolCall, ToolRunner
from rltrain.tools.python_sandbox import run_python
from rltrain.tools.sandbox import MAIN_PATH, isolation_problem

ROOT = Path(__file__).resolve().parents[1]


def _sandboxed_pids() -> list[int]:
    """Host PIDs of processes still running a sandboxed program (their command line names its script)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if MAIN_PATH.encode() in cmdline:
                pids.append(int(entry))
    return pids


def _run(code: str, **kw) -> str:
    out = run_python(textwrap.dedent(code), **{"timeout_s": 5.0, **kw})
    return out.text


def test_this_machine_can_isolate():
    """CI's machines can build the sandbox (if this fails, every attack test below is meaningless)."""
    assert isolation_problem() is None


# ------------------------------------------------------------------------------------------ files
def test_host_files_cannot_be_read(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    out = _run(f"""
        import os
        for p in ("/etc/passwd", "/etc/shadow", {str(secret)!r}, "/root/.ray/auth_token", "/proc/1/environ"):
            try:
                print(p, open(p).read()[:20])
            except OSError as e:
                print(p, "refused", type(e).__name__)
        print(sorted(os.listdir("/")))
    """)
    assert "hunter2" not in out and "root:" not in out
    assert out.count("refused") == 5
    assert "work" not in out and "home" not in out  # the root holds the interpreter, libraries, /dev, /tmp


def test_host_files_cannot_be_written(tmp_path):
    run_file = tmp_path / "global_step_4.ckpt"
    run_file.write_text("good")
    out = _run(f"""
        for p in ({str(run_file)!r}, "/usr/lib/x", "/run/rlplan-sandbox-main.py", "/evil"):
            try:
                open(p, "w").write("evil")
                print(p, "written")
            except OSError as e:
                print(p, "refused", type(e).__name__)
    """)
    assert "written" not in out, out
    assert run_file.read_text() == "good"


def test_scratch_is_capped_and_gone_after_the_call():
    """The scratch /tmp holds at most 16 MiB (the issue's 200 x 64 KB fit, 400 do not) and nothing of it
    is left for the next call."""
    out = _run("""
        n = 0
        try:
            for i in range(400):
                open(f"f{i}", "wb").write(b"x" * 64000)
                n += 1
        except OSError as e:
            print("stopped", n, e.errno)
    """)
    assert out.startswith("stopped") and int(out.split()[1]) < 400 and out.split()[2] == "28"  # ENOSPC
    assert _run("import os; print(os.listdir('.'))").strip() == "[]"


# ------------------------------------------------------------------------------------------ processes
def test_ctypes_system_and_fork_exec_run_no_program(tmp_path):
    marker = tmp_path / "ran"
    out = _run(f"""
        import ctypes, os, _posixsubprocess
        print("system", ctypes.CDLL(None).system(b"id > {marker}"))
        r, w = os.pipe()
        try:
            pid = _posixsubprocess.fork_exec(["/bin/sh", "-c", "id > {marker}"], [b"/bin/sh"], True, (), None,
                None, -1, -1, -1, -1, -1, -1, r, w, True, False, False, None, None, None, -1, None, False)
            print("waited", os.waitpid(pid, 0)[1])
        except OSError as e:
            print("fork_exec refused", e)
    """)
    assert "system" in out
    assert not marker.exists()


def test_a_fork_bomb_hits_the_process_limit():
    before = len(os.listdir("/proc"))
    out = _run("""
        import os, time
        n = 0
        try:
            for _ in range(200):
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                n += 1
        except OSError as e:
            print("refused after", n, e.errno)
    """)
    assert out.startswith("refused after"), out
    assert int(out.split()[2]) < 16 and out.split()[3] == "11"  # EAGAIN at RLIMIT_NPROC
    time.sleep(0.5)
    assert _sandboxed_pids() == []  # the sleeping children died with the namespace
    assert len(os.listdir("/proc")) < before + 8


def test_setsid_double_fork_survivors_die_with_the_call():
    out = _run("""
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(60)
            os._exit(0)
        time.sleep(0.2)
        print("left a daemon")
    """)
    assert "left a daemon" in out
    time.sleep(0.5)
    assert _sandboxed_pids() == []


def test_a_timeout_kills_the_whole_tree():
    t0 = time.perf_counter()
    out = run_python("import os, time\nfor _ in range(3):\n    os.fork()\ntime.sleep(60)", timeout_s=1.5)
    assert out.error and "timed out" in out.text
    assert time.perf_counter() - t0 < 15  # not the program's 60 s (a loaded machine needs some slack)
    time.sleep(0.5)
    assert _sandboxed_pids() == []


def test_the_parent_and_unrelated_processes_cannot_be_killed():
    victim = subprocess.Popen(["sleep", "60"])
    try:
        out = _run(f"""
            import os, signal
            print("ppid", os.getppid())
            for target in (os.getppid(), {victim.pid}, {os.getpid()}, 1):
                try:
                    os.kill(target, signal.SIGKILL)
                    print(target, "signalled")
                except OSError as e:
                    print(target, "refused", e.errno)
            try:
                os.kill(-1, signal.SIGKILL)  # every process it may signal: only its own namespace's
            except OSError as e:
                print("all refused", e.errno)
        """)
        assert "ppid 1" in out  # its parent is the namespace's init: the host is out of sight
        assert f"{victim.pid} refused 3" in out and f"{os.getpid()} refused 3" in out  # ESRCH: not visible
        assert "all refused 3" in out  # nothing else in its namespace
        # Its own process group: the program itself dies, nothing outside does.
        grouped = run_python("import os, signal; os.killpg(0, signal.SIGKILL)", timeout_s=3)
        assert grouped.error and "SIGKILL" in grouped.text
        assert victim.poll() is None  # still alive
    finally:
        victim.kill()
        victim.wait()


def test_the_sandbox_dies_with_its_caller():
    """SIGKILL the process that called run_python: the launcher's parent-death signal takes the tree down."""
    caller = subprocess.Popen([sys.executable, "-c", "from rltrain.tools.python_sandbox import run_python\n"
                               "run_python('import time; time.sleep(60)', timeout_s=60)"], cwd=ROOT)  # fmt: skip
    deadline = time.time() + 20
    while not _sandboxed_pids() and time.time() < deadline:
        time.sleep(0.1)
    assert _sandboxed_pids(), "the sandbox never started"
    caller.kill()
    caller.wait()
    deadline = time.time() + 5
    while _sandboxed_pids() and time.time() < deadline:
        time.sleep(0.1)
    assert _sandboxed_pids() == []


def test_no_privileges_inside():
    out = _run("""
        import ctypes, os, resource
        libc = ctypes.CDLL(None, use_errno=True)
        print("ids", os.getuid(), os.geteuid(), os.getgid())
        print("capeff", [l for l in open("/proc/self/status")] if os.path.exists("/proc/self/status") else "none")
        for name, call in (("unshare", lambda: libc.unshare(0x10000000)),
                           ("mount", lambda: libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)),
                           ("ptrace", lambda: libc.ptrace(16, 1, 0, 0)),
                           ("chroot", lambda: libc.chroot(b"/tmp"))):
            print(name, call(), ctypes.get_errno())
        print("nproc", resource.getrlimit(resource.RLIMIT_NPROC))
    """)
    assert "ids 1000 1000 1000" in out
    for name in ("unshare", "mount", "ptrace", "chroot"):
        assert f"{name} -1 1" in out, out  # EPERM from the seccomp filter
    assert "nproc (16, 16)" in out
    if "CapEff" in out:
        assert "CapEff:\\t0000000000000000" in out


# ------------------------------------------------------------------------------------------ network
@pytest.fixture()
def listeners(tmp_path):
    """A TCP listener on 127.0.0.1 and an AF_UNIX listener on a path and in the abstract namespace; each
    records whether anything connected."""
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    path = str(tmp_path / "host.sock")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(path)
    unix.listen()
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind("\0rlplan-sandbox-test")
    abstract.listen()
    hits: list[str] = []

    def accept(sock: socket.socket, name: str) -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                sock.accept()[0].close()
                hits.append(name)
            except OSError:
                pass

    stop = threading.Event()
    threads = [threading.Thread(target=accept, args=(s, n), daemon=True)
               for s, n in ((tcp, "tcp"), (unix, "unix"), (abstract, "abstract"))]  # fmt: skip
    for t in threads:
        t.start()
    yield tcp.getsockname()[1], path, hits
    stop.set()
    for t in threads:
        t.join()
    for s in (tcp, unix, abstract):
        s.close()


def test_no_socket_of_any_family_reaches_the_host(listeners):
    port, path, hits = listeners
    out = _run(f"""
        import ctypes, socket
        libc = ctypes.CDLL(None, use_errno=True)
        for family in (socket.AF_INET, socket.AF_INET6, socket.AF_UNIX, socket.AF_NETLINK, socket.AF_PACKET):
            print("socket", family, libc.socket(family, socket.SOCK_STREAM, 0), ctypes.get_errno())
        fds = (ctypes.c_int * 2)()
        print("socketpair", libc.socketpair(socket.AF_UNIX, socket.SOCK_STREAM, 0, fds), ctypes.get_errno())
        for target in ((socket.AF_INET, ("127.0.0.1", {port})), (socket.AF_UNIX, {path!r}),
                       (socket.AF_UNIX, "\\0rlplan-sandbox-test")):
            try:
                socket.socket(target[0]).connect(target[1])
                print("connected", target)
            except OSError as e:
                print("refused", e)
    """)
    assert out.count(" -1 1\n") == 6, out  # every socket() / socketpair() refused with EPERM
    assert "connected" not in out
    time.sleep(0.3)
    assert hits == []


# ------------------------------------------------------------------------------------------ the pool
_KILLER_TOOLS = """
import os, signal

def suicide(expression):
    os.kill(os.getpid(), signal.SIGKILL)

suicide.schema = {"type": "function", "function": {"name": "suicide", "parameters": {"type": "object",
                  "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}

def parent_killer(expression):
    os.kill(os.getppid(), signal.SIGKILL)  # the worker's parent is the driver: must not be the driver's end
    return "tried"

parent_killer.schema = {"type": "function", "function": {"name": "parent_killer", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}

def pid(expression):
    return str(os.getpid())

pid.schema = {"type": "function", "function": {"name": "pid", "parameters": {"type": "object",
              "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
"""


def test_tools_run_outside_the_driver_and_a_dead_worker_costs_one_call(tmp_path, monkeypatch):
    (tmp_path / "killer_tools.py").write_text(_KILLER_TOOLS)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tool_plan(MultiTurnConfig(tools=("killer_tools:suicide", "killer_tools:pid", "calculator", "python"),
                          tool_timeout_s=3.0, max_parallel_tools=2))  # fmt: skip
    runner = ToolRunner(cfg)
    try:
        (where,) = runner.run_many([ToolCall("pid", {"expression": ""})])
        assert int(where.text) != os.getpid()  # a worker process, not this one
        dead, ok, py = runner.run_many([ToolCall("suicide", {"expression": ""}),
                                        ToolCall("calculator", {"expression": "6*7"}),
                                        ToolCall("python", {"code": "print(6*7)"})])  # fmt: skip
        assert dead.error and "process" in dead.text
        assert (ok.text, ok.error) == ("42", False)
        assert (py.text.strip(), py.error) == ("42", False)
        for _ in range(3):  # the dead worker was replaced: the pool keeps its size and works
            again = runner.run_many([ToolCall("calculator", {"expression": "1+1"})] * 2)
            assert [r.text for r in again] == ["2", "2"]
        killed_again = runner.run_many([ToolCall("suicide", {"expression": ""})] * 2)
        assert all(r.error for r in killed_again)
        assert runner.run_many([ToolCall("calculator", {"expression": "2*3"})])[0].text == "6"
    finally:
        runner.close()


def test_a_tool_killing_its_workers_parent_is_contained(tmp_path):
    """A driver (a child process here, so that the test survives a failure) whose user tool kills the
    worker's parent: the runner's driver must live on. User tools are trusted code (docs/security.md) — the
    point is that tool code and the driver are separate processes; the python tool's code cannot even see
    its parent (test_the_parent_and_unrelated_processes_cannot_be_killed)."""
    (tmp_path / "killer_tools.py").write_text(_KILLER_TOOLS)
    driver = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from rlconf.config import MultiTurnConfig
        from rlconf.plan.run import tool_plan
        from rltrain.tools import ToolCall, ToolRunner
        runner = ToolRunner(tool_plan(MultiTurnConfig(tools=("killer_tools:suicide", "calculator"), tool_timeout_s=3.0)))
        for _ in range(3):
            print([r.error for r in runner.run_many([ToolCall("suicide", {{"expression": ""}}),
                                                    ToolCall("calculator", {{"expression": "2+2"}})])])
        runner.close()
        print("driver alive")
    """)
    done = subprocess.run(
        [sys.executable, "-c", driver], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[True, False]"] * 3 + ["driver alive"]


# ------------------------------------------------------------------------------------------ the rule
_NO_USERNS = textwrap.dedent("""
    # Docker's default seccomp profile in small: unshare and clone with CLONE_NEWUSER are refused (EPERM).
    import ctypes, os, sys
    lib = ctypes.CDLL("libseccomp.so.2")
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    class Cmp(ctypes.Structure):
        _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(Cmp)]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(0x7FFF0000)
    lib.seccomp_rule_add_array(ctx, 0x00050001, lib.seccomp_syscall_resolve_name(b"unshare"), 0, None)
    lib.seccomp_rule_add_array(ctx, 0x00050001, lib.seccomp_syscall_resolve_name(b"clone"), 1,
                               (Cmp * 1)(Cmp(0, 7, 0x10000000, 0x10000000)))
    ctypes.CDLL(None).prctl(38, 1, 0, 0, 0)
    assert lib.seccomp_load(ctx) == 0
    os.execv(sys.argv[1], sys.argv[1:])
""")


def _rlconf(*args: str, isolated: bool = True) -> subprocess.CompletedProcess:
    rlconf = str(Path(sys.executable).parent / "rlconf")
    cmd = [rlconf, *args] if isolated else [sys.executable, "-c", _NO_USERNS, rlconf, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.slow
def test_validate_refuses_the_python_tool_where_the_machine_cannot_isolate():
    ok = _rlconf("validate", "--preset", "tiny-tool")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    refused = _rlconf("validate", "--preset", "tiny-tool", isolated=False)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    text = refused.stdout + refused.stderr
    assert "tool-sandbox" in text and "rollout.multi_turn.tools" in text and "unshare" in text
    assert "Traceback" not in text
    opted_out = _rlconf("validate", "--preset", "tiny-tool", "--set", "rollout.multi_turn.sandbox=none",
                        isolated=False)  # fmt: skip
    assert opted_out.returncode == 0, opted_out.stdout + opted_out.stderr
    assert "without isolation" in opted_out.stdout + opted_out.stderr
    no_python = _rlconf("validate", "--preset", "tiny-tool", "--set", "rollout.multi_turn.tools=[calculator]",
                        isolated=False)  # fmt: skip
    assert no_python.returncode == 0, no_python.stdout + no_python.stderr


def test_run_python_refuses_to_run_unisolated_when_the_sandbox_cannot_start():
    """Under the same filter, the python tool itself gives an error observation and never runs the code."""
    code = ("from rltrain.tools.python_sandbox import run_python\n"
            "print(repr(run_python('open(\"/tmp/rlplan-unisolated\", \"w\").write(\"x\")').text))")  # fmt: skip
    Path("/tmp/rlplan-unisolated").unlink(missing_ok=True)
    done = subprocess.run([sys.executable, "-c", _NO_USERNS, sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert "the sandbox could not start" in done.stdout, done.stdout + done.stderr
    assert not Path("/tmp/rlplan-unisolated").exists()


def test_sigkill_of_a_sandboxed_program_is_reported_as_such():
    out = run_python("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", timeout_s=3)
    assert out.error and "SIGKILL" in out.text
    assert signal.SIGKILL  # (the program is PID 2: its own signals work, unlike PID 1's)


def test_sandbox_none_runs_trusted_code_with_the_limits_and_warns(capfd):
    """The explicit opt-out (rollout.multi_turn.sandbox: none): the code runs, without isolation, still under
    the time and output limits, and the runner says so on every run."""
    out = run_python("import os; print(os.path.exists('/etc/passwd'))", isolate=False)
    assert (out.text.strip(), out.error) == ("True", False)  # the host's files: no isolation
    slow = run_python("import time; time.sleep(30)", timeout_s=1.0, isolate=False)
    assert slow.error and "timed out" in slow.text
    runner = ToolRunner(tool_plan(MultiTurnConfig(tools=("python",), sandbox="none", max_parallel_tools=1)))
    try:
        (res,) = runner.run_many([ToolCall("python", {"code": "print(1 + 1)"})])
        assert (res.text.strip(), res.error) == ("2", False)
    finally:
        runner.close()
    assert "WITHOUT isolation" in capfd.readouterr().err
