"""Sequence packing (model.use_remove_padding, rltrain/megatron/packing.py) gives what padded rows give.

Rows of very different lengths (1 to 32 tokens, an empty response among them) through the same weights:
* log-probs and entropy of the packed layout equal the padded layout's, with fixed-size and token-budget
  micro-batches, eager and compiled kernels (the compiled path runs the packed RoPE hook), to the rounding of
  the model's reductions (fp32, tests/tolerance.py);
* one PPO update gives the same grad norm, parameters and log-probs after it (and the same loss metrics where
  both layouts cut the same micro-batches);
* at TP = 2 with sequence parallel and at PP = 2 (two gloo processes each) packed log-probs and the update
  equal the padded single-process ones.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.megatron._common import spawn

from ..tolerance import assert_close, rel_tolerance
from ._common import (
    TINY_DEPTH,
    TINY_REDUCTION,
    UPDATE_DEPTH,
    actor_cfg,
    actor_of,
    assert_tiny_close,
    batch_from_lengths,
    free_port,
    init_groups,
    run_spawned,
    tiny_model_cfg,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]

# (prompt, response) lengths: a 1-token row, full-length rows, an empty response.
LENGTHS = [(1, 1), (12, 20), (3, 2), (12, 1), (5, 17), (2, 0), (9, 20), (4, 6)]
GRAD_NORM_REL = rel_tolerance(torch.float32, TINY_REDUCTION, UPDATE_DEPTH)


def _batch() -> dict[str, torch.Tensor]:
    return batch_from_lengths(LENGTHS, 12, 20, seed=3)


def _model(path: str, packed: bool, fused: str = "eager"):
    return dataclasses.replace(tiny_model_cfg(path), use_remove_padding=packed, fused_kernels=fused)


def _cfg(dynamic: bool, tp: int = 1, sequence_parallel: bool = False):
    from rlconf.config import Optim

    cfg = actor_cfg(
        tp,
        ppo_mini_batch_size=8,
        ppo_micro_batch_size_per_gpu=3,
        log_prob_micro_batch_size_per_gpu=3,
        use_dynamic_bsz=dynamic,
        ppo_max_token_len_per_gpu=64,
        shuffle=False,
        optim=Optim(lr=1e-4, clip_grad=1.0),
    )
    return dataclasses.replace(
        cfg, megatron=dataclasses.replace(cfg.megatron, sequence_parallel=sequence_parallel)
    )


def _rl(batch: dict[str, torch.Tensor], old: torch.Tensor) -> dict[str, torch.Tensor]:
    sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(len(LENGTHS))]).unsqueeze(1)
    return {**batch, "old_log_probs": old, "advantages": sign * batch["response_mask"]}


@pytest.mark.parametrize("dynamic", [False, True], ids=["rows", "token_budget"])
def test_packed_log_probs_equal_padded(mp_world, tiny_hf, dynamic):
    batch = _batch()
    out = {}
    for packed in (False, True):
        actor = actor_of(_model(str(tiny_hf), packed), _cfg(dynamic), "cpu", trainable=False)
        assert actor.spec.remove_padding is packed
        mbs = actor.forward_micro_batches(batch)
        if packed:  # one sequence per micro-batch, no padding beyond the rows' own tokens
            assert all(mb.tokens.shape[0] == 1 and mb.packed is not None for mb in mbs)
            real = int(batch["attention_mask"].sum())
            assert sum(mb.tokens.shape[1] for mb in mbs) == real
        out[packed] = actor.compute_log_prob(batch)
    mask = batch["response_mask"].bool()
    assert bool((out[True]["log_probs"][~mask] == 0).all())
    assert_tiny_close(out[True]["log_probs"], out[False]["log_probs"])
    assert_tiny_close(out[True]["entropy"], out[False]["entropy"])


@pytest.mark.slow
def test_packed_log_probs_equal_padded_compiled(mp_world, tiny_hf, monkeypatch):
    """Compiled kernels (the packed RoPE hook over the compiled bshd RoPE, the fused log-prob) and token
    budgets: packed equals padded."""
    from megatron.core.models.common.embeddings import rope_utils

    from rltrain.megatron.model import use_compiled_rope

    use_compiled_rope()
    calls = []
    hook = rope_utils.fused_apply_rotary_pos_emb_thd
    monkeypatch.setattr(
        rope_utils, "fused_apply_rotary_pos_emb_thd", lambda *a, **k: calls.append(1) or hook(*a, **k)
    )
    batch = _batch()
    out = {}
    for packed in (False, True):
        actor = actor_of(_model(str(tiny_hf), packed, "compiled"), _cfg(True), "cpu", trainable=False)
        assert actor.fused_kernels
        out[packed] = actor.compute_log_prob(batch)
    assert calls  # the packed passes rotated through the compiled thd hook
    assert_tiny_close(out[True]["log_probs"], out[False]["log_probs"])
    assert_tiny_close(out[True]["entropy"], out[False]["entropy"])


@pytest.mark.slow
def test_packed_bf16_matches_padded(mp_world, tiny_hf):
    """bf16 weights (megatron's Float16Module passes the packed params on) with compiled kernels: packed
    log-probs and one update's grad norm match the padded ones to bf16 rounding."""
    from ..tolerance import tolerance

    batch = _batch()
    out, norms = {}, {}
    for packed in (False, True):
        model = dataclasses.replace(_model(str(tiny_hf), packed, "compiled"), params_dtype="bfloat16")
        actor = actor_of(model, _cfg(True), "cpu", total_steps=2)
        out[packed] = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
        rl = _rl(batch, out[packed])
        norms[packed] = actor.update_policy(rl)["actor/grad_norm"]
    tol = tolerance(torch.bfloat16, TINY_REDUCTION, depth=TINY_DEPTH, magnitude=float(out[False].abs().max()))
    torch.testing.assert_close(out[True], out[False], **tol)
    assert norms[True] == pytest.approx(
        norms[False], rel=rel_tolerance(torch.bfloat16, TINY_REDUCTION, UPDATE_DEPTH)
    )


def _update(path: str, packed: bool, cfg, batch: dict[str, torch.Tensor], old: torch.Tensor):
    actor = actor_of(_model(path, packed), cfg, "cpu", total_steps=2)
    metrics = actor.update_policy(_rl(batch, old))
    params = {n: p.detach().clone() for m in actor.modules() for n, p in m.named_parameters()}
    metrics["after"] = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
    return metrics, params


@pytest.mark.parametrize("dynamic", [False, True], ids=["rows", "token_budget"])
def test_packed_update_equals_padded(mp_world, tiny_hf, dynamic):
    batch = _batch()
    frozen = actor_of(_model(str(tiny_hf), False), _cfg(dynamic), "cpu", trainable=False)
    old = frozen.compute_log_prob(batch, with_entropy=False)["log_probs"]
    padded, p_params = _update(str(tiny_hf), False, _cfg(dynamic), batch, old)
    packed, k_params = _update(str(tiny_hf), True, _cfg(dynamic), batch, old)
    # The gradient does not depend on how rows fall into micro-batches; the loss metrics (means over
    # micro-batches) do, so they are compared where both layouts cut the same micro-batches.
    keys = ["actor/grad_norm"] + ([] if dynamic else ["actor/loss", "actor/pg_loss", "actor/entropy"])
    for key in keys:
        assert packed[key] == pytest.approx(padded[key], rel=GRAD_NORM_REL, abs=1e-7), key
    assert padded["actor/grad_norm"] > 0
    assert_tiny_close(packed["after"], padded["after"], depth=UPDATE_DEPTH)
    assert p_params.keys() == k_params.keys()
    for name, p in p_params.items():
        assert_tiny_close(k_params[name], p, msg=name, depth=UPDATE_DEPTH)


# ------------------------------------------------------------------------------------ TP = 2 + SP
def _tp2_worker(rank: int, world: int, port: int, path: str, ref: dict) -> None:
    run_spawned(_tp2_run, rank, world, port, path, ref)


def _tp2_run(rank: int, world: int, port: int, path: str, ref: dict) -> None:
    from rltrain.megatron.parallel import init_distributed

    init_distributed("cpu", rank=rank, world_size=world, master_port=port)
    cfg = _cfg(True, tp=2, sequence_parallel=True)
    init_groups(cfg.megatron, "cpu")
    batch = ref["batch"]
    frozen = actor_of(_model(path, True), cfg, "cpu", trainable=False)
    assert frozen.spec.remove_padding and frozen.spec.layout.sequence_parallel
    # Sequence parallel: every packed micro-batch is a multiple of TP long (one padding segment at most).
    assert all(mb.tokens.shape[1] % 2 == 0 for mb in frozen.forward_micro_batches(batch))
    out = frozen.compute_log_prob(batch)
    assert_tiny_close(out["log_probs"], ref["log_probs"], msg="tp2 sp log-probs")
    assert_tiny_close(out["entropy"], ref["entropy"], msg="tp2 sp entropy")
    metrics, _ = _update(path, True, cfg, batch, ref["old"])
    assert metrics["actor/grad_norm"] == pytest.approx(ref["metrics"]["actor/grad_norm"], rel=GRAD_NORM_REL)
    # The update's effect: log-probs after it equal the padded TP = 1 ones.
    assert_tiny_close(
        metrics["after"], ref["metrics"]["after"], msg="tp2 sp after the update", depth=UPDATE_DEPTH
    )


@pytest.mark.slow
@pytest.mark.multiproc
def test_packed_tp2_sequence_parallel_equals_padded_tp1(mp_world, tiny_hf):

    batch = _batch()
    frozen = actor_of(_model(str(tiny_hf), False), _cfg(True), "cpu", trainable=False)
    out = frozen.compute_log_prob(batch)
    metrics, _ = _update(str(tiny_hf), False, _cfg(True), batch, out["log_probs"])
    ref = {"batch": batch, "log_probs": out["log_probs"], "entropy": out["entropy"], "old": out["log_probs"],
           "metrics": metrics}  # fmt: skip
    spawn(_tp2_worker, args=(2, free_port(), str(tiny_hf), ref), nprocs=2, join=True)


# ------------------------------------------------------------------------------------ PP = 2
def _pp2_worker(rank: int, world: int, port: int, path: str, ref: dict) -> None:
    run_spawned(_pp2_run, rank, world, port, path, ref)


def _pp2_run(rank: int, world: int, port: int, path: str, ref: dict) -> None:
    from rltrain.megatron.parallel import init_distributed

    init_distributed("cpu", rank=rank, world_size=world, master_port=port)
    cfg = _cfg(True)
    cfg = dataclasses.replace(cfg, megatron=dataclasses.replace(cfg.megatron, pipeline_model_parallel_size=2))
    init_groups(cfg.megatron, "cpu")
    batch = ref["batch"]
    frozen = actor_of(_model(path, True), cfg, "cpu", trainable=False)
    assert frozen.spec.remove_padding and frozen.spec.layout.pp == 2
    out = frozen.compute_log_prob(batch)  # every stage returns the last stage's results
    assert_tiny_close(out["log_probs"], ref["log_probs"], msg="pp2 log-probs")
    assert_tiny_close(out["entropy"], ref["entropy"], msg="pp2 entropy")
    metrics, _ = _update(path, True, cfg, batch, ref["old"])
    assert metrics["actor/grad_norm"] == pytest.approx(ref["metrics"]["actor/grad_norm"], rel=GRAD_NORM_REL)
    assert_tiny_close(
        metrics["after"], ref["metrics"]["after"], msg="pp2 after the update", depth=UPDATE_DEPTH
    )


@pytest.mark.slow
@pytest.mark.multiproc
def test_packed_pp2_equals_padded_pp1(mp_world, tiny_hf):
    """Pipeline parallel (two stages, megatron's 1F1B schedule sends each packed micro-batch's [T, 1, h]
    activations between them): packed log-probs and the update equal the padded single-process ones."""

    batch = _batch()
    frozen = actor_of(_model(str(tiny_hf), False), _cfg(True), "cpu", trainable=False)
    out = frozen.compute_log_prob(batch)
    metrics, _ = _update(str(tiny_hf), False, _cfg(True), batch, out["log_probs"])
    ref = {"batch": batch, "log_probs": out["log_probs"], "entropy": out["entropy"], "old": out["log_probs"],
           "metrics": metrics}  # fmt: skip
    spawn(_pp2_worker, args=(2, free_port(), str(tiny_hf), ref), nprocs=2, join=True)


# ------------------------------------------------------------------------------------ DP = 2 balancing
def _dp2_worker(rank: int, world: int, port: int, path: str, ref: dict) -> None:
    run_spawned(_dp2_run, rank, world, port, path, ref)


def _dp2_run(rank: int, world: int, port: int, path: str, ref: dict) -> None:
    from megatron.core import parallel_state

    from rltrain.megatron.parallel import init_distributed
    from rltrain.token_balance import dp_balanced_columns

    init_distributed("cpu", rank=rank, world_size=world, master_port=port)
    # Two mini-batches of 4 rows (2 per rank), shuffled: the rows a rank holds decide its mini-batches.
    cfg = dataclasses.replace(_cfg(True), ppo_mini_batch_size=4, shuffle=True)
    init_groups(cfg.megatron, "cpu")
    d = parallel_state.get_data_parallel_rank()
    rl = _rl(ref["batch"], ref["old"])
    lengths = rl["attention_mask"].sum(-1).tolist()
    order = dp_balanced_columns(lengths, 2)
    assert not torch.equal(order, torch.arange(len(LENGTHS)))  # the batch is unbalanced: rows do move
    after = {}
    for name, rows in (("contiguous", torch.arange(len(LENGTHS))), ("balanced", order)):
        shard = {k: v[rows][d * 4 : (d + 1) * 4] for k, v in rl.items()}
        actor = actor_of(_model(path, True), cfg, "cpu", total_steps=2)
        actor.update_policy(shard, step=1)
        after[name] = actor.compute_log_prob(ref["batch"], with_entropy=False)["log_probs"]
    # The same update: every mini-batch held the same rows, only spread differently over the ranks.
    assert_tiny_close(after["balanced"], after["contiguous"], msg="dp2 balanced", depth=UPDATE_DEPTH)
    assert not torch.equal(after["contiguous"], ref["old"])  # the update moved the policy


@pytest.mark.slow
@pytest.mark.multiproc
def test_dp2_token_balanced_update_equals_contiguous_split(mp_world, tiny_hf):
    """The controller's update spread (`token_balance.dp_balanced_columns`) changes which rank computes a
    row, not the update: two mini-batches, shuffled, at DP = 2 give the contiguous split's weights."""

    # The longest rows first: the contiguous split gives rank 0 all the long ones.
    batch = batch_from_lengths(sorted(LENGTHS, key=sum, reverse=True), 12, 20, seed=3)
    frozen = actor_of(_model(str(tiny_hf), True), _cfg(True), "cpu", trainable=False)
    ref = {"batch": batch, "old": frozen.compute_log_prob(batch, with_entropy=False)["log_probs"]}
    spawn(_dp2_worker, args=(2, free_port(), str(tiny_hf), ref), nprocs=2, join=True)


# ------------------------------------------------------------------------------------ mixture of experts
@pytest.mark.slow
def test_packed_moe_equals_padded(mp_world, tmp_path):
    """A tiny Qwen3-MoE (top-2 of 4 experts, a dense layer, load-balancing loss on): packed log-probs equal
    the padded ones, and with the same row micro-batches one update gives the same loss (the aux loss's
    token counts leave the packed padding out as they leave padded columns out), routing load, grad norm
    and log-probs after it."""
    from rlconf.config import ModelConfig, Optim

    from .test_moe import MOE_DEPTH, MOE_REDUCTION, make_tiny_moe

    path = str(make_tiny_moe(tmp_path / "moe", "qwen3_moe"))
    cfg = actor_cfg(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=3, log_prob_micro_batch_size_per_gpu=3,
                    shuffle=False, optim=Optim(lr=1e-4, clip_grad=1.0))  # fmt: skip
    batch = _batch()
    out, updates = {}, {}
    for packed in (False, True):
        model = ModelConfig(path=path, attention_backend="sdpa", use_remove_padding=packed)
        actor = actor_of(model, cfg, "cpu", total_steps=2)
        assert actor.spec.remove_padding is packed
        out[packed] = actor.compute_log_prob(batch)
        updates[packed] = actor.update_policy(_rl(batch, out[False]["log_probs"]))
        updates[packed]["after"] = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
    rel = rel_tolerance(torch.float32, MOE_REDUCTION, 3 * MOE_DEPTH)
    assert_close(out[True]["log_probs"], out[False]["log_probs"], reduction=MOE_REDUCTION, depth=MOE_DEPTH)
    assert_close(out[True]["entropy"], out[False]["entropy"], reduction=MOE_REDUCTION, depth=MOE_DEPTH)
    for key in ("actor/loss", "actor/grad_norm", "actor/moe_aux_loss", "actor/moe_expert_load_max"):
        assert updates[True][key] == pytest.approx(updates[False][key], rel=rel, abs=1e-7), key
    after = updates[True]["after"], updates[False]["after"]
    assert_close(*after, reduction=MOE_REDUCTION, depth=3 * MOE_DEPTH)
