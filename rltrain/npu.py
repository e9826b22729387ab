"""The npu case of the device layer (rltrain/device.py): torch_npu, MindSpeed's megatron adaptor, mstx ranges.

This module imports nothing beyond the standard library at load time; torch_npu and MindSpeed are imported
only when its functions run, which happens on `cluster.device == "npu"` runs (and for the npu profiler)
only. torch_npu needs Ascend CANN, and on a machine without CANN an installed torch_npu breaks even
`import torch` unless `TORCH_DEVICE_BACKEND_AUTOLOAD=0` (DESIGN.md, measured facts); rltrain.device sets
that variable for every process of a cpu or cuda run.

- `load_torch_npu()`: torch_npu, imported here when torch's device-backend autoload did not import it
  already (autoload off, `TORCH_DEVICE_BACKEND_AUTOLOAD=0`); a clear `NpuUnavailableError` when it cannot be.
- `apply_mindspeed(options)`: `import mindspeed.megatron_adaptor` once per process, then, when there are
  options and the adaptor has `repatch` (recent MindSpeed releases), `repatch(options)`. MindSpeed patches
  megatron-core for Ascend (and, through `torch_npu.contrib.transfer_to_npu`, redirects `torch.cuda` /
  `device="cuda"` to the NPU); its documentation asks for the import *before* megatron is imported,
  because a patch cannot reach a name that another module bound at import time under a different name, a
  subclass, or a decorator that already ran. `mindspeed_options(engine)` are the options: the role's engine plan's
  recompute and dropout settings plus `sequence_parallel` and `use_distributed_optimizer`, the keys verl
  hands to `repatch` and MindSpeed's verl guide documents.
- `prepare_npu(local_rank, options)`: both of the above plus binding the process to its NPU; called through
  `rltrain.device.prepare_process("npu", ...)` from the worker's constructor (before any megatron import)
  and again, a no-op by then, from `rltrain.megatron.parallel.init_distributed` before the hccl group.
- `check_npu()`: what `rltrain.device.check_available("npu")` runs before Ray starts: torch_npu importable
  (with CANN), an NPU visible, MindSpeed's adaptor installed (found, not imported: importing it patches).
- `MstxRange(torch_npu, message)`: a context manager that brackets a role call with
  `torch_npu.npu.mstx.range_start/range_end` (or two `mstx.mark` points on a torch_npu without ranges), so
  the call shows as a named range on the host and device timelines of the Ascend profiler.

None of this has run on an NPU (none exists on the project's machines): tests/test_device.py and
tests/test_profiling.py drive it against stand-in modules put in `sys.modules`; docs/hardware.md says what
was and was not run.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Mapping
from types import ModuleType, TracebackType
from typing import Any

log = logging.getLogger(__name__)

AUTOLOAD_ENV = "TORCH_DEVICE_BACKEND_AUTOLOAD"
MINDSPEED_REPO = "https://gitcode.com/Ascend/MindSpeed"
INSTALL_HINT = (
    "install torch_npu matching torch (pip install -e '.[npu]'), Ascend CANN (source its set_env.sh) and "
    f"MindSpeed from source ({MINDSPEED_REPO}; the PyPI `mindspeed` is a placeholder); see docs/hardware.md"
)
ADAPTOR = "mindspeed.megatron_adaptor"

_adapted = False


class NpuUnavailableError(RuntimeError):
    """torch_npu, CANN, an NPU or MindSpeed is missing on a `cluster.device: npu` run.

    `problem` says what is missing, `fix` what to install; the message is both."""

    def __init__(self, problem: str, fix: str = INSTALL_HINT) -> None:
        self.problem, self.fix = problem, fix
        super().__init__(f"{problem}; {fix}")


def _unavailable(what: str, exc: BaseException, extra: str = "") -> NpuUnavailableError:
    return NpuUnavailableError(
        f"cluster.device = npu needs {what}, which could not be imported ({type(exc).__name__}: {exc}){extra}"
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


def mindspeed_options(engine: Any) -> dict[str, Any]:
    """The options a role's engine plan (`rlconf.plan.EnginePlan`) hands to MindSpeed: the recompute
    settings that are on (recompute_modules only with selective recompute, where megatron reads it), the
    dropouts, `sequence_parallel` (the layout's) and `use_distributed_optimizer`. Plain values."""
    t, r = engine.settings.transformer, engine.settings.transformer.recompute
    options: dict[str, Any] = {}
    if r.granularity is not None:
        options["recompute_granularity"] = r.granularity
    if r.method is not None:
        options["recompute_method"] = r.method
    if r.num_layers is not None:
        options["recompute_num_layers"] = r.num_layers
    if r.granularity == "selective":
        options["recompute_modules"] = list(r.modules)
    options["attention_dropout"] = t.attention_dropout
    options["hidden_dropout"] = t.hidden_dropout
    options["sequence_parallel"] = bool(engine.layout.sequence_parallel)
    options["use_distributed_optimizer"] = bool(engine.settings.ddp.use_distributed_optimizer)
    return options


def apply_mindspeed(options: Mapping[str, Any] | None = None) -> None:
    """Import MindSpeed's megatron adaptor (it patches megatron-core on import) and hand it `options`
    through `repatch`; once per process (later calls, with any options, do nothing)."""
    global _adapted
    if _adapted:
        return
    if any(name == "megatron.core" or name.startswith("megatron.core.") for name in sys.modules):
        # MindSpeed rebinds patched names in every loaded module, which covers plain function calls; what
        # megatron captured at import time (subclasses, decorators, aliases) stays unpatched.
        log.warning(
            "MindSpeed's megatron adaptor is applied after megatron.core was imported in this process; "
            "patches of names bound at import time are missed. Call rltrain.device.prepare_process() "
            "before the first megatron import."
        )
    argv = sys.argv
    # The adaptor parses sys.argv for MindSpeed / Megatron-LM flags. A Ray worker's argv holds Ray's own
    # flags, which must not be read as (or collide with) those: the adaptor sees the program name only,
    # and rltrain's options arrive typed, through repatch.
    sys.argv = argv[:1]
    try:
        adaptor = importlib.import_module(ADAPTOR)
        if options:
            repatch = getattr(adaptor, "repatch", None)
            if repatch is None:
                log.warning(
                    "this MindSpeed release has no megatron_adaptor.repatch: the options %s are not passed "
                    "to it (it runs with its defaults)",
                    sorted(options),
                )
            else:
                repatch(dict(options))
    except Exception as exc:
        # The PyPI `mindspeed` is a placeholder without the adaptor (DESIGN.md): ModuleNotFoundError here.
        raise _unavailable(f"MindSpeed ({ADAPTOR})", exc) from exc
    finally:
        sys.argv = argv
    _adapted = True


def prepare_npu(
    local_rank: int | None = None, mindspeed: bool = True, options: Mapping[str, Any] | None = None
) -> ModuleType:
    """Make this process an NPU worker: torch_npu loaded, bound to NPU `local_rank` (modulo the visible
    count, as on CUDA), MindSpeed's adaptor applied with `options`. Idempotent; returns torch_npu."""
    torch_npu = load_torch_npu()
    if local_rank is not None:
        # Ray gives each worker its own device through ASCEND_RT_VISIBLE_DEVICES: index 0 of what it sees.
        torch_npu.npu.set_device(local_rank % max(1, torch_npu.npu.device_count()))
    if mindspeed:
        apply_mindspeed(options)
    return torch_npu


def check_npu() -> None:
    """Raise NpuUnavailableError unless torch_npu imports (with CANN), an NPU is visible and MindSpeed's
    megatron adaptor is installed. The adaptor is located, not imported: importing it patches megatron."""
    torch_npu = load_torch_npu()
    if not torch_npu.npu.is_available() or torch_npu.npu.device_count() == 0:
        raise NpuUnavailableError(
            "cluster.device = npu, but torch_npu sees no NPU "
            f"(ASCEND_RT_VISIBLE_DEVICES={os.environ.get('ASCEND_RT_VISIBLE_DEVICES', '<unset>')})",
            "check the driver with `npu-smi info` and that CANN's set_env.sh is sourced; see docs/hardware.md",
        )
    try:
        found = importlib.util.find_spec(ADAPTOR) is not None
    except Exception as exc:  # the parent package itself is missing or broken
        raise _unavailable(f"MindSpeed ({ADAPTOR})", exc) from exc
    if not found:
        raise NpuUnavailableError(
            f"cluster.device = npu needs MindSpeed ({ADAPTOR}), which is not installed (the PyPI "
            "`mindspeed` package is a placeholder without it)"
        )


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
