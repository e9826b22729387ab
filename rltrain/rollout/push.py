"""Weight push from the trainer to a separate rollout pool (rollout.placement: separate).

The trainer (the policy workers) and the rollout (the rollout workers) are two Ray worker groups, each its
own torch.distributed world (megatron's parallel state is per process and covers one world). The push
needs a group across them: for every pipeline stage p of the trainer, a process group of its own
(`PushGroup`, a store-based gloo / NCCL group outside the default world) holds that stage's sending rank
(tp 0, cp 0, dp 0 of stage p; push rank 0) and every rollout rank (push rank 1 + r). After each update
every trainer rank runs `push_weights` (the TP gather of `weight_sync.iter_hf_weights` is collective over
its stage's TP group) and the senders broadcast their stage in buckets; every rollout rank receives the
stages in order into a `MegatronWeightLoader` of its own layout. Messages carry the weight version and
every bucket its checksum (rltrain/rollout/weight_sync.py).

Failures never hang the run: every collective of a push group times out after rollout.push_timeout_s
(the group's timeout), and the controller waits on both sides at once (`ray_group.wait_all`): a dead or
failing worker on either side stops the step with an error naming its role and rank at once.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import re
import time
from dataclasses import dataclass

import torch

from rltrain import device as devices
from rltrain.rollout.weight_sync import Channel

STORE_PREFIX = "rlplan/push/stage"
FAULT_ENV = "RLPLAN_PUSH_FAULT"
"""Test-only fault points, `NAME@V` (V: a weight version). Production never sets it.

- `receiver_dies@V`: rollout rank 0 exits (as a crash would) when the push of version V reaches it.
- `sender_dies@V`: the sender of stage 0 exits in the middle of the push of version V, after its first
  bucket header: the rollout ranks are inside the push's collectives, waiting for bytes that never come.
- `sender_stalls@V`: the sender of stage 0 stops in the middle of the push of version V for longer than
  the push timeout (a stuck collective): the rollout ranks must time out, not wait forever."""
_FAULTS = ("receiver_dies", "sender_dies", "sender_stalls")
logger = logging.getLogger(__name__)


def _fault_spec() -> tuple[str, int] | None:
    """The (name, version) of `FAULT_ENV`, None when unset; an unknown spec is an error."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    name, _, at = spec.partition("@")
    if name not in _FAULTS or not at.isdigit():
        raise ValueError(f"{FAULT_ENV}={spec}: expected one of {', '.join(_FAULTS)}, then @VERSION")
    return name, int(at)


def receiver_fault(rank: int, version: int) -> None:
    """The receiver's test-only fault point of `FAULT_ENV` (a no-op unless it is set)."""
    spec = _fault_spec()
    if spec is not None and spec == ("receiver_dies", version) and rank == 0:
        logger.warning("%s: rollout rank 0 exits at the push of version %d", FAULT_ENV, version)
        os._exit(1)


def _sender_fault(stage: int, message: object, timeout_s: float) -> None:
    """The sender's test-only fault point, reached after each bucket header of a push (`message`)."""
    spec = _fault_spec()
    if spec is None or stage != 0 or not isinstance(message, dict) or "header" not in message:
        return
    name, version = spec
    if message["version"] != version:
        return
    if name == "sender_dies":
        logger.warning("%s: the sender of stage 0 exits in the push of version %d", FAULT_ENV, version)
        os._exit(1)
    if name == "sender_stalls":
        logger.warning("%s: the sender of stage 0 stalls in the push of version %d", FAULT_ENV, version)
        time.sleep(timeout_s * 2 + 1)


class PushError(RuntimeError):
    """A collective of a push group failed: what broke (gloo's / NCCL's message without its source path)
    and the timeout that bounds it."""


def _first_line(exc: BaseException) -> str:
    """The backend's message, its first line, without the `[/path/to/file.cc:NN] ` prefix."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", lines[0])


@dataclass(frozen=True)
class PushEndpoint:
    """Where the push groups meet: the TCP store hosted by the first sending rank."""

    host: str
    port: int
    timeout_s: float
    senders: int
    """Trainer ranks that send: one per pipeline stage (stage p's group is `STORE_PREFIX{p}`)."""
    receivers: int
    """Rollout ranks."""


class PushGroup(Channel):
    """One stage's push group: a gloo (cpu) or NCCL (cuda) process group built on a TCP store, outside the
    default torch.distributed world (both sides already have one), with the push timeout on every
    collective."""

    def __init__(self, store: torch.distributed.Store, stage: int, rank: int, size: int, device: str,
                 timeout_s: float) -> None:  # fmt: skip
        super().__init__(None)
        self.rank, self.size, self.device = rank, size, device
        self.stage, self.timeout_s = stage, timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        prefixed = torch.distributed.PrefixStore(f"{STORE_PREFIX}{stage}", store)
        if device == "cuda":
            options = torch.distributed.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = torch.distributed.ProcessGroupNCCL(prefixed, rank, size, options)
            self.tensor_device = devices.torch_device(device)
        else:
            self.pg = torch.distributed.ProcessGroupGloo(prefixed, rank, size, timeout)
            self.tensor_device = torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        try:
            self.pg.broadcast([tensor], opts).wait()
        except RuntimeError as exc:  # gloo / NCCL: a peer died or stalled, or the timeout ran out
            raise PushError(
                f"weight push of stage {self.stage} broke: {_first_line(exc)} (a peer died or stalled; every "
                f"push collective waits at most rollout.push_timeout_s = {self.timeout_s:g} s)"
            ) from None

    def broadcast_object(self, obj: object, src: int) -> object:
        """Pickled bytes, their length first (small: a bucket's header)."""
        payload = pickle.dumps(obj) if self.rank == src else b""
        size = torch.tensor([len(payload)], dtype=torch.int64, device=self.tensor_device)
        self.broadcast(size, src)
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=self.tensor_device)
        if self.rank == src:
            buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.broadcast(buf, src)
        if self.rank == src:
            _sender_fault(self.stage, obj, self.timeout_s)
        return obj if self.rank == src else pickle.loads(buf.cpu().numpy().tobytes())

    def close(self) -> None:
        if hasattr(self.pg, "shutdown"):
            self.pg.shutdown()


def host_store(timeout_s: float) -> tuple[torch.distributed.TCPStore, int]:
    """The push store's server, on a free port of this process's node (the first sender hosts it)."""
    store = torch.distributed.TCPStore(
        "0.0.0.0", 0, is_master=True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )
    return store, store.port


def connect_store(endpoint: PushEndpoint) -> torch.distributed.TCPStore:
    return torch.distributed.TCPStore(
        endpoint.host, endpoint.port, is_master=False, timeout=datetime.timedelta(seconds=endpoint.timeout_s)
    )


__all__ = ["PushEndpoint", "PushError", "PushGroup", "connect_store", "host_store"]
