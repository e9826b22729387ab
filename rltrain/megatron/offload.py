"""Moving one role's device state to host memory and back: parameters, gradients, optimizer state.

Colocated roles (actor, rollout, reference policy, critic) take turns on the same device; a role that is not
running can hand its memory back. This module moves whole tensor *storages*: the bytes of each storage are
copied into a host buffer and the device storage is resized to 0 (its memory is released; on GPU to the
caching allocator, and `empty_cache()` then gives it back to the driver for other processes). Reloading
resizes the storage back and copies the bytes in. Every tensor that views the storage (a parameter's `.data`
inside megatron DDP's contiguous `param_data`, `main_grad` inside `grad_data`, the distributed optimizer's
fp32 shards that view `param_data`) stays the same Python object with the same shape and offsets, so
nothing that holds references (DDP buckets, optimizer groups, autograd hooks) has to be rebuilt, and the
round trip is bit-exact for any dtype.

On CPU the "device" is the host: the storages are still released and restored through explicit copies, so
the same code path runs in CI and the accounting (`storage_bytes`) shows what leaves the device.

Touching a tensor whose storage is offloaded is undefined (it can crash the process): the engine reloads
before any use (see `MegatronEngine.offload`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from rltrain import device as devices


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage, stable across resizes (views of one storage share it)."""
    return t.untyped_storage()._cdata


def unique_storages(tensors: Iterable[torch.Tensor], exclude: Iterable[int] = ()) -> list[torch.Tensor]:
    """One tensor per distinct storage among `tensors` (in first-seen order), skipping keys in `exclude`."""
    seen = set(exclude)
    out = []
    for t in tensors:
        key = storage_key(t)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def storage_bytes(tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    """Bytes held on `device` by the distinct storages of `tensors` (an offloaded storage holds 0)."""
    return sum(
        t.untyped_storage().nbytes() for t in unique_storages(tensors) if t.untyped_storage().device == device
    )


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over a whole storage (copies between devices need tensors, not storages)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass
class _Moved:
    storage: torch.UntypedStorage
    nbytes: int


class HostOffloader:
    """Offloads named groups of storages ("params", "grads", "optimizer") to host buffers and back.

    On an accelerator the host buffers are pinned (fast asynchronous copies) and kept between round trips
    (pinned allocation is slow, and each role offloads the same storages every step). On CPU they are plain
    memory and freed after each reload, since there the buffer would double the role's footprint.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.accelerator = devices.is_accelerator(device.type)
        self._moved: dict[str, list[_Moved]] = {}
        # Host copies, keyed like the storages they hold (kept across round trips on accelerators only).
        self._host: dict[int, torch.Tensor] = {}

    def is_offloaded(self, group: str) -> bool:
        return group in self._moved

    def offloaded_groups(self) -> list[str]:
        return list(self._moved)

    def host_bytes(self) -> int:
        """Bytes of host buffers currently held (the offloaded state, plus kept pinned buffers)."""
        return sum(h.numel() for h in self._host.values())

    def offload(self, group: str, tensors: Iterable[torch.Tensor]) -> int:
        """Copy the storages of `tensors` to the host and release them on the device; returns bytes moved.

        Storages already empty (offloaded by another group, or never allocated) are left alone, so groups
        may overlap harmlessly. Offloading a group that is already offloaded is a no-op.
        """
        if group in self._moved:
            return 0
        moved = []
        for t in unique_storages(tensors):
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            if nbytes == 0 or storage.device != self.device:
                continue
            key = storage_key(t)
            host = self._host.get(key)
            if host is None or host.numel() != nbytes:
                host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.accelerator)
                self._host[key] = host
            host.copy_(_as_bytes(storage), non_blocking=self.accelerator)
            moved.append(_Moved(storage, nbytes))
        # The copies must have read the device bytes before the memory is released (and possibly reused
        # by another stream or process).
        self._synchronize()
        for m in moved:
            m.storage.resize_(0)
        self._moved[group] = moved
        self._release_cache()
        return sum(m.nbytes for m in moved)

    def reload(self, group: str) -> int:
        """Restore a group offloaded by `offload` (bit-exact); returns bytes moved. No-op if not offloaded."""
        moved = self._moved.pop(group, None)
        if moved is None:
            return 0
        for m in moved:
            key = m.storage._cdata
            m.storage.resize_(m.nbytes)
            _as_bytes(m.storage).copy_(self._host[key], non_blocking=self.accelerator)
            if not self.accelerator:
                del self._host[key]
        self._synchronize()
        return sum(m.nbytes for m in moved)

    def _synchronize(self) -> None:
        if self.accelerator:
            devices.synchronize(self.device.type)

    def _release_cache(self) -> None:
        # Freed blocks stay in the caching allocator otherwise, invisible to other processes (a colocated
        # critic worker, an inference engine) that want the memory.
        if self.accelerator:
            devices.empty_cache(self.device.type)
