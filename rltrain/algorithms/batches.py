"""Row-level operations on rollout batches: DAPO's overlong penalty and group filter (dynamic sampling),
concatenating batches of different widths, selecting rows."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rltrain.algorithms.core import group_ids


def overlong_penalty(
    response_lengths: Tensor, max_response_length: int, buffer_len: int, penalty_factor: float
) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025) per response of L tokens:

        penalty = min(0, (L_max - L_buffer - L) / L_buffer) * penalty_factor
    0 up to L_max - L_buffer tokens, then falling linearly to -penalty_factor at L_max."""
    lengths = response_lengths.to(torch.float32)
    return torch.clamp((max_response_length - buffer_len - lengths) / buffer_len, max=0.0) * penalty_factor


def groups_with_spread(metric: Tensor, group_index: Tensor | Sequence[Any]) -> Tensor:
    """DAPO dynamic sampling: a bool per response, true where its prompt group's `metric` is not constant
    (those groups carry a learning signal; all-correct or all-wrong groups have advantage 0). A group of one
    response is kept, as in verl."""
    ids = group_ids(group_index, metric.shape[0], metric.device)
    n = int(ids.max()) + 1 if ids.numel() else 0
    lo = torch.full((n,), math.inf, dtype=metric.dtype, device=metric.device).scatter_reduce(
        0, ids, metric, "amin"
    )
    hi = torch.full((n,), -math.inf, dtype=metric.dtype, device=metric.device).scatter_reduce(
        0, ids, metric, "amax"
    )
    counts = torch.zeros(n, dtype=torch.long, device=metric.device).index_add_(0, ids, torch.ones_like(ids))
    return ((hi > lo) | (counts == 1))[ids]


# Row-aligned keys of the rollout layout (rltrain.rollout.batch): [B, P + N] sequences split into a
# left-padded prompt and a right-padded response, and [B, N] response tensors.
_SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids")


def concat_batches(batches: Sequence[dict[str, Tensor]], pad_token_id: int) -> dict[str, Tensor]:
    """Concatenate rollout batches row-wise whatever their prompt (P) and response (N) widths: prompts are
    left-padded to the widest P, responses right-padded to the widest N (pad_token_id in ids, 0 in masks
    and log-probs), position_ids recomputed from the attention mask as the rollout builds them. A
    `group_index` is offset per batch so that groups of different batches stay distinct. Other keys are
    concatenated along rows (1-D) or right-padded with 0 (2-D, [B, N])."""
    if not batches:
        raise ValueError("concat_batches needs at least one batch")
    resp_width = max(b["responses"].shape[1] for b in batches)
    prompt_width = max(b["input_ids"].shape[1] - b["responses"].shape[1] for b in batches)
    out: dict[str, list[Tensor]] = {k: [] for k in batches[0]}
    offset = 0
    for b in batches:
        n = b["responses"].shape[1]
        p = b["input_ids"].shape[1] - n
        for key, value in b.items():
            if key == "position_ids":
                continue
            if key == "group_index":
                out[key].append(value + offset)
            elif key in _SEQUENCE_KEYS or (value.dim() > 2 and value.shape[1] == p + n):
                # Token-aligned keys; [B, P + N, ...] ones (the recorded expert routing) pad with -1.
                pad = pad_token_id if key == "input_ids" else 0 if key in _SEQUENCE_KEYS else -1
                trailing = [0, 0] * (value.dim() - 2)
                prompt = torch.nn.functional.pad(value[:, :p], (*trailing, prompt_width - p, 0), value=pad)
                resp = torch.nn.functional.pad(value[:, p:], (*trailing, 0, resp_width - n), value=pad)
                out[key].append(torch.cat([prompt, resp], 1))
            elif value.dim() == 2:
                pad = pad_token_id if key == "responses" else 0
                out[key].append(torch.nn.functional.pad(value, (0, resp_width - value.shape[1]), value=pad))
            else:
                out[key].append(value)
        if "group_index" in b and b["group_index"].numel():
            offset += int(b["group_index"].max()) + 1
    merged = {k: torch.cat(v, 0) for k, v in out.items() if v}
    if "position_ids" in batches[0]:
        merged["position_ids"] = (merged["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return merged


def select_rows(batch: dict[str, Tensor], rows: Tensor | slice) -> dict[str, Tensor]:
    """The rows `rows` (bool mask, indices or a slice) of every tensor of a row-aligned batch."""
    return {k: v[rows] for k, v in batch.items()}
