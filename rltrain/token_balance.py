"""Token-balanced splits of rows (pure Python; the controller and the engines share them).

* `balanced_split`: rows into groups of given sizes (or free sizes) with balanced token sums: longest rows
  first, each to the lightest group that has room.
* `split_packed_by_tokens`: token-budget micro-batches of packed rows (rltrain/megatron/packing.py): as few
  as the budget allows, balanced.
* `dp_balanced_order`: a permutation of a batch's rows that gives every data-parallel shard (the
  controller's contiguous split) a balanced share of the tokens, and its inverse (forward passes).
* `dp_balanced_columns`: the same for an update, exchanging rows between shards only at the same position,
  so that every mini-batch keeps its rows.
"""

from __future__ import annotations

import math

import torch


def balanced_split(
    lengths: list[int], parts: int, equal_rows: bool = False, caps: list[int] | None = None
) -> list[list[int]]:
    """Row indices in `parts` groups with balanced token sums: longest rows first, each to the lightest
    group that has room (ties by index, so every rank that cuts the same lengths cuts alike). `equal_rows`:
    every group gets len(lengths) // parts rows (the first len % parts groups one more), as data-parallel
    ranks must; `caps`: exactly these row counts (summing to len(lengths)). Groups list rows in ascending
    order.
    """
    n = len(lengths)
    if caps is None:
        caps = [n // parts + (1 if g < n % parts else 0) for g in range(parts)] if equal_rows else [n] * parts
    assert len(caps) == parts and sum(caps) >= n, (caps, n)
    groups: list[list[int]] = [[] for _ in range(parts)]
    sums = [0] * parts
    for i in sorted(range(n), key=lambda j: (-lengths[j], j)):
        open_groups = [g for g in range(parts) if len(groups[g]) < caps[g]]
        g = min(open_groups, key=lambda k: (sums[k], len(groups[k]), k))
        groups[g].append(i)
        sums[g] += lengths[i]
    return [sorted(g) for g in groups]


def _packed_size(lengths: list[int], group: list[int], multiple: int) -> int:
    return math.ceil(sum(lengths[i] for i in group) / multiple) * multiple


def _first_fit_decreasing(lengths: list[int], max_tokens: int, multiple: int) -> list[list[int]]:
    """Longest rows first, each into the first group it fits in (a new one otherwise): always within the
    budget, at most about 11/9 of the fewest groups."""
    groups: list[list[int]] = []
    sums: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        for g, total in enumerate(sums):
            if math.ceil((total + lengths[i]) / multiple) * multiple <= max_tokens:
                groups[g].append(i)
                sums[g] += lengths[i]
                break
        else:
            groups.append([i])
            sums.append(lengths[i])
    return [sorted(g) for g in groups]


def split_packed_by_tokens(lengths: list[int], max_tokens: int, multiple: int = 1) -> list[list[int]]:
    """Token-budget micro-batches of packed rows (use_dynamic_bsz with packing): few (balanced groups, as
    few as a search between the tokens' lower bound and first-fit-decreasing's count finds), within
    the budget (a micro-batch's packed size, the sum of its rows' lengths rounded up to `multiple`, stays
    within `max_tokens` unless it is a single longer row), with balanced token sums; every row once; no
    empty micro-batch. Micro-batches come heaviest first; rows in each in ascending order."""
    if not lengths:
        return []

    def balanced(k: int) -> list[list[int]] | None:
        groups = [g for g in balanced_split(lengths, min(k, len(lengths))) if g]
        fits = all(_packed_size(lengths, g, multiple) <= max_tokens or len(g) == 1 for g in groups)
        return groups if fits else None

    # Rows over the budget take a micro-batch each; the others need at least their tokens / the budget.
    over = [x for x in lengths if x > max_tokens]
    low = max(1, len(over) + math.ceil((sum(lengths) - sum(over)) / max(max_tokens, 1)))
    # First-fit-decreasing always fits; the fewest balanced groups up to its count are preferred
    # (bisection between the lower bound and it: a few tries, not one per count).
    best = _first_fit_decreasing(lengths, max_tokens, multiple)
    lo, hi = low, len(best)
    while lo <= hi:
        mid = (lo + hi) // 2
        found = balanced(mid)
        if found is None:
            lo = mid + 1
        else:
            best, hi = found, mid - 1
    return sorted(best, key=lambda g: (-_packed_size(lengths, g, multiple), g[0]))


def dp_balanced_order(lengths: list[int], shard_sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, inverse): `batch[order]` cut into consecutive shards of `shard_sizes` rows gives each shard a
    balanced token sum (`balanced_split` with those sizes; rows keep their relative order inside a shard);
    `out[inverse]` puts per-row results of the permuted batch back in the original order."""
    groups = balanced_split(lengths, len(shard_sizes), caps=shard_sizes)
    order = torch.tensor([i for g in groups for i in g], dtype=torch.long)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return order, inverse


def dp_balanced_columns(lengths: list[int], dp: int) -> torch.Tensor:
    """A permutation `order` of a batch whose rows split evenly into `dp` contiguous shards that balances the
    shards' tokens while every row keeps its position within a shard: `batch[order]` exchanges rows only
    between shards, at the same position (`order[d * N + p] % N == p`, N = rows / dp).

    Why positions stay: an update cuts each rank's rows into mini-batches by position (in order, or by one
    permutation that every rank draws alike), so a global mini-batch is the same set of rows however the
    rows of one position are spread over the ranks: the update is unchanged (its losses are normalised over
    the whole mini-batch), only its per-rank work is balanced. Columns with the widest spread of lengths go
    first, their longest row to the lightest shard; the shards then differ by at most the widest column
    spread. Identity when the rows do not split evenly."""
    n = len(lengths)
    if dp <= 1 or n % dp:
        return torch.arange(n)
    per = n // dp
    loads = [0] * dp
    order = [0] * n
    columns = sorted(
        range(per),
        key=lambda p: (-(max(lengths[p::per]) - min(lengths[p::per])), p),
    )
    for p in columns:
        rows = sorted((d * per + p for d in range(dp)), key=lambda i: (-lengths[i], i))
        shards = sorted(range(dp), key=lambda d: (loads[d], d))
        for row, shard in zip(rows, shards, strict=True):
            order[shard * per + p] = row
            loads[shard] += lengths[row]
    return torch.tensor(order, dtype=torch.long)
