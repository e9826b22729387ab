"""Per-role profiling (rltrain.profiling) and the NPU device layer (rltrain.npu): folder layout, filtering,
errors, tools and the summary.

The torch profiler runs for real on the CPU and writes real files into tmp_path. Plans are compiled from
the tiny presets with the same overrides a user would pass, so the folders checked are the plan's own.
CUDA / nsys and torch_npu / MindSpeed cannot run on this CPU-only machine: their tests drive the production
code against recording stand-ins (a fake `torch.cuda` at `profiling._cuda`, fake `torch_npu` and `mindspeed`
modules in sys.modules), as each test's docstring says. tests/test_profiling_e2e.py runs the real CLI.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from presets import PRESETS
from rlconf.load import load_config
from rlconf.plan import ProfilePlan, compile_plan
from rltrain import npu, profiling
from rltrain.profiling import Profiler, nsys_command, profiled, write_summary

TWO_RANKS = (
    "cluster.gpus_per_node=2",
    "actor.ppo_micro_batch_size_per_gpu=2",
    "critic.ppo_micro_batch_size_per_gpu=2",
)


def make_plan(tmp_path: Path, *overrides: str, preset: str = "tiny-grpo") -> ProfilePlan:
    cfg = load_config(
        None, preset=preset, overrides=[f"trainer.output_dir={tmp_path}", *overrides], presets=PRESETS
    )
    return compile_plan(cfg).profile


def work() -> torch.Tensor:
    return torch.randn(16, 16) @ torch.randn(16, 16)


def run_steps(prof: Profiler, steps: range, roles: tuple[str, ...]) -> None:
    for step in steps:
        prof.set_step(step)
        for role in roles:
            with prof.profiled(role):
                work()
    prof.close()


def written(save_path: str) -> set[str]:
    """Profile folders on disk (every one holds a meta.json)."""
    return {str(p.parent) for p in Path(save_path).rglob("meta.json")}


def trace_names(folder: str | Path) -> set[str]:
    data = json.loads((Path(folder) / "trace.json").read_text())
    return {e["name"] for e in data["traceEvents"] if "name" in e}


def meta(folder: str | Path) -> dict[str, Any]:
    return json.loads((Path(folder) / "meta.json").read_text())


POLICY_ROLES = ("generate_sequences", "actor_compute_log_prob", "actor_update")


# ============================================================================================ torch
def test_discrete_layout_is_the_plans_and_traces_name_their_role(tmp_path: Path) -> None:
    plan = make_plan(tmp_path, "profile.tool=torch", "profile.steps=[2, 3]")
    assert plan.mode == "discrete" and plan.steps == (2, 3)
    run_steps(Profiler(plan, worker="actor", rank=0, device="cpu"), range(1, 5), POLICY_ROLES)
    run_steps(Profiler(plan, worker="controller", rank=0, device="cpu"), range(1, 5), ("reward_compute",))

    assert written(plan.save_path) == set(plan.folders)
    for folder in plan.folders:
        m = meta(folder)
        role, step = m["role"], m["step"]
        assert folder.endswith(f"/step_{step}/{role}/rank_0")
        assert m["status"] == "ok" and m["wall_s"] > 0 and m["tool"] == "torch" and m["call"] == 1
        names = trace_names(folder)  # the Chrome trace loads and shows the role as a range
        assert role in names
        # one role per trace: nothing of another role (or step) leaked into it
        assert not (names & (set(POLICY_ROLES) - {role}))
        assert "Name" in (Path(folder) / "summary.txt").read_text()  # the key_averages table
    assert not (Path(plan.save_path) / "step_1").exists() and not (Path(plan.save_path) / "step_4").exists()


def test_a_role_called_twice_in_a_step_never_overwrites(tmp_path: Path) -> None:
    plan = make_plan(
        tmp_path, "profile.tool=torch", "profile.steps=[2]", "profile.roles=[generate_sequences]"
    )
    base = Path(plan.folders[0])
    prof = Profiler(plan, worker="actor", rank=0, device="cpu")
    prof.set_step(2)
    with prof.profiled("generate_sequences"):  # e.g. the training generate ...
        work()
    first = (base / "trace.json").read_bytes()
    with prof.profiled("generate_sequences"):  # ... then a validation generate in the same step
        work()
    assert (base / "trace.json").read_bytes() == first
    assert meta(base / "call_2")["call"] == 2 and "generate_sequences" in trace_names(base / "call_2")
    # A resumed run re-doing step 2 in a new process keeps both earlier traces too.
    again = Profiler(plan, worker="actor", rank=0, device="cpu")
    again.set_step(2)
    with again.profiled("generate_sequences"):
        work()
    assert (base / "trace.json").read_bytes() == first
    assert written(plan.save_path) == {str(base), str(base / "call_2"), str(base / "call_3")}


def test_roles_ranks_and_steps_filter(tmp_path: Path) -> None:
    plan = make_plan(
        tmp_path, *TWO_RANKS, "profile.tool=torch", "profile.steps=[2]", "profile.ranks=[1]",
        "profile.roles=[actor_update, critic_update]", preset="tiny-ppo",
    )  # fmt: skip
    every = (*POLICY_ROLES, "ref_compute_log_prob", "critic_compute_values", "critic_update")
    for worker in ("actor", "critic"):
        for rank in (0, 1):
            run_steps(Profiler(plan, worker=worker, rank=rank, device="cpu"), range(1, 4), every)
    root = plan.save_path
    assert written(root) == {f"{root}/step_2/actor_update/rank_1", f"{root}/step_2/critic_update/rank_1"}
    assert written(root) == set(plan.folders)
    assert meta(f"{root}/step_2/critic_update/rank_1")["worker"] == "critic"


def test_disabled_profiler_is_a_shared_no_op(tmp_path: Path) -> None:
    off = make_plan(tmp_path)  # profile.tool = none
    prof = Profiler(off, worker="actor", rank=0, device="cpu")
    prof.set_step(1)
    on = make_plan(tmp_path, "profile.tool=torch", "profile.steps=[2]")
    idle = Profiler(on, worker="actor", rank=0, device="cpu")
    idle.set_step(3)
    # No allocation on the hot path: the same null context every time.
    assert (
        prof.profiled("actor_update") is idle.profiled("actor_update") is prof.profiled("generate_sequences")
    )
    with prof.profiled("actor_update"):
        work()
    prof.close()
    assert not Path(on.save_path).exists()


def test_continuous_mode_one_profile_per_step(tmp_path: Path) -> None:
    plan = make_plan(
        tmp_path, *TWO_RANKS, "profile.tool=torch", "profile.discrete=false", "profile.steps=[2, 3]",
        "profile.all_ranks=true", preset="tiny-ppo",
    )  # fmt: skip
    policy = (*POLICY_ROLES, "ref_compute_log_prob")
    for rank in (0, 1):
        prof = Profiler(plan, worker="actor", rank=rank, device="cpu")
        for step in range(1, 4):
            prof.set_step(step)  # set_step(3) closes step 2's profile; close() closes step 3's
            for role in policy:
                with prof.profiled(role):
                    work()
        prof.close()
        prof.close()  # idempotent
    # The critic's processes share rank numbers with the policy's: they must not write e2e/rank_R.
    run_steps(Profiler(plan, worker="critic", rank=0, device="cpu"), range(1, 4), ("critic_update",))

    assert written(plan.save_path) == set(plan.folders)
    assert all(f.endswith(("/e2e/rank_0", "/e2e/rank_1")) for f in plan.folders)
    for folder in plan.folders:
        m = meta(folder)
        assert m["role"] == "e2e" and m["status"] == "ok"
        assert [c["role"] for c in m["calls"]] == list(policy)
        assert m["wall_s"] >= sum(c["wall_s"] for c in m["calls"])
        assert set(policy) <= trace_names(folder)


# ============================================================================================ errors
class Engine:
    def __init__(self, prof: Profiler) -> None:
        self.profiler = prof
        self.calls = 0

    @profiled("actor_update")
    def update(self, fail: bool) -> str:
        self.calls += 1
        work()
        if fail:
            raise ValueError("loss is nan")
        return "done"


def test_an_error_propagates_once_and_flushes_the_trace(tmp_path: Path) -> None:
    plan = make_plan(tmp_path, "profile.tool=torch", "profile.steps=[2]", "profile.roles=[actor_update]")
    engine = Engine(Profiler(plan, worker="actor", rank=0, device="cpu"))
    engine.profiler.set_step(2)
    with pytest.raises(ValueError, match="loss is nan") as info:
        engine.update(fail=True)
    assert engine.calls == 1  # never re-run
    assert info.value.__cause__ is None and info.value.__context__ is None  # the original, not a wrapper
    folder = Path(plan.folders[0])
    m = meta(folder)
    assert m["status"] == "error" and m["error"] == "ValueError: loss is nan"
    assert any("raised ValueError" in n for n in m["notes"])
    assert "actor_update" in trace_names(folder)  # what was captured is written
    assert (folder / "summary.txt").read_text().startswith("# the call raised ValueError")
    # The profiler is usable after the error; the next call of the step does not overwrite the failed one.
    assert engine.update(fail=False) == "done" and engine.calls == 2
    assert meta(folder / "call_2")["status"] == "ok" and meta(folder)["status"] == "error"


def test_an_error_in_continuous_mode_flushes_the_step(tmp_path: Path) -> None:
    plan = make_plan(tmp_path, "profile.tool=torch", "profile.discrete=false", "profile.steps=[2]")
    engine = Engine(Profiler(plan, worker="actor", rank=0, device="cpu"))
    engine.profiler.set_step(2)
    with engine.profiler.profiled("generate_sequences"):
        work()
    with pytest.raises(ValueError):
        engine.update(fail=True)
    assert engine.calls == 1
    m = meta(plan.folders[0])  # written at the error, without waiting for set_step / close
    assert m["status"] == "error" and [c["status"] for c in m["calls"]] == ["ok", "error"]
    assert {"generate_sequences", "actor_update"} <= trace_names(plan.folders[0])


def test_decorator_rejects_unknown_roles() -> None:
    with pytest.raises(ValueError, match="unknown profiled role"):
        profiled("actor_updte")


# ============================================================================================ nsys
class FakeCuda:
    """Records the CUDA profiler-API, NVTX and synchronize calls the nsys tool makes."""

    def __init__(self) -> None:
        self.events: list[tuple[str, ...]] = []
        self.profiler = types.SimpleNamespace(
            start=lambda: self._log("start"), stop=lambda: self._log("stop")
        )
        self.nvtx = types.SimpleNamespace(
            range_push=lambda name: self._log("push", name), range_pop=lambda: self._log("pop")
        )

    def _log(self, *event: str) -> None:
        self.events.append(event)

    def is_available(self) -> bool:
        return True

    def synchronize(self) -> None:
        self._log("sync")


def test_nsys_brackets_each_role_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """nsys and CUDA cannot exist on this CPU machine: the module's CUDA boundary (`profiling._cuda`, the
    torch.cuda it calls start/stop, NVTX and synchronize on) is replaced by a recorder, and the test checks
    the calls a process launched by `nsys_command` would see, and the files the Profiler writes."""
    cuda = FakeCuda()
    monkeypatch.setattr(profiling, "_cuda", cuda)
    plan = make_plan(
        tmp_path, "cluster.device=cuda", "profile.tool=nsys", "profile.steps=[2]",
        "profile.nsys.trace=[cuda, nvtx, osrt]", "profile.nsys.cuda_memory_usage=true",
    )  # fmt: skip
    prof = Profiler(plan, worker="actor", rank=0, device="cuda")
    run_steps(prof, range(1, 4), ("generate_sequences", "actor_update"))
    work_events = [e for e in cuda.events if e[0] != "sync"]
    assert work_events == [
        ("start",), ("push", "generate_sequences/step_2"), ("pop",), ("stop",),
        ("start",), ("push", "actor_update/step_2"), ("pop",), ("stop",),
    ]  # fmt: skip
    # The capture is bounded by device syncs so queued kernels land in the right report.
    assert cuda.events[cuda.events.index(("start",)) - 1] == ("sync",)
    assert cuda.events[cuda.events.index(("stop",)) - 1] == ("sync",)

    prefix = nsys_command(plan, worker="actor", rank=0)
    raw = f"{plan.save_path}/nsys/actor_rank_0_%p"
    assert prefix == [
        "nsys", "profile", "-o", raw, "--capture-range=cudaProfilerApi", "--capture-range-end=repeat",
        "--trace=cuda,nvtx,osrt", "--force-overwrite=true", "--cuda-memory-usage=true",
    ]  # fmt: skip
    # Each role folder links the numbered report nsys writes for its capture (%p = this process).
    captures = []
    for role in ("generate_sequences", "actor_update"):
        link = Path(f"{plan.save_path}/step_2/{role}/rank_0/report.nsys-rep")
        assert link.is_symlink() and not os.path.isabs(os.readlink(link))
        target = os.path.normpath(link.parent / os.readlink(link))
        stem, capture, ext = target.rsplit(".", 2)
        assert stem == raw.replace("%p", str(os.getpid())) and ext == "nsys-rep"
        captures.append(int(capture))
        assert meta(link.parent)["status"] == "ok"
    assert captures[1] == captures[0] + 1
    # Processes that profile nothing get no nsys prefix.
    assert nsys_command(plan, worker="critic", rank=0) == []
    assert nsys_command(make_plan(tmp_path, "profile.steps=[2]"), worker="actor", rank=0) == []


def test_nsys_without_cuda_records_nothing_but_times_the_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda = FakeCuda()
    monkeypatch.setattr(profiling, "_cuda", cuda)
    plan = make_plan(tmp_path, "cluster.device=cuda", "profile.tool=nsys", "profile.steps=[1]")
    run_steps(Profiler(plan, worker="controller", rank=0, device="cpu"), range(1, 2), ("reward_compute",))
    assert cuda.events == []
    m = meta(plan.folders[-1])
    assert m["role"] == "reward_compute" and m["wall_s"] > 0 and "without CUDA" in m["notes"][0]


# ============================================================================================ npu
# No NPU, CANN, torch_npu or MindSpeed exists on the project's machines (and an installed torch_npu breaks
# `import torch` there): every NPU test puts recording stand-ins for them in sys.modules and runs the
# production code path against those. What that does not show (real traces, real patches) is listed in
# docs/profiling.md.
class FakeTorchNpu(types.ModuleType):
    """A stand-in for torch_npu: `profiler` (profile, schedule, trace handler, _ExperimentalConfig with the
    mstx switch of the given name), `npu.mstx` (range_start/range_end/mark) and the `npu` device calls. Every
    call is appended to `calls` in order; the trace handler writes a marker file where the real one writes
    its `*_ascend_pt` folder."""

    def __init__(
        self, switch: str = "mstx", ranges: bool = True, range_ids: int = 1, broken: bool = False
    ) -> None:
        super().__init__("torch_npu")
        self.calls: list[tuple[str, Any]] = []
        self.adaptations: list[list[str]] = []  # argv seen by each import of the stand-in adaptor
        log = self._log
        ns = types.SimpleNamespace

        def experimental_config(**kwargs: Any) -> dict[str, Any]:
            log("_ExperimentalConfig", kwargs)
            return kwargs

        # The keyword torch_npu uses to turn on mstx collection: `mstx` (recent), `msprof_tx` (older).
        params = [
            inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None)
            for n in ("profiler_level", "aic_metrics", "export_type", switch)
        ]
        experimental_config.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]

        def tensorboard_trace_handler(dir_name: str, analyse_flag: bool = True) -> Callable[[Any], None]:
            log("tensorboard_trace_handler", {"dir_name": dir_name, "analyse_flag": analyse_flag})

            def ready(prof: Any) -> None:
                out = Path(dir_name) / "host_1_ascend_pt"
                out.mkdir(parents=True)
                (out / "marker.json").write_text(json.dumps({"analyse_flag": analyse_flag}))

            return ready

        class FakeProfile:
            def __init__(self, **kwargs: Any) -> None:
                log("profile", kwargs)
                self.on_trace_ready = kwargs["on_trace_ready"]

            def start(self) -> None:
                log("start")

            def stop(self) -> None:
                log("stop")
                self.on_trace_ready(self)

        self.profiler = ns(
            ProfilerActivity=ns(CPU="CPU", NPU="NPU"),
            ProfilerLevel=ns(Level_none="Level_none", Level0="Level0", Level1="Level1", Level2="Level2"),
            AiCMetrics=ns(PipeUtilization="PipeUtilization", AiCoreNone="AiCoreNone"),
            ExportType=ns(Text="Text"),
            _ExperimentalConfig=experimental_config,
            schedule=lambda **kw: log("schedule", kw) or kw,
            tensorboard_trace_handler=tensorboard_trace_handler,
            profile=FakeProfile,
        )
        ids = iter(range(range_ids, 10**6)) if range_ids else iter(lambda: 0, 1)
        mstx = ns(mark=lambda message, stream=None: log("mark", message, stream))
        if broken:
            mstx.range_start = lambda message, stream=None: 1 / 0
        elif ranges:
            mstx.range_start = lambda message, stream=None: log("range_start", message, stream) or next(ids)
            mstx.range_end = lambda range_id: log("range_end", range_id)
        self.npu = ns(
            mstx=mstx,
            current_stream=lambda: "stream0",
            synchronize=lambda: log("synchronize"),
            set_device=lambda index: log("set_device", index),
            device_count=lambda: 8,
        )

    def _log(self, name: str, *args: Any) -> None:
        self.calls.append((name, *args))

    def names(self, *keep: str) -> list[str]:
        return [c[0] for c in self.calls if not keep or c[0] in keep]


@pytest.fixture()
def torch_npu(monkeypatch: pytest.MonkeyPatch) -> FakeTorchNpu:
    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return fake


def npu_plan(tmp_path: Path, *overrides: str) -> ProfilePlan:
    return make_plan(tmp_path, "cluster.device=npu", "profile.tool=npu", "profile.steps=[2]", *overrides)


@pytest.mark.parametrize(
    ("level", "contents", "analysis"),
    [
        ("level1", "[npu, cpu]", True),
        ("level0", "[npu]", False),
        ("level2", "[npu, cpu, memory, shapes, module, stack]", True),
        ("level_none", "[cpu]", False),
    ],
)
def test_npu_passes_level_contents_analysis_and_folder(
    tmp_path: Path, torch_npu: FakeTorchNpu, level: str, contents: str, analysis: bool
) -> None:
    """The option mapping onto torch_npu.profiler, checked against the stand-in torch_npu (no NPU here)."""
    plan = npu_plan(
        tmp_path, "profile.roles=[actor_update]", f"profile.npu.level={level}",
        f"profile.npu.contents={contents}", f"profile.npu.analysis={str(analysis).lower()}",
    )  # fmt: skip
    run_steps(Profiler(plan, worker="actor", rank=0, device="npu"), range(1, 4), POLICY_ROLES)
    folder = plan.folders[0]
    assert folder.endswith("/step_2/actor_update/rank_0")
    by_name = {c[0]: c[1] for c in torch_npu.calls if len(c) > 1}
    assert torch_npu.names("profile", "start", "stop") == ["profile", "start", "stop"]
    expected_level = {"level_none": "Level_none", "level0": "Level0", "level1": "Level1", "level2": "Level2"}
    config = by_name["_ExperimentalConfig"]
    assert config["profiler_level"] == expected_level[level]
    assert config["mstx"] is True  # the role ranges are collected (and are all level_none collects)
    deep = level in ("level1", "level2")
    assert config["aic_metrics"] == ("PipeUtilization" if deep else "AiCoreNone")
    assert by_name["tensorboard_trace_handler"] == {"dir_name": folder, "analyse_flag": analysis}
    assert by_name["schedule"] == {"wait": 0, "warmup": 0, "active": 1, "repeat": 1, "skip_first": 0}
    kw = by_name["profile"]
    parsed = contents.strip("[]").split(", ")
    assert kw["activities"] == [a for a in ("CPU", "NPU") if a.lower() in parsed]
    assert kw["record_shapes"] == ("shapes" in parsed) and kw["profile_memory"] == ("memory" in parsed)
    assert kw["with_stack"] == ("stack" in parsed) and kw["with_modules"] == ("module" in parsed)
    marker = json.loads((Path(folder) / "host_1_ascend_pt" / "marker.json").read_text())
    assert marker == {"analyse_flag": analysis}
    m = meta(folder)
    assert m["tool"] == "npu" and m["status"] == "ok" and m["files"] == ["host_1_ascend_pt"]


def test_npu_brackets_each_role_call_with_an_mstx_range(tmp_path: Path, torch_npu: FakeTorchNpu) -> None:
    """Each profiled role call is one mstx range `ROLE/step_N` on the current NPU stream, inside its own
    torch_npu profile, with device syncs between the range and the profile's bounds (stand-in torch_npu)."""
    plan = npu_plan(tmp_path, "profile.roles=[actor_compute_log_prob, actor_update]")
    engine = Engine(Profiler(plan, worker="actor", rank=0, device="npu"))
    for step in (1, 2, 3):
        engine.profiler.set_step(step)
        with engine.profiler.profiled("generate_sequences"):  # not a profiled role: no range, no sync
            work()
        with engine.profiler.profiled("actor_compute_log_prob"):
            work()
        if step == 2:
            with pytest.raises(ValueError):
                engine.update(fail=True)  # an error still ends the range, then the profile
    engine.profiler.close()
    keep = ("profile", "start", "stop", "range_start", "range_end", "synchronize")
    assert [c for c in torch_npu.calls if c[0] in keep and c[0] != "profile"] == [
        ("synchronize",), ("start",), ("range_start", "actor_compute_log_prob/step_2", "stream0"),
        ("range_end", 1), ("synchronize",), ("stop",),
        ("synchronize",), ("start",), ("range_start", "actor_update/step_2", "stream0"),
        ("range_end", 2), ("stop",),  # no sync after the raising call: the error is already known
    ]  # fmt: skip
    assert meta(f"{plan.save_path}/step_2/actor_update/rank_0")["status"] == "error"
    assert meta(f"{plan.save_path}/step_2/actor_compute_log_prob/rank_0")["status"] == "ok"


def test_npu_continuous_step_has_one_range_per_role_call(tmp_path: Path, torch_npu: FakeTorchNpu) -> None:
    """Continuous mode (stand-in torch_npu): one profile for the step, an mstx range for each role call."""
    plan = npu_plan(tmp_path, "profile.discrete=false")
    run_steps(Profiler(plan, worker="actor", rank=0, device="npu"), range(1, 4), POLICY_ROLES)
    ranges = [c[1] for c in torch_npu.calls if c[0] == "range_start"]
    assert ranges == [f"{role}/step_2" for role in POLICY_ROLES]
    assert torch_npu.names("start", "stop") == ["start", "stop"]
    assert torch_npu.names("range_end") == ["range_end"] * 3
    assert [c["role"] for c in meta(plan.folders[0])["calls"]] == list(POLICY_ROLES)


@pytest.mark.parametrize("variant", ["msprof_tx", "marks only", "range_start fails", "range_start raises"])
def test_npu_older_or_failing_mstx(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, variant: str
) -> None:
    """Stand-ins for older or failing torch_npu releases: the mstx switch is `msprof_tx`; a torch_npu
    without mstx ranges gets start/end marks; a failed range_start (id 0) gets no range_end; a raising
    range_start costs the range (logged), not the role call."""
    fake = FakeTorchNpu(
        switch="msprof_tx" if variant == "msprof_tx" else "mstx",
        ranges=variant != "marks only",
        range_ids=0 if variant == "range_start fails" else 1,
        broken=variant == "range_start raises",
    )
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    plan = npu_plan(tmp_path, "profile.roles=[actor_update]")
    run_steps(Profiler(plan, worker="actor", rank=0, device="npu"), range(2, 3), ("actor_update",))
    config = next(c[1] for c in fake.calls if c[0] == "_ExperimentalConfig")
    marks = [c[1:] for c in fake.calls if c[0] in ("mark", "range_start", "range_end")]
    if variant == "msprof_tx":
        assert config["msprof_tx"] is True and "mstx" not in config
        assert marks == [("actor_update/step_2", "stream0"), (1,)]
    elif variant == "marks only":
        assert marks == [("actor_update/step_2/start", "stream0"), ("actor_update/step_2/end", "stream0")]
    elif variant == "range_start fails":
        assert marks == [("actor_update/step_2", "stream0")]
    else:
        assert marks == [] and "no mstx range for actor_update/step_2: ZeroDivisionError" in caplog.text
    assert meta(plan.folders[0])["status"] == "ok" and fake.names("start", "stop") == ["start", "stop"]


def test_torch_npu_is_imported_only_for_the_npu_tool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # any import of it now raises ImportError
    plan = make_plan(tmp_path, "profile.tool=torch", "profile.steps=[1]", "profile.roles=[actor_update]")
    run_steps(Profiler(plan, worker="actor", rank=0, device="cpu"), range(1, 2), ("actor_update",))
    assert written(plan.save_path) == set(plan.folders)


def test_npu_profiler_without_torch_npu_names_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch_npu made unimportable (None in sys.modules): the npu profiler fails at worker start, naming
    the setting."""
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    plan = npu_plan(tmp_path)
    with pytest.raises(npu.NpuUnavailableError, match=r"cluster\.device = npu needs torch_npu") as info:
        Profiler(plan, worker="actor", rank=0, device="npu")
    assert str(info.value).endswith(npu.INSTALL_HINT)
    # A process that profiles nothing on an npu run does not need it.
    Profiler(plan, worker="critic", rank=0, device="npu")


# ------------------------------------------------------------------ the device layer (rltrain.npu)
@pytest.fixture()
def mindspeed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, torch_npu: FakeTorchNpu
) -> Iterator[FakeTorchNpu]:
    """A stand-in `mindspeed` package on sys.path whose `megatron_adaptor`, like the real one, does its work
    when imported: it records the argv it parses into the stand-in torch_npu (which it imports, as the
    real adaptor imports torch_npu.contrib.transfer_to_npu)."""
    pkg = tmp_path / "site" / "mindspeed"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "megatron_adaptor.py").write_text(
        "import sys\nimport torch_npu\n\ntorch_npu.adaptations.append(list(sys.argv))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(npu, "_adapted", False)
    yield torch_npu
    for name in ("mindspeed.megatron_adaptor", "mindspeed"):
        sys.modules.pop(name, None)


def without_megatron(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as a fresh worker: no megatron.core module loaded (restored after the test)."""
    for name in [n for n in sys.modules if n == "megatron.core" or n.startswith("megatron.core.")]:
        monkeypatch.delitem(sys.modules, name)


def test_prepare_npu_loads_binds_and_adapts_once(
    mindspeed: FakeTorchNpu, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Stand-in torch_npu and MindSpeed: the device is bound, the adaptor imported once, and it parses no
    argv but the program name (a Ray worker's argv holds Ray's flags)."""
    without_megatron(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["default_worker.py", "--node-ip-address=10.0.0.1", "--seed=7"])
    assert npu.prepare_npu(local_rank=9) is mindspeed
    npu.prepare_npu(local_rank=9)
    assert mindspeed.adaptations == [["default_worker.py"]]
    assert sys.argv == ["default_worker.py", "--node-ip-address=10.0.0.1", "--seed=7"]  # restored
    assert [c for c in mindspeed.calls if c[0] == "set_device"] == [("set_device", 1)] * 2  # 9 % 8 NPUs
    assert "after megatron.core was imported" not in caplog.text


def test_mindspeed_after_megatron_warns(
    mindspeed: FakeTorchNpu, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Stand-in MindSpeed applied with a (stand-in) megatron.core already loaded: a warning says so."""
    monkeypatch.setitem(sys.modules, "megatron.core", types.ModuleType("megatron.core"))
    npu.apply_mindspeed()
    assert mindspeed.adaptations and "after megatron.core was imported" in caplog.text


@pytest.mark.parametrize("missing", ["torch_npu", "mindspeed"])
def test_prepare_npu_names_cluster_device_when_a_package_is_missing(
    missing: str, mindspeed: FakeTorchNpu, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One of the two packages made unimportable, the other a stand-in: the error names the setting and
    the fix."""
    monkeypatch.setitem(sys.modules, missing, None)
    with pytest.raises(npu.NpuUnavailableError) as info:
        npu.prepare_npu(local_rank=0)
    text = str(info.value)
    assert text.startswith("cluster.device = npu needs ") and missing in text
    assert text.endswith(npu.INSTALL_HINT)
    assert not npu._adapted  # a later call tries again


def test_init_distributed_prepares_the_npu_before_hccl(
    mindspeed: FakeTorchNpu, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rltrain.megatron.parallel on npu (stand-in torch_npu / MindSpeed, recorded process-group call): the
    device is bound and the adaptor applied before the hccl group is created."""
    from rltrain.megatron import parallel

    without_megatron(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(
        torch.distributed, "init_process_group",
        lambda backend, **kw: mindspeed.calls.append(("init_process_group", backend, len(mindspeed.adaptations))),
    )  # fmt: skip
    parallel.init_distributed("npu", rank=0, world_size=1, master_addr="127.0.0.1", master_port=1)
    assert [c for c in mindspeed.calls if c[0] in ("set_device", "init_process_group")] == [
        ("set_device", 3), ("init_process_group", "hccl", 1),
    ]  # fmt: skip


def test_init_distributed_on_cuda_imports_nothing_of_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch_npu and MindSpeed unimportable, CUDA calls recorded: the cuda path never reaches rltrain.npu."""
    from rltrain.megatron import parallel

    for name in ("torch_npu", "mindspeed", "mindspeed.megatron_adaptor"):
        monkeypatch.setitem(sys.modules, name, None)  # importing any of them would raise
    bound: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # stop before the NCCL group
    parallel.init_distributed("cuda")
    assert bound == [0]


# ============================================================================================ summary
def test_summary_tables_wall_time_per_role_and_rank(tmp_path: Path) -> None:
    plan = make_plan(
        tmp_path, *TWO_RANKS, "profile.tool=torch", "profile.steps=[1, 2]", "profile.all_ranks=true",
        "profile.roles=[generate_sequences, actor_update]", preset="tiny-ppo",
    )  # fmt: skip
    for rank in (0, 1):
        engine = Engine(Profiler(plan, worker="actor", rank=rank, device="cpu"))
        for step in (1, 2):
            engine.profiler.set_step(step)
            with engine.profiler.profiled("generate_sequences"):
                time.sleep(0.06 if step == 1 else 0.0)  # generate is slowest at step 1 ...
            with engine.profiler.profiled("actor_update"):
                time.sleep(0.0 if step == 1 else 0.06)  # ... update at step 2
            if step == 2 and rank == 1:
                with pytest.raises(ValueError):
                    engine.update(fail=True)  # a second update call, failing
        engine.profiler.close()

    md = write_summary(plan.save_path)
    assert md == Path(plan.save_path) / "profile_summary.md"
    text = md.read_text()
    step1, step2 = text.split("## Step 1")[1].split("## Step 2")
    assert "| role | rank 0 | rank 1 | max |" in step1
    assert "| **generate_sequences** (slowest) |" in step1 and "| actor_update |" in step1
    assert "| **actor_update** (slowest) |" in step2 and "(2 calls) error" in step2

    data = json.loads((Path(plan.save_path) / "summary.json").read_text())
    steps = {s["step"]: s for s in data["steps"]}
    assert steps[1]["slowest_role"] == "generate_sequences" and steps[2]["slowest_role"] == "actor_update"
    assert steps[1]["roles"]["generate_sequences"]["0"]["wall_s"] >= 0.06
    assert steps[2]["roles"]["actor_update"]["1"]["calls"] == 2
    assert steps[2]["roles"]["actor_update"]["1"]["status"] == "error"
    assert len(data["records"]) == 9  # 2 roles x 2 ranks x 2 steps, plus the failed second call


def test_summary_of_continuous_profiles_and_of_nothing(tmp_path: Path) -> None:
    plan = make_plan(tmp_path, "profile.tool=torch", "profile.discrete=false", "profile.steps=[2]")
    prof = Profiler(plan, worker="actor", rank=0, device="cpu")
    prof.set_step(2)
    with prof.profiled("generate_sequences"):
        time.sleep(0.03)
    with prof.profiled("actor_update"):
        work()
    prof.close()
    text = write_summary(plan.save_path).read_text()
    assert "| **generate_sequences** (slowest) |" in text and "| e2e |" in text
    assert "No profile was recorded." in write_summary(tmp_path / "empty").read_text()


def test_a_role_called_inside_another_is_a_range_of_the_outer_trace(tmp_path: Path) -> None:
    # One torch profiler per process: a nested profiled call cannot have its own trace, so it is a named
    # range in the outer call's trace and a `nested` entry of its meta.json.
    plan = make_plan(tmp_path, "profile.tool=torch", "profile.steps=[1]")
    prof = Profiler(plan, worker="actor", rank=0, device="cpu")
    prof.set_step(1)
    with prof.profiled("actor_update"), prof.profiled("actor_compute_log_prob"):
        work()
    outer = f"{plan.save_path}/step_1/actor_update/rank_0"
    assert written(plan.save_path) == {outer}
    assert [c["role"] for c in meta(outer)["nested"]] == ["actor_compute_log_prob"]
    assert {"actor_update", "actor_compute_log_prob"} <= trace_names(outer)
