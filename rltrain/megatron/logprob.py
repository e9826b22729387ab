"""Per-token log-probs and entropy from vocab-parallel logits, without gathering the vocabulary.

Logits arrive sharded along the vocabulary across tensor-parallel ranks ([..., V/tp]). Log-probs use
megatron's `vocab_parallel_cross_entropy`; entropy uses `_VocabParallelEntropy` (below), which reduces the
max, the partition function and E_p[z] across the TP group and keeps one shard-sized tensor for backward.
Padded vocabulary rows (megatron pads V to a multiple of 128 x TP) are masked out so that results equal
the unpadded model's.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

# Large negative logit for padded vocabulary entries: exp() underflows to 0 and p * z stays 0 (-inf would
# give 0 * inf = nan in the entropy).
_MASKED_LOGIT = -1e9


def prepare_logits(
    logits: torch.Tensor, temperature: float = 1.0, vocab_size: int | None = None
) -> torch.Tensor:
    """fp32 logits / temperature with padded vocabulary entries of this TP shard masked out.

    Always returns a new tensor: megatron's cross entropy works in place on its input.
    """
    out = logits.float() / temperature
    if vocab_size is not None:
        shard = out.shape[-1]
        start = parallel_state.get_tensor_model_parallel_rank() * shard
        first_padded = vocab_size - start
        if first_padded < shard:
            out[..., max(first_padded, 0) :] = _MASKED_LOGIT
    return out


class _VocabParallelEntropy(torch.autograd.Function):
    """H(softmax(z)) for z sharded over the TP group: H = log Z - E_p[z - m] (m the global max)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        group = parallel_state.get_tensor_model_parallel_group()
        logits_max = logits.max(dim=-1).values
        torch.distributed.all_reduce(logits_max, op=torch.distributed.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        torch.distributed.all_reduce(sum_exp, group=group)
        probs = exp.div_(sum_exp.unsqueeze(-1))
        mean_shifted = (probs * shifted).sum(dim=-1)
        torch.distributed.all_reduce(mean_shifted, group=group)
        ctx.save_for_backward(probs, shifted, mean_shifted)
        return sum_exp.log() - mean_shifted

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # dH/dz_j = -p_j (z_j - E_p[z]); the shift by the max cancels out.
        probs, shifted, mean_shifted = ctx.saved_tensors
        return -grad_output.unsqueeze(-1) * probs * (shifted - mean_shifted.unsqueeze(-1))


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position, logits sharded over the vocabulary ([..., V/tp])."""
    return _VocabParallelEntropy.apply(logits)


def vocab_parallel_log_probs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, vocab_size: int | None = None
) -> torch.Tensor:
    """log softmax(logits / temperature)[labels] per position (logits [..., V/tp], labels [...])."""
    return -vocab_parallel_cross_entropy(prepare_logits(logits, temperature, vocab_size), labels)


def log_probs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    with_entropy: bool = True,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `labels` and (optionally) the entropy, both of softmax(logits / temperature).

    `entropy_grad=False` computes the entropy without autograd (a metric only), saving its backward memory.
    """
    scaled = prepare_logits(logits, temperature, vocab_size)
    entropy = None
    if with_entropy:
        if entropy_grad:
            entropy = vocab_parallel_entropy(scaled)
        else:
            with torch.no_grad():
                entropy = vocab_parallel_entropy(scaled.detach())
    # Cross entropy modifies its input in place; the entropy above saved its own tensors, not `scaled`.
    log_probs = -vocab_parallel_cross_entropy(scaled, labels)
    return log_probs, entropy
