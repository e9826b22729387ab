"""Weight sync from the trainer (megatron actor) to a SEPARATE rollout engine in other processes.

The colocated embedded engine needs none of this: it generates with the actor's own parameters, so a
refit costs nothing. A separate engine (vLLM, or a megatron model of another TP layout on other devices)
gets the actor's weights after every update, in Hugging Face layout, because that is what every engine
loads (`load_weights(iterable of (name, tensor))` in vLLM) and it is independent of the trainer's layout.

Protocol (one torch.distributed group holding the trainer's sending rank `src` and the rollout ranks;
gloo on CPU, NCCL on GPU):

  for every bucket:  broadcast_object_list([header])  then  broadcast(uint8 buffer of header.total bytes)
  end:               broadcast_object_list([None])

`header` lists (name, shape, dtype, byte offset) of the tensors packed into the bucket; buckets hold at
most `bucket_bytes` (one larger tensor goes alone), so peak extra memory is one bucket on each side, not
a model copy, and the number of collectives is ~model bytes / bucket_bytes (large buckets amortise NCCL
launch latency; the bench measures it). Receivers are told everything by the header: they need no arch.

Trainer side: `iter_hf_weights` gathers each parameter's TP shards (a collective over the trainer's TP
group: every trainer TP rank iterates it) and maps it to HF names with the same functions as the HF
export (rltrain/megatron/hf_weights.py), one parameter at a time. `sync_weights` runs it on every
trainer rank and broadcasts from `src`. PP > 1 on the trainer is not supported yet (each stage's
tensors live on another rank; the stages would have to send in turn).

Receiver side: `receive_weights(load_weights, group, src)` hands each bucket's (name, tensor) pairs to a
callback: vLLM's `model.load_weights`, or `MegatronWeightLoader` which reshards into a megatron model of
the receiver's own TP layout (it slices each full tensor for its TP rank, as `load_hf_weights` does).
The tensors handed over are views into the bucket buffer: callbacks must copy them (both do).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from rlconf.config import ModelArch
from rltrain import device as devices

NamedTensors = Iterable[tuple[str, torch.Tensor]]
LoadWeights = Callable[[list[tuple[str, torch.Tensor]]], object]

DEFAULT_BUCKET_BYTES = 512 * 2**20
_ALIGN = 16  # byte alignment of each tensor in a bucket, so that `.view(dtype)` of its slice is legal


@dataclass
class SyncStats:
    """What one sync or refit moved on this rank: tensors, bytes, buckets (collective rounds), wall seconds."""

    tensors: int = 0
    bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0


# ------------------------------------------------------------------------------------ trainer side
@torch.no_grad()
def iter_hf_weights(chunks: Sequence[torch.nn.Module], arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor on the parameter's device) of this actor, one megatron parameter at a time.

    Collective over the TP group: every TP rank of the trainer must iterate it to the end. A tied
    output layer is skipped (HF reads the embedding), as in `export_hf_weights`.
    """
    from megatron.core import parallel_state

    from rltrain.megatron.hf_weights import _global_params, _to_hf
    from rltrain.megatron.model import unwrap

    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise NotImplementedError(
            "weight sync from a pipeline-parallel trainer (PP > 1) is not supported yet"
        )
    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    for chunk in chunks:
        for name, param in _global_params(unwrap(chunk)):
            data = param.detach()
            if tp > 1 and getattr(param, "tensor_model_parallel", False):
                parts = [torch.empty_like(data) for _ in range(tp)]
                torch.distributed.all_gather(parts, data.contiguous(), group=group)
                data = torch.cat(parts, dim=param.partition_dim)
            if name == "output_layer.weight" and arch.share_embeddings_and_output_weights:
                continue
            yield from _to_hf(name, data, arch, tp).items()


def _buckets(named: NamedTensors, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        n = _aligned(t.numel() * t.element_size())
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _unpack(
    header: list[tuple[str, tuple[int, ...], str, int]], buf: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    out = []
    for name, shape, dtype_name, off in header:
        dtype = getattr(torch, dtype_name)
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out.append((name, buf[off : off + nbytes].view(dtype).view(shape)))
    return out


def send_weights(
    named: NamedTensors,
    group: torch.distributed.ProcessGroup | None,
    src: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    device: torch.device | str = "cpu",
    local_load: LoadWeights | None = None,
) -> SyncStats:
    """Broadcast `named` from this rank (`src`, a global rank) to the others of `group` in buckets.

    `device`: where the bucket buffer lives (cuda for NCCL). `local_load`: also hand each bucket to this
    callback here (a rollout shard hosted by the sending process; the bench uses it to time the loading).
    `group=None` with `local_load` sends nothing: an in-process copy through the same packing.
    """
    stats = SyncStats()
    t0 = time.perf_counter()
    for bucket in _buckets(named, bucket_bytes):
        header, off = [], 0
        for name, t in bucket:
            header.append((name, tuple(t.shape), str(t.dtype).removeprefix("torch."), off))
            off += _aligned(t.numel() * t.element_size())
        buf = torch.empty(off, dtype=torch.uint8, device=device)
        for (_, t), (_, _, _, o) in zip(bucket, header, strict=True):
            flat = t.detach().contiguous().view(-1).view(torch.uint8)
            buf[o : o + flat.numel()].copy_(flat)
        if group is not None:
            torch.distributed.broadcast_object_list([header], src=src, group=group)
            torch.distributed.broadcast(buf, src=src, group=group)
        if local_load is not None:
            local_load(_unpack(header, buf))
        stats.tensors += len(bucket)
        stats.bytes += off
        stats.buckets += 1
    if group is not None:
        torch.distributed.broadcast_object_list([None], src=src, group=group)
    _sync(device)
    stats.seconds = time.perf_counter() - t0
    return stats


def receive_weights(
    load_weights: LoadWeights,
    group: torch.distributed.ProcessGroup | None,
    src: int,
    device: torch.device | str = "cpu",
) -> SyncStats:
    """Receive what `send_weights` broadcasts from `src`; each bucket's (name, tensor) pairs (views into
    the bucket buffer on `device`) go to `load_weights`, which must copy them."""
    stats = SyncStats()
    t0 = time.perf_counter()
    while True:
        obj: list[object] = [None]
        torch.distributed.broadcast_object_list(obj, src=src, group=group)
        header = obj[0]
        if header is None:
            break
        assert isinstance(header, list)
        last = header[-1]
        dtype = getattr(torch, last[2])
        total = last[3] + _aligned(torch.Size(last[1]).numel() * torch.empty((), dtype=dtype).element_size())
        buf = torch.empty(total, dtype=torch.uint8, device=device)
        torch.distributed.broadcast(buf, src=src, group=group)
        load_weights(_unpack(header, buf))
        stats.tensors += len(header)
        stats.bytes += total
        stats.buckets += 1
    _sync(device)
    stats.seconds = time.perf_counter() - t0
    return stats


def sync_weights(
    chunks: Sequence[torch.nn.Module],
    arch: ModelArch,
    group: torch.distributed.ProcessGroup | None,
    src: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    local_load: LoadWeights | None = None,
) -> SyncStats:
    """Trainer side, called on EVERY trainer rank (the TP gather is collective); the rank whose global
    rank is `src` broadcasts to `group`, the others only take part in the gather."""
    named = iter_hf_weights(chunks, arch)
    if torch.distributed.get_rank() == src:
        device = next(iter(chunks[0].parameters())).device
        return send_weights(named, group, src, bucket_bytes, device, local_load)
    for _ in named:
        pass
    return SyncStats()


def _sync(device: torch.device | str) -> None:
    devices.synchronize(torch.device(device).type)


# ------------------------------------------------------------------------------------ receiver: megatron
class MegatronWeightLoader:
    """`load_weights` callback that copies streamed HF tensors into a megatron model of the receiver's own
    TP layout (PP = 1 or this rank's stage chunks): each full tensor is fused (qkv, gate/up for the
    receiver's TP size) and sliced for its TP rank exactly as `load_hf_weights` does from files.

    HF tensors are kept (copied) until every megatron parameter that needs them is loaded (q, k and v
    arrive separately); `finish()` checks that every parameter was loaded and frees them.
    """

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        arch: ModelArch,
        tp_size: int | None = None,
        tp_rank: int | None = None,
    ) -> None:
        from megatron.core import parallel_state

        from rltrain.megatron.hf_weights import _global_params
        from rltrain.megatron.model import unwrap

        self.arch = arch
        self.tp = tp_size if tp_size is not None else parallel_state.get_tensor_model_parallel_world_size()
        self.rank = tp_rank if tp_rank is not None else parallel_state.get_tensor_model_parallel_rank()
        self.params: dict[str, tuple[torch.nn.Parameter, int]] = {}
        for chunk in chunks:
            module = unwrap(chunk)
            for name, param in _global_params(module):
                self.params[name] = (param, module.vocab_size)
        self.pending = set(self.params)
        self.received: dict[str, torch.Tensor] = {}

    def __call__(self, named: NamedTensors) -> None:
        for name, t in named:
            self.received[name] = t.detach().clone()
        self._load_ready()

    def get(self, name: str) -> torch.Tensor:  # the reader interface of hf_weights._hf_full_tensor
        return self.received[name]

    def __contains__(self, name: str) -> bool:
        return name in self.received

    @torch.no_grad()
    def _load_ready(self) -> None:
        from rltrain.megatron.hf_weights import _hf_full_tensor, _shard

        for name in sorted(self.pending):
            # An untied lm_head must not fall back to the embedding just because it has not arrived yet.
            if (
                name == "output_layer.weight"
                and not self.arch.share_embeddings_and_output_weights
                and "lm_head.weight" not in self
            ):
                continue
            param, vocab_rows = self.params[name]
            try:
                full = _hf_full_tensor(name, self, self.arch, self.tp, vocab_rows)  # type: ignore[arg-type]
            except KeyError:
                continue  # a source tensor has not arrived yet
            local = _shard(full, param, self.tp, self.rank)
            if local.shape != param.shape:
                raise ValueError(
                    f"{name}: received {tuple(local.shape)}, megatron expects {tuple(param.shape)}"
                )
            param.data.copy_(local.to(param.device, param.dtype))
            self.pending.discard(name)
        if not self.pending:
            self.received.clear()

    def finish(self) -> None:
        """Raise if a parameter was never loaded (a missing tensor in the stream); free what was kept."""
        missing = sorted(self.pending)
        self.received.clear()
        if missing:
            raise KeyError(f"weight sync: no tensors received for {missing[:5]} ({len(missing)} parameters)")
        self.pending = set(self.params)  # ready for the next sync


__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "MegatronWeightLoader",
    "SyncStats",
    "iter_hf_weights",
    "receive_weights",
    "send_weights",
    "sync_weights",
]
