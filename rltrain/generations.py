"""What the model wrote, as text a person reads: every response of a training step or of a validation
(logging.rollout_data_dir / validation_data_dir: one STEP.jsonl per step, verl's dump format, so a verl
user's scripts read them), and the fixed validation samples of logging.val_generations (the rows chosen once
by trainer.seed, the same at every validation; MetricsLogger.log_generations records them).

The controller decodes the responses for the reward anyway; recording them costs a file write per step.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rltrain import metrics_file

GENERATIONS_KEY = "_generations"
"""The private key under which `Trainer.rollout` hands a batch's text rows to its caller, which pops it
(never logged as a metric)."""


def text_rows(
    prompts: Sequence[str],
    responses: Sequence[str],
    ground_truths: Sequence[Any],
    scores: Sequence[float],
    data_sources: Sequence[str],
) -> list[dict[str, Any]]:
    """One record per response: input (the prompt), output (the response), gts (the ground truth), score
    (the reward the update sees) and data_source; `write_step_file` adds the step."""
    return [
        {"input": p, "output": r, "gts": g, "score": float(s), "data_source": d}
        for p, r, g, s, d in zip(prompts, responses, ground_truths, scores, data_sources, strict=True)
    ]


def write_step_file(folder: str, step: int, rows: Sequence[dict[str, Any]]) -> Path:
    """folder/STEP.jsonl holding `rows`, each with its step, written atomically (a resumed run that redoes
    the step replaces it whole)."""
    path = Path(folder) / f"{step}.jsonl"
    os.makedirs(folder, exist_ok=True)
    metrics_file.write_lines(path, [json.dumps({**row, "step": step}, default=str) for row in rows])
    return path


def fixed_sample(n_rows: int, count: int, seed: int) -> list[int]:
    """`count` of `n_rows` row indices chosen by `seed` alone (the validation set's rows in its fixed order:
    the same rows at every validation of the run, and of a resumed run)."""
    order = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed))
    return order[: min(count, n_rows)].tolist()


__all__ = ["GENERATIONS_KEY", "fixed_sample", "text_rows", "write_step_file"]
