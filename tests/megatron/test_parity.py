"""Numerical parity of the megatron engine at TP = PP = DP = 1 (gloo world of 1, CPU, fp32).

* log-probs and entropy equal Hugging Face transformers on the same weights (to the rounding of the model's
  reductions, tests/tolerance.py: about 3e-5 for these fp32 log-probs);
* the chunked log-prob/entropy function equals the unchunked vocab-parallel formulation (values and
  gradients), and the chunk size changes nothing in the engine;
* token-budget micro-batches (use_dynamic_bsz) return rows in the original order and give the same update;
* the distributed optimizer's step equals the plain optimizer's; Adam betas / eps reach the optimizer;
* HF folder -> megatron -> HF export is bit-identical, tensor by tensor.
The multi-process layouts (TP=2, PP=2, DP=2) are checked in test_multiproc.py.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from ..tolerance import assert_close, rel_tolerance
from ._common import (
    TINY_DEPTH,
    TINY_REDUCTION,
    UPDATE_DEPTH,
    actor_cfg,
    actor_of,
    assert_tiny_close,
    batch_from_lengths,
    critic_of,
    hf_logits,
    make_batch,
    make_tiny_qwen2,
    reference_log_probs,
    tiny_model_cfg,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]


def _hf_reference(path, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropy) [B, R] of the responses under transformers' fp32 forward."""
    logits = hf_logits(path, batch["input_ids"], batch["attention_mask"])
    r = batch["responses"].shape[1]
    s = batch["input_ids"].shape[1]
    lp = torch.log_softmax(logits, -1)[:, s - r - 1 : s - 1]
    ent = -(lp.exp() * lp).sum(-1) * batch["response_mask"]
    return reference_log_probs(logits, batch), ent


@pytest.fixture(scope="module")
def untied_hf(tmp_path_factory):
    return make_tiny_qwen2(tmp_path_factory.mktemp("hf_untied") / "qwen2_untied", tie=False, seed=1)


def _uneven_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows of very different lengths (prompt 2..20, response 1..24 tokens) in mixed order."""
    lens = [(20, 24), (2, 1), (11, 3), (3, 24), (20, 2), (5, 9), (2, 24), (14, 14), (7, 1), (19, 20)]
    return batch_from_lengths(lens, 20, 24, seed=seed)


# ------------------------------------------------------------------------------------ HF parity
@pytest.mark.parametrize("tie", [True, False])
def test_log_probs_and_entropy_match_transformers(mp_world, tiny_hf, untied_hf, tie):

    path = tiny_hf if tie else untied_hf
    actor = actor_of(tiny_model_cfg(str(path)), actor_cfg(), "cpu", trainable=False)
    for batch in (make_batch(b=8), _uneven_batch()):
        ref_lp, ref_ent = _hf_reference(path, batch)
        out = actor.compute_log_prob(batch)
        assert_tiny_close(out["log_probs"], ref_lp)
        assert_tiny_close(out["entropy"], ref_ent)
    # Temperature divides the logits before the softmax, as in transformers' sampling.
    batch = make_batch(b=8)
    logits = hf_logits(path, batch["input_ids"], batch["attention_mask"])
    out = actor.compute_log_prob(batch, temperature=0.7, with_entropy=False)
    assert_tiny_close(out["log_probs"], reference_log_probs(logits / 0.7, batch))


# ------------------------------------------------------------------------------------ chunking
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_log_probs_equal_unchunked(mp_world, temperature):
    from rltrain.megatron.logprob import log_probs_and_entropy, token_log_probs_and_entropy

    g = torch.Generator().manual_seed(0)
    vocab, padded = 100, 128  # the last 28 entries are megatron's vocabulary padding
    logits = torch.randn(30, padded, generator=g) * 3
    rows = torch.tensor([0, 3, 4, 5, 9, 17, 18, 22, 29])
    labels = torch.randint(0, vocab, (rows.numel(),), generator=g)
    w_lp, w_ent = torch.randn(rows.numel(), generator=g), torch.randn(rows.numel(), generator=g)

    def run(chunk: int | None):
        x = logits.clone().requires_grad_(True)
        if chunk is None:
            lp, ent = log_probs_and_entropy(x[rows], labels, temperature, vocab)
        else:
            lp, ent = token_log_probs_and_entropy(x, rows, labels, temperature, vocab, chunk_tokens=chunk)
        (lp * w_lp + ent * w_ent).sum().backward()
        return lp.detach(), ent.detach(), x.grad

    ref = run(None)
    # Plain torch, full vocabulary: the padded entries must not count.
    full = torch.log_softmax(logits[rows, :vocab] / temperature, -1)
    # One log-softmax and one entropy sum over the padded vocabulary: a reduction of 128, depth 2.
    assert_close(ref[0], full.gather(1, labels[:, None]).squeeze(1), reduction=padded, depth=2)
    assert_close(ref[1], -(full.exp() * full).sum(-1), reduction=padded, depth=2)
    for chunk in (1, 4, 1000):
        got = run(chunk)
        for a, b in zip(got, ref, strict=True):
            assert_close(a, b, reduction=padded, depth=4)  # values, and gradients through them
        assert got[2][:, vocab:].abs().max() == 0 and got[2][[1, 2, 6]].abs().max() == 0
    # An output left out of the loss contributes no gradient.
    x = logits.clone().requires_grad_(True)
    lp, _ = token_log_probs_and_entropy(x, rows, labels, temperature, vocab, chunk_tokens=4)
    lp.sum().backward()
    y = logits.clone().requires_grad_(True)
    lp2, _ = log_probs_and_entropy(y[rows], labels, temperature, vocab)
    lp2.sum().backward()
    assert_close(x.grad, y.grad, reduction=padded, depth=4)


def test_chunk_size_does_not_change_the_engine(mp_world, tiny_hf):

    results = []
    for chunk in (None, 3):
        cfg = actor_cfg(
            ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=4, shuffle=False, entropy_coeff=0.01
        )
        actor = actor_of(tiny_model_cfg(str(tiny_hf)), cfg, "cpu", total_steps=4)
        actor.logprob_chunk_tokens = chunk
        batch = make_batch(b=8)
        old = actor.compute_log_prob(batch)
        sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(8)]).unsqueeze(1)
        rl = {**batch, "old_log_probs": old["log_probs"], "advantages": sign * batch["response_mask"]}
        norm = actor.update_policy(rl)["actor/grad_norm"]
        results.append((old, norm, actor.compute_log_prob(batch, with_entropy=False)["log_probs"]))
    (a_old, a_norm, a_new), (b_old, b_norm, b_new) = results
    assert_tiny_close(a_old["log_probs"], b_old["log_probs"])
    assert_tiny_close(a_old["entropy"], b_old["entropy"])
    assert a_norm == pytest.approx(b_norm, rel=rel_tolerance(torch.float32, TINY_REDUCTION, UPDATE_DEPTH))
    assert_tiny_close(a_new, b_new, depth=UPDATE_DEPTH)


# ------------------------------------------------------------------------------------ dynamic batching
def test_split_by_tokens_respects_the_budget():
    from rltrain.megatron.engine import split_by_tokens

    lengths = [40, 3, 17, 3, 60, 25, 8, 8, 100, 1]
    for budget in (1, 50, 64, 120, 1000):
        groups = split_by_tokens(lengths, budget)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        for g in groups:
            assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= budget, (budget, g)
    assert split_by_tokens(lengths, 1000) == [[8, 4, 0, 5, 2, 6, 7, 1, 3, 9]]


def test_dynamic_batching_keeps_row_order(mp_world, tiny_hf):
    from rlconf.config import CriticConfig, Optim
    from rltrain.megatron.parallel import seed_parallel_rng

    batch = _uneven_batch()
    # lr 1e-4: Adam's first step is about lr x sign(grad), so a gradient that is zero up to rounding
    # moves its weight by a full lr either way; a small lr keeps that below the rounding tolerance.
    fixed_cfg = actor_cfg(
        ppo_mini_batch_size=10,
        ppo_micro_batch_size_per_gpu=10,
        log_prob_micro_batch_size_per_gpu=10,
        shuffle=False,
        optim=Optim(lr=1e-4),
    )
    dyn_cfg = replace(fixed_cfg, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=64)
    actors = {}
    for name, cfg in (("fixed", fixed_cfg), ("dynamic", dyn_cfg)):
        actors[name] = actor_of(tiny_model_cfg(str(tiny_hf)), cfg, "cpu", total_steps=4)
    mbs = actors["dynamic"].micro_batches(batch, 10, True, 64)
    order = torch.cat([mb.rows for mb in mbs])
    assert len(mbs) > 3 and not torch.equal(order, torch.arange(10))  # really regrouped
    assert all(mb.tokens.numel() <= 64 or mb.tokens.shape[0] == 1 for mb in mbs)

    out = {k: a.compute_log_prob(batch) for k, a in actors.items()}
    ref_lp, ref_ent = _hf_reference(tiny_hf, batch)
    for k in out:
        assert_tiny_close(out[k]["log_probs"], ref_lp, msg=k)
        assert_tiny_close(out[k]["entropy"], ref_ent, msg=k)
    # One update over the same mini-batch: same gradient whatever the micro-batches.
    sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(10)]).unsqueeze(1)
    rl = {**batch, "old_log_probs": ref_lp, "advantages": sign * batch["response_mask"]}
    norms = {k: a.update_policy(rl)["actor/grad_norm"] for k, a in actors.items()}
    assert norms["fixed"] == pytest.approx(
        norms["dynamic"], rel=rel_tolerance(torch.float32, TINY_REDUCTION, UPDATE_DEPTH)
    )
    grads = {k: [p.main_grad for p in a.chunks[0].parameters()] for k, a in actors.items()}
    for g_fixed, g_dyn in zip(grads["fixed"], grads["dynamic"], strict=True):
        # A forward and a backward pass, then the sum over micro-batches (other groupings of the rows).
        assert_close(g_fixed, g_dyn, reduction=TINY_REDUCTION, depth=2 * TINY_DEPTH + 1)
    after = {k: a.compute_log_prob(batch, with_entropy=False)["log_probs"] for k, a in actors.items()}
    assert_tiny_close(after["fixed"], after["dynamic"], depth=UPDATE_DEPTH)

    values = {}
    for name, dyn in (("fixed", False), ("dynamic", True)):
        ccfg = CriticConfig(
            enable=True, ppo_micro_batch_size_per_gpu=10, use_dynamic_bsz=dyn, ppo_max_token_len_per_gpu=64
        )
        seed_parallel_rng(3)  # the same fresh value head in both
        values[name] = critic_of(tiny_model_cfg(str(tiny_hf)), ccfg, "cpu").compute_values(batch)
    assert_tiny_close(values["fixed"], values["dynamic"])


# ------------------------------------------------------------------------------------ optimizer
def test_distributed_optimizer_step_equals_plain_optimizer(mp_world, tiny_hf):
    from rlconf.config import Optim

    weights = []
    for distributed in (True, False):
        cfg = actor_cfg(
            ppo_mini_batch_size=8,
            ppo_micro_batch_size_per_gpu=4,
            shuffle=False,
            optim=Optim(lr=1e-3, clip_grad=1.0),
        )
        cfg = replace(cfg, megatron=replace(cfg.megatron, use_distributed_optimizer=distributed))
        actor = actor_of(tiny_model_cfg(str(tiny_hf)), cfg, "cpu", total_steps=4)
        batch = make_batch(b=8)
        old = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
        sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(8)]).unsqueeze(1)
        rl = {**batch, "old_log_probs": old, "advantages": sign * batch["response_mask"]}
        for _ in range(2):
            actor.update_policy(rl)
        weights.append({k: v.detach().clone() for k, v in actor.modules()[0].named_parameters()})
    for name, w in weights[0].items():
        # The same gradients (one process, no reduction between ranks) through two Adam steps of about ten
        # elementwise operations each, which the two optimizers may order differently: no sum, depth 20.
        assert_close(w, weights[1][name], reduction=1, depth=20, msg=name)


def test_adam_hyperparameters_reach_the_optimizer(mp_world):
    from rlconf.config import Optim

    optim = Optim(lr=3e-4, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)
    actor = actor_of(tiny_model_cfg(None), actor_cfg(optim=optim), "cpu", total_steps=4)
    subs = actor._sub_optimizers()
    assert subs and all(type(s.optimizer).__name__ == "AdamW" for s in subs)
    groups = [g for s in subs for g in s.optimizer.param_groups]
    assert all(g["betas"] == (0.8, 0.95) and g["eps"] == 1e-6 for g in groups)
    # Decoupled weight decay on matrices only (biases and norms take none).
    assert {g["weight_decay"] for g in groups} == {0.05, 0.0}


# ------------------------------------------------------------------------------------ HF round trip
@pytest.mark.parametrize("tie", [True, False])
def test_hf_round_trip_is_bit_identical(mp_world, tiny_hf, untied_hf, tmp_path, tie):
    from rltrain.megatron.hf_weights import export_hf_weights

    src = tiny_hf if tie else untied_hf
    actor = actor_of(tiny_model_cfg(str(src)), actor_cfg(), "cpu", trainable=False)
    export_hf_weights(actor.chunks, actor.arch, tmp_path)
    assert_same_safetensors(src, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is tie


def assert_same_safetensors(a, b) -> None:
    """Every tensor of two HF folders is bit-identical (same names, dtypes, shapes and bytes)."""

    def tensors(folder):
        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            out.update(load_file(f))
        return out

    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys(), ta.keys() ^ tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k
