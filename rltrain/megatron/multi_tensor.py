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

It also gives megatron's distributed optimizer `copy_main_params_to_model_params`: after each step megatron
copies every parameter's updated fp32 shard into the model's 16-bit parameter buffer one `copy_` at a time
(~3,300 launches per step for qwen3-moe, 18,169 `copy_` calls in one profiled update on the H200, whose
device waited for them, docs/benchmarks.md); here the same copies are one `torch._foreach_copy_`, and
`copy_model_grads_to_main_grads` hands each shard its gradient without looking its range up again.
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
    # Each norm in fp32 (as apex's kernel sums, and no per-tensor cast: one dispatch each on the host).
    norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
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


_MEGATRON_METHODS: dict[str, Any] = {}
"""megatron's own DistributedOptimizer methods that `use_foreach_multi_tensor` replaces, by name."""


def megatron_method(name: str) -> Any:
    """megatron's own `DistributedOptimizer.<name>`, kept when `use_foreach_multi_tensor` replaces it: the
    replacements call it for what they do not take (and tests and benches compare with it)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return _MEGATRON_METHODS.setdefault(name, getattr(DistributedOptimizer, name))


def _megatrons_own_way(optimizer: Any) -> bool:
    """Whether megatron's copies do something other than plain per-parameter copies here (a stub optimizer,
    megatron FSDP, the precision-aware optimizer's decoupled gradients and parameters)."""
    return bool(
        optimizer.is_stub_optimizer
        or optimizer.ddp_config.use_megatron_fsdp
        or optimizer.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
    )


def _cached(optimizer: Any, attr: str, groups: tuple, build: Any) -> Any:
    """`build(optimizer, groups)`, made once per optimizer and kept on it as `attr`; made again if megatron
    replaced one of its group lists (it builds them once, with the optimizer). The views it holds stay valid
    through offloading, which resizes their storages in place (rltrain/megatron/offload.py)."""
    key = tuple(id(g) for pair in groups for side in pair for g in side)
    hit = getattr(optimizer, attr, None)
    if hit is None or hit[0] != key:
        hit = (key, build(optimizer, groups))
        setattr(optimizer, attr, hit)
    return hit[1]


def copy_main_params_to_model_params(self: Any) -> None:
    """megatron's `DistributedOptimizer._copy_main_params_to_model_params` (each updated fp32 main shard into
    its range of the model's parameter buffer) as one foreach copy: the same destinations and sources in
    megatron's order, found once per optimizer (~17 ms of host time per qwen3-moe step), the same rounding.
    megatron's own method runs where it does something else (`_megatrons_own_way`, fp8 parameters)."""
    groups = ((self.shard_fp32_from_float16_groups, self.model_float16_groups),
              (self.shard_fp32_groups, self.model_fp32_groups))  # fmt: skip
    copies = (
        None if _megatrons_own_way(self) else _cached(self, "_rlplan_param_copies", groups, _param_copies)
    )
    if copies is None:
        megatron_method("_copy_main_params_to_model_params")(self)
        return
    dst, src = copies
    if dst:
        torch._foreach_copy_(dst, src)


def _param_copies(self: Any, groups: tuple) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """(destinations, sources) of megatron's per-parameter copies in `_copy_main_params_to_model_params`, in
    its order: each main shard's range of the parameter buffer, and the shard. None where a parameter is
    fp8 (megatron quantizes those shards itself)."""
    from megatron.core.fp8_utils import is_float8tensor

    dst, src = [], []
    for shard_groups, model_groups in groups:
        for shard_group, model_group in zip(shard_groups, model_groups, strict=True):
            for shard_main_param, model_param in zip(shard_group, model_group, strict=True):
                if is_float8tensor(model_param):
                    return None
                world_range = self._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
                assert world_range.size == shard_main_param.nelement()
                gbuf_index, _, bucket_id = self.model_param_gbuf_map[model_param]
                buffer = self.buffers[gbuf_index].buckets[bucket_id].param_data
                dst.append(buffer.view(-1)[world_range.start : world_range.end])
                src.append(shard_main_param)
    return dst, src


def copy_model_grads_to_main_grads(self: Any) -> None:
    """megatron's `DistributedOptimizer._copy_model_grads_to_main_grads` (each main shard's `.grad` = its
    range of the parameter's reduced main_grad, as fp32) with the ranges found once per optimizer: megatron
    looks up every parameter's range and slices its main_grad on every step (~14 ms of host time per
    qwen3-moe step, 3,243 parameters, on the 2-core CPU). The same gradients (views of the same buffer, cast
    only where the buffer is not fp32); megatron's own method where `_megatrons_own_way`."""
    if _megatrons_own_way(self):
        megatron_method("_copy_model_grads_to_main_grads")(self)
        return
    groups = ((self.model_float16_groups, self.shard_fp32_from_float16_groups),
              (self.model_fp32_groups, self.shard_fp32_groups))  # fmt: skip
    for shard_main_param, view, cast in _cached(self, "_rlplan_grad_views", groups, _grad_views):
        shard_main_param.grad = view.float() if cast else view


def _grad_views(self: Any, groups: tuple) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
    """(main shard, its range of the parameter's main_grad, whether to cast it) for every parameter, in
    megatron's order. megatron's `.float()` of a view of an fp32 main_grad is the view itself, so only a 16-bit
    main_grad is cast, at every step as megatron casts it (a cast per parameter is a dispatch on the host)."""
    views: list[tuple[torch.Tensor, torch.Tensor, bool]] = []
    for model_groups, shard_groups in groups:
        for model_group, shard_group in zip(model_groups, shard_groups, strict=True):
            for model_param, shard_main_param in zip(model_group, shard_group, strict=True):
                param_range = self._get_model_param_range_map(model_param)["param"]
                assert param_range.size == shard_main_param.nelement()
                view = model_param.main_grad.view(-1)[param_range.start : param_range.end]
                views.append((shard_main_param, view, view.dtype != torch.float32))
    return views


def use_foreach_multi_tensor() -> None:
    """Serve megatron's gradient clipping (`optimizer.clip_grads`) and mixed-precision optimizer copies
    (`optimizer.optimizer`) with `l2_norm` and `scale` where megatron fell back to its local Python loops,
    and its distributed optimizer's copies around a step with `copy_main_params_to_model_params` and
    `copy_model_grads_to_main_grads`. Idempotent."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for name, mine in (("_copy_main_params_to_model_params", copy_main_params_to_model_params),
                       ("_copy_model_grads_to_main_grads", copy_model_grads_to_main_grads)):  # fmt: skip
        if getattr(DistributedOptimizer, name) is megatron_method(name):
            setattr(DistributedOptimizer, name, mine)
    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = l2_norm
    for module in (clip_grads, megatron_optimizer):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = scale
