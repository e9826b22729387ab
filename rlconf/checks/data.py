"""Rules of the prompt data: file types, trainer.total_epochs against the prompt files, and (filesystem) that the files exist.

Each rule registers itself in rlconf.rules with `@rule(name, fields...)` when this module is imported
(rlconf.validate imports every check module, in the order the docs list the rules).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace

from rlconf.checks.limits import MAX_TOTAL_STEPS
from rlconf.checks.values import sizes_ok
from rlconf.config import (
    RLConfig,
)
from rlconf.errors import ConfigError, Issue, error
from rlconf.files import MAX_DATA_BYTES, check_regular
from rlconf.rules import rule
from rlconf.run_length import RULE as RUN_LENGTH_RULE
from rlconf.run_length import run_length, setting_issues

PROMPT_FILE_TYPES = (".parquet", ".jsonl")
"""Suffixes the data loader reads (rltrain.data; case-insensitive)."""


@rule("data-files", "data.train_files", "data.val_files")
def data_files(c: RLConfig) -> Iterator[Issue]:
    """Prompt files are .parquet or .jsonl (the types the data loader reads)."""
    for name in ("train_files", "val_files"):
        for i, f in enumerate(getattr(c.data, name)):
            if not f.lower().endswith(PROMPT_FILE_TYPES):
                hint = " (JSON lines: rename it to .jsonl)" if f.lower().endswith(".json") else ""
                yield error(f"data.{name}[{i}]", f"{f!r} is not a .parquet or .jsonl file{hint}",
                            "convert it to parquet or jsonl (one JSON object per line)", "data-files")  # fmt: skip


@rule(RUN_LENGTH_RULE, "trainer.total_epochs", "trainer.total_steps", "data.train_files")
def total_epochs(c: RLConfig) -> Iterator[Issue]:
    """trainer.total_epochs is >= 1, replaces trainer.total_steps (which stays at its default: setting both
    is an error naming both) and needs data.train_files (a synthetic task is an unbounded stream)."""
    yield from setting_issues(c)


@rule(f"{RUN_LENGTH_RULE}-prompts", "trainer.total_epochs", "data.train_files", "data.train_batch_size",
      filesystem=True)  # fmt: skip
def total_epochs_prompts(c: RLConfig) -> Iterator[Issue]:
    """With trainer.total_epochs, data.train_files can be counted and hold at least one full batch of
    data.train_batch_size prompts, and the steps they give stay within the plan's limit."""
    files = c.data.train_files
    if c.trainer.total_epochs is None or setting_issues(c) or not sizes_ok(c):
        return
    if not all(os.path.isfile(f) and f.lower().endswith(PROMPT_FILE_TYPES) for f in files):
        return  # data-files and data-files-exist report these
    name = f"{RUN_LENGTH_RULE}-prompts"
    try:
        length = run_length(c)
    except ConfigError as exc:
        yield from (replace(i, rule=name) for i in exc.issues)
        return
    if length.total_steps > MAX_TOTAL_STEPS:
        yield error("trainer.total_epochs", f"{length.describe()} is more than a plan supports "
                    f"({MAX_TOTAL_STEPS:,} steps)", "use fewer epochs (a longer run resumes from its checkpoint "
                    "with more epochs)", name)  # fmt: skip


@rule("data-files-exist", "data.train_files", "data.val_files", filesystem=True)
def data_files_exist(c: RLConfig) -> Iterator[Issue]:
    """Prompt files exist (relative paths are relative to the directory the run starts in)."""
    for name in ("train_files", "val_files"):
        for i, f in enumerate(getattr(c.data, name)):
            if os.path.lexists(f) and not os.path.isdir(
                f
            ):  # a FIFO or device: refused, never opened blocking
                try:
                    check_regular(f, MAX_DATA_BYTES, key=f"data.{name}[{i}]", what="prompt file")
                except ConfigError as exc:
                    yield replace(exc.issues[0], rule="data-files-exist")
                continue
            if not os.path.isfile(f):
                what = "is a folder" if os.path.isdir(f) else "does not exist"
                yield error(f"data.{name}[{i}]", f"prompt file {f!r} {what}",
                            f"fix the path (relative to {os.getcwd()})", "data-files-exist")  # fmt: skip
