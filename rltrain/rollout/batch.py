"""The batch layout every rollout engine returns (embedded with or without KV cache, vLLM): one builder."""

from __future__ import annotations

import torch


def rollout_batch(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    log_probs: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The engine layout from left-padded prompts [B, P] and right-padded responses [B, N]: `input_ids`,
    `attention_mask`, `position_ids` [B, P + N] (positions count real tokens), `responses`,
    `response_mask` and `rollout_log_probs` [B, N]."""
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    return {
        "input_ids": torch.cat([prompt_ids, responses], 1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": responses,
        "response_mask": response_mask,
        "rollout_log_probs": log_probs,
    }
