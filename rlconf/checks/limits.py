"""The plan's size limits, enforced by rule plan-limits (rlconf.checks.run) and re-exported by rlconf.plan.

Bounds that keep the plan's tables (rank grids, lr rows) to a size a controller can hold; far beyond any
real run, they only turn absurd inputs into a ConfigError instead of an hour of list building.
"""

from __future__ import annotations

MAX_DEVICES = 1 << 17
"""Devices of a cluster the plan lays out at most."""
MAX_TOTAL_STEPS = 100_000
"""Training steps of a run the plan tabulates at most."""
MAX_INT = 1 << 40
"""The largest integer a config field may hold."""
