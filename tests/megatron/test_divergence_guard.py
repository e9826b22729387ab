"""The engine's divergence guard (MegatronEngine.optimizer_step): an update whose loss or gradient norm is
not finite is not applied, in fp32 and bf16, decided on the host (foreach AdamW, megatron's reads) or on the
device (torch's fused AdamW given the flag, as on accelerators), so the weights and the optimizer state stay
as they were; a finite update right after it is applied as usual."""

from __future__ import annotations

import math

import pytest
import torch

from ._common import (
    actor_cfg,
    actor_of,
    free_port,
    fuse_adam_on_cpu,
    init_groups,
    make_batch,
    run_spawned,
    spawn,
    tiny_model_cfg,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]


def _weights(actor) -> dict[str, torch.Tensor]:
    from rltrain.megatron.model import unwrap

    return {n: p.detach().clone() for c in actor.chunks for n, p in unwrap(c).named_parameters()}


def _optimizer_steps(actor) -> list[int]:
    """AdamW's step counter of each parameter with state (absent before the first applied step)."""
    inner = [o.optimizer for o in actor._sub_optimizers()]
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


def _dp2_guard_body(rank: int, world: int, port: int, hf_path: str, out_dir: str) -> None:
    import json
    import os

    from rlconf.config import Optim
    from rltrain.megatron.model import steps_on_device
    from rltrain.megatron.parallel import init_distributed

    init_distributed("cpu", rank=rank, world_size=world, master_port=port)
    cfg = actor_cfg(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=2, optim=Optim(lr=1e-3))
    init_groups(cfg.megatron, "cpu")
    actor = actor_of(tiny_model_cfg(hf_path), cfg, "cpu", total_steps=10)
    fuse_adam_on_cpu(actor)
    rows = slice(rank * 4, (rank + 1) * 4)  # DP ranks split the 8 rows
    local = {k: v[rows] for k, v in make_batch(b=8).items()}
    local["old_log_probs"] = actor.compute_log_prob(local, with_entropy=False)["log_probs"]
    local["advantages"] = torch.ones_like(local["old_log_probs"]) * local["response_mask"]
    good = actor.update_policy(local, step=1)
    before, steps = _weights(actor), _optimizer_steps(actor)
    poisoned = dict(local, advantages=local["advantages"].clone())
    if rank == 1:  # one rank's loss is NaN; the other's is finite
        row, col = torch.nonzero(local["response_mask"])[0].tolist()
        poisoned["advantages"][row, col] = float("nan")
    bad = actor.update_policy(poisoned, step=2)
    after = _weights(actor)
    result = {
        "on_device": steps_on_device(actor._optimizer),
        "good_skipped": good["actor/skipped_updates"],
        "bad_skipped": bad["actor/skipped_updates"],
        "weights_kept": all(torch.equal(before[n], after[n]) for n in before),
        "steps_kept": _optimizer_steps(actor) == steps and bool(steps),
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _dp2_guard(rank: int, world: int, port: int, hf_path: str, out_dir: str) -> None:
    run_spawned(_dp2_guard_body, rank, world, port, hf_path, out_dir)


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_non_finite_update_on_one_dp_rank_is_applied_on_none(mp_world, tiny_hf, tmp_path):
    """DP = 2 (distributed optimizer), the step decided on the device: a NaN in one rank's loss leaves every
    rank's weights and optimizer state as they were (the ranks agree without reading a value back)."""
    import json

    spawn(_dp2_guard, args=(2, free_port(), str(tiny_hf), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result == {"on_device": True, "good_skipped": 0.0, "bad_skipped": 1.0, "weights_kept": True,
                          "steps_kept": True}, (rank, result)  # fmt: skip


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
