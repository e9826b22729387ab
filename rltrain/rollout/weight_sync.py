"""Weight sync from the trainer (megatron actor) to a SEPARATE rollout engine in other processes.

The colocated embedded engine needs none of this: it generates with the actor's own parameters, so a
refit costs nothing. A separate engine (vLLM, or a megatron model of another TP layout on other devices)
gets the actor's weights after every update, in Hugging Face layout, because that is what every engine
loads (`load_weights(iterable of (name, tensor))` in vLLM) and it is independent of the trainer's layout.

Protocol (one group holding the trainer's sending rank `src` and the rollout ranks; gloo on CPU, NCCL on
GPU; a `Channel`: a torch.distributed group of the default world, or a process group of its own between
two Ray worker groups, rltrain/rollout/push.py):

  for every bucket:  broadcast object {version, header, checksum}  then  broadcast(uint8 buffer)
  end:               broadcast object {version, end: buckets sent}

`header` lists (name, shape, dtype, byte offset) of the tensors packed into the bucket; buckets hold at
most `bucket_bytes` (one larger tensor goes alone), so peak extra memory is one bucket on each side, not
a model copy, and the number of collectives is ~model bytes / bucket_bytes (large buckets amortise NCCL
launch latency; the bench measures it). Receivers are told everything by the header: they need no arch.
Every message carries the sender's weight `version` (a receiver expecting another one fails: stale or
crossed pushes), every bucket the checksum of its bytes (a 64-bit sum of its 32-bit words, exact in any
summation order; a receiver whose bytes differ fails naming the bucket), and the end message the bucket
count (a lost bucket fails).

Trainer side: `iter_hf_weights` gathers each parameter's TP shards (a collective over the trainer's TP
group: every trainer TP rank iterates it) and maps it to HF names with the same functions as the HF
export (rltrain/megatron/hf_weights.py), one parameter at a time. `sync_weights` runs it on every
trainer rank and broadcasts from `src`. With PP > 1 each stage's tensors live on its own ranks:
`iter_hf_weights` yields this stage's (global layer numbers), and each stage sends on its own group
(rltrain/rollout/push.py).

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

from rlconf.arch import ModelArch
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


class WeightSyncError(RuntimeError):
    """A push that arrived wrong: another version than expected, a bucket whose bytes changed, a lost bucket."""


class Channel:
    """Broadcasts over a torch.distributed group of the default world (None: the whole world)."""

    def __init__(self, group: torch.distributed.ProcessGroup | None = None) -> None:
        self.group = group

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        torch.distributed.broadcast(tensor, src=src, group=self.group)

    def broadcast_object(self, obj: object, src: int) -> object:
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=src, group=self.group)
        return box[0]


def _channel(group: Channel | torch.distributed.ProcessGroup | None) -> Channel:
    return group if isinstance(group, Channel) else Channel(group)


def checksum(buf: torch.Tensor) -> int:
    """64-bit sum of a bucket's 32-bit words (its length is a multiple of 16 bytes): integer addition is
    exact in any order, so sender and receiver agree on any device."""
    return int(buf.view(torch.int32).sum(dtype=torch.int64))


# ------------------------------------------------------------------------------------ trainer side
@torch.no_grad()
def iter_hf_weights(chunks: Sequence[torch.nn.Module], arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor on the parameter's device) of this actor's pipeline stage, one megatron
    parameter at a time (global layer numbers: the stages together give the whole model).

    Collective over the TP group: every TP rank of the trainer must iterate it to the end. A tied
    output layer is skipped (HF reads the embedding), as in `export_hf_weights`.
    """
    from megatron.core import parallel_state

    from rltrain.megatron.hf_weights import global_params, to_hf
    from rltrain.megatron.model import unwrap

    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    for chunk in chunks:
        for name, param in global_params(unwrap(chunk)):
            data = param.detach()
            if tp > 1 and getattr(param, "tensor_model_parallel", False):
                parts = [torch.empty_like(data) for _ in range(tp)]
                torch.distributed.all_gather(parts, data.contiguous(), group=group)
                data = torch.cat(parts, dim=param.partition_dim)
            if name == "output_layer.weight" and arch.share_embeddings_and_output_weights:
                continue
            yield from to_hf(name, data, arch, tp).items()


def buckets(named: NamedTensors, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`named` cut into lists of at most `bucket_bytes` (aligned sizes; a larger tensor is a bucket alone)."""
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
    group: Channel | torch.distributed.ProcessGroup | None,
    src: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    device: torch.device | str = "cpu",
    local_load: LoadWeights | None = None,
    version: int = 0,
) -> SyncStats:
    """Broadcast `named` from this rank (`src`, its rank in the group) to the others of `group` in buckets,
    as weight version `version`.

    `device`: where the bucket buffer lives (cuda for NCCL). `local_load`: also hand each bucket to this
    callback here (a rollout shard hosted by the sending process; the bench uses it to time the loading).
    `group=None` with `local_load` sends nothing: an in-process copy through the same packing.
    """
    channel = _channel(group) if group is not None else None
    stats = SyncStats()
    t0 = time.perf_counter()
    for bucket in buckets(named, bucket_bytes):
        header, off = [], 0
        for name, t in bucket:
            header.append((name, tuple(t.shape), str(t.dtype).removeprefix("torch."), off))
            off += _aligned(t.numel() * t.element_size())
        buf = torch.empty(off, dtype=torch.uint8, device=device)
        for (_, t), (_, _, _, o) in zip(bucket, header, strict=True):
            flat = t.detach().contiguous().view(-1).view(torch.uint8)
            buf[o : o + flat.numel()].copy_(flat)
        if channel is not None:
            channel.broadcast_object({"version": version, "header": header, "checksum": checksum(buf)}, src)
            channel.broadcast(buf, src)
        if local_load is not None:
            local_load(_unpack(header, buf))
        stats.tensors += len(bucket)
        stats.bytes += off
        stats.buckets += 1
    if channel is not None:
        channel.broadcast_object({"version": version, "end": stats.buckets}, src)
    _sync(device)
    stats.seconds = time.perf_counter() - t0
    return stats


def receive_weights(
    load_weights: LoadWeights,
    group: Channel | torch.distributed.ProcessGroup | None,
    src: int,
    device: torch.device | str = "cpu",
    version: int | None = None,
) -> SyncStats:
    """Receive what `send_weights` broadcasts from `src`; each bucket's (name, tensor) pairs (views into
    the bucket buffer on `device`) go to `load_weights`, which must copy them. `version`: the weight
    version expected (None: any). Raises WeightSyncError on another version, changed bytes or a lost
    bucket."""
    channel = _channel(group)
    stats = SyncStats()
    t0 = time.perf_counter()
    while True:
        msg = channel.broadcast_object(None, src)
        assert isinstance(msg, dict)
        if version is not None and msg["version"] != version:
            raise WeightSyncError(
                f"weight push from rank {src} is version {msg['version']}, expected {version}"
            )
        if "end" in msg:
            if msg["end"] != stats.buckets:
                raise WeightSyncError(
                    f"weight push v{msg['version']} from rank {src}: {msg['end']} buckets sent, {stats.buckets} "
                    "received"
                )
            break
        header = msg["header"]
        last = header[-1]
        dtype = getattr(torch, last[2])
        total = last[3] + _aligned(torch.Size(last[1]).numel() * torch.empty((), dtype=dtype).element_size())
        buf = torch.empty(total, dtype=torch.uint8, device=device)
        channel.broadcast(buf, src)
        if checksum(buf) != msg["checksum"]:
            raise WeightSyncError(
                f"weight push v{msg['version']} from rank {src}: bucket {stats.buckets} ({header[0][0]} ...) "
                "arrived with other bytes than were sent (checksum mismatch)"
            )
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
    group: Channel | torch.distributed.ProcessGroup | None,
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

        from rltrain.megatron.hf_weights import global_params
        from rltrain.megatron.model import unwrap

        self.arch = arch
        self.tp = tp_size if tp_size is not None else parallel_state.get_tensor_model_parallel_world_size()
        self.rank = tp_rank if tp_rank is not None else parallel_state.get_tensor_model_parallel_rank()
        self.params: dict[str, tuple[torch.nn.Parameter, int]] = {}
        for chunk in chunks:
            module = unwrap(chunk)
            for name, param in global_params(module):
                self.params[name] = (param, module.vocab_size)
        self.pending = set(self.params)
        self.received: dict[str, torch.Tensor] = {}

    def __call__(self, named: NamedTensors) -> None:
        for name, t in named:
            self.received[name] = t.detach().clone()
        self._load_ready()

    def get(self, name: str) -> torch.Tensor:  # the reader interface of hf_weights.hf_full_tensor
        return self.received[name]

    def __contains__(self, name: str) -> bool:
        return name in self.received

    @torch.no_grad()
    def _load_ready(self) -> None:
        from rltrain.megatron.hf_weights import hf_full_tensor, tp_shard

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
                full = hf_full_tensor(name, self, self.arch, self.tp, vocab_rows)  # type: ignore[arg-type]
            except KeyError:
                continue  # a source tensor has not arrived yet
            local = tp_shard(full, param, self.tp, self.rank)
            if local.shape != param.shape:
                raise ValueError(
                    f"{name}: received {tuple(local.shape)}, megatron expects {tuple(param.shape)}"
                )
            if name.endswith(
                ".mlp.router.expert_bias"
            ):  # the routing bias stays fp32 (hf_weights loads it so)
                param.data = local.to(device=param.device, dtype=torch.float32)
            else:
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
    "Channel",
    "MegatronWeightLoader",
    "SyncStats",
    "WeightSyncError",
    "checksum",
    "iter_hf_weights",
    "receive_weights",
    "send_weights",
    "sync_weights",
]
