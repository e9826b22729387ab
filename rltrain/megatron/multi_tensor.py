"""megatron's multi-tensor fallbacks (what apex's `amp_C.multi_tensor_l2norm` / `multi_tensor_scale` do when
neither apex nor Transformer Engine is installed) as torch's foreach kernels.

Why: megatron's local fallbacks (`megatron.core.utils.local_multi_tensor_l2_norm` / `_scale`) loop over the
parameters in Python. The gradient norm of every optimizer step runs one `torch.norm` per parameter and then
`torch.tensor(list_of_norms)`, which reads each norm back to the host one at a time; clipping runs a
multiply and a copy per parameter. A qwen3-moe step has ~3,240 parameters (24 layers x 64 experts x 2
weights and the rest): 12,976 norms and as many host reads in one profiled update on the H200, whose device
then idled (docs/benchmarks.md). Here the norms are one `torch._foreach_norm` and a norm of their stack, read
back never (megatron reads the total once), and the scale one `torch._foreach_mul_` (or a foreach multiply and
copy where source and destination differ). Same sums per parameter; the total's summation order differs from
the fallback's by fp32 rounding.

`use_foreach_multi_tensor()` serves megatron's optimizer and gradient clipping with them where megatron fell
back to its local functions; apex's or Transformer Engine's kernels, where installed, are kept.
"""

from __future__ import annotations

from typing import Any

import torch


def l2_norm(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: list[list[torch.Tensor]],
    per_tensor: bool,
    *args: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """amp_C.multi_tensor_l2norm: the L2 norm of all tensors of `tensor_lists` as a [1] fp32 tensor on their
    device (and each tensor's norm where `per_tensor`), no host read."""
    tensors = [t for group in tensor_lists for t in group]
    norms = torch.stack([n.float() for n in torch._foreach_norm(tensors)])
    return torch.linalg.vector_norm(norms).reshape(1), (norms if per_tensor else None)


def scale(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]], factor: float
) -> None:
    """amp_C.multi_tensor_scale: dst = src * factor for tensor_lists = [srcs, dsts] (in place where they are the
    same tensors, as gradient clipping passes them)."""
    src, dst = tensor_lists
    if all(s is d for s, d in zip(src, dst, strict=True)):
        torch._foreach_mul_(dst, factor)
    elif factor == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, factor))


def use_foreach_multi_tensor() -> None:
    """Serve megatron's gradient clipping (`optimizer.clip_grads`) and mixed-precision optimizer copies
    (`optimizer.optimizer`) with `l2_norm` and `scale` where megatron fell back to its local Python loops.
    Idempotent."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = l2_norm
    for module in (clip_grads, megatron_optimizer):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = scale
