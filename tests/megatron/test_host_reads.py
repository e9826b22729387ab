"""Host reads inside an update (issue 36): on a GPU each read of a tensor's value waits for all the work queued
before it, so one inside a layer's forward serialises the host and the device layer by layer (a profiled
qwen3-moe update on the H200 read each MoE layer's routing counts back, 576 times per update). The routing
statistics are summed on the device and read once per update; a micro-batch's loss weight is a device
tensor, so nothing is read between its forward and its backward; the micro-batches' metrics come back in one
copy per optimizer step."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from ._common import batch_from_lengths, no_host_reads, tiny_moe_actor


@pytest.fixture
def moe_actor(mp_world):
    return tiny_moe_actor(layers=3, micro_batch=2)


def test_routing_stats_are_read_once_per_update(moe_actor, monkeypatch):
    """No host read while a routing is recorded (3 MoE layers x 2 micro-batches of them), and the
    update's expert-load metric is the one the routers' own routing maps give."""
    from rltrain.megatron.model import MoeRoutingStats, unwrap
    from rltrain.megatron.moe_decode import ROUTE_OBSERVERS

    for name in ("_record", "_record_index"):  # megatron's router (its forward hook), or train_route's
        record = getattr(MoeRoutingStats, name)

        def record_without_reads(self, *args, record=record):
            with no_host_reads(monkeypatch):
                return record(self, *args)

        monkeypatch.setattr(MoeRoutingStats, name, record_without_reads)
    seen: dict[int, torch.Tensor] = {}

    def count(router, routed, padding):
        # routed [tokens, experts]; padding columns (True in the mask) are not tokens
        if padding is not None:
            routed = routed & ~padding.reshape(-1, 1)
        tokens = routed.sum(0, dtype=torch.float64)
        seen[router.layer_number] = seen.get(router.layer_number, 0) + tokens

    def hook(router, inputs, output):
        count(router, output[1], inputs[1] if len(inputs) > 1 else None)

    def observe(router, index, padding):
        routed = torch.nn.functional.one_hot(index, router.num_experts).sum(1).bool()
        count(router, routed, padding)

    routers = [m for m in unwrap(moe_actor.chunks[0]).modules() if hasattr(m, "router_replay")]
    assert len(routers) == 3
    handles = [r.register_forward_hook(hook) for r in routers]
    ROUTE_OBSERVERS.append(observe)
    batch = batch_from_lengths([(6, 8), (4, 7), (6, 3), (5, 8)], 6, 8, vocab=128)
    mask = batch["response_mask"].float()
    try:
        metrics = moe_actor.update_policy(
            {**batch, "old_log_probs": torch.zeros_like(mask), "advantages": mask}
        )
    finally:
        ROUTE_OBSERVERS.remove(observe)
        for h in handles:
            h.remove()
    loads = [float(c.max() / c.mean()) for c in seen.values()]
    assert metrics["actor/moe_expert_load_max"] == pytest.approx(sum(loads) / len(loads), rel=1e-12)
    assert metrics["actor/moe_aux_loss"] > 0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_micro_batch_weight_is_a_device_tensor_equal_to_the_host_float(mode, monkeypatch):
    """The weight needs no host read, and a loss times it is bit for bit the loss times the Python float the
    weight was before (the scalar is rounded to fp32 inside the product either way)."""
    from rltrain.megatron.engine import MegatronEngine

    gen = torch.Generator().manual_seed(0)
    for dp in (1, 2, 3):
        engine = SimpleNamespace(dp_size=dp)
        for _ in range(20):
            mask = (torch.rand(5, 9, generator=gen) < 0.6).long()
            mask[0] = 0  # a row without a valid token
            totals = (float(mask.sum()) * dp + 17.0, 4.0 * dp + 1.0)
            loss = torch.randn((), generator=gen)
            with no_host_reads(monkeypatch):
                weight = MegatronEngine.micro_batch_weight(engine, mask, mode, totals)
            assert isinstance(weight, torch.Tensor) and weight.dtype == torch.float32
            if mode == "token-mean":
                before = float(mask.sum()) / totals[0] * dp
            else:
                before = float((mask.sum(-1) > 0).sum()) / totals[1] * dp
            assert torch.equal(loss * weight, loss * before)


def _reads_outside_the_schedule(actor, rl: dict, monkeypatch) -> tuple[int, dict]:
    """(host reads of an update outside its forward / backward schedule and its micro-batches' making, which
    reads the host's own batch: it comes from the controller on the CPU; the update's metrics)."""
    from rltrain.megatron.engine import MegatronEngine

    from ._common import HOST_READS

    count = 0
    inside = False

    def not_counted(method):
        def run(self, *args, **kwargs):
            nonlocal inside
            inside = True
            try:
                return method(self, *args, **kwargs)
            finally:
                inside = False

        return run

    def counted(original):
        def read(self, *args, **kwargs):
            nonlocal count
            count += not inside
            return original(self, *args, **kwargs)

        return read

    with monkeypatch.context() as m:
        for method in ("run_schedule", "micro_batches"):
            m.setattr(MegatronEngine, method, not_counted(getattr(MegatronEngine, method)))
        for name in HOST_READS:
            m.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
        metrics = actor.update_policy(rl)
    return count, metrics


def test_an_update_reads_its_metrics_once_per_optimizer_step(mp_world, monkeypatch):
    """Outside the forward / backward schedule an update reads the same number of values back to the host
    whether its mini-batch has 1, 2 or 4 micro-batches (its micro-batches' metrics come back in one copy per
    optimizer step, not one read per metric per micro-batch)."""
    batch = batch_from_lengths([(6, 8), (4, 7), (6, 3), (5, 8)], 6, 8, vocab=128)
    mask = batch["response_mask"].float()
    rl = {**batch, "old_log_probs": torch.zeros_like(mask), "advantages": mask}
    reads = {}
    for micro in (4, 2, 1):
        reads[micro], metrics = _reads_outside_the_schedule(
            tiny_moe_actor(layers=2, micro_batch=micro), rl, monkeypatch
        )
        assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert reads[4] == reads[2] == reads[1], reads


@pytest.mark.parametrize("where", ["host", "device"])
def test_an_optimizer_step_decided_on_the_device_reads_nothing_back(mp_world, monkeypatch, where):
    """With the step decided on the device (fused AdamW, `model.steps_on_device`), an optimizer step (gradient
    norm, clipping, the divergence guard, the update) reads no value back to the host, so the host goes on to
    the next mini-batch while the device works; the update's steps come back in one copy after the last one
    (`MegatronEngine.read_steps`). megatron's host step reads the norm and the guard the loss at every step."""
    from rltrain.megatron.engine import MegatronEngine

    from ._common import fuse_adam_on_cpu

    batch = batch_from_lengths([(6, 8), (4, 7), (6, 3), (5, 8)], 6, 8, vocab=128)
    mask = batch["response_mask"].float()
    rl = {**batch, "old_log_probs": torch.zeros_like(mask), "advantages": mask}
    actor = tiny_moe_actor(layers=2, micro_batch=1, mini_batch=2)
    if where == "device":
        fuse_adam_on_cpu(actor)
    step = MegatronEngine.optimizer_step

    def step_without_reads(self, *args, **kwargs):
        with no_host_reads(monkeypatch):
            return step(self, *args, **kwargs)

    monkeypatch.setattr(MegatronEngine, "optimizer_step", step_without_reads)
    if where == "host":
        with pytest.raises(pytest.fail.Exception, match="host read"):
            actor.update_policy(rl)
        return
    metrics = actor.update_policy(rl)
    assert metrics["actor/skipped_updates"] == 0.0 and math.isfinite(metrics["actor/grad_norm"])
