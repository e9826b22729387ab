"""The optimizer step decided on the device (`model.steps_on_device`: torch's fused AdamW takes the guard's
flag, so the gradient norm, clipping and the divergence guard need no value on the host): the same weights,
gradient norms and metrics as megatron's host-side decisions, bit for bit, with clipping active or not.
The CPU takes the fused kernel here as an accelerator does (`_common.fuse_adam_on_cpu`)."""

from __future__ import annotations

import pytest
import torch

from ._common import batch_from_lengths, fuse_adam_on_cpu, tiny_moe_actor

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def _weights(actor) -> dict[str, torch.Tensor]:
    from rltrain.megatron.model import unwrap

    return {n: p.detach().clone() for c in actor.chunks for n, p in unwrap(c).named_parameters()}


@pytest.mark.parametrize("clip_grad", [1e-3, 1e3], ids=["clipped", "unclipped"])
def test_a_step_decided_on_the_device_equals_megatrons_host_step(mp_world, monkeypatch, clip_grad):
    """Two updates of two optimizer steps each (a bf16 MoE actor: dense and expert optimizers, chained), once
    with the host deciding (megatron's norm and clipping read back, `deviceguard` switched off) and once on the
    device: every weight equal bit for bit, the same loss and gradient norm metrics."""
    from rlconf.config import Optim
    from rltrain.megatron.fused import TRAIN_KERNELS_OFF_ENV
    from rltrain.megatron.model import steps_on_device

    batch = batch_from_lengths([(6, 8), (4, 7), (6, 3), (5, 8)], 6, 8, vocab=128)
    mask = batch["response_mask"].float()
    rl = {**batch, "old_log_probs": torch.zeros_like(mask) - 1.0, "advantages": mask * 3.0}
    runs = {}
    for where in ("host", "device"):
        if where == "host":
            monkeypatch.setenv(TRAIN_KERNELS_OFF_ENV, "deviceguard")
        else:
            monkeypatch.delenv(TRAIN_KERNELS_OFF_ENV, raising=False)
        torch.manual_seed(0)  # the same initial weights in both runs
        actor = tiny_moe_actor(
            layers=2, micro_batch=1, params_dtype="bfloat16", mini_batch=2, total_steps=3,
            optim=Optim(lr=1e-2, clip_grad=clip_grad),
        )  # fmt: skip
        fuse_adam_on_cpu(actor)
        assert steps_on_device(actor._optimizer) == (where == "device")
        assert len(actor._optimizer.chained_optimizers) == 2
        metrics = [actor.update_policy(rl, step=s) for s in (1, 2)]
        runs[where] = (_weights(actor), metrics)
    (w_host, m_host), (w_dev, m_dev) = runs["host"], runs["device"]
    assert all(torch.equal(w_host[n], w_dev[n]) for n in w_host)
    for host, dev in zip(m_host, m_dev, strict=True):
        assert host["actor/skipped_updates"] == dev["actor/skipped_updates"] == 0.0
        assert dev["actor/pg_loss"] == host["actor/pg_loss"]
        assert dev["actor/grad_norm"] == pytest.approx(host["actor/grad_norm"], rel=1e-14)
    if clip_grad < 1.0:  # the clipped case clipped: its norms exceed the bound
        assert all(m["actor/grad_norm"] > clip_grad for m in m_dev)
    torch.manual_seed(0)
    initial = _weights(tiny_moe_actor(2, 1, "bfloat16"))
    assert any(not torch.equal(w_dev[n], v) for n, v in initial.items()), "the updates changed no weight"
