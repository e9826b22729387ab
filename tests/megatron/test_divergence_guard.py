"""The engine's divergence guard (MegatronEngine.optimizer_step): an update whose loss or gradient norm is
not finite is not applied, in fp32 and bf16, decided on the host (foreach AdamW, megatron's reads) or on the
device (torch's fused AdamW given the flag, as on accelerators), so the weights and the optimizer state stay
as they were; a finite update right after it is applied as usual."""

from __future__ import annotations

import math

import pytest
import torch

from ._common import actor_cfg, actor_of, fuse_adam_on_cpu, make_batch, tiny_model_cfg

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]


def _weights(actor) -> dict[str, torch.Tensor]:
    from rltrain.megatron.model import unwrap

    return {n: p.detach().clone() for c in actor.chunks for n, p in unwrap(c).named_parameters()}


def _optimizer_steps(actor) -> list[int]:
    """AdamW's step counter of each parameter with state (absent before the first applied step)."""
    opt = actor._optimizer
    inner = [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]
    return [int(s["step"]) for o in inner for s in o.state.values() if "step" in s]


@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_non_finite_update_is_not_applied(mp_world, tiny_hf, dtype, where):
    import dataclasses

    from rlconf.config import Optim
    from rltrain.megatron.model import steps_on_device

    cfg = actor_cfg(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, optim=Optim(lr=1e-3))
    model = dataclasses.replace(tiny_model_cfg(str(tiny_hf)), params_dtype=dtype)
    actor = actor_of(model, cfg, "cpu", total_steps=10)
    if where == "device":
        fuse_adam_on_cpu(actor)
    assert steps_on_device(actor._optimizer) == (where == "device")
    batch = make_batch(b=4)
    batch["old_log_probs"] = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
    batch["advantages"] = torch.ones_like(batch["old_log_probs"]) * batch["response_mask"]
    good = actor.update_policy(batch, step=1)
    assert good["actor/skipped_updates"] == 0.0 and math.isfinite(good["actor/grad_norm"])
    before, steps = _weights(actor), _optimizer_steps(actor)
    assert steps and all(s == 1 for s in steps)

    # One NaN advantage on a response token: the loss and every gradient are NaN.
    poisoned = dict(batch, advantages=batch["advantages"].clone())
    row, col = torch.nonzero(batch["response_mask"])[0].tolist()
    poisoned["advantages"][row, col] = float("nan")
    bad = actor.update_policy(poisoned, step=2)
    assert bad["actor/skipped_updates"] == 1.0
    assert not math.isfinite(bad["actor/loss"]) and not math.isfinite(bad["actor/grad_norm"])
    after = _weights(actor)
    assert all(torch.equal(before[n], after[n]) for n in before), "a NaN update changed the weights"
    assert _optimizer_steps(actor) == steps, "a NaN update advanced the optimizer state"

    # The next finite update is applied and moves the weights.
    again = actor.update_policy(batch, step=3)
    assert again["actor/skipped_updates"] == 0.0
    moved = _weights(actor)
    assert any(not torch.equal(before[n], moved[n]) for n in before)
    assert all(torch.isfinite(t).all() for t in moved.values())
    assert all(s == 2 for s in _optimizer_steps(actor))


def test_weights_finite_sees_one_non_finite_weight(mp_world, tiny_hf):
    """The check the controller makes before every save (a checkpoint of non-finite weights is never
    written): one NaN or inf anywhere in the weights makes it False."""
    from rltrain.megatron.model import unwrap

    actor = actor_of(tiny_model_cfg(str(tiny_hf)), actor_cfg(), "cpu", total_steps=10)
    assert actor.weights_finite()
    params = dict(unwrap(actor.chunks[0]).named_parameters())
    norm = next(p for n, p in params.items() if n.endswith("final_layernorm.weight"))
    for bad in (float("nan"), float("inf")):
        with torch.no_grad():
            saved = norm[0].item()
            norm[0] = bad
        assert not actor.weights_finite()
        with torch.no_grad():
            norm[0] = saved
        assert actor.weights_finite()
