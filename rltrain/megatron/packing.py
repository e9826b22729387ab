"""Sequence packing (megatron's THD layout) for the log-prob, value and update passes.

A packed micro-batch holds its rows back to back in one sequence [1, T] with no padding between them
(T = the sum of the rows' valid lengths, rounded up to the sequence-parallel multiple by one padding segment
at the end). `cu_seqlens` [rows (+1 padding segment) + 1] marks where each row starts; positions restart at 0
in every row, and attention is causal within each row and never crosses rows. megatron-core carries the
layout through GPTModel as `PackedSeqParams(qkv_format="thd")`; this module gives it what megatron only
offers through Transformer Engine or flash-attn:

* `packed_attention`: the core attention of `model.SdpaAttention` for packed queries [T, heads, dim]. On cuda
  with 16-bit activations and no attention dropout it is torch's variable-length flash attention
  (`torch.nn.attention.varlen.varlen_attn`, KV heads grouped as they are: `enable_gqa` where torch has it,
  else passed through, which torch 2.11's flash kernel groups itself); on
  one H200 (8 rows of 400..4096 tokens, 16k tokens, 12 query / 2 KV heads, bf16) forward + backward took
  2.3 ms against 3.2 ms for SDPA on the same rows padded to 4096 and 3.9 ms for one SDPA call per row.
  Elsewhere (cpu, fp32, dropout) one causal SDPA call per row: the padded path's math row by row.
* `rope_thd`: megatron's `fused_apply_rotary_pos_emb_thd` hook (its fused RoPE for packed rows needs
  Transformer Engine): each token's angle is looked up at its position within its row, then the compiled
  `fused.compiled_rope` rotates all tokens at once (no host sync, no per-row loop).
* the index maps: `pack_rows` (rows of the engine's batch layout -> packed tokens, positions, cu_seqlens and
  the packed position predicting each response token), `unpack` (packed values -> padded rows, for tests),
  and, from rltrain/token_balance.py, `split_packed_by_tokens` (token-budget micro-batches whose token sums,
  not padded sizes, meet the budget, balanced).

The plan decides where packing runs (`EngineSettings.remove_padding`, rlconf/plan/engine.py); the engine
never re-derives it.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

from rltrain.device import from_host
from rltrain.token_balance import balanced_split, split_packed_by_tokens


@dataclass
class RowPackedSeqParams(PackedSeqParams):
    """megatron's PackedSeqParams plus the segment lengths on the host (the per-row attention slices its
    rows without reading cu_seqlens back from the device)."""

    seqlens: tuple[int, ...] = ()
    padding_mask: torch.Tensor | None = None
    """[1, T] True on positions that are no row's token (the trailing padding segment, the placeholder of a
    row without tokens): mixture-of-experts routers leave them out of the load-balancing loss."""


@dataclass(frozen=True)
class PackedRows:
    """One packed micro-batch: tokens and positions [1, T], the packed position whose output predicts each
    response token [b, R] (clamped inside its row where the response is padding), and megatron's params."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    gather_index: torch.Tensor
    params: RowPackedSeqParams


def _row_spans(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(first valid column, valid length, prompt length) of each row of the engine's batch layout (each
    row's valid tokens contiguous; the response is the span up to its last valid response token)."""
    mask = batch["attention_mask"].bool()
    resp_mask = batch["response_mask"]
    valid = mask.sum(-1)
    start = torch.where(mask.any(-1), mask.int().argmax(-1), torch.zeros_like(valid))
    r = resp_mask.shape[1]
    resp_len = (resp_mask.bool() * torch.arange(1, r + 1)).max(-1).values if r else resp_mask.sum(-1)
    return start, valid, valid - resp_len


def pack_rows(batch: dict[str, torch.Tensor], seq_multiple: int, device: torch.device) -> PackedRows:
    """Pack the rows of `batch` (engine layout: input_ids / attention_mask [b, S], response_mask [b, R], on
    the host) into one sequence on `device`.

    Row i's valid tokens occupy packed positions cu[i] .. cu[i+1]-1 at positions 0 .. len_i - 1; padding up to
    a multiple of `seq_multiple` (sequence parallel) is one more segment at the end (token 0), so every
    packed position belongs to exactly one segment and no real row attends to it. A row without valid
    tokens still gets one (padding) token, so every row has a position to read its outputs from.
    """
    start, valid, prompt_len = _row_spans(batch)
    lengths = valid.clamp(min=1)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    used = int(offsets[-1])
    total = math.ceil(used / seq_multiple) * seq_multiple
    seqlens = [int(x) for x in lengths.tolist()] + ([total - used] if total > used else [])
    row_of = torch.repeat_interleave(torch.arange(len(lengths)), lengths)  # [used]
    pos = torch.arange(used) - offsets[row_of]
    src = (start[row_of] + pos).clamp(max=batch["input_ids"].shape[1] - 1)
    real = pos < valid[row_of]
    padding = torch.ones(total, dtype=torch.bool)
    padding[:used] = ~real
    tokens = torch.zeros(total, dtype=batch["input_ids"].dtype)
    tokens[:used] = torch.where(real, batch["input_ids"][row_of, src], torch.zeros_like(src))
    positions = torch.zeros(total, dtype=torch.long)
    positions[:used] = pos
    if total > used:
        positions[used:] = torch.arange(total - used)
    r = batch["response_mask"].shape[1]
    local = (prompt_len.unsqueeze(1) - 1 + torch.arange(r).unsqueeze(0)).clamp(min=0)
    local = torch.minimum(local, (lengths - 1).unsqueeze(1))
    gather_index = offsets[:-1].unsqueeze(1) + local
    cu = from_host(torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32), device)
    longest = max(seqlens)
    params = RowPackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        seqlens=tuple(seqlens),
        padding_mask=from_host(padding.unsqueeze(0), device),
    )
    return PackedRows(
        from_host(tokens.unsqueeze(0), device),
        from_host(positions.unsqueeze(0), device),
        from_host(gather_index, device),
        params,
    )


def unpack(values: torch.Tensor, seqlens: list[int] | tuple[int, ...], rows: int, fill: float = 0.0):
    """Packed per-token values [T, ...] -> padded rows [rows, max length, ...] (the first `rows` segments;
    a trailing padding segment is dropped); positions past a row's length hold `fill`."""
    width = max(seqlens[:rows], default=0)
    out = values.new_full((rows, width, *values.shape[1:]), fill)
    for i, part in enumerate(torch.split(values[: sum(seqlens)], list(seqlens))[:rows]):
        out[i, : part.shape[0]] = part
    return out


# ------------------------------------------------------------------------------------ attention
@functools.cache
def _varlen() -> tuple[Callable[..., torch.Tensor], frozenset[str]] | None:
    """torch's variable-length flash attention and its keyword names, or None where torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_causal(names: frozenset[str]) -> dict[str, object]:
    """The keyword that makes torch's varlen attention causal, given its parameter names: `window_size`
    (-1, 0) in newer torch, `is_causal` in torch 2.11."""
    return {"window_size": (-1, 0)} if "window_size" in names else {"is_causal": True}


@functools.cache
def _varlen_groups_heads() -> bool:
    """Whether torch's varlen kernel takes fewer KV heads than query heads without `enable_gqa` (its flash
    kernel does; a wrapper that checks the head counts raises): tried once on a tiny input."""
    fn, names = _varlen()  # type: ignore[misc]
    q = torch.zeros((2, 2, 64), dtype=torch.bfloat16, device="cuda")
    kv = torch.zeros((2, 1, 64), dtype=torch.bfloat16, device="cuda")
    cu = torch.tensor([0, 2], dtype=torch.int32, device="cuda")
    try:
        fn(q, kv, kv, cu, cu, 2, 2, **varlen_causal(names))
    except (RuntimeError, ValueError):
        return False
    return True


def varlen_supported(q: torch.Tensor, dropout_p: float) -> bool:
    """Whether `packed_attention` takes torch's varlen flash kernel for these queries."""
    return (
        q.is_cuda
        and q.dtype in (torch.bfloat16, torch.float16)
        and dropout_p == 0.0
        and _varlen() is not None
    )


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    params: PackedSeqParams,
    scale: float | None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal attention within each packed segment: q [T, hq, d], k / v [T, hkv, d] -> [T, hq, d]."""
    gqa = q.shape[1] != k.shape[1]
    found = _varlen()
    if varlen_supported(q, dropout_p) and found is not None:
        fn, names = found
        kwargs: dict[str, object] = {"scale": scale, **varlen_causal(names)}
        if gqa and "enable_gqa" in names:
            kwargs["enable_gqa"] = True
        cu_q, cu_k = params.cu_seqlens_q, params.cu_seqlens_kv
        # megatron's q / k / v are views of the fused qkv projection; the flash kernel wants dense rows.
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        args = (cu_q, cu_k, params.max_seqlen_q, params.max_seqlen_kv)
        if not gqa or "enable_gqa" in names or _varlen_groups_heads():
            # The flash kernel groups query heads over the KV heads itself (torch 2.11's wrapper has no
            # enable_gqa but passes grouped KV through: measured equal to repeated heads, 4% faster).
            return fn(q, k, v, *args, **kwargs)
        rep = q.shape[1] // k.shape[1]
        return fn(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), *args, **kwargs)
    seqlens = getattr(params, "seqlens", ())
    if not seqlens:  # a PackedSeqParams from elsewhere: read the lengths back once
        seqlens = tuple(torch.diff(params.cu_seqlens_q).tolist())
    outs = []
    for qs, ks, vs in zip(*(torch.split(x, list(seqlens)) for x in (q, k, v)), strict=True):
        # [t, h, d] -> [1, h, t, d]
        o = F.scaled_dot_product_attention(
            qs.transpose(0, 1).unsqueeze(0),
            ks.transpose(0, 1).unsqueeze(0),
            vs.transpose(0, 1).unsqueeze(0),
            dropout_p=dropout_p,
            is_causal=True,
            scale=scale,
            enable_gqa=gqa,
        )
        outs.append(o.squeeze(0).transpose(0, 1))
    return torch.cat(outs, 0)


# ------------------------------------------------------------------------------------ RoPE
def packed_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Each packed token's position within its segment ([total], on cu_seqlens' device, no host sync)."""
    idx = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    seg = torch.searchsorted(cu_seqlens, idx, right=True) - 1
    return (idx - cu_seqlens[seg]).long()


def rope_thd(
    t: torch.Tensor,
    cu_seqlens: torch.Tensor,
    freqs: torch.Tensor,
    cp_size: int = 1,
    cp_rank: int = 0,
    rotate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """RoPE of packed t [T, heads, dim] with the angles freqs [max_len, 1, 1, rot] of each token's position
    within its row: megatron's `fused_apply_rotary_pos_emb_thd` hook. `rotate(t [T, 1, h, d], freqs
    [T, 1, 1, rot])` is the bshd RoPE to use (default: megatron's unfused one)."""
    assert cp_size == 1, "packed RoPE with context parallel is refused by the plan"
    if rotate is None:
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

        rotate = _apply_rotary_pos_emb_bshd
    return rotate(t.unsqueeze(1), _packed_angles(cu_seqlens, freqs, t.shape[0])).squeeze(1)


# The angles of the last packed micro-batch: every layer's query and key share one tensor (computed once per
# forward, saved once for the backward) instead of one [T, 1, 1, rot] fp32 copy per call.
_ANGLES: list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]] = []


def _packed_angles(cu_seqlens: torch.Tensor, freqs: torch.Tensor, total: int) -> torch.Tensor:
    """freqs [max_len, 1, 1, rot] at each packed token's position within its row: [total, 1, 1, rot]."""
    if _ANGLES and _ANGLES[0][0] is cu_seqlens and _ANGLES[0][1] is freqs and _ANGLES[0][2] == total:
        return _ANGLES[0][3]
    angles = freqs.index_select(0, packed_positions(cu_seqlens, total))
    _ANGLES[:] = [(cu_seqlens, freqs, total, angles)]
    return angles


__all__ = [
    "PackedRows",
    "RowPackedSeqParams",
    "balanced_split",
    "pack_rows",
    "packed_attention",
    "packed_positions",
    "rope_thd",
    "split_packed_by_tokens",
    "unpack",
]
