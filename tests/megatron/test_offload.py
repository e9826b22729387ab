"""Offloading a role's state to host memory (gloo world of 1, CPU): each part (params, grads, optimizer)
really leaves the device (its storages are released: `untyped_storage().nbytes() == 0`, and the engine's
byte accounting drops to 0), comes back bit-identical, and training after a round trip equals training
without one. The reference policy shares the actor's step-0 weights, holds parameters only and offloads.

On CPU the "device" is the host, so what is measured is the device-side storage the engine releases. A
GPU test (skipped without CUDA) checks that the same calls lower `torch.cuda.memory_allocated()`.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import replace

import pytest
import torch

from tests.megatron._common import spawn

from ._common import actor_cfg, actor_of, free_port, init_groups, make_batch, tiny_model_cfg

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]

GROUPS = ("params", "grads", "optimizer")


def _cfg(distributed: bool = True, offload: bool = False, **kw):
    cfg = actor_cfg(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=4, shuffle=False, **kw)
    mcfg = replace(
        cfg.megatron,
        use_distributed_optimizer=distributed,
        param_offload=offload,
        grad_offload=offload,
        optimizer_offload=offload,
    )
    return replace(cfg, megatron=mcfg)


def _rl_batch(actor, seed: int = 0) -> dict[str, torch.Tensor]:
    batch = make_batch(b=8, seed=seed)
    old = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
    sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(8)]).unsqueeze(1)
    return {**batch, "old_log_probs": old, "advantages": sign * batch["response_mask"]}


def _snapshot(engine) -> dict[str, list[torch.Tensor]]:
    """The raw bytes of every storage of each part (bit-exact comparison, NaN-safe)."""
    from rltrain.megatron.offload import unique_storages

    return {
        g: [
            torch.empty(0, dtype=torch.uint8, device=t.untyped_storage().device)
            .set_(t.untyped_storage())
            .clone()
            for t in unique_storages(engine.state_tensors(g))
        ]
        for g in GROUPS
    }


def _adam_states(engine) -> list[torch.Tensor]:
    subs = engine._sub_optimizers()
    return [v for s in subs for st in s.optimizer.state.values() for k, v in st.items() if k != "step"]


@pytest.mark.parametrize(
    "dtype,distributed",
    [("float32", True), ("float32", False), ("bfloat16", True), ("bfloat16", False)],
)
def test_each_part_leaves_the_device_and_returns_bit_identical(mp_world, tiny_hf, dtype, distributed):
    from megatron.core.distributed import DistributedDataParallel

    mcfg = replace(tiny_model_cfg(str(tiny_hf)), params_dtype=dtype)
    actor = actor_of(mcfg, _cfg(distributed), "cpu", total_steps=4)
    actor.update_policy(_rl_batch(actor))  # creates Adam state and leaves gradients in the buffers
    before = actor.device_memory()
    snap = _snapshot(actor)
    n_params = sum(p.numel() for c in actor.chunks for p in c.parameters())
    elem = 2 if dtype == "bfloat16" else 4
    # Every part holds at least what the model implies (buffers are padded for the distributed optimizer).
    assert before["params"] >= n_params * elem
    assert before["grads"] >= n_params * 4  # grad_reduce_in_fp32
    # Adam moments (2 x fp32), plus fp32 main params when the model is 16-bit.
    assert before["optimizer"] >= n_params * 4 * (2 + (dtype == "bfloat16"))

    chunk = actor._chunks[0]
    assert isinstance(chunk, DistributedDataParallel)
    buffer = chunk.buffers[0]
    assert (buffer.param_data is not None) == distributed  # megatron's contiguous param buffer
    adam = _adam_states(actor)
    assert adam

    for group in GROUPS:
        moved = actor.offload(**{group: True})
        assert moved[group] == before[group], group
        now = actor.device_memory()
        assert now[group] == 0, (group, now)
        assert {g: now[g] for g in GROUPS if g != group} == {g: before[g] for g in GROUPS if g != group}
        if group == "params":
            released = [p for c in actor._chunks for p in c.parameters()]
            if distributed:
                released.append(buffer.param_data)
        elif group == "grads":
            released = [buffer.grad_data, *(p.main_grad for p in chunk.parameters())]
        else:
            released = adam
            if dtype == "bfloat16":
                opt = actor._sub_optimizers()[0]
                mains = opt.shard_fp32_from_float16_groups if distributed else opt.fp32_from_float16_groups
                released = released + [p for g in mains for p in g]
        assert all(t.untyped_storage().nbytes() == 0 for t in released), group
        assert actor.offloaded() == [group]
        assert actor.reload()[group] == before[group]
        assert actor.offloaded() == []
        assert actor.device_memory() == before

    # All at once, then the round trip is bit-identical for every storage.
    actor.offload(params=True, grads=True, optimizer=True)
    assert actor.device_memory() == dict.fromkeys(GROUPS, 0)
    actor.reload()
    after = _snapshot(actor)
    for g in GROUPS:
        assert len(after[g]) == len(snap[g]) and all(
            torch.equal(a, b) for a, b in zip(after[g], snap[g], strict=True)
        ), g


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_training_after_reload_equals_no_offload(mp_world, tiny_hf, dtype):

    mcfg = replace(tiny_model_cfg(str(tiny_hf)), params_dtype=dtype)
    results = []
    for offload in (False, True):
        actor = actor_of(mcfg, _cfg(offload=offload), "cpu", total_steps=4)
        batch = _rl_batch(actor)
        norms = [actor.update_policy(batch)["actor/grad_norm"]]
        # The worker's call points: after the update grads + optimizer leave, the weights stay for the
        # rollout; then everything leaves while another role runs.
        moved = actor.offload_for_other_roles(keep_params=True)
        if offload:
            assert set(moved) == {"grads", "optimizer"} and actor.offloaded() == ["grads", "optimizer"]
        lp1 = actor.compute_log_prob(batch)["log_probs"]
        # compute_log_prob needs the weights only: the training state stays on the host.
        assert actor.offloaded() == (["grads", "optimizer"] if offload else [])
        moved = actor.offload_for_other_roles()
        if offload:
            # Already on the host: nothing more to move.
            assert moved["grads"] == moved["optimizer"] == 0 and moved["params"] > 0
            assert actor.device_memory() == dict.fromkeys(GROUPS, 0)
        norms.append(actor.update_policy(batch)["actor/grad_norm"])  # reloads everything it needs
        assert actor.offloaded() == []
        lp2 = actor.compute_log_prob(batch)["log_probs"]
        results.append((norms, lp1, lp2))
    (n0, a0, b0), (n1, a1, b1) = results
    assert n0 == n1
    assert torch.equal(a0, a1) and torch.equal(b0, b1)


def test_offloaded_state_is_reloaded_by_any_access(mp_world, tiny_hf):
    """`chunks` brings the parameters back, `optimizer` everything: code outside the engine (checkpoints,
    HF export) never touches a released storage."""

    actor = actor_of(tiny_model_cfg(str(tiny_hf)), _cfg(), "cpu", total_steps=4)
    actor.update_policy(_rl_batch(actor))
    actor.offload(params=True, grads=True, optimizer=True)
    assert actor.current_lr() > 0 and actor.offloaded() == ["params", "grads", "optimizer"]
    _ = actor.modules()
    assert actor.offloaded() == ["grads", "optimizer"]
    assert actor.optimizer is not None and actor.offloaded() == []


def test_reference_policy_shares_actor_weights_parameters_only(mp_world, tiny_hf):

    cfg = _cfg()
    actor = actor_of(tiny_model_cfg(str(tiny_hf)), cfg, "cpu", total_steps=4)
    # Built from the actor (no checkpoint read), with param_offload as its own MegatronConfig asks.
    ref_mcfg = replace(cfg.megatron, param_offload=True)
    ref = actor_of(
        tiny_model_cfg(str(tiny_hf)), cfg, "cpu", megatron_cfg=ref_mcfg, trainable=False, init_from=actor
    )
    for a, r in zip(actor.modules(), ref.modules(), strict=True):
        ra = dict(a.named_parameters())
        for name, p in r.named_parameters():
            assert torch.equal(p, ra[name]) and not p.requires_grad, name
    mem = ref.device_memory()
    assert mem["grads"] == 0 and mem["optimizer"] == 0  # no DDP gradient buffer, no optimizer
    # Exactly the weights (the actor's DDP buffer is padded for the distributed optimizer).
    assert mem["params"] == sum(p.numel() * 4 for c in ref.chunks for p in c.parameters())
    batch = make_batch(b=8)
    expected = actor.compute_log_prob(batch)["log_probs"]
    assert torch.equal(ref.compute_log_prob(batch)["log_probs"], expected)
    assert ref.offload_for_other_roles() == {"params": mem["params"]}
    assert ref.device_memory()["params"] == 0
    # The next call brings the weights back on its own.
    assert torch.equal(ref.compute_log_prob(batch)["log_probs"], expected)
    # The actor trains; the reference policy stays at step 0.
    rl = {**batch, "old_log_probs": expected, "advantages": torch.ones(8, 5) * batch["response_mask"]}
    actor.update_policy(rl)
    assert not torch.equal(actor.compute_log_prob(batch)["log_probs"], expected)
    assert torch.equal(ref.compute_log_prob(batch)["log_probs"], expected)


# ------------------------------------------------------------------------------------ GPU
def _gpu_worker(rank: int, port: int, hf_path: str, out: str) -> None:
    try:
        _gpu_offload(port, hf_path, out)
    except Exception:
        traceback.print_exc()  # mp.spawn reports only the exception type of a child otherwise
        raise


def _gpu_offload(port: int, hf_path: str, out: str) -> None:
    from rltrain.megatron.parallel import destroy_parallel, init_distributed

    os.environ["LOCAL_RANK"] = "0"
    init_distributed("cuda", rank=0, world_size=1, master_port=port)
    cfg = _cfg(offload=True)
    init_groups(cfg.megatron, "cuda")
    mcfg = replace(tiny_model_cfg(hf_path), params_dtype="bfloat16")
    actor = actor_of(mcfg, cfg, "cuda", total_steps=4)
    batch = _rl_batch(actor)
    actor.update_policy(batch)
    torch.cuda.synchronize()
    snap = _snapshot(actor)
    before = actor.device_memory()
    alloc0 = torch.cuda.memory_allocated()
    actor.offload(params=True, grads=True, optimizer=True)
    alloc1 = torch.cuda.memory_allocated()
    actor.reload()
    alloc2 = torch.cuda.memory_allocated()
    after = _snapshot(actor)
    total = sum(before.values())
    lines = [f"device_memory {before}", f"allocated {alloc0} -> offloaded {alloc1} -> reloaded {alloc2}"]
    assert alloc0 - alloc1 >= total, lines
    assert alloc2 == alloc0, lines
    for g in GROUPS:
        assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(after[g], snap[g], strict=True)), g
    actor.update_policy(batch)
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    destroy_parallel()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.multiproc
def test_gpu_offload_releases_device_memory(tiny_hf, tmp_path):
    out = tmp_path / "gpu_offload.txt"
    spawn(_gpu_worker, args=(free_port(), str(tiny_hf), str(out)), nprocs=1, join=True)
    print(out.read_text())
