"""Generation ahead of the update on a separate rollout pool (rollout.placement: separate).

A producer thread in the controller makes the batch of each step (`produce(step)`: prompts, generation on
the rollout workers, rewards) while the main thread trains on an earlier one and pushes weights. Three
rules keep it correct:

- Bounded staleness: the batch of step s starts generating only once the rollout holds weights of version
  >= s - 1 - off_policy_steps (version v = the weights after v updates). With off_policy_steps 0 each batch
  waits for the push of the update before it (on-policy); with 1 the batch of step s + 1 is generated while
  step s trains, with the weights after step s - 1.
- One version per batch: a push waits until the batch being generated is done, and no generation starts
  while a push runs, so every row of a batch (every turn of a multi-turn rollout) sees the same weights.
- Nothing is lost on failure: an exception in the producer reaches the main thread when it asks for that
  batch (or at once if it is waiting), with its type and message (a WorkerError names role and rank).

Everything that touches the rollout workers from the main thread (a push, validation) runs inside
`exclusive()`, so the two threads never drive the rollout workers at the same time.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

_POLL_S = 0.5  # the main thread's wait wakes this often, so Ctrl-C is handled promptly


class RolloutPipeline:
    """Produces the batches of steps first..last on a background thread, at most `off_policy_steps` ahead of
    the rollout's weights."""

    def __init__(
        self, produce: Callable[[int, int], Any], first: int, last: int, off_policy_steps: int, version: int
    ) -> None:
        """`produce(step, version)` makes the batch of `step` with the rollout's weights of `version`;
        `version`: the weights the rollout holds now (the initial push)."""
        self._produce = produce
        self._steps = range(first, last + 1)
        self.off_policy_steps = off_policy_steps
        self.version = version
        self._cond = threading.Condition()
        self._busy = False  # a generation, a push or a validation is using the rollout workers
        self._results: dict[int, tuple[bool, Any]] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rlplan-rollout", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for step in self._steps:
            with self._cond:
                while not self._stopping and (self._busy or self.version < step - 1 - self.off_policy_steps):
                    self._cond.wait()
                if self._stopping:
                    return
                self._busy = True
                version = self.version
            try:
                result: tuple[bool, Any] = (True, (self._produce(step, version), version))
            except BaseException as exc:  # handed to the main thread, which raises it
                result = (False, exc)
            with self._cond:
                self._busy = False
                self._results[step] = result
                self._cond.notify_all()
            if not result[0]:
                return

    def take(self, step: int) -> tuple[Any, int]:
        """(the batch of `step`, the weight version it was generated with); waits for it. Raises what the
        producer raised."""
        if self._thread is None:
            self.start()
        with self._cond:
            while step not in self._results:
                if self._failed() is not None:
                    break
                self._cond.wait(_POLL_S)
            ok, value = self._results.pop(step, None) or (False, self._failed())
        if not ok:
            raise value
        return value

    def _failed(self) -> BaseException | None:
        return next((v for ok, v in self._results.values() if not ok), None)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Use the rollout workers from the main thread (a push, a validation pass): waits for a generation
        in progress to end; none starts until this ends."""
        with self._cond:
            while self._busy:
                self._cond.wait(_POLL_S)
            self._busy = True
        try:
            yield
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def push(self, version: int, send: Callable[[], Any]) -> Any:
        """Run `send` (the weight push of `version`) once no generation is in progress; the batches waiting
        for `version` start after it. The version changes before any generation can start again, so a batch
        is never tagged with other weights than it used."""
        with self.exclusive():
            result = send()
            with self._cond:
                self.version = version
        return result

    def close(self) -> None:
        """Stop producing (a generation in progress finishes or fails on its own: the thread is a daemon)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()


__all__ = ["RolloutPipeline"]
