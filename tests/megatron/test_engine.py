"""Single-process megatron engine tests (gloo world of 1, TP = PP = 1): build, forward, HF weights,
log-probs against a plain recomputation, policy/critic updates and sampling."""

from __future__ import annotations

import json

import pytest
import torch

from ..tolerance import rel_tolerance
from ._common import (
    TINY_REDUCTION,
    UPDATE_DEPTH,
    actor_cfg,
    actor_of,
    assert_tiny_close,
    critic_of,
    hf_logits,
    make_batch,
    make_tiny_qwen2,
    reference_log_probs,
    tiny_model_cfg,
)

# megatron-core warns about missing apex / Transformer Engine and deprecated arguments on every build.
_QUIET = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]
pytestmark = _QUIET


def _full_logits(actor, batch):
    """Full-vocabulary logits [B, S, V] from the megatron model in the batch's own (unaligned) layout."""
    from rltrain.megatron.cpu_compat import cuda_to_cpu
    from rltrain.megatron.model import unwrap

    model = unwrap(actor.chunks[0])
    model.eval()
    out = torch.zeros(*batch["input_ids"].shape, actor.vocab_size)
    with cuda_to_cpu(), torch.no_grad():
        for i in range(batch["input_ids"].shape[0]):
            m = batch["attention_mask"][i].bool()
            ids = batch["input_ids"][i][m].unsqueeze(0)
            logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], attention_mask=None)
            out[i, m] = logits[0, :, : actor.vocab_size].float()
    return out


def test_hf_logits_match_transformers(mp_world, tiny_hf):

    actor = actor_of(tiny_model_cfg(str(tiny_hf)), actor_cfg(), "cpu", trainable=False)
    batch = make_batch()
    ours = _full_logits(actor, batch)
    ref = hf_logits(tiny_hf, batch["input_ids"], batch["attention_mask"])
    m = batch["attention_mask"].bool()
    assert_tiny_close(ours[m], ref[m])
    # Log-probs through the pipeline schedule, vocab-parallel CE and alignment equal a plain recomputation.
    out = actor.compute_log_prob(batch)
    assert_tiny_close(out["log_probs"], reference_log_probs(ref, batch))
    probs = torch.softmax(ref, -1)
    ent = -(probs * torch.log_softmax(ref, -1)).sum(-1)
    r = batch["responses"].shape[1]
    s = batch["input_ids"].shape[1]
    ref_ent = ent[:, s - r - 1 : s - 1] * batch["response_mask"]
    assert_tiny_close(out["entropy"], ref_ent)


def _rl_batch(actor, seed=0):
    batch = make_batch(b=8, seed=seed)
    old = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
    # Advantage +1 on even rows, -1 on odd rows.
    sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(8)]).unsqueeze(1)
    batch["old_log_probs"] = old
    batch["advantages"] = sign * batch["response_mask"]
    return batch, old, sign


def test_update_policy_moves_log_probs_with_advantage(mp_world, tiny_hf):
    from rlconf.config import Optim

    # A small lr keeps the ratio inside the clip range (clipped tokens have zero gradient).
    cfg = actor_cfg(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=4, ppo_epochs=2, optim=Optim(lr=1e-4))
    actor = actor_of(tiny_model_cfg(str(tiny_hf)), cfg, "cpu", total_steps=10)
    batch, old, sign = _rl_batch(actor)
    history = [actor.update_policy(batch) for _ in range(3)]
    metrics = history[0]
    for key in (
        "actor/loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/grad_norm",
        "actor/lr",
    ):
        assert key in metrics and metrics[key] == metrics[key], key  # present and not nan
    assert metrics["actor/grad_norm"] > 0
    assert metrics["actor/lr"] == pytest.approx(1e-4)
    # The surrogate falls until PPO clipping stops the updates (then the gradient is 0).
    assert history[-1]["actor/loss"] < history[0]["actor/loss"]
    assert history[-1]["actor/pg_clipfrac"] > history[0]["actor/pg_clipfrac"]
    new = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
    mask = batch["response_mask"].bool()
    delta = ((new - old) * sign)[mask]
    assert delta.mean() > 0, "log-probs should rise where the advantage is positive and fall where negative"


def test_micro_batching_does_not_change_the_gradient(mp_world, tiny_hf):
    """One mini-batch as 1 micro-batch or 4 micro-batches gives the same update (token-mean weighting)."""

    results = []
    for micro in (8, 2):
        cfg = actor_cfg(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=micro, shuffle=False)
        actor = actor_of(tiny_model_cfg(str(tiny_hf)), cfg, "cpu", total_steps=10)
        batch, _, _ = _rl_batch(actor)
        m = actor.update_policy(batch)
        results.append((m["actor/grad_norm"], actor.compute_log_prob(batch, with_entropy=False)["log_probs"]))
    assert results[0][0] == pytest.approx(
        results[1][0], rel=rel_tolerance(torch.float32, TINY_REDUCTION, UPDATE_DEPTH)
    )
    assert_tiny_close(results[0][1], results[1][1], depth=UPDATE_DEPTH)


def test_random_init_local_and_sdpa_attention_agree(mp_world):
    from rltrain.megatron.parallel import seed_parallel_rng

    outs = []
    for backend in ("local", "sdpa"):
        seed_parallel_rng(7)
        actor = actor_of(tiny_model_cfg(None, backend), actor_cfg(), "cpu", trainable=False)
        outs.append(actor.compute_log_prob(make_batch())["log_probs"])
    assert_tiny_close(outs[0], outs[1])
    assert outs[0].abs().sum() > 0


def test_generate_greedy_matches_recomputation(mp_world, tiny_hf):

    actor = actor_of(tiny_model_cfg(str(tiny_hf)), actor_cfg(), "cpu", trainable=False)
    prompts = make_batch(b=3)["input_ids"][:, :6]
    out = actor.generate(prompts, max_new_tokens=4, temperature=0.0, eos_id=None, pad_id=0)
    assert out["responses"].shape == (3, 4)
    assert out["response_mask"].all()
    # Each greedy token is the argmax of HF's logits for the sequence so far.
    logits = hf_logits(tiny_hf, out["input_ids"], out["attention_mask"])
    p = prompts.shape[1]
    pred = logits[:, p - 1 : p + 3].argmax(-1)
    assert torch.equal(pred, out["responses"])
    # Rollout log-probs equal compute_log_prob on the generated batch.
    lp = actor.compute_log_prob(out, with_entropy=False)["log_probs"]
    assert_tiny_close(lp, out["rollout_log_probs"])
    # Sampling with temperature is reproducible for a given seed and stops at eos.
    a = actor.generate(prompts, 4, temperature=1.0, top_p=0.9, top_k=20, eos_id=5, pad_id=0, seed=3)
    b = actor.generate(prompts, 4, temperature=1.0, top_p=0.9, top_k=20, eos_id=5, pad_id=0, seed=3)
    assert torch.equal(a["responses"], b["responses"])


def test_critic_update_reduces_value_loss(mp_world, tiny_hf):
    from rlconf.config import CriticConfig, Optim

    ccfg = CriticConfig(
        enable=True, ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=4, optim=Optim(lr=3e-3), ppo_epochs=2
    )
    critic = critic_of(tiny_model_cfg(str(tiny_hf)), ccfg, "cpu", total_steps=10)
    batch = make_batch(b=8)
    values = critic.compute_values(batch)
    assert values.shape == batch["responses"].shape
    batch["values"] = values
    batch["returns"] = torch.ones_like(values) * batch["response_mask"]
    first = critic.update_critic(batch)
    for _ in range(3):
        last = critic.update_critic(batch)
    assert last["critic/vf_loss"] < first["critic/vf_loss"]
    assert "critic/grad_norm" in last and last["critic/lr"] > 0
    # The checkpoint manager saves module.sharded_state_dict(): the value head must be part of it.
    from rltrain.megatron.cpu_compat import cuda_to_cpu

    with cuda_to_cpu():
        sharded = critic.modules()[0].sharded_state_dict()
    assert "output_layer.weight" in sharded and "embedding.word_embeddings.weight" in sharded


def test_hf_export_roundtrip(mp_world, tiny_hf, tmp_path):
    from rltrain.megatron.hf_weights import export_hf_weights

    for tie in (True, False):
        src = tiny_hf if tie else make_tiny_qwen2(tmp_path / "untied", tie=False, seed=1)
        actor = actor_of(tiny_model_cfg(str(src)), actor_cfg(), "cpu", trainable=False)
        out = tmp_path / f"export_{tie}"
        export_hf_weights(actor.chunks, actor.arch, out)
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["tie_word_embeddings"] is tie and cfg["model_type"] == "qwen2"
        batch = make_batch()
        a = hf_logits(src, batch["input_ids"], batch["attention_mask"])
        b = hf_logits(out, batch["input_ids"], batch["attention_mask"])
        assert torch.equal(a, b)  # the export holds the very same tensors
