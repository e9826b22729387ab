"""How many training steps a run has: `trainer.total_steps`, or `trainer.total_epochs` passes over the prompt
files.

The plan derives the count once (`rlconf.plan` compiles with it in `trainer.total_steps` and records it as
`RunPlan.total_steps` and `TrainerPlan.length`, so the lr table, the checkpoint steps and the trainer loop
all read the same number) and shows where it came
from. An epoch is cut the way `rltrain.data.PromptDataloader` cuts it: both call `batches_per_epoch`.
Prompts are counted without reading them (rlconf never tokenizes): non-empty lines of a .jsonl file, the
row count in a parquet file's footer. Pure apart from that: pyarrow is imported only to read a footer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

from rlconf.config import RLConfig, TrainerConfig
from rlconf.errors import ConfigError, Issue, error

RULE = "total-epochs"
"""Rule name of every issue about trainer.total_epochs (rlconf.validate registers it)."""

DEFAULT_TOTAL_STEPS: int = next(f.default for f in fields(TrainerConfig) if f.name == "total_steps")  # type: ignore[assignment]
"""trainer.total_steps left at its default: the value total_epochs replaces."""


def batches_per_epoch(num_prompts: int, batch_size: int) -> int:
    """Training batches in one pass over `num_prompts` prompts: the incomplete last batch of an epoch is
    dropped, so every step trains on exactly `batch_size` prompts."""
    return num_prompts // batch_size


@dataclass(frozen=True)
class RunLength:
    """The run's training steps and where the number comes from."""

    total_steps: int
    total_epochs: int | None = None
    """Set when the steps are total_epochs x batches_per_epoch."""
    prompts: int | None = None
    """Rows in data.train_files (with total_epochs)."""
    batch_size: int | None = None
    """data.train_batch_size (with total_epochs)."""
    batches_per_epoch: int | None = None

    def describe(self) -> str:
        """One line for `rlconf plan`: `total_steps 150 = 15 epochs x 10 batches of 64 prompts (...)`."""
        if self.total_epochs is None:
            return f"total_steps {self.total_steps} (trainer.total_steps)"
        unused = (self.prompts or 0) - (self.batches_per_epoch or 0) * (self.batch_size or 0)
        tail = f"; {unused} left over each epoch" if unused else ""
        return (
            f"total_steps {self.total_steps} = {self.total_epochs} epochs x {self.batches_per_epoch} batches of "
            f"{self.batch_size} prompts (trainer.total_epochs; {self.prompts} prompts in data.train_files{tail})"
        )


def setting_issues(c: RLConfig) -> list[Issue]:
    """What is wrong with how the config asks for total_epochs, without opening a file."""
    t = c.trainer
    epochs = t.total_epochs
    if epochs is None:
        return []
    issues = []
    if isinstance(epochs, int) and not isinstance(epochs, bool) and epochs < 1:
        issues.append(error("trainer.total_epochs", f"must be >= 1, got {epochs}",
                            "use a positive number of epochs, or null to count trainer.total_steps", RULE))  # fmt: skip
    if t.total_steps != DEFAULT_TOTAL_STEPS:
        issues.append(
            error(
                "trainer.total_steps",
                f"trainer.total_steps = {t.total_steps} and trainer.total_epochs = {epochs} both set the run's "
                "length",
                "keep one: remove trainer.total_epochs, or trainer.total_steps (back to its default "
                f"{DEFAULT_TOTAL_STEPS}, which total_epochs replaces; a preset's total_steps is reset with "
                f"--trainer.total_steps {DEFAULT_TOTAL_STEPS})",
                RULE,
            )
        )
    if not c.data.train_files:
        issues.append(
            error(
                "trainer.total_epochs",
                f"total_epochs = {epochs}, but without data.train_files the prompts are the synthetic task "
                f"{c.data.synthetic_task!r}, an unbounded stream that has no epochs",
                "set trainer.total_steps instead (the number of steps), or point data.train_files at prompt files",
                RULE,
            )
        )
    return issues


def count_prompt_rows(path: str, where: str) -> int:
    """Prompts in one file as the data loader reads it (before data.truncation = filter drops long ones):
    non-empty lines of a .jsonl file, rows of a parquet file (from its footer). ConfigError on `where` when
    the file is missing, of another type or unreadable."""
    if not os.path.isfile(path):
        raise ConfigError([error(where, f"cannot count the prompts of {path!r}: no such file",
                                 "fix the path, or set trainer.total_steps instead of total_epochs", RULE)])  # fmt: skip
    lower = path.lower()
    if lower.endswith(".jsonl"):
        with open(path, "rb") as fh:
            return sum(1 for line in fh if line.strip())
    if lower.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq

            return int(pq.read_metadata(path).num_rows)
        except ImportError as exc:
            raise ConfigError([error(where, f"counting the rows of {path!r} needs pyarrow ({exc})",
                                     "pip install pyarrow", RULE)]) from exc  # fmt: skip
        except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for a file that is not parquet
            raise ConfigError([error(where, f"cannot read the parquet footer of {path!r}: {exc}",
                                     "check that the file is a complete parquet file", RULE)]) from exc  # fmt: skip
    raise ConfigError([error(where, f"cannot count the prompts of {path!r}: not a .parquet or .jsonl file",
                             "convert it to parquet or jsonl", RULE)])  # fmt: skip


def run_length(c: RLConfig) -> RunLength:
    """The run's steps: trainer.total_steps, or total_epochs x batches per epoch of data.train_files.
    Raises ConfigError (rule total-epochs) when total_epochs is set wrongly or its files cannot be counted."""
    t = c.trainer
    if t.total_epochs is None:
        return RunLength(t.total_steps)
    issues = setting_issues(c)
    if issues:
        raise ConfigError(issues)
    prompts = sum(count_prompt_rows(f, f"data.train_files[{i}]") for i, f in enumerate(c.data.train_files))
    batch = c.data.train_batch_size
    per_epoch = batches_per_epoch(prompts, batch) if batch >= 1 else 0
    if per_epoch == 0:
        raise ConfigError(
            [
                error(
                    "data.train_batch_size",
                    f"data.train_files hold {prompts} prompts, fewer than data.train_batch_size = {batch}: an "
                    "epoch has no full batch",
                    f"lower data.train_batch_size to at most {prompts}, or add prompts",
                    RULE,
                )
            ]
        )
    return RunLength(t.total_epochs * per_epoch, t.total_epochs, prompts, batch, per_epoch)


def with_run_length(c: RLConfig, length: RunLength) -> RLConfig:
    """`c` with trainer.total_steps set to the derived step count (total_epochs stays, as the source)."""
    if length.total_steps == c.trainer.total_steps:
        return c
    return replace(c, trainer=replace(c.trainer, total_steps=length.total_steps))


def resolved_or_same(c: RLConfig) -> RLConfig:
    """`c` with its derived step count when total_epochs resolves here, else `c` unchanged (validation
    reports why; the files may also live on another machine)."""
    if c.trainer.total_epochs is None:
        return c
    try:
        return with_run_length(c, run_length(c))
    except ConfigError:
        return c
