"""Context parallel without Transformer Engine: sequence split / gather over the CP group and CP attention.

megatron-core's own context parallel runs inside Transformer Engine's attention, which does not install
here (CPU) and is optional on GPUs. This module does the same job with torch SDPA:

* Load-balanced split (megatron's layout, `get_batch_on_this_cp_rank`): a sequence padded to a multiple of
  2 x CP is cut into 2 x CP equal chunks; CP rank r holds chunks r and 2CP-1-r, so every rank gets the same
  share of causal attention work. megatron's RoPE already follows this layout whenever the CP group has more
  than one rank (`get_pos_emb_on_this_cp_rank`), so the model needs no position changes.
* Attention (`cp_attention`): K and V are all-gathered over the CP group (autograd-aware: the backward sums
  every rank's K/V gradients and keeps this rank's part), and SDPA runs the local queries against all keys
  with a mask that is causal in the ORIGINAL token order. The engine right-pads rows, so padding keys sit
  after every valid query and the causal mask hides them.
* Outputs: the last stage's output stays in this rank's chunks. The loss functions evaluate what they need
  at the positions this rank holds (`to_local` maps original positions to local ones: log-probs and
  entropy from the local vocab-parallel logits, values, the next-token logits of a row) and `sum_over_cp`
  adds up the per-token results ([b, R], a few bytes per token) over the CP group: each position is held by
  exactly one rank, so the sum is the CP=1 result, and no rank ever holds the [b, S, V/tp] logits of the
  whole sequence. `gather_sequence` (the whole output in original order) is kept for loss functions that
  need every position. Every CP rank then computes the same loss from the same summed (or gathered)
  tensor, so its gradient is the same on every rank, and the backward keeps it for this rank's own part
  (no communication). Each rank's weight gradients are then its share of the CP=1 gradient; megatron's
  schedule multiplies the loss by CP (it expects a loss over local tokens) and DDP averages over the
  data-parallel-with-CP group (the experts' gradients too: megatron scales them by 1 / (dp x cp) before
  summing over the expert data-parallel group): the two cancel, and the update equals CP=1's.
* Mixture-of-experts layers route each rank's own tokens (the alltoall dispatcher exchanges them over the
  expert-parallel group as at CP=1); megatron's router sums its per-expert token counts over the TP x CP
  group, so every rank's load-balancing loss is its share of the whole sequence's, and scales that loss's
  gradient by CP like the main loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state


def cp_world_size() -> int:
    """Ranks in this rank's context-parallel group (1 when megatron's parallel state is not initialised)."""
    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_context_parallel_world_size()


def local_chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two of the 2 x CP sequence chunks CP rank `cp_rank` holds (megatron's load-balanced layout)."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def local_positions(length: int, cp_rank: int, cp_size: int, device: torch.device) -> torch.Tensor:
    """Original positions [length / CP] of the tokens CP rank `cp_rank` holds of a sequence of `length`."""
    chunk = length // (2 * cp_size)
    first, second = local_chunk_ids(cp_rank, cp_size)
    return torch.cat(
        [
            torch.arange(first * chunk, (first + 1) * chunk, device=device),
            torch.arange(second * chunk, (second + 1) * chunk, device=device),
        ]
    )


def split_sequence(tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This CP rank's two chunks of `tensor` along `dim` (whose size must be a multiple of 2 x CP)."""
    cp = cp_world_size()
    if cp == 1:
        return tensor
    length = tensor.shape[dim]
    if length % (2 * cp):
        raise ValueError(f"context parallel: sequence length {length} is not a multiple of 2 x CP = {2 * cp}")
    index = local_positions(length, parallel_state.get_context_parallel_rank(), cp, tensor.device)
    return tensor.index_select(dim, index)


class _GatherOverCp(torch.autograd.Function):
    """All-gather along `dim` over the CP group, concatenated in rank order. Backward with `sum_grads`: the
    gradients of every rank's copy are summed (all-reduce) and this rank's slice is kept, i.e. a
    reduce-scatter written with all-reduce, which gloo also supports; without: every rank's gradient is
    the same, and this rank's slice is kept."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, dim: int, sum_grads: bool) -> torch.Tensor:
        group = parallel_state.get_context_parallel_group()
        ctx.dim, ctx.group, ctx.sum_grads = dim, group, sum_grads
        ctx.rank, ctx.size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        ctx.local = tensor.shape[dim]
        parts = [torch.empty_like(tensor) for _ in range(ctx.size)]
        torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.sum_grads:
            grad = grad.contiguous()
            torch.distributed.all_reduce(grad, group=ctx.group)
        return grad.narrow(ctx.dim, ctx.rank * ctx.local, ctx.local).contiguous(), None, None


def gather_over_cp(tensor: torch.Tensor, dim: int, sum_grads: bool = True) -> torch.Tensor:
    """Every CP rank's `tensor` concatenated along `dim` in rank order (autograd-aware; `sum_grads`: see
    `_GatherOverCp`)."""
    return _GatherOverCp.apply(tensor, dim, sum_grads)


def gathered_positions(length_local: int, cp_size: int, device: torch.device) -> torch.Tensor:
    """Original positions of the tokens of a rank-order gather of every CP rank's local sequence."""
    length = length_local * cp_size
    return torch.cat([local_positions(length, r, cp_size, device) for r in range(cp_size)])


def gather_sequence(tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """The whole sequence in original order from each CP rank's local part along `dim`, for a loss that
    every CP rank computes alike (the backward keeps this rank's slice; see the module docstring)."""
    cp = cp_world_size()
    if cp == 1:
        return tensor
    gathered = gather_over_cp(tensor, dim, sum_grads=False)
    order = torch.argsort(gathered_positions(tensor.shape[dim], cp, tensor.device))
    return gathered.index_select(dim, order)


def to_local(index: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where original positions `index` (any shape, values in [0, length)) of a sequence of `length` tokens
    sit in this CP rank's local part: (local position, 0 where not held; held by this rank). At CP=1 every
    position is held where it is."""
    cp = cp_world_size()
    if cp == 1:
        return index, torch.ones_like(index, dtype=torch.bool)
    chunk = length // (2 * cp)
    first, second = local_chunk_ids(parallel_state.get_context_parallel_rank(), cp)
    which = torch.div(index, chunk, rounding_mode="floor")
    held = (which == first) | (which == second)
    local = torch.where(which == first, index - first * chunk, index - (second - 1) * chunk)
    return torch.where(held, local, torch.zeros_like(local)), held


class _SumOverCp(torch.autograd.Function):
    """All-reduce (sum) over the CP group whose backward passes the gradient through unchanged: every CP
    rank computes the same loss from the sum, so d loss / d sum is the same everywhere and is the gradient
    of this rank's addend."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone(memory_format=torch.contiguous_format)
        torch.distributed.all_reduce(out, group=parallel_state.get_context_parallel_group())
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def sum_over_cp(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` summed over the CP group (autograd-aware, for a loss every CP rank computes alike); the
    tensor itself at CP=1. Used for per-position results that are nonzero on the one rank holding the
    position."""
    if cp_world_size() == 1:
        return tensor
    return _SumOverCp.apply(tensor)


def select_positions(out: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """out[i, index[i, j], ...] for original positions `index` [b, n] from this rank's local output
    `out` [b, L / CP, ...] (the whole sequence's [b, L, ...] at CP=1): [b, n, ...], summed over the CP group
    (each position comes from the rank that holds it). Only the selected positions cross the group."""
    b, length = out.shape[0], out.shape[1] * cp_world_size()
    local, held = to_local(index, length)
    idx = local.view(b, -1, *([1] * (out.dim() - 2))).expand(-1, -1, *out.shape[2:])
    picked = torch.gather(out, 1, idx)
    if cp_world_size() == 1:
        return picked
    held = held.view(*held.shape, *([1] * (out.dim() - 2)))
    return sum_over_cp(torch.where(held, picked, torch.zeros_like(picked)))


class CpLocalLoss:
    """A loss function (`MegatronEngine.run_schedule`'s `loss_fn(mb, output)`) that takes this CP rank's own
    part of the output ([b, L / CP, ...], positions as `to_local` maps them) and sums its per-position
    results over the CP group itself (`sum_over_cp`, `select_positions`); other loss functions get the whole
    sequence (`gather_sequence`)."""

    def __init__(
        self, fn: Callable[[Any, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
    ) -> None:
        self.fn = fn

    def __call__(self, mb: Any, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.fn(mb, output)


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    enable_gqa: bool,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence's keys; [b, h, s_local, d] in,
    [b, h, s_local, d] out (s_local: this rank's two chunks).

    K / V of all CP ranks are gathered (memory O(sequence) per rank for K and V only; the scores stay
    [s_local, s]). The mask compares original positions: query at position i sees keys at positions <= i.
    """
    cp = cp_world_size()
    rank = parallel_state.get_context_parallel_rank()
    s_local = q.shape[2]
    k_all = gather_over_cp(k, 2)
    v_all = gather_over_cp(v, 2)
    q_pos = local_positions(s_local * cp, rank, cp, q.device)
    k_pos = gathered_positions(s_local, cp, q.device)
    mask = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # [s_local, s] True = attend
    return F.scaled_dot_product_attention(
        q, k_all, v_all, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa
    )


def pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
    """megatron's `get_pos_emb_on_this_cp_rank` without its pinned-memory CUDA index tensor (it pins host
    memory and calls `.cuda()`, which a CPU-only torch refuses); same chunks, on the embedding's device."""
    cp_size = cp_group.size()
    index = torch.tensor(local_chunk_ids(cp_group.rank(), cp_size), device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[(seq_dim + 1) :])
    pos_emb = pos_emb.index_select(seq_dim, index)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[(seq_dim + 2) :])


def use_portable_rope_split() -> None:
    """Point megatron's rotary embeddings at `pos_emb_on_this_cp_rank` (idempotent; same result on GPU,
    and the only version that runs on CPU)."""
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = pos_emb_on_this_cp_rank
