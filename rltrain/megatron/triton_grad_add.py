"""A MoE layer's stacked expert weight gradients added into the experts' main_grads by one Triton kernel.

Why: the grouped products write dW1 [E, 2F, H] / dW2 [E, H, F] in bf16; `moe_experts._add_into_main_grads`
cast them to fp32 a chunk of experts at a time and added them with `torch._foreach_add_`: per element a bf16
read, an fp32 write and read of the cast and an fp32 read and write of the main_grad (18 bytes), ~12
launches per MoE layer per micro-batch. In a profiled qwen3-moe update on the H200 the casts and adds took
0.38 s of its 4.4 s of kernels (docs/benchmarks.md). Here one program reads a tile of dW and of an expert's
main_grad, adds in fp32 and writes back (10 bytes per element): one launch per weight kind and layer.

The main_grads are views into megatron DDP's one gradient buffer wherever DDP put them (its layout runs in
reverse parameter order, an expert's fc1 and fc2 interleaved): the kernel takes each expert's element offset
into that buffer, kept on the device per set of offsets (`_OFFSETS`) so no call copies them from the host.
The sum is the one the cast-then-add path computes (fp32 + fp32 rounded once), bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rltrain import device as devices
from rltrain.megatron import decode_kernels

try:  # triton ships with torch's CUDA wheels; CPU installs have none (and must not add it)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None  # type: ignore[assignment]

BLOCK = 2048
"""Elements of one expert's gradient per program."""

SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_OFFSETS: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}
"""Each set of main_grad offsets (a layer's fc1 or fc2 experts) as an int64 tensor on its device."""
_OFFSETS_MAX = 4096


def unsupported(mains: Sequence[torch.Tensor], dw: torch.Tensor) -> str | None:
    """Why `add_into` cannot add dw [E, ...] into `mains` (None: it can): Triton on dw's device
    (`device_unsupported`) and the layout `layout_unsupported` takes."""
    return device_unsupported(dw.device) or layout_unsupported(mains, dw)


def device_unsupported(device: torch.device) -> str | None:
    """Why the kernel cannot run on `device` (None: it can)."""
    if triton is None or device.type != "cuda":
        return "no triton on this device"
    return decode_kernels.where_unsupported(devices.kind(device.type).name)


def layout_unsupported(mains: Sequence[torch.Tensor], dw: torch.Tensor) -> str | None:
    """Why the kernel cannot take these tensors (None: it can): fp32 main_grads of dw[e]'s size, each
    contiguous and all in one buffer on dw's device, a contiguous 16/32-bit dw with one gradient per
    main_grad."""
    if dw.dtype not in SOURCE_DTYPES or not dw.is_contiguous() or dw.shape[0] != len(mains) or not mains:
        return "gradients not a contiguous [E, ...] 16/32-bit stack of one per main_grad"
    size = dw[0].numel()
    storage = mains[0].untyped_storage().data_ptr()
    for main in mains:
        if main.dtype != torch.float32 or main.numel() != size or not main.is_contiguous():
            return "main_grads not fp32, contiguous and of the gradients' size"
        if main.device != dw.device or main.untyped_storage().data_ptr() != storage:
            return "main_grads not in one buffer"
    return None


def add_into(mains: Sequence[torch.Tensor], dw: torch.Tensor) -> None:
    """mains[e] += dw[e] (in fp32) for every expert e, in one kernel; `unsupported` must name no reason."""
    size = dw[0].numel()
    if size == 0:
        return
    offsets = _offsets(mains)
    first = mains[0]
    whole = first.untyped_storage().nbytes() // first.element_size()
    buffer = first.as_strided((whole,), (1,), 0)  # the whole gradient buffer, from its first element
    _launch(buffer, offsets, dw, size)


def _launch(buffer: torch.Tensor, offsets: torch.Tensor, dw: torch.Tensor, size: int) -> None:
    """buffer[offsets[e] : offsets[e] + size] += dw[e] for every e: the kernel."""
    assert triton is not None, "triton is not installed (triton_grad_add.unsupported)"
    _add_kernel[(len(offsets), triton.cdiv(size, BLOCK))](buffer, offsets, dw, size, BLOCK=BLOCK)


def _offsets(mains: Sequence[torch.Tensor]) -> torch.Tensor:
    key = (mains[0].device, tuple(m.storage_offset() for m in mains))
    found = _OFFSETS.get(key)
    if found is None:
        if len(_OFFSETS) >= _OFFSETS_MAX:  # buffers rebuilt many times over (tests): start afresh
            _OFFSETS.clear()
        found = _OFFSETS[key] = torch.tensor(key[1], dtype=torch.int64, device=mains[0].device)
    return found


if triton is not None:

    @triton.jit
    def _add_kernel(buffer, offsets, dw, size, BLOCK: tl.constexpr):
        expert = tl.program_id(0)
        cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        keep = cols < size
        dst = buffer + tl.load(offsets + expert) + cols
        src = dw + expert.to(tl.int64) * size + cols
        total = tl.load(dst, mask=keep) + tl.load(src, mask=keep).to(tl.float32)
        tl.store(dst, total, mask=keep)
