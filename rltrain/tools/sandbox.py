"""Isolation for code a model wrote: one process tree in its own namespaces, with a seccomp filter and limits.

`run_isolated` starts this file as a script (`python -I -S sandbox.py SPEC`, standard library only) which
builds the sandbox in three processes, the way bubblewrap does it:

  launcher (in the host's namespaces; dies with its parent, PR_SET_PDEATHSIG)
    -> setup: unshare(user, mount, PID, network, IPC, UTS); the launcher writes its uid / gid maps
       -> init, PID 1 of the new PID namespace: builds the root, drops every privilege, reaps orphans
          -> the program (PID 2): rlimits, no_new_privs, seccomp, then execve

What the program sees and may do:
  - Files: a fresh read-only root holding only the interpreter, its standard library (site-packages hidden
    behind an empty folder), the system's shared libraries (/usr/lib, /lib, /lib64, /etc/ld.so.cache), /dev/null,
    zero, full, random, urandom, a /proc of its own PID namespace, and /tmp: a private tmpfs capped at
    `scratch_mib` (and 4,096 files) that is its working directory and disappears with the namespace. No host
    /etc, /home, /root, /tmp, run folder or socket path is reachable (the old root is unmounted after
    pivot_root).
  - Identity: uid / gid 1000 inside, mapped to 100000 outside when the caller is root (so RLIMIT_NPROC
    applies: the kernel exempts uid 0) or to the caller's own uid otherwise; no capabilities (the bounding set
    is emptied before the uid changes), no_new_privs.
  - Processes: its own PID namespace (host processes are invisible, and kill() can reach only its own tree;
    init is unkillable from inside), its own session, RLIMIT_NPROC `max_processes`; when the program exits, init
    exits and the kernel kills everything left in the namespace (setsid() or double forks do not escape);
    when the caller dies or kills the launcher's process group at a timeout, PR_SET_PDEATHSIG takes the whole
    chain down.
  - Network: a new network namespace (no interface up), and the seccomp filter refuses socket() and
    socketpair() of every family, so neither TCP to 127.0.0.1 nor AF_UNIX to a host socket is possible.
  - Syscalls refused (EPERM) by the seccomp filter (libseccomp): sockets, ptrace and process_vm_*, mount and
    the new mount API, pivot_root, chroot, unshare, setns, clone with a namespace flag (clone3: ENOSYS so libc
    falls back to clone), bpf, perf_event_open, userfaultfd, io_uring, keyrings, module and kexec calls,
    reboot, swap, quotactl, open_by_handle_at, clock and host-name changes; foreign-architecture syscalls kill.
  - Limits: RLIMIT_CPU, RLIMIT_AS (`memory_mib`), RLIMIT_FSIZE (`max_file_bytes`: stdout / stderr files and
    any scratch file), RLIMIT_NOFILE 64, RLIMIT_CORE 0; the caller adds the wall clock.

`isolation_problem()` runs the whole mechanism once on a probe program and says what is missing when it fails
(rule `tool-sandbox`); `rlconf validate` runs `python -I -S sandbox.py --probe` the same way. Nothing here is
imported by the program, and nothing but the standard library is imported here.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import platform
import signal
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import asdict, dataclass, field

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
NAMESPACES = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = (
    1024,
    2048,
    4096,
    16384,
    1 << 18,
    1 << 21,
)
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
SETUP_FAILED = 125
"""Exit code of a sandbox that could not be built (its stderr says which step failed and why)."""
SETUP_PREFIX = "rlplan-sandbox: "
INNER_ID = 1000
"""uid and gid of the program inside the sandbox."""
OUTER_ID_AS_ROOT = 100000
"""The host uid / gid the inner 1000 maps to when the caller is root (a uid with no account and no files)."""
MAIN_PATH = "/run/rlplan-sandbox-main.py"
"""Where the program's script lies inside the sandbox (read-only)."""
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_DENIED = [
    "socket",
    "socketpair",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    "kcmp",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "unshare",
    "setns",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "keyctl",
    "add_key",
    "request_key",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "open_by_handle_at",
    "name_to_handle_at",
    "fanotify_init",
    "syslog",
    "iopl",
    "ioperm",
    "lookup_dcookie",
    "vhangup",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "sethostname",
    "setdomainname",
]
_CLONE_FLAGS = (
    CLONE_NEWUSER,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWNET,
    CLONE_NEWIPC,
    CLONE_NEWUTS,
    CLONE_NEWCGROUP,
)


@dataclass(frozen=True)
class SandboxSpec:
    """What one isolated run is: the program and its limits (JSON between the caller and the launcher)."""

    argv: list[str]
    """The program's command line inside the sandbox (argv[0] is an absolute path in the read-only root)."""
    workdir: str
    """A host folder of the caller's (mode 0700): holds the mount point `root/` and the files in `files`."""
    files: dict[str, str] = field(default_factory=dict)
    """Sandbox path -> host path: files copied into the read-only root before it is sealed."""
    env: dict[str, str] = field(default_factory=dict)
    memory_mib: int = 256
    cpu_s: int = 6
    max_file_bytes: int = 65536
    scratch_mib: int = 16
    max_processes: int = 16
    parent_pid: int = 0
    """The caller's PID: the launcher exits at once if its parent is already another process."""


def interpreter() -> str:
    """The real interpreter binary (not a virtual environment's link to it): what the sandbox runs."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def _read_only_paths() -> tuple[list[str], list[str]]:
    """(host paths bound read-only at the same place, folders hidden behind an empty read-only folder)."""
    exe = interpreter()
    paths = {exe}
    base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}
    stdlib = sysconfig.get_paths(vars=base)
    for key in ("stdlib", "platstdlib"):
        paths.add(os.path.realpath(stdlib[key]))
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        libdir = sysconfig.get_config_var("LIBDIR") or ""
        if os.path.isdir(libdir):
            paths.update(os.path.join(libdir, n) for n in os.listdir(libdir) if n.startswith("libpython"))
    for sys_dir in ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/lib32", "/libx32", "/etc/ld.so.cache"):
        if os.path.exists(sys_dir):
            paths.add(sys_dir)
    hidden = {os.path.realpath(stdlib[k]) for k in ("purelib", "platlib")}
    return sorted(paths), sorted(h for h in hidden if os.path.isdir(h))


# ---- the launcher's side (runs as `python -I -S sandbox.py SPEC`) ---------------------------------------


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.unshare.argtypes = [ctypes.c_int]
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    return libc


class _SetupError(Exception):
    pass


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise _SetupError(f"{what}: {os.strerror(err)} (errno {errno.errorcode.get(err, err)})")


def _fail(message: str) -> None:
    os.write(2, (SETUP_PREFIX + message + "\n").encode())
    os._exit(SETUP_FAILED)


def _mirror_exit(status: int) -> None:
    """Leave with the same exit status as a child whose wait status is `status` (same code or signal)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP have no handler to reset
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else SETUP_FAILED)


def _locked_flags(path: str) -> int:
    """Mount flags of `path`'s mount a remount in a user namespace must keep (the kernel locks them)."""
    st = os.statvfs(path).f_flag
    flags = 0
    for st_bit, ms_bit in ((1, MS_RDONLY), (2, MS_NOSUID), (4, MS_NODEV), (8, MS_NOEXEC), (1024, MS_NOATIME),
                           (2048, MS_NODIRATIME), (4096, MS_RELATIME)):  # fmt: skip
        if st & st_bit:
            flags |= ms_bit
    return flags


def _bind_read_only(libc: ctypes.CDLL, source: str, target: str) -> None:
    _check(libc.mount(source.encode(), target.encode(), None, MS_BIND | MS_REC, None), f"bind {source}")
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | _locked_flags(source)
    _check(libc.mount(None, target.encode(), None, flags, None), f"read-only {source}")


def _make_target(root: str, path: str, is_dir: bool) -> str:
    target = root + path
    os.makedirs(target if is_dir else os.path.dirname(target), exist_ok=True)
    if not is_dir and not os.path.exists(target):
        open(target, "w").close()
    return target


def _build_root(libc: ctypes.CDLL, spec: SandboxSpec) -> None:
    """In the new mount namespace: a sealed read-only root with the interpreter, /dev, /proc and /tmp."""
    _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make mounts private")
    root = os.path.join(spec.workdir, "root")
    size = 4 * 2**20 + sum(os.path.getsize(p) for p in spec.files.values())
    _check(libc.mount(b"tmpfs", root.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=0755".encode()),
           "mount the root tmpfs")  # fmt: skip
    bound, hidden = _read_only_paths()
    for path in bound:
        if os.path.islink(path):  # /lib -> usr/lib on merged-/usr systems: the same link inside
            os.makedirs(os.path.dirname(root + path), exist_ok=True)
            os.symlink(os.readlink(path), root + path)
            continue
        _bind_read_only(libc, path, _make_target(root, path, os.path.isdir(path)))
    for path in hidden:
        target = root + path
        if os.path.isdir(target):
            _check(libc.mount(b"tmpfs", target.encode(), b"tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, b"size=4k"),
                   f"hide {path}")  # fmt: skip
    for dev in ("null", "zero", "full", "random", "urandom"):
        target = _make_target(root, "/dev/" + dev, False)
        _check(libc.mount(f"/dev/{dev}".encode(), target.encode(), None, MS_BIND, None), f"bind /dev/{dev}")
    for inside, host in spec.files.items():
        target = _make_target(root, inside, False)
        with open(host, "rb") as src, open(target, "wb") as dst:
            dst.write(src.read())
    os.makedirs(root + "/tmp", exist_ok=True)
    os.makedirs(root + "/proc", exist_ok=True)
    scratch = f"size={spec.scratch_mib * 2**20},nr_inodes=4096,mode=1777".encode()
    _check(
        libc.mount(b"tmpfs", (root + "/tmp").encode(), b"tmpfs", MS_NOSUID | MS_NODEV, scratch), "mount /tmp"
    )
    # Seal: pivot into the new root, drop the old one, make the root read-only.
    os.chdir(root)
    os.mkdir(".oldroot")
    number = _PIVOT_ROOT.get(platform.machine())
    if number is not None:
        _check(libc.syscall(number, b".", b".oldroot"), "pivot_root")
        _check(libc.umount2(b"/.oldroot", MNT_DETACH), "unmount the old root")
        os.rmdir("/.oldroot")
    else:  # no pivot_root number known here: chroot (the seccomp filter refuses a second chroot)
        os.chroot(".")
    _check(libc.mount(None, b"/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None), "seal the root")
    # A /proc of this PID namespace only (best effort: without it the program still runs).
    libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    libc.sethostname(b"sandbox", 7)
    os.chdir("/tmp")


def _drop_privileges(libc: ctypes.CDLL) -> None:
    for cap in range(64):  # empty the bounding set while we still may (CAP_SETPCAP), so execve gains nothing
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == errno.EINVAL:
            break
    # A non-root caller's namespace has setgroups denied (and no groups to drop).
    with contextlib.suppress(PermissionError):
        os.setgroups([])
    os.setresgid(INNER_ID, INNER_ID, INNER_ID)
    os.setresuid(INNER_ID, INNER_ID, INNER_ID)
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "parent-death signal")  # reset by setuid


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]  # fmt: skip


def _load_seccomp() -> ctypes.CDLL:
    """libseccomp (opened on the host side, before the root changes)."""
    try:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError as exc:
        raise _SetupError(f"libseccomp is not installed ({exc})") from exc
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]  # fmt: skip
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    return lib


def _seccomp_filter(lib: ctypes.CDLL) -> int:
    """A libseccomp filter (not yet loaded): allow by default, refuse the syscalls of `_DENIED`."""
    ctx = lib.seccomp_init(0x7FFF0000)  # SCMP_ACT_ALLOW
    if not ctx:
        raise _SetupError("seccomp_init failed")

    def deny(call: str, err: int, *cmps: _ArgCmp) -> None:
        nr = lib.seccomp_syscall_resolve_name(call.encode())
        if nr < 0:  # not a syscall on this architecture
            return
        arr = (_ArgCmp * len(cmps))(*cmps) if cmps else None
        if lib.seccomp_rule_add_array(ctx, 0x00050000 | err, nr, len(cmps), arr) != 0:  # SCMP_ACT_ERRNO
            raise _SetupError(f"seccomp rule for {call} failed")

    for call in _DENIED:
        deny(call, errno.EPERM)
    for flag in _CLONE_FLAGS:  # clone(flags, ...) with a namespace flag; SCMP_CMP_MASKED_EQ = 7
        deny("clone", errno.EPERM, _ArgCmp(0, 7, flag, flag))
    deny("clone3", errno.ENOSYS)  # its flags sit behind a pointer: libc then falls back to clone
    return ctx


def _run_program(libc: ctypes.CDLL, seccomp: ctypes.CDLL, spec: SandboxSpec) -> None:
    """PID 2: limits, no_new_privs, seccomp, execve (never returns)."""
    import resource

    limits = {
        resource.RLIMIT_CPU: spec.cpu_s,
        resource.RLIMIT_AS: spec.memory_mib * 2**20,
        resource.RLIMIT_FSIZE: spec.max_file_bytes,
        resource.RLIMIT_NOFILE: 64,
        resource.RLIMIT_NPROC: spec.max_processes,
        resource.RLIMIT_CORE: 0,
    }
    ctx = _seccomp_filter(seccomp)
    for which, value in limits.items():
        resource.setrlimit(which, (value, value))
    os.closerange(3, 1 << 16)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    if seccomp.seccomp_load(ctx) != 0:
        raise _SetupError("seccomp_load failed")
    os.execve(spec.argv[0], spec.argv, spec.env)


def _init(libc: ctypes.CDLL, seccomp: ctypes.CDLL, spec: SandboxSpec, status_fd: int) -> None:
    """PID 1 of the new namespace: build the root, drop privileges, start the program, reap, and hand the
    program's wait status to the setup process (PID 1 cannot die by a signal of its own to mirror it)."""
    try:
        os.setsid()  # kill(0, ...) from inside reaches only this session
        _build_root(libc, spec)
        _drop_privileges(libc)
    except (OSError, _SetupError) as exc:
        _fail(f"setup: {exc}")
    program = os.fork()
    if program == 0:
        try:
            _run_program(libc, seccomp, spec)
        except (OSError, _SetupError) as exc:
            _fail(f"start: {exc}")
    while True:  # reap whatever the program leaves; its own exit ends the namespace
        pid, status = os.wait()
        if pid == program:
            os.write(status_fd, str(status).encode())
            os._exit(0)


def _write_maps(pid: int) -> None:
    """Map inner uid / gid 1000 for the setup process `pid` (and inner 0 to root when the caller is root)."""
    if os.geteuid() == 0:
        uid_map = gid_map = f"0 0 1\n{INNER_ID} {OUTER_ID_AS_ROOT} 1\n"
    else:
        with open(f"/proc/{pid}/setgroups", "w") as f:
            f.write("deny")
        uid_map, gid_map = f"{INNER_ID} {os.geteuid()} 1\n", f"{INNER_ID} {os.getegid()} 1\n"
    for name, text in (("uid_map", uid_map), ("gid_map", gid_map)):
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(text)


def launch(spec: SandboxSpec) -> None:
    """The launcher: start the setup process in new namespaces, write its id maps, mirror its exit."""
    import resource

    libc = _libc()
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if spec.parent_pid and os.getppid() != spec.parent_pid:
        _fail("the caller is gone")
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the launcher mirrors a crash by dying the same way
    try:
        seccomp = _load_seccomp()
    except _SetupError as exc:
        _fail(str(exc))
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    setup = os.fork()
    if setup == 0:
        os.close(ready_r)
        os.close(go_w)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if libc.unshare(NAMESPACES) != 0:
            err = ctypes.get_errno()
            _fail(f"unshare: cannot create user, mount, PID and network namespaces: {os.strerror(err)}")
        os.write(ready_w, b"1")
        if os.read(go_r, 1) != b"1":
            _fail("the launcher could not write the id maps")
        status_r, status_w = os.pipe()
        init = os.fork()  # PID 1 of the new PID namespace
        if init == 0:
            os.close(status_r)
            _init(libc, seccomp, spec, status_w)
        os.close(status_w)
        init_status = os.waitpid(init, 0)[1]
        reported = os.read(status_r, 32)
        _mirror_exit(int(reported) if reported else init_status)
    os.close(ready_w)
    os.close(go_r)
    if os.read(ready_r, 1) == b"1":
        try:
            _write_maps(setup)
            os.write(go_w, b"1")
        except OSError as exc:
            os.write(2, f"{SETUP_PREFIX}setup: writing the id maps: {exc}\n".encode())
    os.close(go_w)
    _mirror_exit(os.waitpid(setup, 0)[1])


# ---- the caller's side ----------------------------------------------------------------------------------


def launcher_command(spec_path: str) -> list[str]:
    """The command that builds a sandbox from the spec file at `spec_path` (isolated mode, stdlib only)."""
    return [interpreter(), "-I", "-S", os.path.abspath(__file__), spec_path]


def run_isolated(spec: SandboxSpec, stdout: int, stderr: int, timeout_s: float) -> tuple[int | None, bool]:
    """Run `spec` to its end or `timeout_s`: (the program's return code as Popen gives it, timed out?). At a
    timeout the launcher's process group is killed, which takes the namespace down with it."""
    spec_path = os.path.join(spec.workdir, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(asdict(spec), f)
    proc = subprocess.Popen(
        launcher_command(spec_path),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        start_new_session=True,
        close_fds=True,
    )
    return wait_or_kill_group(proc, timeout_s)


def wait_or_kill_group(proc: subprocess.Popen, timeout_s: float) -> tuple[int | None, bool]:
    """Wait for `proc` (started with start_new_session) up to `timeout_s`; past it, SIGKILL its whole process
    group. Returns (its return code as Popen gives it, timed out?)."""
    try:
        return proc.wait(timeout=timeout_s), False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return proc.returncode, True


_PROBE = r"""
import os, socket
checks = {"pid 2": os.getpid() == 2, "uid 1000": os.getuid() == 1000, "no /etc/passwd": not os.path.exists("/etc/passwd")}
try:
    socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    checks["socket refused"] = False
except PermissionError:
    checks["socket refused"] = True
print("ok" if all(checks.values()) else "failed: " + ", ".join(k for k, v in checks.items() if not v))
"""


def isolation_problem() -> str | None:
    """None when this machine can build the sandbox (one real run of a probe program); else what failed."""
    if sys.platform != "linux":
        return f"the sandbox needs Linux namespaces; this is {sys.platform}"
    with tempfile.TemporaryDirectory(prefix="rlplan-sandbox-probe-") as work:
        os.mkdir(os.path.join(work, "root"))
        main, out, err = (os.path.join(work, n) for n in ("main.py", "out", "err"))
        with open(main, "w") as f:
            f.write(_PROBE)
        spec = SandboxSpec([interpreter(), "-I", "-S", MAIN_PATH], work, {MAIN_PATH: main},
                           {"PATH": "/usr/bin:/bin"}, parent_pid=os.getpid())  # fmt: skip
        with open(out, "wb") as o, open(err, "wb") as e:
            code, timed_out = run_isolated(spec, o.fileno(), e.fileno(), 20.0)
        with (
            open(out, encoding="utf-8", errors="replace") as o,
            open(err, encoding="utf-8", errors="replace") as e,
        ):
            text, detail = o.read().strip(), e.read().strip()
    if code == 0 and text == "ok":
        return None
    if timed_out:
        return "the probe did not finish in 20 s"
    lines = [ln for ln in detail.splitlines() if ln.startswith(SETUP_PREFIX)] or detail.splitlines()[-1:]
    return (lines[0].removeprefix(SETUP_PREFIX) if lines else text) or f"the probe exited with code {code}"


if __name__ == "__main__":
    if sys.argv[1:] == ["--probe"]:
        problem = isolation_problem()
        print("ok" if problem is None else problem)
        sys.exit(0 if problem is None else 1)
    with open(sys.argv[1]) as f:
        launch(SandboxSpec(**json.load(f)))
