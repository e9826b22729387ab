"""Masked reductions and the small tensor helpers every other module of the algorithm layer uses:
masked sum / mean / var / whiten, entropy and log-probs from logits, outcome rewards placed on the last
token, dense group ids. Shapes: `B` responses, `T` response tokens; `response_mask` is 1 on generated tokens
and 0 on padding."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(values * mask) over `dim` (all elements when None)."""
    prod = values * mask
    return prod.sum() if dim is None else prod.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(values * mask) / sum(mask) over `dim` (all elements when None); 0 where the mask is empty."""
    denom = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / denom.clamp_min(1e-8)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the masked elements: sum(mask * (v - mean)^2) / (n - 1) (unbiased) or / n.

    With n <= 1 valid element the unbiased variance is undefined and 0 is returned.
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        var = torch.where(n > 1, var * n / (n - 1).clamp_min(1e-8), torch.zeros_like(var))
    return var


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """(values - mean) / sqrt(var + 1e-8) with mean and unbiased var over the masked elements.

    With shift_mean false the mean is added back (only the scale changes). Positions outside the mask are
    transformed by the same formula; callers mask them.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: H = logsumexp(z) - sum(softmax(z) * z)."""
    pd = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (pd * logits).sum(-1)


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """log softmax(logits)[..., label]: the log-probability of each label, shape of `labels`."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def outcome_to_token_level(scores: Tensor, response_mask: Tensor) -> Tensor:
    """Place one scalar reward per response on its last valid token (zeros elsewhere), shape (B, T).

    This is how rule-based rewards enter token-level estimators (GAE, REINFORCE++) and the KL penalty.
    """
    mask = response_mask.to(scores.dtype if scores.is_floating_point() else torch.float32)
    out = torch.zeros_like(mask)
    lengths = response_mask.long().sum(-1)
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    # Index of the last 1 in each row (works for interior zeros too).
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(response_mask.bool(), positions, torch.full_like(positions, -1)).max(-1).values
    out[rows, last[rows]] = scores.to(out.dtype)[rows]
    return out


def group_ids(group_index: Tensor | Sequence[Any], n: int, device: torch.device) -> Tensor:
    """Dense int ids 0..G-1 for any 1-D int tensor or sequence of hashables (e.g. uid strings)."""
    if isinstance(group_index, Tensor):
        if group_index.dim() != 1:
            raise ValueError(f"group_index must be 1-D, got shape {tuple(group_index.shape)}")
        keys = group_index.tolist()
    else:
        keys = list(group_index)
    if len(keys) != n:
        raise ValueError(f"group_index has {len(keys)} entries for {n} responses")
    dense: dict[Any, int] = {}
    return torch.tensor([dense.setdefault(k, len(dense)) for k in keys], dtype=torch.long, device=device)
