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

`fused=True` (the engines pass `EnginePlan.fused_kernels`, on by default on cuda) runs the same math in three
torch.compile'd functions instead of eager ops. Why: on one H200 (Qwen2.5-1.5B shape, 522k tokens,
`compute_log_prob` without entropy) the eager chunk loop took 1.0 s of a 5.2 s log-prob pass. Each ~220-token
chunk launched ~15 kernels (index_select, .float(), div_, max, sub_, gather, exp, sum, ...), about 8 full fp32
passes over [chunk, V] and ~36k launches per pass, where two reads of the 16-bit logits suffice. The fused
forward reads the selected rows of the 16-bit logits inside the compiled kernels (row gather, upcast,
temperature and padding mask in registers): one reduction gives each row's max, and after the TP max
all-reduce one more gives sum exp(z - m), the target's shifted logit and (with entropy) sum exp(z - m)(z - m), all
rows in one pass since nothing [rows, V]-sized is materialised. The fused backward is one kernel too: it
computes the 16-bit gradient of each selected row and stores it straight into grad_logits (an index_copy_,
rows being distinct, that inductor fuses with the computation), so it needs no chunking either: no [chunk, V]
tensor exists in the fused path, and the only [N, V] one is grad_logits. The functions are compiled once per
process with dynamic (unbacked) sizes, so no chunk length or micro-batch size recompiles them. Results equal
the eager path up to fp32 summation order; the eager path stays the default and the CPU path.

Measured on one H200 (torch 2.11; bf16 logits [8192, 151936], 7168 selected rows): forward 14.3 ms eager ->
2.8 ms fused without entropy (so ~0.2 s instead of ~1.0 s for 522k tokens), 19.1 -> 2.8 ms with it; forward +
backward 48 -> 5.8 ms (62 -> 5.9 ms with entropy), three kernels near 2 TB/s plus grad_logits' zero fill.
Memory beyond the logits: forward 255 MiB -> 0.3 MiB; backward 2948 MiB -> 2374 MiB, which is grad_logits. On
CPU inductor stores exp(z - m) of the entropy variant's forward (its CPU heuristic realises a reused exp); the
cuda kernels keep it in registers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

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
    """Tokens per chunk so that one fp32 [tokens, V/tp] temporary holds DEFAULT_CHUNK_ELEMENTS (eager path;
    the fused path materialises nothing [tokens, V/tp]-sized and takes all rows at once)."""
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


# ------------------------------------------------------------------------------------ fused (compiled)
# Plain functions of tensors that torch.compile turns into one or two kernels each. `rows` selects the
# token rows of the [N, V/tp] logits; every [n]-sized argument describes those rows. Nothing [n, V/tp]-sized
# is materialised (on cuda): the gather, the upcast, the temperature and the mask are inlined into the
# kernels that reduce, and the backward's gradient into its store into grad_logits.
def _scaled_rows(logits: torch.Tensor, rows: torch.Tensor, temperature: float, valid: int) -> torch.Tensor:
    z = logits.index_select(0, rows).float() / temperature
    col = torch.arange(z.shape[-1], device=z.device)
    return torch.where(col < valid, z, _MASKED_LOGIT)


def _fused_row_max(logits: torch.Tensor, rows: torch.Tensor, temperature: float, valid: int) -> torch.Tensor:
    return _scaled_rows(logits, rows, temperature, valid).amax(dim=-1)


def _shifted(
    logits: torch.Tensor,
    rows: torch.Tensor,
    local_labels: torch.Tensor,
    in_shard: torch.Tensor,
    m: torch.Tensor,
    temperature: float,
    valid: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the selected rows' z - m, the target's z - m): what both stats functions reduce."""
    z = _scaled_rows(logits, rows, temperature, valid) - m.unsqueeze(-1)
    # The target read straight from the logits (one element a row), not from the scaled rows, so that the
    # scaled rows stay a producer of the reductions alone and are never realised as a buffer.
    t = logits[rows, local_labels].float() / temperature
    t = torch.where(local_labels < valid, t, _MASKED_LOGIT)
    return z, torch.where(in_shard, t - m, 0.0)


def _fused_sums(*args: torch.Tensor | float | int) -> torch.Tensor:
    """[sum exp(z - m), target z - m] stacked, ready for the TP all-reduce (`_shifted`'s arguments)."""
    z, target = _shifted(*args)  # type: ignore[arg-type]
    return torch.stack([z.exp().sum(dim=-1), target])


def _fused_sums_entropy(*args: torch.Tensor | float | int) -> torch.Tensor:
    """[sum exp(z - m), target z - m, sum exp(z - m) (z - m)] stacked, ready for the TP all-reduce."""
    z, target = _shifted(*args)  # type: ignore[arg-type]
    e = z.exp()
    return torch.stack([e.sum(dim=-1), target, (e * z).sum(dim=-1)])


def _fused_grad(
    logits: torch.Tensor,
    rows: torch.Tensor,
    local_labels: torch.Tensor,
    in_shard: torch.Tensor,
    m: torch.Tensor,
    log_z: torch.Tensor,
    mean_shifted: torch.Tensor,
    grad_logp: torch.Tensor,
    grad_ent: torch.Tensor,
    temperature: float,
    valid: int,
) -> torch.Tensor:
    """d loss / d logits[rows] in the logits' dtype: (onehot g_logp - p (g_logp + g_ent (z - m - E))) / T,
    the eager backward's expression term for term (an absent output's gradient arrives as zeros)."""
    z = _scaled_rows(logits, rows, temperature, valid) - m.unsqueeze(-1)
    probs = (z - log_z.unsqueeze(-1)).exp()
    g_logp = grad_logp.float().unsqueeze(-1)
    coef = g_logp + (z - mean_shifted.unsqueeze(-1)) * grad_ent.float().unsqueeze(-1)
    col = torch.arange(z.shape[-1], device=z.device)
    hit = (col == local_labels.unsqueeze(-1)) & in_shard.unsqueeze(-1)
    grad_z = torch.where(hit, g_logp, 0.0) - coef * probs
    return (grad_z / temperature).to(logits.dtype)


def _fused_grad_into(
    grad_logits: torch.Tensor,
    logits: torch.Tensor,
    rows: torch.Tensor,
    *stats: torch.Tensor | float | int,
) -> None:
    """grad_logits[rows] = `_fused_grad(logits, rows, *stats)`, in place. Inductor fuses the computation into
    the scatter's store (rows are distinct, so a copy), so no [rows, V/tp] gradient exists even briefly."""
    grad_logits.index_copy_(0, rows, _fused_grad(logits, rows, *stats))


@functools.cache
def _compiled(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`fn` under torch.compile with dynamic sizes, built on first use (once per process and function).

    fullgraph: a graph break would silently bring back eager kernels. realize_reads_threshold: inductor
    materialises a reused pointwise value that reads more than 4 tensors (the default); the scaled rows read
    the logits, the rows, the max and the temperature and feed two reductions, so one more input would turn
    them into an fp32 [rows, V/tp] buffer.
    """
    return torch.compile(fn, dynamic=True, fullgraph=True, options={"realize_reads_threshold": 64})


def _call_fused(
    fn: Callable[..., torch.Tensor | None],
    logits: torch.Tensor,
    *rest: torch.Tensor | float | int,
    grad_logits: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Call the compiled `fn` on detached tensors whose length (dim 0 of each in `rest`) is unbacked, with
    `grad_logits` (written in place) first when given.

    dynamic=True alone still specialises a size of 0 or 1, so a one-token chunk (or micro-batch) would
    recompile; an unbacked size never is. Detaching drops the autograd view relation of a chunk's slice
    (dynamo would otherwise guard on the size of the sliced tensor, e.g. the caller's `rows` being a slice
    of a longer tensor) and makes whether the logits require grad (the update vs. a no-grad log-prob pass)
    no guard either. Strides likewise: the gradient of `lp.sum()` arrives expanded (stride 0), which would
    recompile against a stride of 1 (`contiguous()` leaves a one-element tensor's stride 0 as it is, and
    torch 2.11 guards on it).
    """
    tensors = []
    for a in rest:
        if isinstance(a, torch.Tensor):
            a = a.detach().contiguous()
            if a.stride(0) != 1:  # at most one element: any stride addresses it
                a = a.as_strided(a.shape, (1,))
            torch._dynamo.decorators.mark_unbacked(a, 0)
        tensors.append(a)
    front = () if grad_logits is None else (grad_logits,)
    return _compiled(fn)(*front, logits.detach(), *tensors)


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
        fused: bool,
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
        # The fused forward holds nothing [rows, V/tp]-sized, so it takes all rows at once (chunk_tokens bounds
        # its backward's gradient chunk); the eager one walks them in chunks.
        step = max(n, 1) if fused else chunk_tokens
        for c0 in range(0, n, step):
            c = slice(c0, min(c0 + step, n))
            if fused:
                m = _call_fused(_fused_row_max, logits, rows[c], temperature, valid)
            else:
                z = logits.index_select(0, rows[c]).float()
                if temperature != 1.0:
                    z.div_(temperature)
                if valid < shard:
                    z[:, valid:] = _MASKED_LOGIT
                m = z.max(dim=-1).values
            if group is not None:
                torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
            if fused:
                sums = _fused_sums_entropy if with_entropy else _fused_sums
                packed = _call_fused(
                    sums, logits, rows[c], local_labels[c], in_shard[c], m, temperature, valid
                )
            else:
                z.sub_(m.unsqueeze(-1))
                target = torch.where(in_shard[c], z.gather(1, local_labels[c].unsqueeze(-1)).squeeze(-1), 0.0)
                e = z.exp()
                stats = [e.sum(dim=-1), target]
                if with_entropy:
                    stats.append((e.mul_(z)).sum(dim=-1))
                del e, z
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
        ctx.fused = fused
        ctx.set_materialize_grads(False)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor | None, grad_ent: torch.Tensor | None):  # type: ignore[override]
        logits, rows, local_labels, in_shard, maxes, log_z, mean_shifted = ctx.saved_tensors
        if grad_ent is not None and not ctx.with_entropy:
            grad_ent = None  # the entropy output was zeros, not a function of the logits
        grad_logits = torch.zeros_like(logits)
        if grad_logp is None and grad_ent is None:
            return grad_logits, None, None, None, None, None, None, None
        shard = logits.shape[-1]
        n = rows.numel()
        if ctx.fused:
            # One compiled function for all cases: an absent output's gradient enters as zeros, which
            # leaves the expression equal to the eager one's without that term.
            zeros = torch.zeros(n, dtype=torch.float32, device=logits.device)
            g_logp = zeros if grad_logp is None else grad_logp
            g_ent = zeros if grad_ent is None else grad_ent
        for c0 in range(0, n, ctx.chunk_tokens):
            c = slice(c0, min(c0 + ctx.chunk_tokens, n))
            if ctx.fused:
                _call_fused(
                    _fused_grad_into,
                    logits,
                    rows[c],
                    local_labels[c],
                    in_shard[c],
                    maxes[c],
                    log_z[c],
                    mean_shifted[c],
                    g_logp[c],
                    g_ent[c],
                    ctx.temperature,
                    ctx.valid,
                    grad_logits=grad_logits,
                )
                continue
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
        return grad_logits, None, None, None, None, None, None, None


def token_log_probs_and_entropy(
    logits: torch.Tensor,
    rows: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    with_entropy: bool = True,
    chunk_tokens: int | None = None,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `labels` and (optionally) the entropy of softmax(logits[rows] / temperature).

    logits [N, V/tp] (any float dtype, this TP rank's vocabulary shard), rows [n] (indices into N; each at
    most once), labels [n] (global vocabulary ids). Returns fp32 [n] tensors. Gradients flow to `logits`
    from both outputs; an output that does not reach the loss costs nothing in the backward.

    `fused` runs the torch.compile'd kernels (module docstring); the results equal the eager path's up to
    fp32 summation order. The eager path works `chunk_tokens` rows at a time (default:
    `default_chunk_tokens(V/tp)`) to bound its fp32 temporaries. The fused path has none: its forward always
    takes all rows at once, and its backward too by default (`chunk_tokens` then only splits the backward's
    launches, for tests).
    """
    if chunk_tokens is None:
        chunk_tokens = rows.numel() if fused else default_chunk_tokens(logits.shape[-1])
    logp, ent = _ChunkedLogProbEntropy.apply(
        logits, rows, labels, float(temperature), vocab_size, max(int(chunk_tokens), 1), with_entropy, fused
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
