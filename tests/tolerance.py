"""Comparison tolerances derived from the dtype and the size of the reductions behind a value.

Two computations of one value that sum in different orders (another TP split, another DP reduction, a chunked
log-softmax, or simply another CPU whose vector width changes how a BLAS kernel blocks its sums) agree only
up to rounding. A floating-point sum of n terms carries a relative error that grows like sqrt(n) * eps for
random rounding (n * eps in the worst case); a value that passes through `depth` such reductions in sequence
(the layers of a network) compounds them like a random walk, sqrt(depth). So the tolerance is

    rel = SAFETY * eps(dtype) * sqrt(reduction * depth),   atol = rel * magnitude

where `reduction` is the longest sum (e.g. the widest matmul inner dimension), `depth` the number of such
sums in sequence and `magnitude` the size of the compared values. A bare `atol=1e-6` tuned on one machine is
what made the suite fail on an Intel CPU where CI's AMD passed (3 ulps instead of 2 at magnitude 4).

Bit-exact comparisons (`torch.equal`) stay where the computation is the same code on the same data (a
checkpoint round trip, a resume, a copy): those must not differ at all.
"""

from __future__ import annotations

import math

import torch

# Observed differences on AMD and Intel CPUs sit within about a fifth of the tolerance this gives for the
# tiny test models (e.g. 1.9e-6 against 3.5e-5 for log-probs of magnitude 4.6 through 10 reductions of 176).
SAFETY = 2.0


def tolerance(dtype: torch.dtype, reduction: int, depth: int = 1, magnitude: float = 1.0) -> dict[str, float]:
    """`atol` / `rtol` for torch.testing.assert_close between two orderings of the same computation."""
    rel = SAFETY * torch.finfo(dtype).eps * math.sqrt(max(reduction, 1) * max(depth, 1))
    return {"atol": rel * magnitude, "rtol": rel}


def rel_tolerance(dtype: torch.dtype, reduction: int, depth: int = 1) -> float:
    """The relative tolerance alone, for scalars compared with pytest.approx(rel=...)."""
    return tolerance(dtype, reduction, depth)["rtol"]


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    reduction: int,
    depth: int = 1,
    msg: str | None = None,
) -> None:
    """assert_close with the tolerance of `expected`'s dtype, `reduction` and `depth`; the magnitude is the
    largest |expected| (log-probs of a vocabulary of 100 are about 4.6, so their ulp is 4x that at 1)."""
    magnitude = float(expected.detach().abs().max()) if expected.numel() else 0.0
    magnitude = magnitude or 1.0  # an all-zero reference: rounding relative to 1
    tol = tolerance(expected.dtype, reduction, depth, magnitude)
    torch.testing.assert_close(actual, expected, **tol, msg=msg)
