"""The device layer: the one place in rltrain that knows which hardware a run uses (`cluster.device`).

Everything else asks this module, by the `cluster.device` string (cpu | cuda | npu), instead of calling
`torch.cuda.*` or comparing device names; tests/test_device.py fails when a module under rltrain/ calls
`torch.cuda` directly. What it answers:

- facts of the kind (`kind(device)`): the torch.distributed backend (gloo / nccl / hccl), the mixed
  `cpu:gloo,<dev>:<backend>` backend for process groups that also run CPU-side collectives, the Ray resource
  a worker reserves (`GPU` / `NPU`, none on cpu), the variable through which Ray hands a worker its devices
  (`CUDA_VISIBLE_DEVICES` / `ASCEND_RT_VISIBLE_DEVICES`), and whether it is an accelerator at all;
- device calls: the torch device of this process, set_device / device_count / synchronize, memory stats,
  the accelerator RNG state, streams and events. On cpu they are no-ops or answer with the host (there is
  nothing to synchronize, no device memory, no device RNG beyond torch's default generator);
- process set-up (`prepare_process`): cpu enables the megatron CPU compatibility layer
  (rltrain/megatron/cpu_compat.py, this layer's cpu case: megatron-core assumes CUDA in a few places);
  cuda binds the process to its GPU; npu loads torch_npu, binds the NPU and applies MindSpeed's megatron
  adaptor before megatron-core is imported (rltrain/npu.py). `device_context` is the per-thread part of
  the cpu case, entered around calls into megatron;
- environment: `TORCH_DEVICE_BACKEND_AUTOLOAD=0` for every process of a cpu or cuda run (an installed
  torch_npu otherwise loads with `import torch` and, without Ascend CANN, breaks it), and
  `check_available` before Ray starts, so that a run on hardware this machine lacks stops with exit code 2
  and what to install instead of a traceback or a placement group that never fills.

Imports stay light: torch is imported inside the functions (the `rltrain` CLI sets the environment before
torch loads), torch_npu only on npu and only through rltrain/npu.py.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

AUTOLOAD_ENV = "TORCH_DEVICE_BACKEND_AUTOLOAD"


@dataclass(frozen=True)
class DeviceKind:
    """What a `cluster.device` value means for the processes of a run."""

    name: str
    """cpu | cuda | npu: also torch's device type."""
    dist_backend: str
    """torch.distributed backend of the run's process groups."""
    ray_resource: str | None
    """Ray resource each worker reserves one of (fractions when roles share a device); None: CPUs only."""
    visible_devices_env: str | None
    """Variable through which Ray gives each worker its own devices (the worker then uses index 0)."""

    @property
    def is_accelerator(self) -> bool:
        return self.name != "cpu"


KINDS: dict[str, DeviceKind] = {
    "cpu": DeviceKind("cpu", "gloo", None, None),
    "cuda": DeviceKind("cuda", "nccl", "GPU", "CUDA_VISIBLE_DEVICES"),
    "npu": DeviceKind("npu", "hccl", "NPU", "ASCEND_RT_VISIBLE_DEVICES"),
}


def kind(device: str) -> DeviceKind:
    """The `DeviceKind` of a `cluster.device` value; ValueError for anything else."""
    try:
        return KINDS[device]
    except KeyError:
        raise ValueError(f"unknown device {device!r}; expected one of {', '.join(KINDS)}") from None


def dist_backend(device: str) -> str:
    """torch.distributed backend: gloo on cpu, nccl on cuda, hccl on npu."""
    return kind(device).dist_backend


def cpu_and_device_backend(device: str) -> str:
    """Backend string of a process group that serves both CPU tensors (gloo) and device tensors, e.g.
    `cpu:gloo,cuda:nccl` (torch dispatches each collective by the tensors' device); plain gloo on cpu."""
    k = kind(device)
    return k.dist_backend if not k.is_accelerator else f"cpu:gloo,{k.name}:{k.dist_backend}"


def ray_resource(device: str) -> str | None:
    """The Ray resource a worker of this device reserves: GPU, NPU, or None on cpu."""
    return kind(device).ray_resource


def visible_devices_env(device: str) -> str | None:
    """CUDA_VISIBLE_DEVICES on cuda, ASCEND_RT_VISIBLE_DEVICES on npu, None on cpu."""
    return kind(device).visible_devices_env


def is_accelerator(device: str) -> bool:
    """True on cuda and npu: tensors live in device memory and device work runs asynchronously."""
    return kind(device).is_accelerator


# ============================================================================================ device calls
def accelerator_module(device: str) -> Any:
    """The torch device module of an accelerator (`torch.cuda`, `torch_npu.npu`), None on cpu.

    Both modules have the same API (set_device, synchronize, memory_allocated, get_rng_state, Stream, ...);
    every device call below goes through this one lookup. Getting `torch.cuda` does not initialise CUDA.
    """
    if kind(device).name == "cuda":
        import torch

        return torch.cuda
    if device == "npu":
        from rltrain.npu import load_torch_npu

        return load_torch_npu().npu
    return None


def is_available(device: str) -> bool:
    """Whether this process sees at least one device of the kind (always True on cpu)."""
    mod = accelerator_module(device)
    return True if mod is None else bool(mod.is_available())


def device_count(device: str) -> int:
    """Devices of the kind visible to this process; 0 on cpu (the host is not counted)."""
    mod = accelerator_module(device)
    return 0 if mod is None else int(mod.device_count())


def current_index(device: str) -> int | None:
    """Index of this process's current device; None on cpu."""
    mod = accelerator_module(device)
    return None if mod is None else int(mod.current_device())


def torch_device(device: str, index: int | None = None) -> torch.device:
    """The torch.device tensors of this process live on: `cpu`, or `cuda:I` / `npu:I` with I the given
    index or, by default, the process's current device."""
    import torch

    if not is_accelerator(device):
        return torch.device("cpu")
    return torch.device(device, current_index(device) if index is None else index)


def from_host(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without making the host wait: on CUDA pinned and copied asynchronously (a
    copy from pageable memory first waits for everything queued on the stream, so one per micro-batch
    tensor stalled the host at each mini-batch); elsewhere `tensor.to(device)`."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def set_device(device: str, index: int) -> None:
    """Make device `index` current in this process (before NCCL / HCCL create communicators on it)."""
    mod = accelerator_module(device)
    if mod is not None:
        mod.set_device(index)


def synchronize(device: str) -> None:
    """Wait for the device work queued by this process (CPU work is synchronous: a no-op there)."""
    mod = accelerator_module(device)
    if mod is not None:
        mod.synchronize()


def memory_allocated(device: str) -> int:
    """Bytes of device memory held by tensors of this process (0 on cpu)."""
    mod = accelerator_module(device)
    return 0 if mod is None else int(mod.memory_allocated())


def max_memory_allocated(device: str) -> int:
    """Peak of `memory_allocated` since the process started or `reset_peak_memory_stats` (0 on cpu)."""
    mod = accelerator_module(device)
    return 0 if mod is None else int(mod.max_memory_allocated())


def reset_peak_memory_stats(device: str) -> None:
    mod = accelerator_module(device)
    if mod is not None:
        mod.reset_peak_memory_stats()


# Dense (no sparsity) 16-bit tensor-core peak of each device model, FLOP/s, from the vendors' data sheets
# (SXM / OAM parts). MFU divides by these; a device not listed gets no MFU rather than a guessed one.
PEAK_BF16_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "H20": 148e12,
    "A100": 312e12,
    "A800": 312e12,
    "B200": 2250e12,
    "L40S": 362e12,
    "Ascend910B": 313e12,
}


def device_name(device: str) -> str | None:
    """The model name of this process's device (`NVIDIA H200`, ...); None on cpu."""
    mod = accelerator_module(device)
    if mod is None:
        return None
    name = mod.get_device_name() if device == "cuda" else mod.get_device_name(mod.current_device())
    return str(name)


@functools.cache
def multiprocessor_count(device: str) -> int | None:
    """Streaming multiprocessors of this process's device (what a kernel's grid fills); None on cpu and
    where the device module does not report them."""
    mod = accelerator_module(device)
    if mod is None:
        return None
    count = getattr(mod.get_device_properties(mod.current_device()), "multi_processor_count", None)
    return None if count is None else int(count)


def peak_flops(device: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of this process's device for matmuls in `dtype` (model.params_dtype), or None: on
    cpu, for float32 (the peak depends on TF32 settings) and for a device model not in PEAK_BF16_FLOPS."""
    if dtype not in ("bfloat16", "float16"):
        return None
    name = device_name(device)
    if name is None:
        return None
    compact = name.replace(" ", "")
    # Longest key first: "H200" must not be read as "H20".
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in compact:
            return PEAK_BF16_FLOPS[key]
    return None


def memory_stats(device: str) -> dict[str, Any]:
    """The caching allocator's statistics (empty on cpu)."""
    mod = accelerator_module(device)
    return {} if mod is None else dict(mod.memory_stats())


def empty_cache(device: str) -> None:
    """Return cached free blocks to the device, so other processes (a colocated role) can use them."""
    mod = accelerator_module(device)
    if mod is not None:
        mod.empty_cache()


def get_rng_state(device: str) -> torch.Tensor | None:
    """The current device's RNG state; None on cpu, where torch.get_rng_state() is the only state."""
    mod = accelerator_module(device)
    return None if mod is None else mod.get_rng_state()


def set_rng_state(device: str, state: torch.Tensor) -> None:
    mod = accelerator_module(device)
    if mod is not None:
        mod.set_rng_state(state)


def manual_seed(device: str, seed: int) -> None:
    """Seed the current device's generator (the default generator is torch.manual_seed's business)."""
    mod = accelerator_module(device)
    if mod is not None:
        mod.manual_seed(int(seed))


def new_stream(device: str) -> Any:
    """A new stream on the current device; None on cpu (work there runs in program order)."""
    mod = accelerator_module(device)
    return None if mod is None else mod.Stream()


def current_stream(device: str) -> Any:
    mod = accelerator_module(device)
    return None if mod is None else mod.current_stream()


def new_event(device: str, enable_timing: bool = False) -> Any:
    """A new event (record / wait / elapsed_time) on the current device; None on cpu."""
    mod = accelerator_module(device)
    return None if mod is None else mod.Event(enable_timing=enable_timing)


def stream_context(device: str, stream: Any) -> contextlib.AbstractContextManager[Any]:
    """Queue work onto `stream` inside the block (a null context on cpu or for stream None)."""
    mod = accelerator_module(device)
    return contextlib.nullcontext() if mod is None or stream is None else mod.stream(stream)


def graphs_supported(device: str) -> bool:
    """Whether work can be captured in device graphs and replayed (CUDA graphs); cpu and npu: no (NPU
    graphs exist in torch_npu but were never run here, so nothing captures there)."""
    return device == "cuda"


def graph_pool(device: str) -> Any:
    """A memory pool handle for graphs that share memory (they must not run at the same time)."""
    import torch

    return torch.cuda.graph_pool_handle() if graphs_supported(device) else None


def capture_graph(
    device: str, fn: Callable[[], Any], pool: Any = None, warm_up: bool = True
) -> tuple[Any, Any]:
    """Capture `fn` as a device graph: (graph with `.replay()`, fn's outputs, which each replay rewrites).

    `fn` runs once on the capture stream first (the warm-up torch.cuda.graph asks for: lazy initialisation,
    compilation and allocator state happen outside the capture), so it must be safe to run twice with the
    same inputs. A capture that fails leaves torch's allocator recording into the pool and its RNG in capture
    mode (measured on the H200: every later capture and random draw of the process then fails), so nothing
    may be left to chance inside one: `warm_up=False` is only for a call whose shapes and code path a capture
    with its warm-up has already met in this process (the caller keeps that record: `inference.CAPTURED`),
    where the warm-up would only repeat the Python of a step (30-40 ms of a 1.5B decode step on the H200).
    """
    import torch

    if warm_up:
        side = _capture_stream(torch.cuda.current_device())
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
    return _capture(torch, fn, pool)


def _capture(torch: Any, fn: Callable[[], Any], pool: Any) -> tuple[Any, Any]:
    """`fn` captured on this process's capture stream. Not `torch.cuda.graph`: it empties the allocator's
    cache before every capture, so the KV cache a compaction has just freed goes back to the driver and
    the next allocations pay cudaMalloc again."""
    graph = torch.cuda.CUDAGraph()
    stream = _capture_stream(torch.cuda.current_device())
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin(*(() if pool is None else (pool,)))
        try:
            out = fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, out


@functools.cache
def _capture_stream(device_index: int) -> Any:
    """One side stream per device for every capture and warm-up on it, so their allocations come from one
    stream's cached blocks."""
    import torch

    return torch.cuda.Stream(device=device_index)


# ============================================================================================ processes
def worker_env(device: str) -> dict[str, str]:
    """Environment variables every worker process of a run gets before it imports torch.

    Off npu: `TORCH_DEVICE_BACKEND_AUTOLOAD=0`. torch imports every installed device backend (torch_npu
    among them) inside `import torch`; an installed torch_npu without Ascend CANN makes that import fail
    (DESIGN.md, measured). rltrain never needs autoload: torch_npu is imported explicitly on npu runs.
    """
    return {} if device == "npu" else {AUTOLOAD_ENV: "0"}


def configure_process_env(device: str) -> None:
    """Apply `worker_env(device)` to this process, leaving values the user set alone. Call it before
    torch is imported (the rltrain CLI does); Ray's local cluster passes the variables on to its workers."""
    for name, value in worker_env(device).items():
        os.environ.setdefault(name, value)


def prepare_process(device: str, local_rank: int | None = None, engine: Any = None) -> None:
    """Per-process set-up for `device`; idempotent, and cheap after the first call.

    cpu: the megatron CPU compatibility layer (process-wide function redirects).
    cuda: bind the process to GPU `local_rank` (modulo the visible count; Ray gives each worker its own).
    npu: torch_npu, NPU `local_rank`, then MindSpeed's megatron adaptor with the options of `engine`
    (the role's rlconf.plan.EnginePlan; rltrain.npu.mindspeed_options). The adaptor patches megatron-core when
    imported, so the first call must come before the process imports megatron; the worker makes it in its
    constructor.
    """
    k = kind(device)
    if k.name == "cpu":
        from rltrain.megatron import cpu_compat

        cpu_compat.enable_cpu_compat()
    elif k.name == "cuda":
        if local_rank is not None:
            count = device_count(device)
            if count == 0:
                raise RuntimeError(
                    f"cluster.device = cuda, but this process sees no CUDA device "
                    f"({k.visible_devices_env}={os.environ.get(k.visible_devices_env or '', '<unset>')})"
                )
            set_device(device, local_rank % count)
    else:
        from rltrain.npu import mindspeed_options, prepare_npu

        options = mindspeed_options(engine) if engine is not None else None
        prepare_npu(local_rank=local_rank, options=options)


def device_context(device: str) -> contextlib.AbstractContextManager[None]:
    """The context the engine wraps each call into megatron in: on cpu the per-thread rewrite of megatron's
    `device="cuda"` / `.cuda()` requests (rltrain.megatron.cpu_compat), nothing on accelerators."""
    if kind(device).is_accelerator:
        return contextlib.nullcontext()
    from rltrain.megatron import cpu_compat

    cpu_compat.enable_cpu_compat()
    return cpu_compat.cuda_to_cpu()


# ============================================================================================ availability
def check_available(device: str) -> None:
    """Raise ConfigError (path `cluster.device`, exit code 2) when this machine cannot run `device`:
    no CUDA device on cuda; torch_npu / CANN / MindSpeed missing or no NPU on npu. Call it before Ray
    starts a local cluster; a remote cluster's nodes are not this machine and are not checked here."""
    from rlconf.errors import ConfigError, error

    k = kind(device)
    if k.name == "cpu":
        return
    if k.name == "cuda":
        import torch

        if is_available(device):
            return
        build = torch.version.cuda or "none (a CPU-only build)"
        raise ConfigError(
            [
                error(
                    "cluster.device",
                    f"cluster.device = cuda, but this machine has no usable CUDA device (torch "
                    f"{torch.__version__}, CUDA build {build}, "
                    f"{k.visible_devices_env}={os.environ.get(k.visible_devices_env or '', '<unset>')})",
                    "run on a machine with NVIDIA GPUs and a CUDA build of torch (docs/hardware.md), join "
                    "such a Ray cluster with cluster.ray_address, or set cluster.device: cpu",
                    "device-available",
                )
            ]
        )
    from rltrain.npu import NpuUnavailableError, check_npu

    try:
        check_npu()
    except NpuUnavailableError as exc:
        raise ConfigError(
            [
                error(
                    "cluster.device",
                    exc.problem,
                    exc.fix + " (or set cluster.device: cpu)",
                    "device-available",
                )
            ]
        ) from None
