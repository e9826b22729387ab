"""Training and validation prompts: files (parquet / jsonl) or built-in synthetic tasks, and their loader.

A prompt source yields `Example`s (token ids, prompt text, ground truth); `PromptDataloader` cuts them into
`PromptBatch`es of `data.train_batch_size` prompts and can save and restore its position, so a resumed run
sees exactly the batches it would have seen. Batches hold *unpadded* token-id lists (prompts differ in
length and each engine pads its own way); `PromptBatch.left_padded` gives the left-padded tensor and
attention mask that generation wants.

Synthetic tasks (no download, seeded by `data.seed`, an unlimited deterministic stream; sample i depends
only on (task, seed, split, i)):
    count  "1 2 3" -> "4 5 6"    continue a run of consecutive digits (start 1-4, three digits each side)
    copy   "3 9 1" -> "3 9 1"    repeat the prompt's digits
    add    "12+7=" -> "19"       sum a number below 100 and a digit
    mul    "47*8=" -> "376"      a two-digit number times a digit (the tiny-tool preset: the tiny model
                                 cannot multiply, the calculator tool can)
`count` is deliberately narrow: with the default `digit_match` reward a random-init 2-layer model (hidden 64,
vocab 32) trained by GRPO (8 prompts x 4 samples, lr 1e-3) raises its reward about threefold in 30 steps;
with starts drawn from all ten digits the same run barely moves (the marginal answer distribution is then
uniform, and learning the conditional "successor" map from a 1-in-32 hit rate takes hundreds of steps).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlconf.errors import ConfigError, error
from rlconf.files import MAX_DATA_BYTES, check_regular
from rlconf.plan.run import DataPlan
from rlconf.run_length import batches_per_epoch
from rltrain.tokenizer import Prompt, Tokenizer, messages_to_text

logger = logging.getLogger(__name__)

SYNTHETIC_TASKS: tuple[str, ...] = ("count", "copy", "add", "mul")
# Size of the synthetic validation split: large enough for a stable mean, small enough for CPU runs.
SYNTHETIC_VAL_SIZE = 64
# The synthetic prompt spaces are tiny (count has 4 distinct prompts), so "held out" means a separately
# seeded stream, not disjoint content.
_SPLIT_CODES = {"train": 0, "val": 1}
# Give up on a synthetic stream after this many consecutive filtered samples (max_prompt_length too small).
_MAX_CONSECUTIVE_FILTERED = 1000


class DataError(ConfigError):
    """Prompts that cannot be loaded as configured; names the `data.*` path, the file and the fix."""

    def __init__(self, path: str, message: str, fix: str, rule: str = "data") -> None:
        super().__init__([error(path, message, fix, rule=rule)])
        self.message = message
        self.fix = fix


@dataclass(frozen=True)
class Example:
    """One prompt ready for rollout: `input_ids` already fitted to data.max_prompt_length."""

    input_ids: list[int]
    prompt: str
    """Plain prompt text (chat messages joined), passed to the reward function."""
    ground_truth: str
    index: int
    """Position in the source: row number over all files, or the synthetic stream index."""
    data_source: str = ""
    """verl's `data_source` column (which scorer reward.function default_compute_score picks); empty
    when the data has none."""
    extra_info: Any = None
    """verl's `extra_info` column, handed to verl-style reward functions as is."""


@dataclass(frozen=True)
class PromptBatch:
    """A batch of prompts: unpadded token ids plus what the reward function needs."""

    input_ids: list[list[int]]
    prompts: list[str]
    ground_truths: list[str]
    indices: list[int]
    data_sources: list[str]
    extra_infos: list[Any]

    def __len__(self) -> int:
        return len(self.input_ids)

    def left_padded(self, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask), both (B, max_len) int64, left-padded so generation appends at the
        right edge of every row."""
        return left_pad(self.input_ids, pad_token_id)


def left_pad(seqs: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad id lists to a (B, max_len) tensor; the mask is 1 on real tokens."""
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        if seq:
            ids[row, width - len(seq) :] = torch.as_tensor(list(seq), dtype=torch.long)
            mask[row, width - len(seq) :] = 1
    return ids, mask


def fit_prompt(ids: list[int], max_len: int, truncation: str, where: str) -> list[int] | None:
    """Apply `data.truncation` to a prompt longer than `data.max_prompt_length`.

    filter -> None (drop it), left -> keep the last max_len tokens, right -> keep the first max_len tokens,
    error -> raise DataError naming `where` (file and row, or the synthetic sample).
    """
    if len(ids) <= max_len:
        return ids
    if truncation == "filter":
        return None
    if truncation == "left":
        return ids[-max_len:]
    if truncation == "right":
        return ids[:max_len]
    if truncation == "error":
        raise DataError(
            "data.max_prompt_length",
            f"prompt {where} has {len(ids)} tokens, more than data.max_prompt_length={max_len}",
            "raise data.max_prompt_length, or set data.truncation to filter (drop long prompts), left or "
            "right (cut them)",
            rule="prompt-too-long",
        )
    raise DataError(
        "data.truncation",
        f"unknown truncation mode {truncation!r}",
        "use one of error, left, right, filter",
        rule="data-truncation",
    )


# ----------------------------------------------------------------------------------- synthetic tasks
def synthetic_sample(task: str, seed: int, index: int, split: str = "train") -> tuple[str, str]:
    """(prompt, answer) number `index` of a synthetic task's stream; a pure function of its arguments."""
    if split not in _SPLIT_CODES:
        raise ValueError(f"split must be one of {', '.join(_SPLIT_CODES)}, got {split!r}")
    if task not in SYNTHETIC_TASKS:
        raise DataError(
            "data.synthetic_task",
            f"unknown synthetic task {task!r}",
            f"use one of {', '.join(SYNTHETIC_TASKS)}, or set data.train_files",
            rule="synthetic-task",
        )
    # SeedSequence mixes the words into independent streams: no overlap between seeds, splits or indices.
    rng = np.random.default_rng([seed, _SPLIT_CODES[split], index, SYNTHETIC_TASKS.index(task)])
    if task == "count":
        start = int(rng.integers(1, 5))
        prompt = " ".join(str((start + i) % 10) for i in range(3))
        answer = " ".join(str((start + 3 + i) % 10) for i in range(3))
        return prompt, answer
    if task == "copy":
        digits = " ".join(str(int(d)) for d in rng.integers(0, 10, size=3))
        return digits, digits
    if task == "add":
        a, b = int(rng.integers(0, 100)), int(rng.integers(0, 10))
        return f"{a}+{b}=", str(a + b)
    if task == "mul":
        a, b = int(rng.integers(10, 100)), int(rng.integers(2, 10))
        return f"{a}*{b}=", str(a * b)
    raise AssertionError(f"synthetic task {task!r} is listed but not implemented")


class SyntheticPromptSource:
    """A synthetic task as an indexable stream; `size` None means unlimited (training)."""

    def __init__(
        self,
        task: str,
        seed: int,
        tokenizer: Tokenizer,
        data: DataPlan,
        split: str = "train",
        size: int | None = None,
    ) -> None:
        synthetic_sample(task, seed, 0, split)  # validates task and split up front
        self.task, self.seed, self.split, self.size = task, seed, split, size
        self.tokenizer = tokenizer
        self.max_prompt_length = data.max_prompt_length
        self.truncation = data.truncation
        self.apply_chat_template = data.apply_chat_template

    def __len__(self) -> int:
        if self.size is None:
            raise TypeError("an unlimited synthetic stream has no length")
        return self.size

    def get(self, index: int) -> Example | None:
        """Example `index`, or None when data.truncation=filter drops it."""
        prompt, answer = synthetic_sample(self.task, self.seed, index, self.split)
        ids = self.tokenizer.encode_prompt(prompt, self.apply_chat_template)
        fitted = fit_prompt(ids, self.max_prompt_length, self.truncation, f"{self.task}[{index}] {prompt!r}")
        if fitted is None:
            return None
        return Example(fitted, prompt, answer, index)


# ------------------------------------------------------------------------------------------- files
# verl's parquet columns beside the prompt and the ground truth, read when present (verl's own names).
DATA_SOURCE_KEY, EXTRA_INFO_KEY = "data_source", "extra_info"


def _lookup(record: dict[str, Any], key: str) -> tuple[bool, Any]:
    """record[key], or a nested lookup for dotted keys (verl's `reward_model.ground_truth`)."""
    if key in record:
        return True, record[key]
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _read_rows(path: Path, files_key: str) -> tuple[list[dict[str, Any]], list[str] | None]:
    """Rows of a parquet or jsonl file (and the parquet column names)."""
    if os.path.lexists(path):
        # A FIFO, a device or a symlink to /dev/zero is refused without blocking; the size is bounded.
        try:
            check_regular(path, MAX_DATA_BYTES, key=files_key, what="prompt file")
        except ConfigError as exc:
            issue = exc.issues[0]
            raise DataError(files_key, issue.message, issue.fix, rule="data-file-unreadable") from None
    if not path.is_file():
        raise DataError(
            files_key,
            f"prompt file {str(path)!r} does not exist",
            f"fix the path in {files_key} (relative paths are relative to the working directory)",
            rule="data-file-missing",
        )
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow raises ArrowInvalid/OSError for corrupt files
            raise DataError(
                files_key,
                f"cannot read parquet file {str(path)!r}: {exc}",
                "check that the file is a complete parquet file",
                rule="data-file-unreadable",
            ) from exc
        return table.to_pylist(), list(table.column_names)
    if suffix == ".jsonl":
        rows = []
        with path.open("rb") as fh:  # bytes: a line that is not UTF-8 is named, not a decode traceback
            for lineno, raw in enumerate(fh, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise DataError(
                        files_key,
                        f"{path}:{lineno} is not UTF-8 text (byte {exc.start + 1} of the line: "
                        f"{raw[exc.start : exc.start + 1]!r})",
                        "save the file as UTF-8 (JSON lines are UTF-8)",
                        rule="data-file-unreadable",
                    ) from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(
                        files_key,
                        f"{path}:{lineno} is not valid JSON ({exc.msg})",
                        "write one JSON object per line",
                        rule="data-file-unreadable",
                    ) from exc
                except RecursionError:
                    raise DataError(
                        files_key,
                        f"{path}:{lineno} is JSON nested too deeply to read",
                        "write one flat JSON object per line (prompt, answer, chat messages)",
                        rule="data-file-unreadable",
                    ) from None
                if not isinstance(row, dict):
                    raise DataError(
                        files_key,
                        f"{path}:{lineno} holds a {type(row).__name__}, not a JSON object",
                        'write one JSON object per line, e.g. {"prompt": "...", "answer": "..."}',
                        rule="data-file-unreadable",
                    )
                rows.append(row)
        return rows, None
    raise DataError(
        files_key,
        f"unsupported prompt file type {path.suffix!r} ({path})",
        "use .parquet or .jsonl files",
        rule="data-file-type",
    )


def _check_prompt(value: Any, where: str) -> Prompt:
    if isinstance(value, str):
        return value
    if isinstance(value, list | tuple) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in value
    ):
        return [dict(m) for m in value]
    raise DataError(
        "data.prompt_key",
        f"prompt {where} is a {type(value).__name__}; expected a string or a list of chat messages "
        "({'role': ..., 'content': ...})",
        "point data.prompt_key at a text column or a column of chat messages",
        rule="data-prompt-type",
    )


def load_prompt_files(
    files: Sequence[str],
    data: DataPlan,
    tokenizer: Tokenizer,
    files_key: str = "data.train_files",
) -> list[Example]:
    """Read, tokenize and fit every prompt of `files` (rows numbered across files in order).

    Rows longer than data.max_prompt_length are dropped, cut or rejected per data.truncation; the number
    dropped is logged. Raises DataError for missing files and columns, bad rows, or when nothing is left.
    """
    examples: list[Example] = []
    dropped = 0
    index = 0
    for name in files:
        path = Path(name)
        rows, columns = _read_rows(path, files_key)
        for key_path, key in (
            ("data.prompt_key", data.prompt_key),
            ("data.answer_key", data.answer_key),
        ):
            # Parquet has a schema: report a missing column once, with the columns there are.
            if columns is not None and key not in columns and key.split(".")[0] not in columns:
                raise DataError(
                    key_path,
                    f"column {key!r} not found in {path} (columns: {', '.join(columns)})",
                    f"set {key_path} to one of the columns of {path}",
                    rule="data-missing-column",
                )
        for row_no, row in enumerate(rows):
            where = f"{path}:{row_no + 1}" if columns is None else f"{path} row {row_no}"
            found_p, raw_prompt = _lookup(row, data.prompt_key)
            found_a, raw_answer = _lookup(row, data.answer_key)
            for found, key_path, key in (
                (found_p, "data.prompt_key", data.prompt_key),
                (found_a, "data.answer_key", data.answer_key),
            ):
                if not found:
                    raise DataError(
                        key_path,
                        f"key {key!r} missing in {where} (keys: {', '.join(row)})",
                        f"set {key_path} to the key holding it, or add it to every row of {path}",
                        rule="data-missing-column",
                    )
            if raw_answer is None:
                raise DataError(
                    "data.answer_key",
                    f"{data.answer_key!r} is null in {where}",
                    "give every row a ground truth (the reward function needs one)",
                    rule="data-missing-answer",
                )
            prompt = _check_prompt(raw_prompt, where)
            ids = tokenizer.encode_prompt(prompt, data.apply_chat_template)
            fitted = fit_prompt(ids, data.max_prompt_length, data.truncation, where)
            if fitted is None:
                dropped += 1
            else:
                source = row.get(DATA_SOURCE_KEY)
                examples.append(
                    Example(
                        fitted,
                        messages_to_text(prompt),
                        str(raw_answer),
                        index,
                        "" if source is None else str(source),
                        row.get(EXTRA_INFO_KEY),
                    )
                )
            index += 1
    if dropped:
        logger.warning(
            "dropped %d of %d prompts longer than data.max_prompt_length=%d (data.truncation=filter)",
            dropped,
            index,
            data.max_prompt_length,
        )
    if not examples:
        reason = (
            f"all {index} prompts are longer than data.max_prompt_length={data.max_prompt_length}"
            if dropped
            else "the files hold no rows"
        )
        raise DataError(
            files_key if not dropped else "data.max_prompt_length",
            f"no prompts left in {', '.join(files)}: {reason}",
            "raise data.max_prompt_length or set data.truncation to left/right"
            if dropped
            else f"check {files_key}",
            rule="data-empty",
        )
    return examples


class ListPromptSource:
    """A finite list of examples (loaded from files)."""

    def __init__(self, examples: list[Example]) -> None:
        self.examples = examples
        self.size: int | None = len(examples)

    def __len__(self) -> int:
        return len(self.examples)

    def get(self, index: int) -> Example | None:
        return self.examples[index]


PromptSource = ListPromptSource | SyntheticPromptSource


# ------------------------------------------------------------------------------------------ loader
class PromptDataloader:
    """Batches of prompts with a resumable position.

    Training (`repeat=True`): an endless iterator. A finite source is walked epoch by epoch in an order
    that is a permutation seeded by (seed, epoch) when `shuffle`, with the incomplete last batch of each
    epoch dropped so every step has `batch_size` prompts (`rlconf.run_length.batches_per_epoch`, the rule
    the plan counts trainer.total_epochs by); an unlimited synthetic stream is read in index
    order (it is random already). `state_dict()` records (epoch, cursor); loading it makes the next batch
    the one an uninterrupted run would have produced.

    Validation (`repeat=False`): each `iter()` makes one ordered pass over the whole source, the last
    batch possibly smaller; it keeps no state.
    """

    def __init__(
        self,
        source: PromptSource,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 1,
        repeat: bool = True,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.source = source
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.repeat = repeat
        self.epoch = 0
        self.cursor = 0
        if repeat and source.size is not None and source.size < batch_size:
            raise DataError(
                "data.train_batch_size",
                f"data.train_batch_size={batch_size} is larger than the {source.size} prompts available",
                f"lower data.train_batch_size to at most {source.size}, or add prompts",
                rule="data-too-few-prompts",
            )
        if not repeat and source.size is None:
            raise ValueError("a validation loader needs a finite source")
        self._order_epoch = -1
        self._order: np.ndarray | None = None

    def _order_for(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            n = len(self.source)
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(n)
            else:
                self._order = np.arange(n)
            self._order_epoch = epoch
        assert self._order is not None
        return self._order

    @staticmethod
    def _batch(examples: list[Example]) -> PromptBatch:
        return PromptBatch(
            input_ids=[list(e.input_ids) for e in examples],
            prompts=[e.prompt for e in examples],
            ground_truths=[e.ground_truth for e in examples],
            indices=[e.index for e in examples],
            data_sources=[e.data_source for e in examples],
            extra_infos=[e.extra_info for e in examples],
        )

    def __iter__(self) -> Iterator[PromptBatch]:
        if self.repeat:
            return self
        return self._one_pass()

    def _one_pass(self) -> Iterator[PromptBatch]:
        n = len(self.source)
        for start in range(0, n, self.batch_size):
            examples = [self.source.get(i) for i in range(start, min(start + self.batch_size, n))]
            kept = [e for e in examples if e is not None]
            if kept:
                yield self._batch(kept)

    def __len__(self) -> int:
        """Batches per epoch (training: full batches only; validation: including the last partial one)."""
        if self.source.size is None:
            raise TypeError("an unlimited prompt stream has no length")
        if self.repeat:
            return batches_per_epoch(self.source.size, self.batch_size)
        return -(-self.source.size // self.batch_size)

    def __next__(self) -> PromptBatch:
        if not self.repeat:
            raise TypeError("iterate a validation loader with iter() / for")
        if self.source.size is None:
            return self._next_from_stream()
        # An epoch ends where the plan's step count (trainer.total_epochs) says it ends: one shared rule.
        if self.cursor // self.batch_size >= batches_per_epoch(self.source.size, self.batch_size):
            self.epoch += 1
            self.cursor = 0
        order = self._order_for(self.epoch)
        picked = order[self.cursor : self.cursor + self.batch_size]
        self.cursor += self.batch_size
        examples = [self.source.get(int(i)) for i in picked]
        return self._batch([e for e in examples if e is not None])

    def _next_from_stream(self) -> PromptBatch:
        examples: list[Example] = []
        skipped = 0
        while len(examples) < self.batch_size:
            example = self.source.get(self.cursor)
            self.cursor += 1
            if example is None:
                skipped += 1
                if skipped >= _MAX_CONSECUTIVE_FILTERED:
                    raise DataError(
                        "data.max_prompt_length",
                        f"{skipped} synthetic prompts in a row are longer than data.max_prompt_length",
                        "raise data.max_prompt_length or set data.truncation to left/right",
                        rule="data-empty",
                    )
                continue
            skipped = 0
            examples.append(example)
        return self._batch(examples)

    def state_dict(self) -> dict[str, Any]:
        """The position: {"epoch", "cursor"} plus what identifies the order (seed, shuffle, batch size,
        source size), all plain ints/bools so it serializes to JSON."""
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "num_prompts": self.source.size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position. A changed source size, seed or shuffle setting means the saved
        position points into a different order: the run continues from it anyway, with a warning."""
        mismatched = [
            f"{key} {state[key]!r} -> {now!r}"
            for key, now in (
                ("num_prompts", self.source.size),
                ("seed", self.seed),
                ("shuffle", self.shuffle),
                ("batch_size", self.batch_size),
            )
            if key in state and state[key] != now
        ]
        if mismatched:
            logger.warning(
                "prompt loader state was saved for a different setup (%s); the order after resume differs",
                "; ".join(mismatched),
            )
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])


# ---------------------------------------------------------------------------------------- building
def build_prompt_sources(data: DataPlan, tokenizer: Tokenizer) -> tuple[PromptSource, PromptSource | None]:
    """(train, val) sources from `data`: files when data.train_files is set, else the synthetic task.

    Validation: data.val_files when set; else, for the synthetic task, SYNTHETIC_VAL_SIZE samples of a
    separately seeded stream; else (training files without validation files) None: no validation.
    """
    seed = data.seed  # the plan resolved it (data.seed, null: trainer.seed)
    if data.train_files:
        train: PromptSource = ListPromptSource(load_prompt_files(data.train_files, data, tokenizer))
    else:
        train = SyntheticPromptSource(data.synthetic_task, seed, tokenizer, data, "train")
    val: PromptSource | None
    if data.val_files:
        val = ListPromptSource(load_prompt_files(data.val_files, data, tokenizer, "data.val_files"))
    elif not data.train_files:
        val = SyntheticPromptSource(
            data.synthetic_task, seed, tokenizer, data, "val", size=SYNTHETIC_VAL_SIZE
        )
    else:
        val = None
    return train, val


def build_dataloaders(
    data: DataPlan, tokenizer: Tokenizer
) -> tuple[PromptDataloader, PromptDataloader | None]:
    """(train loader, validation loader or None) for the `data` section."""
    train_src, val_src = build_prompt_sources(data, tokenizer)
    seed = data.seed
    train = PromptDataloader(train_src, data.train_batch_size, shuffle=data.shuffle, seed=seed, repeat=True)
    val = (
        None
        if val_src is None
        else PromptDataloader(val_src, data.val_batch_size, shuffle=False, seed=seed, repeat=False)
    )
    return train, val
