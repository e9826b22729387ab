"""The KV cache of a multi-turn rollout's rows kept between its turn calls (`KVSession`), for
rltrain.megatron.inference.generate_with_kv_cache (which loads a call's cached columns from it and stores
what the call computed)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class _Held:
    """Where one row's cached keys/values live: row `index` of block `block`, columns `start` onwards, one
    per token of `tokens` (the row's context positions 0.., contiguous)."""

    block: int
    index: int
    start: int
    tokens: list[int]


@dataclass
class _Block:
    """The cache tensors one turn call left behind (per chunk, per layer: keys, values [C, R, groups,
    head_dim]) and how many of its rows the session still holds (freed at 0)."""

    kv: list[list[tuple[torch.Tensor, torch.Tensor]]]
    live: int


class KVSession:
    """The KV cache of one multi-turn rollout's rows on this rank, kept between its turn calls.

    Rows are keyed by the caller's row ids (stable over the rollout). A turn call passes each row's whole
    context; the session finds how much of it is cached (the longest common prefix with the tokens it
    holds, at most all but the last token, whose logits are needed), so a row whose context the caller
    changed (cut to a budget, or a different row under the same id) is still correct: only the matching
    prefix is reused. What a call generated is held for the next call: the context and every sampled token
    but the last (its keys/values are never computed; the next call prefills it with the observation).
    `drop` forgets rows that ended; the owner drops the whole session at the end of the rollout.

    Rows of one call live in one block (tensors in the engine's layout); a row that moves on to a later
    call leaves its old block, which is freed once none of its rows is held (rows waiting on a slow tool
    keep theirs alive meanwhile).
    """

    def __init__(self) -> None:
        self.rows: dict[int, _Held] = {}
        self.blocks: dict[int, _Block] = {}
        self._next = 0
        # Context tokens taken from the cache / run through the model, over the session (for the metrics).
        self.reused_tokens = 0
        self.prefilled_tokens = 0

    def drop(self, row_ids: Sequence[int]) -> None:
        """Forget these rows (ended); unknown ids are ignored."""
        for row in row_ids:
            held = self.rows.pop(int(row), None)
            if held is not None:
                self._release(held.block)

    def _release(self, block: int) -> None:
        blk = self.blocks[block]
        blk.live -= 1
        if blk.live == 0:
            del self.blocks[block]

    def reusable(self, row_id: int, context: list[int]) -> int:
        """How many leading tokens of `context` this session holds keys/values for (never all of it)."""
        held = self.rows.get(row_id)
        if held is None:
            return 0
        n = min(len(held.tokens), len(context) - 1)
        if held.tokens[:n] == context[:n]:
            return max(n, 0)
        i = 0
        while i < n and held.tokens[i] == context[i]:
            i += 1
        return i

    def load(self, engine: Any, row_ids: list[int], lengths: list[int], width: int, cols: int) -> None:
        """Fill the engine's (zeroed) cache columns [0, cols) of a call whose contexts are right-aligned at
        `width` (row i at columns width - lengths[i] ..) from the held rows: column j of row i is its
        context token j - (width - lengths[i]). `engine`: the call's rltrain.megatron.inference.KVCacheGenerator
        (typed loosely: that module imports this one)."""
        if cols <= 0:
            return
        dev = engine.device
        by_block: dict[int, list[int]] = {}
        for i, row in enumerate(row_ids):
            if width - lengths[i] < cols:  # some of its columns precede the prefill
                by_block.setdefault(self.rows[row].block, []).append(i)
        col = torch.arange(cols, device=dev).unsqueeze(1)  # [cols, 1]
        for b, dst in by_block.items():
            held = [self.rows[row_ids[i]] for i in dst]
            first = torch.tensor([width - lengths[i] for i in dst], device=dev)  # first real column
            offset = torch.tensor([h.start for h in held], device=dev) - first
            src_rows = torch.tensor([h.index for h in held], device=dev)
            dst_rows = torch.tensor(dst, device=dev)
            valid = (col >= first).unsqueeze(-1).unsqueeze(-1)  # [cols, n, 1, 1]
            for chunk, src_chunk in zip(engine.cache, self.blocks[b].kv, strict=True):
                for (k, v), (sk, sv) in zip(chunk, src_chunk, strict=True):
                    src_col = (col + offset).clamp(0, sk.shape[0] - 1)  # [cols, n]
                    for dst_t, src_t in ((k, sk), (v, sv)):
                        part = src_t[src_col, src_rows.unsqueeze(0)]  # [cols, n, groups, head_dim]
                        dst_t[:cols].index_copy_(1, dst_rows, torch.where(valid, part, 0).to(dst_t.dtype))

    def store(
        self,
        parts: list[tuple[torch.Tensor, list[list[tuple[torch.Tensor, torch.Tensor]]]]],
        row_ids: list[int],
        contexts: list[list[int]],
        width: int,
        generated: list[list[int]],
    ) -> None:
        """Hold what a call computed: `parts` (batch rows, their cache rows) as `_decode` harvested them;
        row i's context right-aligned at `width`, then its generated tokens (all but the last cached)."""
        order = torch.cat([rows.cpu() for rows, _ in parts]).tolist()
        kv = [
            [
                (
                    torch.cat([p[c][layer][0] for _, p in parts], 1),
                    torch.cat([p[c][layer][1] for _, p in parts], 1),
                )
                for layer in range(len(parts[0][1][c]))
            ]
            for c in range(len(parts[0][1]))
        ]
        block = self._next
        self._next += 1
        self.drop([row_ids[i] for i in order])  # their old holdings (already loaded into this call)
        self.blocks[block] = _Block(kv, len(order))
        for j, i in enumerate(order):
            tokens = contexts[i] + generated[i][:-1]
            self.rows[row_ids[i]] = _Held(block, j, width - len(contexts[i]), tokens)
