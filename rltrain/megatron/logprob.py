"""Per-token log-probs and entropy from vocab-parallel logits, without gathering the vocabulary.

Logits arrive sharded along the vocabulary across tensor-parallel ranks ([..., V/tp]). Only a few scalars
per token cross the TP group (the max, the partition function, the target logit and E_p[z]); the vocabulary
shard never does.

`token_log_probs_and_entropy` is what the roles use. It is one autograd function that walks the selected
token rows in chunks of `chunk_tokens`, so the fp32 working set is bounded by chunk x V/tp whatever the
micro-batch size (a [tokens, V/tp] fp32 copy of a 4k-token micro-batch of a 152k vocabulary is 2.3 GiB per
temporary). It saves only the logits it was given (the model's output, alive anyway) and three fp32 scalars
per token; the backward recomputes each chunk's softmax from them, with no communication.

`log_probs_and_entropy` is the unchunked formulation (megatron's `vocab_parallel_cross_entropy` plus
`_VocabParallelEntropy`); it stays as the reference the chunked function is tested against.

Padded vocabulary rows (megatron pads V to a multiple of 128 x TP) are masked out so that results equal the
unpadded model's.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

# Large negative logit for padded vocabulary entries: exp() underflows to 0 and p * z stays 0 (-inf would
# give 0 * inf = nan in the entropy).
_MASKED_LOGIT = -1e9

# fp32 elements of one chunk's [tokens, V/tp] working tensor when no chunk size is given: 2**25 elements
# (128 MiB) keeps the few chunk-sized temporaries well under a GiB and chunks large enough (≈ 220 tokens
# of a 152k vocabulary at TP=1) that the per-chunk collectives do not dominate.
DEFAULT_CHUNK_ELEMENTS = 2**25


def default_chunk_tokens(shard_vocab: int) -> int:
    """Tokens per chunk so that one fp32 [tokens, V/tp] temporary holds DEFAULT_CHUNK_ELEMENTS."""
    return max(1, DEFAULT_CHUNK_ELEMENTS // max(shard_vocab, 1))


def _vocab_start_and_valid(shard: int, vocab_size: int | None) -> tuple[int, int]:
    """(first global vocabulary id of this TP rank's shard, number of unpadded ids in the shard)."""
    start = parallel_state.get_tensor_model_parallel_rank() * shard
    if vocab_size is None:
        return start, shard
    return start, max(0, min(shard, vocab_size - start))


def prepare_logits(
    logits: torch.Tensor, temperature: float = 1.0, vocab_size: int | None = None
) -> torch.Tensor:
    """fp32 logits / temperature with padded vocabulary entries of this TP shard masked out.

    Always returns a new tensor: megatron's cross entropy works in place on its input.
    """
    out = logits.float() / temperature
    _, valid = _vocab_start_and_valid(out.shape[-1], vocab_size)
    if valid < out.shape[-1]:
        out[..., valid:] = _MASKED_LOGIT
    return out


# ------------------------------------------------------------------------------------ chunked (used)
def _tp_group_or_none() -> torch.distributed.ProcessGroup | None:
    # A world-of-one all-reduce still costs a gloo round trip per chunk; skip it at TP=1.
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_tensor_model_parallel_group()


class _ChunkedLogProbEntropy(torch.autograd.Function):
    """log p(label) and H(p) of p = softmax(z / T), z the rows `rows` of vocab-parallel logits [N, V/tp].

    Forward per chunk: shifted = z - max (max all-reduced), then one all-reduce of [sum exp, target shifted
    logit, sum exp * shifted] gives log Z, log p = target - log Z and H = log Z - E_p[shifted].
    Saved: the logits, and per token max, log Z, E_p[shifted] (fp32). Backward per chunk, from those:
    d log p / dz = (onehot - p) / T and dH / dz = -p (shifted - E_p[shifted]) / T; no communication.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        logits: torch.Tensor,
        rows: torch.Tensor,
        labels: torch.Tensor,
        temperature: float,
        vocab_size: int | None,
        chunk_tokens: int,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        shard = logits.shape[-1]
        vocab_start, valid = _vocab_start_and_valid(shard, vocab_size)
        group = _tp_group_or_none()
        n = rows.numel()
        dev = logits.device
        maxes = torch.empty(n, dtype=torch.float32, device=dev)
        log_z = torch.empty(n, dtype=torch.float32, device=dev)
        mean_shifted = torch.zeros(n, dtype=torch.float32, device=dev)
        log_probs = torch.empty(n, dtype=torch.float32, device=dev)
        local_labels = labels - vocab_start
        in_shard = (local_labels >= 0) & (local_labels < shard)
        local_labels = local_labels.clamp(0, shard - 1)
        for c0 in range(0, n, chunk_tokens):
            c = slice(c0, min(c0 + chunk_tokens, n))
            z = logits.index_select(0, rows[c]).float()
            if temperature != 1.0:
                z.div_(temperature)
            if valid < shard:
                z[:, valid:] = _MASKED_LOGIT
            m = z.max(dim=-1).values
            if group is not None:
                torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
            z.sub_(m.unsqueeze(-1))
            target = torch.where(in_shard[c], z.gather(1, local_labels[c].unsqueeze(-1)).squeeze(-1), 0.0)
            e = z.exp()
            stats = [e.sum(dim=-1), target]
            if with_entropy:
                stats.append((e.mul_(z)).sum(dim=-1))
            del e
            packed = torch.stack(stats)
            if group is not None:
                torch.distributed.all_reduce(packed, group=group)
            lz = packed[0].log()
            maxes[c] = m
            log_z[c] = lz
            log_probs[c] = packed[1] - lz
            if with_entropy:
                mean_shifted[c] = packed[2] / packed[0]
        entropy = log_z - mean_shifted if with_entropy else torch.zeros_like(log_z)
        ctx.save_for_backward(logits, rows, local_labels, in_shard, maxes, log_z, mean_shifted)
        ctx.temperature = temperature
        ctx.valid = valid
        ctx.chunk_tokens = chunk_tokens
        ctx.with_entropy = with_entropy
        ctx.set_materialize_grads(False)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor | None, grad_ent: torch.Tensor | None):  # type: ignore[override]
        logits, rows, local_labels, in_shard, maxes, log_z, mean_shifted = ctx.saved_tensors
        if grad_ent is not None and not ctx.with_entropy:
            grad_ent = None  # the entropy output was zeros, not a function of the logits
        grad_logits = torch.zeros_like(logits)
        if grad_logp is None and grad_ent is None:
            return grad_logits, None, None, None, None, None, None
        shard = logits.shape[-1]
        n = rows.numel()
        for c0 in range(0, n, ctx.chunk_tokens):
            c = slice(c0, min(c0 + ctx.chunk_tokens, n))
            z = logits.index_select(0, rows[c]).float()
            if ctx.temperature != 1.0:
                z.div_(ctx.temperature)
            if ctx.valid < shard:
                z[:, ctx.valid :] = _MASKED_LOGIT
            z.sub_(maxes[c].unsqueeze(-1))
            probs = (z - log_z[c].unsqueeze(-1)).exp_()
            # Both terms are -p * (...): fold them into one coefficient per element.
            coef = torch.zeros_like(z)
            if grad_logp is not None:
                coef.add_(grad_logp[c].float().unsqueeze(-1))
            if grad_ent is not None:
                coef.add_(z.sub_(mean_shifted[c].unsqueeze(-1)).mul_(grad_ent[c].float().unsqueeze(-1)))
            grad_z = coef.mul_(probs).neg_()
            if grad_logp is not None:
                # + grad at the label (on the rank whose shard holds it): a scatter, not boolean indexing,
                # which would wait for the device once per chunk and stall the launch queue.
                hit = torch.where(in_shard[c], grad_logp[c].float(), 0.0)
                grad_z.scatter_add_(1, local_labels[c].unsqueeze(-1), hit.unsqueeze(-1))
            if ctx.temperature != 1.0:
                grad_z.div_(ctx.temperature)
            grad_logits.index_add_(0, rows[c], grad_z.to(grad_logits.dtype))
        return grad_logits, None, None, None, None, None, None


def token_log_probs_and_entropy(
    logits: torch.Tensor,
    rows: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    with_entropy: bool = True,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `labels` and (optionally) the entropy of softmax(logits[rows] / temperature).

    logits [N, V/tp] (any float dtype, this TP rank's vocabulary shard), rows [n] (indices into N; each at
    most once), labels [n] (global vocabulary ids). Returns fp32 [n] tensors. Work is done `chunk_tokens`
    rows at a time (default: `default_chunk_tokens(V/tp)`). Gradients flow to `logits` from both outputs;
    an output that does not reach the loss costs nothing in the backward.
    """
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(logits.shape[-1])
    logp, ent = _ChunkedLogProbEntropy.apply(
        logits, rows, labels, float(temperature), vocab_size, max(int(chunk_tokens), 1), with_entropy
    )
    return logp, (ent if with_entropy else None)


# ------------------------------------------------------------------------------------ unchunked reference
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
    """Unchunked reference: log-probs of `labels` and (optionally) the entropy of softmax(logits / T).

    Materialises fp32 [..., V/tp] copies of all of `logits`; the roles use `token_log_probs_and_entropy`.
    `entropy_grad=False` computes the entropy without autograd (a metric only).
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
