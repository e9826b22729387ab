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
* Outputs (`gather_sequence`): the last stage's local output is all-gathered and put back in the original
  order, so the loss functions see the whole sequence exactly as at CP=1. Every CP rank then computes the
  same loss, so the gradient of the gathered output is the same on every rank and its backward keeps this
  rank's slice (no communication). Each rank's weight gradients are then its share of the CP=1 gradient;
  megatron's schedule multiplies the loss by CP (it expects a loss over local tokens) and DDP averages over
  the data-parallel-with-CP group: the two cancel, and the update equals CP=1's.
"""

from __future__ import annotations

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
