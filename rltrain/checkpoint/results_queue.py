"""Megatron's dist-checkpoint write-results queue, without a manager process.

megatron-core's `FileSystemWriterAsync` hands every save's write results (or the exception) to one
process-wide queue, `filesystem_async._results_queue`, made on a process's first save as a
multiprocessing Manager started by the *spawn* method: a fresh interpreter that re-imports the caller's
main module (inside a Ray worker, Ray's worker module) and then torch, to unpickle the results. On 2 cores
that cost 3-4 s of every run's first save, and each saving worker kept a ~300 MB process alive for it.

Who puts: the saving process itself (a synchronous save writes in-process) or the writer megatron forks
for an asynchronous save (`AsyncCallsQueue(persistent=False)`: fork); the saving process reads once the
write has ended. `WriteResultsQueue` serves both without a server: an in-process put goes straight into a
`queue.Queue`; a forked writer sends the pickled results down a pipe inherited across the fork, and a
thread of the owner drains the pipe into that queue, so the writer never blocks on a full pipe.
`install` seeds megatron's queue global with one before the first save (megatron then uses it as its own).
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import threading
from typing import Any

# How long a read waits for a forked writer's results to cross the pipe. The writer has sent them before
# it exits and megatron reads only after that, so they are normally there within milliseconds; a writer
# killed before sending leaves nothing, and megatron then reports "results_queue should not be empty".
ARRIVAL_WAIT_S = 10.0


class WriteResultsQueue:
    """The queue methods megatron's writer uses (`put`, `get_nowait`), for the owner and its forks."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("fork")
        self.owner = os.getpid()
        self._items: queue.Queue[Any] = queue.Queue()
        self._reader, self._writer = ctx.Pipe(duplex=False)
        # Two asynchronous saves may be in flight: their writers send one message at a time.
        self._send_lock = ctx.Lock()
        threading.Thread(target=self._drain, name="rlplan-ckpt-results", daemon=True).start()

    def _drain(self) -> None:
        while True:
            try:
                item = self._reader.recv()
            except (EOFError, OSError):
                return
            self._items.put(item)

    def put(self, item: Any) -> None:
        if os.getpid() == self.owner:
            self._items.put(item)
            return
        with self._send_lock:
            self._writer.send(item)

    def get_nowait(self) -> Any:
        """The next results; waits up to ARRIVAL_WAIT_S for a forked writer's to cross the pipe (megatron
        reads after the write ended), then raises queue.Empty as megatron's manager queue would."""
        return self._items.get(timeout=ARRIVAL_WAIT_S)

    def empty(self) -> bool:
        return self._items.empty()


def install() -> WriteResultsQueue | Any:
    """Make megatron's write-results queue a `WriteResultsQueue` unless this process already has one
    (megatron's own included); returns the queue in place. Called by the saving process before each save:
    a process forked from a saver that saves itself gets its own (the inherited one's reader thread lives
    in the parent). Megatron is imported by the caller."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    current = filesystem_async._results_queue
    if current is None or (isinstance(current, WriteResultsQueue) and current.owner != os.getpid()):
        filesystem_async._results_queue = WriteResultsQueue()
    return filesystem_async._results_queue


__all__ = ["ARRIVAL_WAIT_S", "WriteResultsQueue", "install"]
