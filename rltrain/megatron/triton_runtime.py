"""triton and triton.language where installed, else None: the one guarded import of the Triton kernels'
modules (triton ships with torch's CUDA wheels; CPU installs have none and must not add it). Each kernel
module defines its kernels under `if triton is not None:` and names why it cannot run through
`decode_kernels.where_unsupported`."""

from __future__ import annotations

from typing import Any

triton: Any
tl: Any
try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = tl = None

__all__ = ["tl", "triton"]
