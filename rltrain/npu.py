"""Ascend NPU device layer: torch_npu, MindSpeed's megatron adaptor and mstx range markers.

This module imports nothing beyond the standard library at load time; torch_npu and MindSpeed are imported
only when its functions run, which happens on `cluster.device == "npu"` runs (and for the npu profiler)
only. torch_npu needs Ascend CANN, and on a machine without CANN an installed torch_npu breaks even
`import torch` unless `TORCH_DEVICE_BACKEND_AUTOLOAD=0` (DESIGN.md, measured facts).

- `load_torch_npu()`: torch_npu, imported here when torch's device-backend autoload did not import it
  already (autoload off, `TORCH_DEVICE_BACKEND_AUTOLOAD=0`); a clear `NpuUnavailableError` when it cannot be.
- `apply_mindspeed()`: `import mindspeed.megatron_adaptor` once per process. MindSpeed patches megatron-core
  for Ascend (and, through `torch_npu.contrib.transfer_to_npu`, redirects `torch.cuda` / `device="cuda"`
  to the NPU); its documentation asks for the import *before* megatron is imported, because a patch cannot
  reach a name that another module bound at import time under a different name, a subclass, or a decorator
  that already ran.
- `prepare_npu(local_rank)`: both of the above plus binding the process to its NPU, called from
  `rltrain.megatron.parallel.init_distributed` before the hccl process group is created.
- `MstxRange(torch_npu, message)`: a context manager that brackets a role call with
  `torch_npu.npu.mstx.range_start/range_end` (or two `mstx.mark` points on a torch_npu without ranges), so
  the call shows as a named range on the host and device timelines of the Ascend profiler.

None of this has run on an NPU (none exists on the project's machines): tests/test_profiling.py drives it
against stand-in modules put in `sys.modules`; docs/profiling.md says what was and was not run.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from types import ModuleType, TracebackType
from typing import Any

log = logging.getLogger(__name__)

AUTOLOAD_ENV = "TORCH_DEVICE_BACKEND_AUTOLOAD"
INSTALL_HINT = "install torch_npu and MindSpeed from source; see docs/profiling.md"
ADAPTOR = "mindspeed.megatron_adaptor"

_adapted = False


class NpuUnavailableError(RuntimeError):
    """torch_npu or MindSpeed cannot be loaded on a `cluster.device: npu` run."""


def _unavailable(what: str, exc: BaseException, extra: str = "") -> NpuUnavailableError:
    return NpuUnavailableError(
        f"cluster.device = npu needs {what}, which could not be imported "
        f"({type(exc).__name__}: {exc}){extra}; {INSTALL_HINT}"
    )


def load_torch_npu() -> ModuleType:
    """torch_npu, imported now unless torch's device-backend autoload already did (a cached import)."""
    try:
        return importlib.import_module("torch_npu")
    except Exception as exc:  # ImportError, OSError (CANN libraries such as libhccl.so), version errors
        extra = ""
        if os.environ.get(AUTOLOAD_ENV) == "0":
            # Autoload off is the right setting for CPU-only machines with torch_npu installed; on an NPU
            # machine it only means torch_npu is imported here instead of by `import torch`.
            extra = f" ({AUTOLOAD_ENV}=0 is set: torch_npu was imported explicitly, not by `import torch`)"
        raise _unavailable("torch_npu with Ascend CANN (source CANN's set_env.sh)", exc, extra) from exc


def apply_mindspeed() -> None:
    """Import MindSpeed's megatron adaptor (it patches megatron-core on import); once per process."""
    global _adapted
    if _adapted:
        return
    if any(name == "megatron.core" or name.startswith("megatron.core.") for name in sys.modules):
        # MindSpeed rebinds patched names in every loaded module, which covers plain function calls; what
        # megatron captured at import time (subclasses, decorators, aliases) stays unpatched.
        log.warning(
            "MindSpeed's megatron adaptor is applied after megatron.core was imported in this process; "
            "patches of names bound at import time are missed. Call rltrain.npu.prepare_npu() before the "
            "first megatron import."
        )
    argv = sys.argv
    # The adaptor parses sys.argv for MindSpeed / Megatron-LM flags. A Ray worker's argv holds Ray's own
    # flags, which must not be read as (or collide with) those: the adaptor sees the program name only.
    sys.argv = argv[:1]
    try:
        importlib.import_module(ADAPTOR)
    except Exception as exc:
        # The PyPI `mindspeed` is a placeholder without the adaptor (DESIGN.md): ModuleNotFoundError here.
        raise _unavailable(f"MindSpeed ({ADAPTOR})", exc) from exc
    finally:
        sys.argv = argv
    _adapted = True


def prepare_npu(local_rank: int | None = None, mindspeed: bool = True) -> ModuleType:
    """Make this process an NPU worker: torch_npu loaded, bound to NPU `local_rank` (modulo the visible
    count, as on CUDA), MindSpeed's adaptor applied. Idempotent; returns torch_npu."""
    torch_npu = load_torch_npu()
    if local_rank is not None:
        # Ray gives each worker its own device through ASCEND_RT_VISIBLE_DEVICES: index 0 of what it sees.
        torch_npu.npu.set_device(local_rank % max(1, torch_npu.npu.device_count()))
    if mindspeed:
        apply_mindspeed()
    return torch_npu


class MstxRange:
    """An mstx range around a block on the current NPU stream (host and device timelines).

    `range_start` returns 0 when it fails (no profiler collecting mstx, for instance): no `range_end` then.
    A torch_npu without `range_start` gets two marks, `MESSAGE/start` and `MESSAGE/end`.
    """

    __slots__ = ("_id", "_message", "_mstx", "_stream")

    def __init__(self, torch_npu: Any, message: str) -> None:
        self._mstx = torch_npu.npu.mstx
        self._message = message
        # With a stream the marker is also placed on the device stream, so the range brackets the kernels
        # the call queued, not only the host time that queued them.
        self._stream = torch_npu.npu.current_stream()
        self._id = 0

    def __enter__(self) -> None:
        if hasattr(self._mstx, "range_start"):
            self._id = self._mstx.range_start(self._message, self._stream)
        else:
            self._mstx.mark(f"{self._message}/start", self._stream)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if hasattr(self._mstx, "range_start"):
            if self._id:
                self._mstx.range_end(self._id)
        else:
            self._mstx.mark(f"{self._message}/end", self._stream)
