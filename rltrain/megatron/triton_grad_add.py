"""A MoE layer's stacked expert weight gradients added into the experts' main_grads by one Triton kernel.

Why: the grouped products write dW1 [E, 2F, H] / dW2 [E, H, F] in bf16; `moe_experts._add_into_main_grads`
cast them to fp32 a chunk of experts at a time and added them with `torch._foreach_add_`: per element a bf16
read, an fp32 write and read of the cast and an fp32 read and write of the main_grad (18 bytes), ~12
launches per MoE layer per micro-batch. In a profiled qwen3-moe update on the H200 the casts and adds took
0.38 s of its 4.4 s of kernels (docs/benchmarks.md). Here one program reads a tile of dW and of an expert's
main_grad, adds in fp32 and writes back (10 bytes per element): one launch per weight kind and layer.

The main_grads are views into megatron DDP's one gradient buffer wherever DDP put them (its layout runs in
reverse parameter order, an expert's fc1 and fc2 interleaved): the kernel takes each expert's element offset
into that buffer (`Destination`, made once per layer and weight kind per training pass by the caller, so
neither the checks over the E main_grads nor the offsets' copy to the device repeat per micro-batch). The sum
is the one the cast-then-add path computes (fp32 + fp32 rounded once), bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rltrain import device as devices
from rltrain.megatron import decode_kernels
from rltrain.megatron.triton_runtime import tl, triton

BLOCK = 2048
"""Elements of one expert's gradient per program."""

SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Destination:
    """Where `add_into` adds: the main_grads' whole buffer (a flat view from its first element), each
    expert's element offset into it (int64, on the device) and the elements per expert."""

    buffer: torch.Tensor
    offsets: torch.Tensor
    size: int


def destination(mains: Sequence[torch.Tensor]) -> Destination | str:
    """The `Destination` of these main_grads, or why the kernel cannot add into them: Triton on their
    device, fp32, one size, each contiguous and all in one buffer."""
    if not mains:
        return "no main_grads"
    first = mains[0]
    reason = device_unsupported(first.device)
    if reason is not None:
        return reason
    storage = first.untyped_storage().data_ptr()
    for main in mains:
        if main.dtype != torch.float32 or main.numel() != first.numel() or not main.is_contiguous():
            return "main_grads not fp32, contiguous and of one size"
        if main.device != first.device or main.untyped_storage().data_ptr() != storage:
            return "main_grads not in one buffer"
    whole = first.untyped_storage().nbytes() // first.element_size()
    offsets = torch.tensor([m.storage_offset() for m in mains], dtype=torch.int64)
    return Destination(
        first.as_strided((whole,), (1,), 0), devices.from_host(offsets, first.device), first.numel()
    )


def device_unsupported(device: torch.device) -> str | None:
    """Why the kernel cannot run on `device` (None: it can)."""
    if triton is None or device.type != "cuda":
        return "no triton on this device"
    return decode_kernels.where_unsupported(devices.kind(device.type).name)


def gradients_unsupported(dest: Destination, dw: torch.Tensor) -> str | None:
    """Why dw [E, ...] cannot be added into `dest` (None: it can): a contiguous 16/32-bit stack of one
    gradient per main_grad, each of the main_grads' size, on their device."""
    if dw.dtype not in SOURCE_DTYPES or not dw.is_contiguous() or dw.device != dest.buffer.device:
        return "gradients not a contiguous 16/32-bit stack on the main_grads' device"
    if dw.shape[0] != len(dest.offsets) or dw[0].numel() != dest.size:
        return "not one gradient of the main_grads' size per main_grad"
    return None


def add_into(dest: Destination, dw: torch.Tensor) -> None:
    """main_grad[e] += dw[e] (in fp32) for every expert e, in one kernel; `gradients_unsupported` must name
    no reason."""
    if dest.size:
        _launch(dest.buffer, dest.offsets, dw, dest.size)


def _launch(buffer: torch.Tensor, offsets: torch.Tensor, dw: torch.Tensor, size: int) -> None:
    """buffer[offsets[e] : offsets[e] + size] += dw[e] for every e: the kernel."""
    assert triton is not None, "triton is not installed (triton_grad_add.device_unsupported)"
    _add_kernel[(len(offsets), triton.cdiv(size, BLOCK))](buffer, offsets, dw, size, BLOCK=BLOCK)


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
