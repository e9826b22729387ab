"""megatron's multi-tensor fallbacks as torch's foreach kernels (rltrain/megatron/multi_tensor.py): the gradient
norm and the clipping scale equal megatron's local Python loops, read nothing back to the host, and are what
megatron's gradient clipping and optimizer call once the engine built its optimizer."""

from __future__ import annotations

import pytest
import torch

from ..tolerance import assert_close
from ._common import no_host_reads


def _grads(gen: torch.Generator) -> list[torch.Tensor]:
    shapes = [(7, 3), (64,), (1,), (5, 4, 2), (0,)] * 40  # 200 tensors, an empty one among them
    return [torch.randn(s, generator=gen) * (i % 7 + 1) for i, s in enumerate(shapes)]


def test_foreach_l2_norm_equals_megatrons_loop_without_host_reads(monkeypatch):
    from megatron.core.utils import local_multi_tensor_l2_norm

    from rltrain.megatron import cpu_compat
    from rltrain.megatron.multi_tensor import l2_norm

    grads = _grads(torch.Generator().manual_seed(0))
    with cpu_compat.cuda_to_cpu():  # the fallback builds its result on "cuda"
        want, _ = local_multi_tensor_l2_norm(0, None, [grads], False)
    halves = [grads[:77], grads[77:]]  # megatron may hand over several lists
    with no_host_reads(monkeypatch):
        got, per = l2_norm(0, None, halves, True)
        got_only, none = l2_norm(0, None, [grads], False)
    assert got.shape == (1,) and got.dtype == torch.float32 and none is None
    assert_close(got, want, reduction=len(grads) * 64)
    assert torch.equal(got, got_only)
    assert_close(per, torch.stack([g.norm() for g in grads]), reduction=64)


def test_foreach_scale_equals_megatrons_loop(monkeypatch):
    from megatron.core.utils import local_multi_tensor_scale

    from rltrain.megatron.multi_tensor import scale

    gen = torch.Generator().manual_seed(1)
    grads = _grads(gen)
    mine, theirs = [g.clone() for g in grads], [g.clone() for g in grads]
    with no_host_reads(monkeypatch):
        scale(0, None, [mine, mine], 0.37)  # clipping: in place
    local_multi_tensor_scale(0, None, [theirs, theirs], 0.37)
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    src = [g.to(torch.bfloat16) for g in grads]  # the optimizer's copies: 16-bit to fp32 and back
    for factor in (1.0, 0.5):
        mine, theirs = [torch.zeros_like(g) for g in grads], [torch.zeros_like(g) for g in grads]
        scale(0, None, [src, mine], factor)
        local_multi_tensor_scale(0, None, [src, theirs], factor)
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


def test_megatron_clips_through_the_foreach_kernels(mp_world, monkeypatch):
    """After `use_foreach_multi_tensor()` (build_optimizer calls it) megatron's own gradient norm and clipping
    run the foreach functions and give what its local fallbacks give."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer

    from rltrain.megatron import cpu_compat, multi_tensor

    for module in (clip_grads, megatron_optimizer):  # megatron's fallbacks, restored after the test
        monkeypatch.setattr(module, "multi_tensor_scale_impl", utils.local_multi_tensor_scale)
    monkeypatch.setattr(clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm)
    gen = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.zeros(g.shape)) for g in _grads(gen)]
    grads = _grads(gen)
    group = torch.distributed.group.WORLD
    results = {}
    for way in ("local", "foreach"):
        if way == "foreach":
            multi_tensor.use_foreach_multi_tensor()
            assert clip_grads.l2_norm_impl is multi_tensor.l2_norm
            assert clip_grads.multi_tensor_scale_impl is multi_tensor.scale
            assert megatron_optimizer.multi_tensor_scale_impl is multi_tensor.scale
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        with cpu_compat.cuda_to_cpu():
            norm = clip_grads.get_grad_norm_fp32([p.grad for p in params], grad_stats_parallel_group=group)
            clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=norm)
        results[way] = (norm, [p.grad.clone() for p in params])
    (norm_a, grads_a), (norm_b, grads_b) = results["local"], results["foreach"]
    assert norm_b == pytest.approx(norm_a, rel=1e-6)
    for a, b in zip(grads_a, grads_b, strict=True):
        assert_close(b, a, reduction=64)


def test_the_distributed_optimizers_copies_are_megatrons_in_one_foreach_copy(mp_world, monkeypatch):
    """megatron's distributed optimizer copies each updated fp32 main shard into the model's 16-bit parameter
    buffer after a step: `copy_main_params_to_model_params` (installed by `use_foreach_multi_tensor`, which
    build_optimizer calls) does it in one foreach copy, with the buffer megatron's per-parameter copies give
    bit for bit (a bf16 MoE actor: 2 layers x 8 experts x 2 weights and the rest); before a step each main
    shard gets the gradient view megatron's per-parameter lookups give (`copy_model_grads_to_main_grads`)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from rltrain.megatron import multi_tensor

    from ._common import batch_from_lengths, tiny_moe_actor

    actor = tiny_moe_actor(layers=2, micro_batch=4, params_dtype="bfloat16")
    assert (
        DistributedOptimizer._copy_main_params_to_model_params
        is multi_tensor.copy_main_params_to_model_params
    )
    # megatron chains a distributed optimizer for the dense parameters and one for the experts
    optimizers = [o for o in actor.optimizer.chained_optimizers if isinstance(o, DistributedOptimizer)]
    assert len(optimizers) == 2
    batch = batch_from_lengths([(6, 8), (4, 7), (6, 3), (5, 8)], 6, 8, vocab=128)
    mask = batch["response_mask"].float()
    actor.update_policy({**batch, "old_log_probs": -mask, "advantages": mask})  # the fp32 shards moved
    copies = []
    real_foreach = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s: copies.append(len(d)) or real_foreach(d, s))
    counts = []
    for optimizer in optimizers:
        buffers = [b.param_data for gbuf in optimizer.buffers for b in gbuf.buckets]
        results = {}
        for way, method in (("megatron", multi_tensor.megatron_method("_copy_main_params_to_model_params")), ("foreach", DistributedOptimizer._copy_main_params_to_model_params)):  # fmt: skip
            for b in buffers:
                b.fill_(7.0)  # (megatron pads the buffer: the padding keeps it)
            method(optimizer)
            results[way] = [b.clone() for b in buffers]
        counts.append(sum(len(g) for g in (*optimizer.model_float16_groups, *optimizer.model_fp32_groups)))
        for a, b in zip(results["megatron"], results["foreach"], strict=True):
            assert torch.equal(a, b) and (a != 7.0).float().mean() > 0.9
    assert copies == counts and 2 * 2 * 8 in counts  # one foreach copy per optimizer; the experts' own
    # The gradients each main shard gets before a step: megatron's per-parameter lookups, or the views found
    # once (`copy_model_grads_to_main_grads`): the same ranges of the same main_grad buffers.
    assert DistributedOptimizer._copy_model_grads_to_main_grads is multi_tensor.copy_model_grads_to_main_grads
    for optimizer in optimizers:
        for buffer in optimizer.buffers:
            buffer.grad_data.copy_(
                torch.randn(buffer.grad_data.shape, generator=torch.Generator().manual_seed(3))
            )
        shards = [
            p for g in (*optimizer.shard_fp32_from_float16_groups, *optimizer.shard_fp32_groups) for p in g
        ]
        grads = {}
        for way, method in (("megatron", multi_tensor.megatron_method("_copy_model_grads_to_main_grads")), ("cached", DistributedOptimizer._copy_model_grads_to_main_grads)):  # fmt: skip
            for _ in range(2):  # the second call takes the cached ranges
                for p in shards:
                    p.grad = None
                method(optimizer)
            grads[way] = [p.grad for p in shards]
        for a, b in zip(grads["megatron"], grads["cached"], strict=True):
            assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b) and a.data_ptr() == b.data_ptr()
