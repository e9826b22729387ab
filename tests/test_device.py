"""The device layer (rltrain/device.py): one module answers "which hardware", for cpu, cuda and npu.

No NPU, CANN, torch_npu or MindSpeed exists on the project's machines (and an installed torch_npu breaks
`import torch` there), and no GPU either. The cpu case runs for real (here and in every other test). The npu
branches run against STAND-INS: a `torch_npu` module put in `sys.modules` (or on `sys.path` for a
subprocess) whose `npu` device module records every call, and a `mindspeed` package whose
`megatron_adaptor` records when it is imported and what `repatch` receives. The cuda branches run against
a recording `torch.cuda` where they would touch a GPU. Each test's docstring says which of these it uses.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rlconf.config import MegatronConfig, OverrideTransformerConfig
from rlconf.errors import ConfigError
from rltrain import device as devices
from rltrain import npu

ROOT = Path(__file__).resolve().parent.parent
# megatron-core (imported by the checkpoint test) warns about missing apex / Transformer Engine.
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

# Modules under rltrain/ allowed to name `torch.cuda`: the device layer itself and its cpu case.
DEVICE_LAYER = {"rltrain/device.py", "rltrain/megatron/cpu_compat.py"}


# ============================================================================================ grep test
def torch_cuda_uses(source: str) -> list[int]:
    """Lines that use `torch.cuda` in code (comments and strings do not count): `torch.cuda...`,
    `import torch.cuda`, `from torch.cuda import ...`, `from torch import cuda`, `getattr(torch, "cuda")`."""
    lines = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "cuda":
            hit = isinstance(node.value, ast.Name) and node.value.id == "torch"
        elif isinstance(node, ast.Import):
            hit = any(a.name == "torch.cuda" or a.name.startswith("torch.cuda.") for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            hit = module == "torch.cuda" or module.startswith("torch.cuda.")
            hit |= module == "torch" and any(a.name == "cuda" for a in node.names)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
            args = node.args
            hit = (
                len(args) >= 2
                and isinstance(args[0], ast.Name)
                and args[0].id == "torch"
                and isinstance(args[1], ast.Constant)
                and args[1].value == "cuda"
            )
        else:
            continue
        if hit:
            lines.add(node.lineno)
    return sorted(lines)


def test_the_grep_finds_every_spelling() -> None:
    src = textwrap.dedent(
        """\
        import torch.cuda
        from torch.cuda import synchronize
        from torch import cuda, nn
        x = torch.cuda.current_device()
        # torch.cuda in a comment
        s = "torch.cuda in a string"
        y = torch.cudart  # another name
        m = getattr(torch, "cuda")
        n = other.torch.cuda
        """
    )
    assert torch_cuda_uses(src) == [1, 2, 3, 4, 8]


def test_no_module_outside_the_device_layer_calls_torch_cuda() -> None:
    """Every .py file under rltrain/ is tokenized; only the device layer (and the listed GPU-performance
    files awaiting conversion) may name torch.cuda."""
    offenders = {}
    for path in sorted((ROOT / "rltrain").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in DEVICE_LAYER:
            continue
        if lines := torch_cuda_uses(path.read_text()):
            offenders[rel] = lines
    assert not offenders, f"use rltrain.device instead of torch.cuda in: {offenders}"


def test_the_allow_lists_name_existing_files() -> None:
    for rel in DEVICE_LAYER:
        assert (ROOT / rel).is_file(), rel


# ============================================================================================ the kinds
@pytest.mark.parametrize(
    ("device", "backend", "mixed", "resource", "visible"),
    [
        ("cpu", "gloo", "gloo", None, None),
        ("cuda", "nccl", "cpu:gloo,cuda:nccl", "GPU", "CUDA_VISIBLE_DEVICES"),
        ("npu", "hccl", "cpu:gloo,npu:hccl", "NPU", "ASCEND_RT_VISIBLE_DEVICES"),
    ],
)
def test_device_kinds(
    device: str, backend: str, mixed: str, resource: str | None, visible: str | None
) -> None:
    """Pure facts: no device module is touched (this runs on the CPU-only machine for all three)."""
    assert devices.dist_backend(device) == backend
    assert devices.cpu_and_device_backend(device) == mixed
    assert devices.ray_resource(device) == resource
    assert devices.visible_devices_env(device) == visible
    assert devices.is_accelerator(device) is (device != "cpu")


def test_unknown_device_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        devices.dist_backend("tpu")


def test_every_config_device_has_a_kind() -> None:
    from typing import get_args

    from rlconf.config import Device

    assert set(get_args(Device)) == set(devices.KINDS)


def test_cpu_device_calls_are_host_answers() -> None:
    """The cpu case for real: the host device, nothing to synchronize, no device memory, RNG or streams."""
    assert devices.torch_device("cpu") == torch.device("cpu")
    assert devices.accelerator_module("cpu") is None
    assert devices.is_available("cpu") and devices.device_count("cpu") == 0
    devices.synchronize("cpu")
    devices.empty_cache("cpu")
    devices.reset_peak_memory_stats("cpu")
    assert devices.memory_allocated("cpu") == devices.max_memory_allocated("cpu") == 0
    assert devices.memory_stats("cpu") == {}
    assert devices.get_rng_state("cpu") is None
    state = torch.get_rng_state()
    devices.manual_seed("cpu", 3)  # the default generator is not the device layer's: untouched
    devices.set_rng_state("cpu", torch.zeros(1))
    assert torch.equal(torch.get_rng_state(), state)
    assert devices.new_stream("cpu") is None and devices.new_event("cpu") is None
    assert devices.multiprocessor_count("cpu") is None
    with devices.stream_context("cpu", None):
        pass


def test_worker_env_turns_backend_autoload_off_except_on_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert devices.worker_env("cpu") == devices.worker_env("cuda") == {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    assert devices.worker_env("npu") == {}
    monkeypatch.delenv("TORCH_DEVICE_BACKEND_AUTOLOAD", raising=False)
    devices.configure_process_env("cuda")
    assert os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "0"
    monkeypatch.setenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")
    devices.configure_process_env("cpu")
    assert os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "1", "a value the user set is kept"


def test_ray_options_per_device() -> None:
    from rltrain.ray_group import accelerator_options

    assert accelerator_options("cpu", 0.5) == {}
    assert accelerator_options("cuda", 0.5) == {"num_gpus": 0.5}  # Ray refuses "GPU" among resources
    assert accelerator_options("npu", 0.5) == {"resources": {"NPU": 0.5}}


# ============================================================================================ cuda (recorded)
class RecordingCuda(types.SimpleNamespace):
    """A stand-in for torch.cuda's device calls (no GPU here): records set_device / synchronize."""

    def __init__(self, count: int = 2) -> None:
        super().__init__(calls=[])
        self.count = count

    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        return self.count

    def set_device(self, index: int) -> None:
        self.calls.append(("set_device", index))

    def synchronize(self) -> None:
        self.calls.append(("synchronize",))


def test_cuda_prepare_binds_local_rank_modulo_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    """Recording stand-in for torch.cuda behind `accelerator_module("cuda")`."""
    cuda = RecordingCuda(count=2)
    monkeypatch.setattr(devices, "accelerator_module", lambda d: cuda if d == "cuda" else None)
    devices.prepare_process("cuda", local_rank=3)
    devices.synchronize("cuda")
    assert cuda.calls == [("set_device", 1), ("synchronize",)]
    cuda.count = 0
    with pytest.raises(RuntimeError, match="sees no CUDA device"):
        devices.prepare_process("cuda", local_rank=0)


def test_cuda_check_without_a_gpu_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """`is_available` forced False (as on this machine): exit-2 error naming cluster.device and the fix."""
    monkeypatch.setattr(devices, "is_available", lambda d: d == "cpu")
    with pytest.raises(ConfigError) as info:
        devices.check_available("cuda")
    assert info.value.path == "cluster.device"
    text = info.value.format()
    assert "no usable CUDA device" in text and "cluster.device: cpu" in text


# ============================================================================================ npu (stand-ins)
class StandInTorchNpu(types.ModuleType):
    """STAND-IN for torch_npu (none is installed here): `npu` is a device module whose calls are recorded
    in `calls`, in order; `devices` NPUs are visible."""

    def __init__(self, visible: int = 8) -> None:
        super().__init__("torch_npu")
        self.calls: list[tuple[Any, ...]] = []
        self.repatched: list[dict[str, Any]] = []
        self.adaptor_saw_megatron: list[bool] = []
        rec = self._rec
        self.npu = types.SimpleNamespace(
            is_available=lambda: visible > 0,
            device_count=lambda: visible,
            current_device=lambda: rec("current_device") or 0,
            set_device=lambda i: rec("set_device", i),
            synchronize=lambda: rec("synchronize"),
            memory_allocated=lambda: rec("memory_allocated") or 5,
            max_memory_allocated=lambda: rec("max_memory_allocated") or 7,
            reset_peak_memory_stats=lambda: rec("reset_peak_memory_stats"),
            memory_stats=lambda: rec("memory_stats") or {"allocated_bytes.all.current": 5},
            empty_cache=lambda: rec("empty_cache"),
            get_rng_state=lambda: rec("get_rng_state") or torch.tensor([1, 2], dtype=torch.uint8),
            set_rng_state=lambda s: rec("set_rng_state", s.tolist()),
            manual_seed=lambda s: rec("manual_seed", s),
            Stream=lambda: rec("Stream") or "stream1",
            current_stream=lambda: "stream0",
            Event=lambda enable_timing=False: rec("Event", enable_timing) or "event",
            stream=lambda s: rec("stream", s) or __import__("contextlib").nullcontext(),
        )

    def _rec(self, *call: Any) -> None:
        self.calls.append(call)


@pytest.fixture()
def torch_npu(monkeypatch: pytest.MonkeyPatch) -> StandInTorchNpu:
    fake = StandInTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return fake


ADAPTOR_SOURCE = """\
import sys
import torch_npu

# Like the real adaptor: it does its work when imported (and, in recent releases, offers repatch).
torch_npu.adaptor_saw_megatron.append(any(n.startswith("megatron.core") for n in sys.modules))
torch_npu.calls.append(("mindspeed.megatron_adaptor", list(sys.argv)))
{repatch}
"""
REPATCH_SOURCE = """
def repatch(config):
    torch_npu.repatched.append(dict(config))
"""


def write_mindspeed(site: Path, repatch: bool = True) -> Path:
    """A STAND-IN `mindspeed` package (the PyPI one is a placeholder; the real one is not installed)."""
    pkg = site / "mindspeed"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "megatron_adaptor.py").write_text(ADAPTOR_SOURCE.format(repatch=REPATCH_SOURCE if repatch else ""))
    return site


@pytest.fixture()
def mindspeed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, torch_npu: StandInTorchNpu
) -> Iterator[StandInTorchNpu]:
    monkeypatch.syspath_prepend(str(write_mindspeed(tmp_path / "site")))
    monkeypatch.setattr(npu, "_adapted", False)
    yield torch_npu
    for name in ("mindspeed.megatron_adaptor", "mindspeed"):
        sys.modules.pop(name, None)


def test_npu_device_calls_go_to_torch_npu(torch_npu: StandInTorchNpu) -> None:
    """Stand-in torch_npu: every device call of the layer lands on `torch_npu.npu`."""
    assert devices.accelerator_module("npu") is torch_npu.npu
    devices.set_device("npu", 2)
    devices.synchronize("npu")
    assert devices.memory_allocated("npu") == 5 and devices.max_memory_allocated("npu") == 7
    devices.reset_peak_memory_stats("npu")
    devices.empty_cache("npu")
    assert devices.get_rng_state("npu").tolist() == [1, 2]
    devices.set_rng_state("npu", torch.tensor([3], dtype=torch.uint8))
    devices.manual_seed("npu", 11)
    assert devices.new_stream("npu") == "stream1" and devices.current_stream("npu") == "stream0"
    assert devices.new_event("npu", enable_timing=True) == "event"
    with devices.stream_context("npu", "stream1"):
        pass
    assert devices.device_count("npu") == 8 and devices.current_index("npu") == 0
    assert torch_npu.calls == [
        ("set_device", 2), ("synchronize",), ("memory_allocated",), ("max_memory_allocated",),
        ("reset_peak_memory_stats",), ("empty_cache",), ("get_rng_state",), ("set_rng_state", [3]),
        ("manual_seed", 11), ("Stream",), ("Event", True), ("stream", "stream1"), ("current_device",),
    ]  # fmt: skip


def test_npu_prepare_binds_then_applies_mindspeed_with_the_role_options(
    mindspeed: StandInTorchNpu, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stand-in torch_npu and MindSpeed (with repatch): NPU bound, adaptor imported with the worker's argv
    hidden, the role's override_transformer_config handed to repatch; a second call changes nothing."""
    monkeypatch.setattr(sys, "argv", ["default_worker.py", "--node-ip-address=10.0.0.1"])
    cfg = MegatronConfig(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        override_transformer_config=OverrideTransformerConfig(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        ),
    )
    engine = _engine_plan(cfg, world_size=2)
    devices.prepare_process("npu", local_rank=9, engine=engine)
    devices.prepare_process("npu", local_rank=9, engine=engine)
    assert [c for c in mindspeed.calls if c[0] != "set_device"] == [
        ("mindspeed.megatron_adaptor", ["default_worker.py"])
    ]
    assert [c for c in mindspeed.calls if c[0] == "set_device"] == [("set_device", 1)] * 2  # 9 % 8
    assert mindspeed.repatched == [
        {
            "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1,
            "attention_dropout": 0.0, "hidden_dropout": 0.0,
            "sequence_parallel": True, "use_distributed_optimizer": True,
        }
    ]  # fmt: skip
    assert sys.argv == ["default_worker.py", "--node-ip-address=10.0.0.1"]


def test_mindspeed_options_keep_recompute_modules_only_for_selective() -> None:
    sel = MegatronConfig(
        override_transformer_config=OverrideTransformerConfig(recompute_granularity="selective")
    )
    assert npu.mindspeed_options(_engine_plan(sel))["recompute_modules"] == ["core_attn"]
    assert "recompute_modules" not in npu.mindspeed_options(_engine_plan(MegatronConfig()))
    # No recompute: left to MindSpeed.
    assert "recompute_granularity" not in npu.mindspeed_options(_engine_plan(MegatronConfig()))


def _engine_plan(megatron: MegatronConfig, world_size: int = 1):
    """The actor's engine plan of a small plan with this megatron section (what a worker hands MindSpeed)."""
    from rlconf.config import ModelConfig
    from rlconf.plan import small_plan

    return small_plan(ModelConfig(), "cpu", world_size=world_size, megatron=megatron).engine("actor")


def test_mindspeed_without_repatch_warns_that_options_are_not_passed(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    torch_npu: StandInTorchNpu,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Stand-in of an older MindSpeed (adaptor without repatch): imported, and a warning names the options."""
    monkeypatch.syspath_prepend(str(write_mindspeed(tmp_path / "old", repatch=False)))
    monkeypatch.setattr(npu, "_adapted", False)
    try:
        npu.apply_mindspeed({"sequence_parallel": True})
    finally:
        for name in ("mindspeed.megatron_adaptor", "mindspeed"):
            sys.modules.pop(name, None)
    assert torch_npu.repatched == [] and "no megatron_adaptor.repatch" in caplog.text


def test_init_distributed_uses_hccl_after_binding_and_mindspeed(
    mindspeed: StandInTorchNpu, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stand-in torch_npu / MindSpeed and a recorded init_process_group: the hccl backend, chosen by the
    device layer, after the NPU is bound and MindSpeed applied."""
    from rltrain.megatron import parallel

    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(
        torch.distributed,
        "init_process_group",
        lambda backend, **kw: mindspeed.calls.append(("init", backend)),
    )
    parallel.init_distributed("npu", rank=0, world_size=1, master_addr="127.0.0.1", master_port=1)
    assert [c[0] for c in mindspeed.calls] == ["set_device", "mindspeed.megatron_adaptor", "init"]
    assert mindspeed.calls[-1] == ("init", "hccl")


def test_missing_torch_npu_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch_npu made unimportable (None in sys.modules), as on this machine without the stand-in."""
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(npu.NpuUnavailableError) as info:
        devices.prepare_process("npu", local_rank=0)
    text = str(info.value)
    assert text.startswith("cluster.device = npu needs torch_npu with Ascend CANN")
    assert "pip install -e '.[npu]'" in text and "gitcode.com/Ascend/MindSpeed" in text
    assert text.endswith("see docs/hardware.md")
    with pytest.raises(ConfigError) as cfg_info:
        devices.check_available("npu")
    assert cfg_info.value.path == "cluster.device" and "docs/hardware.md" in cfg_info.value.format()


def test_npu_check_needs_an_npu_and_the_real_mindspeed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Stand-in torch_npu: with no NPU visible, then with NPUs but no MindSpeed adaptor (the PyPI
    placeholder has none: a stand-in `mindspeed` package without `megatron_adaptor`), then complete."""
    monkeypatch.setitem(sys.modules, "torch_npu", StandInTorchNpu(visible=0))
    with pytest.raises(ConfigError, match="sees no NPU"):
        devices.check_available("npu")
    monkeypatch.setitem(sys.modules, "torch_npu", StandInTorchNpu())
    placeholder = tmp_path / "placeholder" / "mindspeed"
    placeholder.mkdir(parents=True)
    (placeholder / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(placeholder.parent))
    monkeypatch.delitem(sys.modules, "mindspeed", raising=False)
    try:
        with pytest.raises(ConfigError, match="placeholder"):
            devices.check_available("npu")
        (placeholder / "megatron_adaptor.py").write_text(
            "raise RuntimeError('must not be imported by the check')\n"
        )
        devices.check_available("npu")  # found, not imported
        assert "mindspeed.megatron_adaptor" not in sys.modules
    finally:
        sys.modules.pop("mindspeed", None)


def test_checkpoint_rng_state_keeps_the_npu_generator(torch_npu: StandInTorchNpu) -> None:
    """Stand-in torch_npu: the checkpoint's RNG record holds the NPU generator under "npu" and restores it."""
    from rltrain.checkpoint.engine_state import rng_state as _rng_state
    from rltrain.checkpoint.engine_state import set_rng_state as _set_rng_state

    engine = types.SimpleNamespace(device="npu")
    state = _rng_state(engine)  # type: ignore[arg-type]
    assert state["npu"].tolist() == [1, 2] and "cuda" not in state
    _set_rng_state(engine, state)  # type: ignore[arg-type]
    assert ("set_rng_state", [1, 2]) in torch_npu.calls


# ------------------------------------------------------------------ import order in a fresh worker process
STANDIN_TORCH_NPU = """\
import types

calls = []
repatched = []
adaptor_saw_megatron = []
npu = types.SimpleNamespace(
    is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0,
    set_device=lambda i: calls.append(("set_device", i)), synchronize=lambda: None,
)
"""

ORDER_SCRIPT = """\
import importlib.abc, json, sys

order = []

class Recorder(importlib.abc.MetaPathFinder):
    # Notes the first import of each watched module; the normal finders then load it.
    def find_spec(self, name, path=None, target=None):
        if name in ("torch_npu", "mindspeed.megatron_adaptor", "megatron.core"):
            order.append(name)
        return None

sys.meta_path.insert(0, Recorder())
from presets import PRESETS
from rlconf.load import load_config
from rlconf.plan import compile_plan
from rltrain.workers import PolicyWorker

cfg = load_config(None, preset="tiny-grpo", presets=PRESETS, overrides=[
    "cluster.device=npu", "trainer.output_dir=OUT",
    "actor.megatron.override_transformer_config.recompute_granularity=full",
    "actor.megatron.override_transformer_config.recompute_method=uniform",
    "actor.megatron.override_transformer_config.recompute_num_layers=1",
])
worker = PolicyWorker(role="actor", rank=0, world_size=1, master_addr="127.0.0.1", master_port=1,
                      plan=compile_plan(cfg))
import rltrain.megatron.actor  # what the worker's init_model imports first: megatron-core
import torch_npu
print(json.dumps({"order": order, "saw_megatron": torch_npu.adaptor_saw_megatron,
                  "repatched": torch_npu.repatched, "calls": [list(c) for c in torch_npu.calls]}))
"""


def test_worker_applies_mindspeed_before_megatron_is_imported(tmp_path: Path) -> None:
    """A fresh process (as a Ray worker is) with a STAND-IN torch_npu module and a STAND-IN mindspeed
    package on sys.path, and the real megatron-core: constructing the policy worker of a `cluster.device:
    npu` plan imports torch_npu, then MindSpeed's adaptor (which sees no megatron.core yet and receives the
    actor's recompute options), and megatron.core only afterwards, when the engine module loads."""
    site = write_mindspeed(tmp_path / "site")
    (site / "torch_npu.py").write_text(STANDIN_TORCH_NPU)
    script = ORDER_SCRIPT.replace("OUT", str(tmp_path / "out"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got["order"] == ["torch_npu", "mindspeed.megatron_adaptor", "megatron.core"]
    assert got["saw_megatron"] == [False]
    assert got["repatched"][0]["recompute_granularity"] == "full"
    assert got["calls"][0] == ["set_device", 0]
