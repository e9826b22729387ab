"""A budget of time and memory for code we run but did not write: a chat template's Jinja rendering (at
`rlconf validate` by rlconf.model_files, and at every rendering by rltrain.tokenizer).

A chat template ships inside a model folder (tokenizer_config.json, chat_template.jinja) and runs in
transformers' sandboxed Jinja environment, which stops attribute tricks but not work: two nested
`range(100000)` loops run 10^10 iterations (the issue saw 10 GB after 90 s). Jinja compiles a template to
Python, so `render_budget` traces the rendering thread (sys.settrace) and, every few thousand trace events,
checks the clock and this process's resident memory; past MAX_RENDER_S seconds or MAX_RENDER_GROWTH bytes of
growth it raises RenderBudgetExceeded inside the template's own frame, which unwinds the render. A real
chat template renders in well under a millisecond, far inside the budget; tracing costs a few times that.
Standard library only (rlconf never imports torch).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

MAX_RENDER_S = 2.0
"""Seconds one rendering may take."""
MAX_RENDER_GROWTH = 512 << 20
"""Bytes the process's resident memory may grow by during one rendering."""
CHECK_EVERY = 4096
"""Trace events between two checks of the clock and the memory."""
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class RenderBudgetExceeded(RuntimeError):
    """A rendering ran past its time or memory budget (the message says which)."""


def _rss() -> int:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


@contextlib.contextmanager
def render_budget(
    what: str, seconds: float = MAX_RENDER_S, growth: int = MAX_RENDER_GROWTH
) -> Iterator[None]:
    """Run the body under a budget; RenderBudgetExceeded (naming `what`) when it runs past it."""
    previous = sys.gettrace()
    deadline = time.monotonic() + seconds
    base = _rss()
    count = 0

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        count += 1
        if count % CHECK_EVERY == 0:
            if time.monotonic() > deadline:
                raise RenderBudgetExceeded(f"{what} ran longer than {seconds:g} s")
            if _rss() - base > growth:
                raise RenderBudgetExceeded(
                    f"{what} grew this process's memory by more than {growth >> 20} MiB"
                )
        return trace

    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(previous)
