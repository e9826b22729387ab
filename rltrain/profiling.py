"""Per-role profiling of RL workers: torch.profiler, Nsight Systems or the Ascend NPU profiler.

Every worker process owns one `Profiler` built from the compiled `ProfilePlan` (rlconf.plan). Each role call
(generate_sequences, actor_update, ...) is wrapped in `profiler.profiled(ROLE)` (or the `@profiled(ROLE)`
decorator); the call is profiled only when the plan profiles that role, at the current step, on this rank,
and otherwise costs one frozenset membership test and a shared null context (bench/profiler_overhead.py).
One thread per process makes the calls (a Ray actor runs one method at a time).

Output (the layout is an interface, see DESIGN.md):
- discrete mode: one profile per role call in `save_path/step_N/ROLE/rank_R/` (the folders the plan lists);
  a second call of the same role in the same step goes to `.../rank_R/call_2/` and so on, never over an
  earlier trace (also across resumed runs: a folder is taken once its meta.json exists).
- continuous mode: one profile per step in `save_path/step_N/e2e/rank_R/`, opened by the step's first
  profiled call and closed by `set_step` of another step or `close()`; role calls inside are named ranges.
- every profile folder has `meta.json` (role, step, rank, worker, tool, wall_s, status ok|error|running);
  `write_summary(save_path)` turns them into `profile_summary.md` and `summary.json` (role x rank wall
  seconds per step) and returns the Markdown file's path; the controller prints it at the end of the run.

Tools: torch writes `trace.json` (Chrome trace, opens in Perfetto) and `summary.txt` (key_averages table);
nsys brackets calls with cudaProfilerStart/Stop and NVTX ranges for a process launched with
`nsys_command(...)`, whose numbered reports are linked into the role folders; npu drives
`torch_npu.profiler` (imported only when the tool is npu, through rltrain.npu) whose trace handler writes
into the folder, and brackets each role call with an mstx range (`ROLE/step_N`) that the profiler collects.

An exception inside a profiled call stops and flushes the profile (status error, with a note) and is
re-raised once; the call is never re-run. Profiling failures themselves (a trace that cannot be exported)
are logged and noted in meta.json rather than raised: a profiler must not kill a training run.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from rlconf.plan import ProfilePlan
from rlconf.profile_vocab import ROLES, NpuProfileOptions, NsysProfileOptions, TorchProfileOptions
from rltrain import device as devices
from rltrain.checkpoint.manifest import JSON_ERRORS, read_json
from rltrain.npu import MstxRange, load_torch_npu

log = logging.getLogger(__name__)

META = "meta.json"
E2E = "e2e"
SUMMARY_MD = "profile_summary.md"
# The CUDA device module the nsys tool calls (profiler start/stop, NVTX, synchronize), from the device layer.
# Held here, at the module boundary, so that tests on a CUDA-less machine can put a recording stand-in in
# its place.
_cuda: Any = devices.accelerator_module("cuda")
# PolicyWorker serves actor, rollout and ref in one process: the plan names the worker role of each
# profiled role, the process is identified by its host worker.
_HOST = {"rollout": "actor", "ref": "actor"}
# nsys numbers each cudaProfilerStart/Stop capture of a process from 1 (`-o NAME` -> NAME.K.nsys-rep);
# the count is per process, whichever Profiler object started the capture.
_nsys_captures = itertools.count(1)

F = TypeVar("F", bound=Callable[..., Any])


def _host(worker: str) -> str:
    return _HOST.get(worker, worker)


def profiled_roles(plan: ProfilePlan, worker: str, rank: int) -> frozenset[str]:
    """Roles this process (worker, rank) profiles at the plan's steps; empty when it profiles nothing.

    Discrete mode: the roles whose target lists this rank for this process's worker. Continuous mode: every
    profiled role, but only in the processes of the `e2e` target (the actor pool's policy workers), so that
    no two processes of one rank write the same `e2e/rank_R` folder.
    """
    if not plan.enabled:
        return frozenset()
    mine = [t for t in plan.targets if rank in t.ranks and _host(t.worker) == _host(worker)]
    if plan.mode == "continuous":
        return frozenset(plan.roles) if any(t.role == E2E for t in mine) else frozenset()
    return frozenset(t.role for t in mine)


def nsys_output(plan: ProfilePlan, worker: str, rank: int) -> str:
    """The `nsys profile -o` name of one worker process; `%p` is expanded by nsys to the process id."""
    return f"{plan.save_path}/nsys/{worker}_rank_{rank}_%p"


def nsys_command(plan: ProfilePlan, worker: str, rank: int) -> list[str]:
    """The argv prefix a launcher puts before a worker's command line (`[*prefix, python, ...]`).

    Empty when this process profiles nothing, so a launcher can always prepend it. The process runs the whole
    job under one nsys session; nsys records only between the Profiler's cudaProfilerStart/Stop calls and
    writes one numbered report per capture (`--capture-range-end=repeat`), which the Profiler links into
    `save_path/step_N/ROLE/rank_R/report.nsys-rep`. `worker` and `rank` must be those the process gives its
    Profiler: the link names the report from them and the process id.
    """
    if plan.tool != "nsys" or not profiled_roles(plan, worker, rank):
        return []
    opts = plan.options
    assert isinstance(opts, NsysProfileOptions)
    cmd = [
        "nsys",
        "profile",
        "-o",
        nsys_output(plan, worker, rank),
        "--capture-range=cudaProfilerApi",
        "--capture-range-end=repeat",
        f"--trace={','.join(opts.trace)}",
        "--force-overwrite=true",
    ]
    if opts.cuda_memory_usage:
        cmd.append("--cuda-memory-usage=true")
    return cmd


# ============================================================================================ backends
class _Backend:
    """One tool: start a capture into a folder, mark a role range inside it, stop and write it."""

    tool = ""

    def start(self, folder: Path, notes: list[str]) -> Any:
        raise NotImplementedError

    def mark(self, role: str, step: int) -> AbstractContextManager[Any]:
        return torch.profiler.record_function(role)

    def stop(self, handle: Any, folder: Path, error: BaseException | None, notes: list[str]) -> None:
        raise NotImplementedError


class _TorchBackend(_Backend):
    tool = "torch"

    def __init__(self, opts: TorchProfileOptions, device: str) -> None:
        from torch.profiler import ProfilerActivity

        self.opts = opts
        # cpu is always recorded; cuda only on a cuda run that sees a GPU; others (npu) are not torch's.
        self.activities = [ProfilerActivity.CPU]
        self.dropped = [a for a in opts.activities if a not in ("cpu", "cuda")]
        if "cuda" in opts.activities:
            if device == "cuda" and _cuda.is_available():
                self.activities.append(ProfilerActivity.CUDA)
            else:
                self.dropped.append("cuda")
        self.sort_by = "self_device_time_total" if len(self.activities) > 1 else "self_cpu_time_total"

    def start(self, folder: Path, notes: list[str]) -> Any:
        if self.dropped:
            notes.append(f"activities {self.dropped} are not available here; recorded {self._names()}")
        prof = torch.profiler.profile(
            activities=self.activities,
            record_shapes=self.opts.record_shapes,
            profile_memory=self.opts.profile_memory,
            with_stack=self.opts.with_stack,
            with_flops=self.opts.with_flops,
        )
        prof.start()
        return prof

    def _names(self) -> list[str]:
        return [a.name.lower() for a in self.activities]

    def stop(self, handle: Any, folder: Path, error: BaseException | None, notes: list[str]) -> None:
        handle.stop()
        handle.export_chrome_trace(str(folder / "trace.json"))
        head = f"# {notes[-1]}\n" if error is not None else ""
        table = handle.key_averages().table(sort_by=self.sort_by, row_limit=50)
        (folder / "summary.txt").write_text(head + table + "\n")


class _NvtxRange:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        _cuda.nvtx.range_push(self.name)

    def __exit__(self, *exc: object) -> None:
        _cuda.nvtx.range_pop()


class _NsysBackend(_Backend):
    tool = "nsys"

    def __init__(self, plan: ProfilePlan, worker: str, rank: int, device: str) -> None:
        self.cuda = device == "cuda"
        self.output = nsys_output(plan, worker, rank).replace("%p", str(os.getpid()))
        # nsys writes the reports at capture ends, long after launch: the folder exists by then.
        Path(self.output).parent.mkdir(parents=True, exist_ok=True)

    def start(self, folder: Path, notes: list[str]) -> Any:
        if not self.cuda:
            notes.append("nsys records CUDA processes only; this process runs without CUDA: nothing captured")
            return None
        capture = next(_nsys_captures)
        report = Path(f"{self.output}.{capture}.nsys-rep")
        link = folder / "report.nsys-rep"
        # nsys writes the report when the capture ends (or at exit); the relative link resolves then and
        # keeps working when the whole save_path is copied elsewhere.
        with contextlib.suppress(OSError):
            link.unlink(missing_ok=True)
            link.symlink_to(os.path.relpath(report, folder))
        notes.append(f"nsys capture {capture} of this process: {report}")
        _cuda.synchronize()
        _cuda.profiler.start()
        return capture

    def mark(self, role: str, step: int) -> AbstractContextManager[Any]:
        if not self.cuda:
            return contextlib.nullcontext()
        return _NvtxRange(f"{role}/step_{step}")

    def stop(self, handle: Any, folder: Path, error: BaseException | None, notes: list[str]) -> None:
        if handle is None:
            return
        _cuda.synchronize()
        _cuda.profiler.stop()


_NPU_LEVELS = {"level_none": "Level_none", "level0": "Level0", "level1": "Level1", "level2": "Level2"}


def _mstx_switch(experimental_config: Callable[..., Any]) -> dict[str, bool]:
    """The `_ExperimentalConfig` argument that makes torch_npu's profiler collect mstx ranges: `mstx` in
    recent torch_npu, `msprof_tx` in older ones (without it, the ranges' messages are not collected)."""
    try:
        params = inspect.signature(experimental_config).parameters
    except (TypeError, ValueError):  # a C-implemented callable without a signature: the current name
        return {"mstx": True}
    for name in ("mstx", "msprof_tx"):
        if name in params:
            return {name: True}
    return {}


class _NpuRange:
    """A role call as a torch `record_function` range (the profiler's framework view) and an mstx range
    (host and device timelines, and what level_none collects). A failing mstx call costs the range, never
    the role call: it is logged and the call runs on."""

    __slots__ = ("_message", "_mstx", "_record", "_torch_npu")

    def __init__(self, torch_npu: Any, role: str, step: int) -> None:
        self._record = torch.profiler.record_function(role)
        self._torch_npu, self._message = torch_npu, f"{role}/step_{step}"
        self._mstx: MstxRange | None = None

    def __enter__(self) -> None:
        self._record.__enter__()
        try:
            mstx = MstxRange(self._torch_npu, self._message)
            mstx.__enter__()
            self._mstx = mstx
        except Exception as exc:
            log.warning("profiler: no mstx range for %s: %s", self._message, _describe(exc))

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._mstx is not None:
                self._mstx.__exit__(*exc)
        except Exception as err:
            log.warning("profiler: could not end the mstx range %s: %s", self._message, _describe(err))
        finally:
            self._record.__exit__(*exc)


class _NpuBackend(_Backend):
    tool = "npu"

    def __init__(self, opts: NpuProfileOptions) -> None:
        # Imported here only: torch_npu needs Ascend CANN and must never load on other machines.
        self.torch_npu = load_torch_npu()
        self.opts = opts

    def start(self, folder: Path, notes: list[str]) -> Any:
        tp = self.torch_npu.profiler
        c = self.opts.contents
        activities = []
        if "cpu" in c:
            activities.append(tp.ProfilerActivity.CPU)
        if "npu" in c:
            activities.append(tp.ProfilerActivity.NPU)
        level = getattr(tp.ProfilerLevel, _NPU_LEVELS[self.opts.level])
        # AI-core pipeline metrics come with levels 1 and 2; level0 / level_none collect none.
        deep = self.opts.level in ("level1", "level2")
        experimental = tp._ExperimentalConfig(
            profiler_level=level,
            aic_metrics=tp.AiCMetrics.PipeUtilization if deep else tp.AiCMetrics.AiCoreNone,
            export_type=tp.ExportType.Text,
            **_mstx_switch(tp._ExperimentalConfig),
        )
        prof = tp.profile(
            activities=activities,
            # One active step from start() to stop(): stop() ends the recording and runs on_trace_ready.
            schedule=tp.schedule(wait=0, warmup=0, active=1, repeat=1, skip_first=0),
            on_trace_ready=tp.tensorboard_trace_handler(str(folder), analyse_flag=self.opts.analysis),
            record_shapes="shapes" in c,
            profile_memory="memory" in c,
            with_stack="stack" in c,
            with_modules="module" in c,
            experimental_config=experimental,
        )
        if not self.opts.analysis:
            notes.append("offline analysis off: run torch_npu.profiler.profiler.analyse(<this folder>) later")
        prof.start()
        return prof

    def mark(self, role: str, step: int) -> AbstractContextManager[Any]:
        return _NpuRange(self.torch_npu, role, step)

    def stop(self, handle: Any, folder: Path, error: BaseException | None, notes: list[str]) -> None:
        handle.stop()


def _backend(plan: ProfilePlan, worker: str, rank: int, device: str) -> _Backend:
    opts = plan.options
    if plan.tool == "torch":
        assert isinstance(opts, TorchProfileOptions)
        return _TorchBackend(opts, device)
    if plan.tool == "nsys":
        return _NsysBackend(plan, worker, rank, device)
    if plan.tool == "npu":
        assert isinstance(opts, NpuProfileOptions)
        return _NpuBackend(opts)
    raise ValueError(f"profile.tool = {plan.tool!r} has no profiler")


# ============================================================================================ profiler
@dataclass
class _Session:
    """One open profile: a discrete role call or a continuous step."""

    folder: Path
    role: str
    step: int
    call: int
    meta: dict[str, Any]
    t0: float
    handle: Any = None
    notes: list[str] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)


_NOOP = contextlib.nullcontext()
_NOTHING: frozenset[str] = frozenset()


def _write_json(path: Path, data: dict[str, Any]) -> None:
    # Write then rename: write_summary (maybe in another process) never reads half a file.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _free_folder(base: Path) -> tuple[Path, int]:
    """The plan's folder, or its first free `call_K` subfolder when an earlier call already took it."""
    if not (base / META).exists():
        return base, 1
    k = 2
    while (base / f"call_{k}" / META).exists():
        k += 1
    return base / f"call_{k}", k


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Profiler:
    """The profiler of one worker process (worker role, rank within its world, device)."""

    def __init__(self, plan: ProfilePlan, worker: str, rank: int, device: str) -> None:
        self.plan, self.worker, self.rank, self.device = plan, worker, rank, device
        self.step = 0
        self._steps = frozenset(plan.steps)
        self._roles = profiled_roles(plan, worker, rank)
        self._continuous = plan.mode == "continuous"
        # Roles profiled at the current step: the only thing a role call looks at.
        self._live = _NOTHING
        self._session: _Session | None = None
        # Built (and torch_npu imported) only in processes that profile something: fails at start-up, not
        # at step N, when the tool cannot load.
        self._backend = _backend(plan, worker, rank, device) if self._roles else None
        # torch_npu's device module, for the syncs around profiled calls on an NPU (any tool).
        self._npu = devices.accelerator_module("npu") if device == "npu" and self._roles else None

    # ------------------------------------------------------------------ the worker's calls
    def set_step(self, step: int) -> None:
        """The training step of the next calls (1-based); ends a continuous profile of another step."""
        if self._session is not None and step != self.step:
            self._end(None)
        self.step = step
        self._live = self._roles if step in self._steps else _NOTHING

    def profiled(self, role: str) -> AbstractContextManager[Any]:
        """Wraps one role call: profiles it when the plan asks for (step, role, rank); else a no-op."""
        if role not in self._live:
            return _NOOP
        return self._call(role)

    def close(self) -> None:
        """Flush an open continuous profile (end of run). Safe to call more than once."""
        if self._session is not None:
            self._end(None)

    # ------------------------------------------------------------------ internals
    @contextlib.contextmanager
    def _call(self, role: str) -> Iterator[None]:
        assert self._backend is not None
        owner = self._session is None
        self._sync()  # queued device work of earlier calls is not this call's
        if owner:
            try:
                self._session = self._begin(E2E if self._continuous else role)
            except OSError as exc:  # an unwritable save_path costs the profile, not the run
                log.warning("profiler: %s at step %d runs unprofiled: %s", role, self.step, _describe(exc))
                yield
                return
        session = self._session
        assert session is not None
        error: BaseException | None = None
        t0 = time.perf_counter()
        try:
            with self._backend.mark(role, self.step):
                yield
            self._sync()  # an asynchronous device error of the call surfaces here, as the call's error
        except BaseException as exc:
            error = exc
            raise  # once, unchanged; the body is never run again
        finally:
            self._record(session, owner, role, time.perf_counter() - t0, error)

    def _record(
        self, session: _Session, owner: bool, role: str, wall: float, error: BaseException | None
    ) -> None:
        entry: dict[str, Any] = {
            "role": role,
            "wall_s": round(wall, 6),
            "status": "ok" if error is None else "error",
        }
        if error is not None:
            entry["error"] = _describe(error)
        if owner and not self._continuous:
            session.meta["wall_s"] = entry["wall_s"]
        else:
            # A continuous step's role calls, or a discrete call nested in another role's call (one torch
            # profiler per process: it is a named range inside the outer call's trace).
            session.calls.append(entry)
        if owner and not self._continuous:
            self._end(error)
        elif self._continuous and error is not None and self._session is session:
            # An error flushes the step's profile so the trace up to it survives whatever the caller does
            # next (the run usually ends; a later call in the same step opens call_2).
            self._end(error)

    def _begin(self, role: str) -> _Session:
        assert self._backend is not None
        base = Path(f"{self.plan.save_path}/step_{self.step}/{role}/rank_{self.rank}")
        folder, call = _free_folder(base)
        folder.mkdir(parents=True, exist_ok=True)
        meta = {
            "role": role,
            "step": self.step,
            "rank": self.rank,
            "worker": self.worker,
            "tool": self.plan.tool,
            "mode": self.plan.mode,
            "call": call,
            "pid": os.getpid(),
            "wall_s": None,
            "status": "running",
        }
        # Written now: the folder is taken (a later call or a resumed run picks call_K), and a process
        # that dies mid-call leaves `running` for the summary to show.
        _write_json(folder / META, meta)
        session = _Session(folder, role, self.step, call, meta, 0.0)
        try:
            session.handle = self._backend.start(folder, session.notes)
        except Exception as exc:  # the call still runs and is timed, unprofiled
            log.warning("profiler: could not start %s for %s: %s", self.plan.tool, folder, _describe(exc))
            session.notes.append(f"profiler did not start: {_describe(exc)}")
            session.handle = None
        session.t0 = time.perf_counter()  # the profiler's own start-up is not the step's time
        return session

    def _end(self, error: BaseException | None) -> None:
        session, self._session = self._session, None
        assert session is not None and self._backend is not None
        meta = session.meta
        if self._continuous:  # before the trace export, which is the profiler's time, not the step's
            meta["wall_s"] = round(time.perf_counter() - session.t0, 6)
        if error is not None:
            session.notes.append(f"the call raised {_describe(error)}: the profile stops there")
        if session.handle is not None:
            try:
                self._backend.stop(session.handle, session.folder, error, session.notes)
            except Exception as exc:
                log.warning("profiler: could not write %s: %s", session.folder, _describe(exc))
                session.notes.append(f"profile not written: {_describe(exc)}")
        # A continuous step with a failed call failed; a discrete call is judged by itself (a nested call
        # whose error it caught is listed in `nested`).
        failed = self._continuous and any(c["status"] == "error" for c in session.calls)
        meta["status"] = "error" if error is not None or failed else "ok"
        if error is not None:
            meta["error"] = _describe(error)
        meta["calls" if self._continuous else "nested"] = session.calls
        meta["notes"] = session.notes
        meta["files"] = sorted(
            p.name for p in session.folder.iterdir() if p.name != META and not p.name.startswith("call_")
        )
        try:
            _write_json(session.folder / META, meta)
        except OSError as exc:
            log.warning("profiler: could not write %s: %s", session.folder / META, _describe(exc))

    def _sync(self) -> None:
        # Device work is asynchronous: wall times and capture bounds mean something only after a sync.
        if self.device == "cuda" and _cuda.is_available():
            _cuda.synchronize()
        elif self._npu is not None:
            self._npu.synchronize()


def profiled(role: str) -> Callable[[F], F]:
    """Decorator for a method of an object with `self.profiler`: the method body is one `role` call."""
    if role not in ROLES:
        raise ValueError(f"unknown profiled role {role!r}; roles are {', '.join(ROLES)}")

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            prof: Profiler = self.profiler
            if role not in prof._live:  # the common case: skip even the null context
                return fn(self, *args, **kwargs)
            with prof._call(role):
                return fn(self, *args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


# ============================================================================================ summary
_STATUS_ORDER = {"ok": 0, "running": 1, "error": 2}


def _records(save_path: Path) -> list[dict[str, Any]]:
    """One record per role call found under save_path (continuous profiles give one per role call inside,
    plus the `e2e` step itself)."""
    out: list[dict[str, Any]] = []
    metas = [*save_path.glob(f"step_*/*/rank_*/{META}"), *save_path.glob(f"step_*/*/rank_*/call_*/{META}")]
    for path in metas:
        try:
            meta = read_json(path)  # bounded (rltrain.checkpoint.manifest.read_json)
        except JSON_ERRORS as exc:
            log.warning("profiler summary: skipping %s: %s", path, exc)
            continue
        base = {
            "step": meta["step"],
            "rank": meta["rank"],
            "worker": meta["worker"],
            "tool": meta["tool"],
            "folder": str(path.parent.relative_to(save_path)),
        }
        out.append({**base, "role": meta["role"], "wall_s": meta["wall_s"], "status": meta["status"]})
        if meta["role"] == E2E and "calls" in meta:
            out.extend(
                {**base, "role": c["role"], "wall_s": c["wall_s"], "status": c["status"]}
                for c in meta["calls"]
            )
    return sorted(out, key=lambda r: (r["step"], r["role"], r["rank"], r["folder"]))


def _role_order(role: str) -> tuple[int, str]:
    return (ROLES.index(role) if role in ROLES else len(ROLES), role)


def write_summary(save_path: str | Path) -> Path:
    """Collect every profile folder's meta.json under save_path into `profile_summary.md` (per step: a
    role x rank table of wall seconds, the slowest role in bold) and `summary.json`; returns the Markdown
    file's path (its text is what the controller prints at the end of a run)."""
    root = Path(save_path)
    root.mkdir(parents=True, exist_ok=True)
    records = _records(root)
    # (step, role, rank) -> total wall seconds over the calls, number of calls, worst status.
    cells: dict[int, dict[str, dict[int, dict[str, Any]]]] = {}
    for r in records:
        cell = (
            cells.setdefault(r["step"], {})
            .setdefault(r["role"], {})
            .setdefault(r["rank"], {"wall_s": 0.0, "calls": 0, "status": "ok"})
        )
        cell["calls"] += 1
        cell["wall_s"] = round(cell["wall_s"] + (r["wall_s"] or 0.0), 6)
        if _STATUS_ORDER[r["status"]] > _STATUS_ORDER[cell["status"]]:
            cell["status"] = r["status"]

    steps_json = []
    lines = ["# Profile summary", "", f"`{root}`: wall seconds of each role call, per step and rank.", ""]
    if not cells:
        lines.append("No profile was recorded.")
    for step in sorted(cells):
        roles = cells[step]
        ranks = sorted({rank for by_rank in roles.values() for rank in by_rank})
        timed = {
            role: max(c["wall_s"] for c in by_rank.values()) for role, by_rank in roles.items() if role != E2E
        }
        slowest = max(timed, key=lambda role: timed[role]) if timed else None
        lines += [f"## Step {step}", ""]
        lines.append("| role | " + " | ".join(f"rank {r}" for r in ranks) + " | max |")
        lines.append("|---|" + "---:|" * (len(ranks) + 1))
        for role in sorted(roles, key=_role_order):
            by_rank = roles[role]
            row = [_cell(by_rank[r]) if r in by_rank else "–" for r in ranks]
            peak = f"{max(c['wall_s'] for c in by_rank.values()):.4f}"
            name = role
            if role == slowest:
                name, peak = f"**{role}** (slowest)", f"**{peak}**"
            lines.append(f"| {name} | " + " | ".join(row) + f" | {peak} |")
        lines.append("")
        steps_json.append(
            {
                "step": step,
                "slowest_role": slowest,
                "roles": {
                    role: {str(rank): c for rank, c in sorted(by.items())} for role, by in roles.items()
                },
            }
        )
    md = root / SUMMARY_MD
    md.write_text("\n".join(lines) + "\n")
    _write_json(root / "summary.json", {"save_path": str(root), "steps": steps_json, "records": records})
    return md


def _cell(c: dict[str, Any]) -> str:
    text = f"{c['wall_s']:.4f}"
    if c["calls"] > 1:
        text += f" ({c['calls']} calls)"
    if c["status"] != "ok":
        text += f" {c['status']}"
    return text
