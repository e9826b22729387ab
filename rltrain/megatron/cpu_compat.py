"""The cpu case of the device layer (rltrain/device.py): unmodified megatron-core 0.16.1 on CPU with gloo.

megatron-core assumes CUDA in a handful of places (measured, see DESIGN.md "Measured facts"). On a CPU run
(`cluster.device == "cpu"`) this module redirects exactly those assumptions; on cuda and npu it is never
called and megatron runs untouched. Only rltrain.device uses it (`prepare_process("cpu")` and
`device_context("cpu")`); everything is in this one module so that a megatron upgrade shows, through
tests/megatron/test_cpu_compat.py (one test per redirect), which assumption moved. It lives beside the
engine because what it redirects are megatron's assumptions, not a device's.

Two parts:

* `enable_cpu_compat()` (process-wide, idempotent) replaces functions:
  - `torch.cuda.current_device()` -> `torch.device("cpu")`: megatron passes it as `device=` when it builds
    tensors (layers, rotary embedding, grad buffers, p2p shapes); a device object works everywhere an int
    would, without a mode.
  - `torch.cuda.synchronize()` -> no-op (p2p communication, parallel_state, DDP offload).
  - CUDA RNG state functions used by `megatron.core.tensor_parallel.random` (`torch.cuda.get_rng_state`,
    `torch.cuda.set_rng_state`, `torch.cuda.manual_seed`, and megatron's own `_get_cuda_rng_state` /
    `_set_cuda_rng_state`) -> the CPU default generator, so the model-parallel RNG tracker forks CPU state.
  - CUDA streams of the MoE alltoall token dispatcher (`torch.cuda.Stream()` built once per process for its
    device-to-host copies, `torch.cuda.current_stream()`, `torch.cuda.stream(s)`, `record_event()` and the
    event's `synchronize()`) -> `CpuStream`, whose waits and events are no-ops: CPU ops are synchronous.
  - megatron's pipeline point-to-point messages (`p2p_communication._p2p_ops`, the unbatched path the
    engine uses on gloo, `batch_p2p_comm=False`, and `P2PCommunicator._communicate_shapes`, the shape
    exchange before each send / receive with `variable_seq_lengths`) -> the same messages in `_p2p_ops`'
    even/odd order, where a send does not wait for its receiver: only the receives are waited on, the sends
    complete in the background and are reaped later (and all of them when the schedule returns). Two
    reasons. megatron always batches the shapes, posting (send_prev, recv_prev, send_next, recv_next) on
    both ranks, and gloo matches messages between two ranks in posting order, so at PP = 2 with virtual
    stages (both directions between the same pair) shapes crossed. And megatron's interleaved schedule
    has calls in which one stage sends what its peer receives only in a later call (at CP = 2 x PP = 2 x
    VPP = 2 with two micro-batches: the last stage's first gradient, sent while the first stage is still
    sending its warmup activations); NCCL lets such a send finish, while a gloo send waits for its
    receive, so both stages waited for each other: the hang of context parallel with virtual pipeline
    parallel on CPU.
  - the dispatcher's `maybe_move_tensor_to_cpu` -> also converts CPU tensors when asked for numpy: megatron's
    converts only CUDA tensors, so on a CPU run the alltoall split sizes stayed tensors, which
    `all_to_all_single` refuses (it takes sequences of ints).
* `cuda_to_cpu()` (per thread, re-entrant context manager) enters a `TorchFunctionMode` that rewrites
  what cannot be patched as a function: tensors created with a literal `device="cuda"` (schedules,
  optimizer, clip_grads, local multi-tensor l2 norm), `Tensor.cuda()` / `Tensor.to("cuda")`, and
  `Tensor.type()` answering `torch.cuda.FloatTensor`-style names for CPU tensors (the dtype checks in
  distrib_optimizer, optimizer and clip_grads compare against those strings). Torch function modes are
  thread-local, so the engine enters it around each call into megatron instead of once per process.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_lock = threading.Lock()
_enabled = False
_tls = threading.local()
_CPU = torch.device("cpu")

# Tensor.type() names of CPU tensors -> the CUDA names megatron's optimizer checks compare against.
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
    "torch.BoolTensor": "torch.cuda.BoolTensor",
}


def is_enabled() -> bool:
    """Whether `enable_cpu_compat()` has patched this process."""
    return _enabled


def _is_cuda_device(device: Any) -> bool:
    # An int device means a CUDA ordinal to torch; on a CPU run it can only come from megatron code that
    # assumed CUDA. bool is an int subclass but never a device, so it is excluded.
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


def _current_device() -> torch.device:
    return _CPU


def _synchronize(device: Any = None) -> None:
    # CPU ops are synchronous; megatron calls this around p2p and offload.
    return None


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    # The generator itself, not torch.manual_seed: that one calls torch.cuda.manual_seed_all (left alone).
    torch.default_generator.manual_seed(int(seed))


class CpuEvent:
    """Stand-in for torch.cuda.Event on a CPU run: everything before it has already happened."""

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True


class CpuStream:
    """Stand-in for torch.cuda.Stream on a CPU run (megatron's MoE dispatcher copies its split sizes to the
    host on a side stream). CPU work runs in order on the calling thread, so there is one stream and waiting
    on it is a no-op."""

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        self.device = _CPU

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> CpuEvent:
        return CpuEvent()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CpuStream)

    def __hash__(self) -> int:
        return 0


_CPU_STREAM = CpuStream()


def _current_stream(device: Any = None) -> CpuStream:
    return _CPU_STREAM


def _stream_context(stream: Any = None) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def _move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    # megatron's version skips non-CUDA tensors entirely, numpy conversion included.
    if torch.is_tensor(tensor):
        tensor = tensor.cpu()
        return tensor.numpy() if as_numpy else tensor
    return tensor


class _RngForkWarningFilter(logging.Filter):
    """Drops megatron's 'CPU RNG state changed within GPU RNG context' warning.

    On CPU the tracker's 'GPU' state is the CPU generator, so any random op inside a tracker fork (dropout,
    init) changes the CPU state by design; the warning would fire on every such fork.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_pending_sends: list[Any] = []  # gloo send requests of pipeline messages not yet reaped


def _reap_sends(wait: bool) -> None:
    """Drop the completed pipeline sends (with `wait`: wait for all of them first)."""
    if wait:
        for req in _pending_sends:
            req.wait()
        _pending_sends.clear()
    else:
        _pending_sends[:] = [r for r in _pending_sends if not r.is_completed()]


def _p2p_ops_deferred_sends(**kwargs: Any) -> dict[str, Any]:
    """megatron's `_p2p_ops` (even/odd ordered isend / irecv) returning only the receive requests; the send
    requests are kept in `_pending_sends` (see the module docstring)."""
    _reap_sends(wait=False)
    reqs = _ORIGINAL["_p2p_ops"](**kwargs)
    for name in ("send_next", "send_prev"):
        if name in reqs:
            _pending_sends.append(reqs.pop(name))
    return reqs


def _communicate_shapes_ordered(self: Any, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
    """megatron's `P2PCommunicator._communicate_shapes` through `_p2p_ops_deferred_sends`; same arguments
    and result."""

    def shape_of(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.tensor(t.size(), device=_CPU, dtype=torch.int64)

    recv_prev_shape = torch.empty(3, device=_CPU, dtype=torch.int64) if recv_prev else None
    recv_next_shape = torch.empty(3, device=_CPU, dtype=torch.int64) if recv_next else None
    reqs = _p2p_ops_deferred_sends(
        tensor_send_prev=shape_of(tensor_send_prev),
        tensor_recv_prev=recv_prev_shape,
        tensor_send_next=shape_of(tensor_send_next),
        tensor_recv_next=recv_next_shape,
        group=self.pp_group,
        prev_pipeline_rank=self.prev_rank,
        next_pipeline_rank=self.next_rank,
    )
    for req in reqs.values():
        req.wait()
    return (
        [0, 0, 0] if recv_prev_shape is None else recv_prev_shape.tolist(),
        [0, 0, 0] if recv_next_shape is None else recv_next_shape.tolist(),
    )


def _reaping_schedule(schedule: Any) -> Any:
    """A pipeline schedule that waits for its deferred sends before returning."""

    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return schedule(*args, **kwargs)
        finally:
            _reap_sends(wait=True)

    run.__wrapped__ = schedule  # type: ignore[attr-defined]
    return run


_ORIGINAL: dict[str, Any] = {}


def enable_cpu_compat() -> None:
    """Patch the process-wide CUDA assumptions of megatron-core for a CPU run. Idempotent.

    Call only when `cluster.device == "cpu"`: it replaces `torch.cuda` functions in this process.
    """
    global _enabled
    with _lock:
        if _enabled:
            return
        import megatron.core.tensor_parallel.random as mp_random
        import torch.cuda.random as cuda_random

        torch.cuda.current_device = _current_device
        torch.cuda.synchronize = _synchronize
        torch.cuda.Stream = CpuStream  # type: ignore[misc]
        torch.cuda.current_stream = _current_stream
        torch.cuda.stream = _stream_context  # type: ignore[assignment]
        import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

        token_dispatcher.maybe_move_tensor_to_cpu = _move_tensor_to_cpu
        from megatron.core.pipeline_parallel import p2p_communication, schedules

        _ORIGINAL["_p2p_ops"] = p2p_communication._p2p_ops
        p2p_communication._p2p_ops = _p2p_ops_deferred_sends
        p2p_communication.P2PCommunicator._communicate_shapes = _communicate_shapes_ordered
        for name in (
            "forward_backward_pipelining_with_interleaving",
            "forward_backward_pipelining_without_interleaving",
        ):
            setattr(schedules, name, _reaping_schedule(getattr(schedules, name)))
        for module in (torch.cuda, cuda_random):
            module.get_rng_state = _cpu_get_rng_state
            module.set_rng_state = _cpu_set_rng_state
            module.manual_seed = _cpu_manual_seed
        # megatron's tracker calls these module-level helpers by name (fork, checkpointing).
        mp_random._get_cuda_rng_state = _cpu_get_rng_state
        mp_random._set_cuda_rng_state = _cpu_set_rng_state
        logging.getLogger(mp_random.__name__).addFilter(_RngForkWarningFilter())
        # Torch attributes a warning raised inside a torch function to the Python frame that called the op,
        # which under CudaToCpuMode is __torch_function__ below. megatron's own non-leaf `.grad` read in
        # DistributedOptimizer.zero_grad (its source notes it "throws grad-access warning") therefore
        # showed as this module's UserWarning. Only warnings attributed to this module are dropped: the
        # mode's own code reads no `.grad`, so a non-leaf `.grad` read elsewhere still warns.
        warnings.filterwarnings(
            "ignore", message="The .grad attribute of a Tensor that is not a leaf", category=UserWarning,
            module=__name__.replace(".", r"\."),
        )  # fmt: skip
        _enabled = True


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device requests to the CPU inside megatron calls (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            # .cuda(device=None, non_blocking=False, memory_format=...) -> stay on the CPU.
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_to_cpu() -> Iterator[None]:
    """Enter the CUDA->CPU rewrite mode on this thread (re-entrant: nested uses are free)."""
    if getattr(_tls, "active", False):
        yield
        return
    _tls.active = True
    try:
        with CudaToCpuMode():
            yield
    finally:
        _tls.active = False
