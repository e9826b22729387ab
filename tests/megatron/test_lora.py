"""LoRA on the megatron engine (rltrain/megatron/lora.py, peft_io.py): adapters on megatron-core's own
tensor-parallel linears, the base frozen, the reference = adapters off, merge, and PEFT folders."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from rlconf.config import LoraConfig, ModelConfig

from ._common import actor_cfg, actor_of, assert_tiny_close, make_batch, reference_log_probs, tiny_model_cfg

RANK, ALPHA = 4, 8.0


def _lora_actor(path, lora: LoraConfig | None = None, total_steps: int = 4, **kw):

    cfg = replace(actor_cfg(**kw), lora=lora or LoraConfig(rank=RANK, alpha=ALPHA))
    return actor_of(tiny_model_cfg(str(path)), cfg, "cpu", total_steps=total_steps)


def _train(actor, batch, steps: int = 3) -> None:
    old = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
    sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(batch["input_ids"].shape[0])]).unsqueeze(
        1
    )
    rl = {**batch, "old_log_probs": old, "advantages": sign * batch["response_mask"]}
    for _ in range(steps):
        actor.update_policy(rl)


@pytest.fixture(scope="module")
def trained(mp_world, tiny_hf):
    """A LoRA actor on the tiny Qwen2 after three updates, and the frozen base model's log-probs."""

    batch = make_batch(4)
    base = actor_of(tiny_model_cfg(str(tiny_hf)), actor_cfg(), "cpu", trainable=False)
    base_lp = base.compute_log_prob(batch, with_entropy=False)["log_probs"]
    actor = _lora_actor(tiny_hf)
    init_lp = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
    _train(actor, batch)
    return {"actor": actor, "batch": batch, "base_lp": base_lp, "init_lp": init_lp}


def test_only_adapters_train_and_start_at_the_base(trained):
    actor = trained["actor"]
    names = [n for n, p in actor.modules()[0].named_parameters() if p.requires_grad]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    # B starts at zero: the adapted model is the base model exactly.
    assert torch.equal(trained["init_lp"], trained["base_lp"])
    # The optimizer holds the adapters only: its state is a few times the adapters' bytes, not the model's.
    mem = actor.device_memory()
    adapters = sum(
        p.numel() * p.element_size() for n, p in actor.modules()[0].named_parameters() if p.requires_grad
    )
    assert mem["grads"] == adapters
    assert mem["optimizer"] < 3 * adapters < mem["params"]
    plan_params = actor.spec.lora.params
    assert plan_params == sum(p.numel() for n, p in actor.modules()[0].named_parameters() if p.requires_grad)


def test_training_moves_the_policy_and_adapters_off_is_the_base(trained):
    from rltrain.megatron.lora import adapters_disabled

    actor, batch = trained["actor"], trained["batch"]
    after = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
    assert (after - trained["base_lp"]).abs().max() > 1e-2
    with adapters_disabled(actor.chunks):
        ref = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
    assert torch.equal(ref, trained["base_lp"])  # the reference policy for free, bit for bit
    again = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
    assert torch.equal(again, after)


def test_merged_weights_equal_adapters_and_restore_exactly(trained):
    from rltrain.megatron.lora import merged_weights

    actor, batch = trained["actor"], trained["batch"]
    before = {n: p.detach().clone() for n, p in actor.modules()[0].named_parameters()}
    adapted = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
    with merged_weights(actor.chunks, actor.arch):
        merged = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
    assert_tiny_close(merged, adapted)
    for n, p in actor.modules()[0].named_parameters():
        assert torch.equal(p, before[n]), n


def test_generation_uses_the_adapters(mp_world, tiny_hf):
    """The embedded engine samples with the adapters merged for the call: its log-probs of the sampled tokens
    are the adapted model's (compute_log_prob applies the adapters on the fly), not the base model's, its
    greedy tokens differ from the base model's, and the base weights come back bit for bit."""
    from rltrain.megatron.lora import adapted_linears, adapters_disabled

    actor = _lora_actor(tiny_hf)
    g = torch.Generator().manual_seed(0)
    for _, _, lin in adapted_linears(actor.chunks):
        with torch.no_grad():
            for p in lin.lora_B.values():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    before = {n: p.detach().clone() for n, p in actor.modules()[0].named_parameters()}
    prompts = make_batch(4)["input_ids"][:, :6]
    for use_cache in (True, False):
        out = actor.generate(prompts, 6, temperature=1.0, pad_id=0, seed=3, use_cache=use_cache)
        mask = out["response_mask"].bool()
        adapted = actor.compute_log_prob(out, with_entropy=False)["log_probs"]
        assert_tiny_close(out["rollout_log_probs"][mask], adapted[mask], msg=f"use_cache={use_cache}")
        with adapters_disabled(actor.chunks):
            base = actor.compute_log_prob(out, with_entropy=False)["log_probs"]
        assert (base[mask] - adapted[mask]).abs().max() > 1e-2
    greedy = actor.generate(prompts, 6, temperature=0.0, pad_id=0)["responses"]
    with adapters_disabled(actor.chunks):
        assert not torch.equal(actor.generate(prompts, 6, temperature=0.0, pad_id=0)["responses"], greedy)
    for n, p in actor.modules()[0].named_parameters():
        assert torch.equal(p, before[n]), n


def test_peft_folder_round_trip(trained, tmp_path):
    """save_peft_adapter writes PEFT's names and shapes; load_peft_adapter into a fresh engine gives the same
    policy; a folder for another rank is refused with the path to fix."""
    from safetensors.torch import load_file

    from rltrain.megatron.peft_io import AdapterError, load_peft_adapter, save_peft_adapter

    actor, batch = trained["actor"], trained["batch"]
    save_peft_adapter(actor.chunks, actor.spec.lora, actor.arch, tmp_path / "adapter", "base")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == RANK and cfg["lora_alpha"] == ALPHA and cfg["peft_type"] == "LORA"
    assert set(cfg["target_modules"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    tensors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    a = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"]
    assert a.shape == (RANK, 64) and b.shape == (32, RANK)
    fresh = _lora_actor(actor.spec.model.weights)
    load_peft_adapter(fresh.chunks, fresh.spec.lora, fresh.arch, tmp_path / "adapter")
    assert torch.equal(
        fresh.compute_log_prob(batch, with_entropy=False)["log_probs"],
        actor.compute_log_prob(batch, with_entropy=False)["log_probs"],
    )
    other = replace(fresh.spec.lora, rank=8)
    with pytest.raises(AdapterError, match=r"actor\.lora\.adapter_path"):
        load_peft_adapter(fresh.chunks, other, fresh.arch, tmp_path / "adapter")


def test_peft_loads_the_adapter_with_the_engines_logits(trained, tmp_path):
    """`peft.PeftModel.from_pretrained(base, folder)` on the source HF folder gives the engine's log-probs."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from rltrain.megatron.peft_io import save_peft_adapter

    actor, batch = trained["actor"], trained["batch"]
    src = actor.spec.model.weights
    save_peft_adapter(actor.chunks, actor.spec.lora, actor.arch, tmp_path / "adapter", src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, str(tmp_path / "adapter")).eval()
    position_ids = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=position_ids
        ).logits
    expected = reference_log_probs(logits, batch)
    got = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
    assert_tiny_close(got, expected)


def test_partial_qkv_target_adapts_only_the_query_slice(mp_world, tiny_hf):
    """q_proj alone: one (A, B) pair on linear_qkv whose delta touches only the query rows."""
    from rltrain.megatron.lora import adapted_linears, delta_weight

    actor = _lora_actor(tiny_hf, LoraConfig(rank=2, alpha=2.0, target_modules=("q_proj",)))
    linears = list(adapted_linears(actor.chunks))
    assert {name for _, name, _ in linears} == {"linear_qkv"}
    _, _, qkv = linears[0]
    with torch.no_grad():
        qkv.lora_B["q_proj"].normal_()
    delta = delta_weight(qkv, actor.arch).reshape(
        2, 4, 16, 64
    )  # 2 groups x [2 q heads, k, v] x head width 16
    assert delta[:, :2].abs().sum() > 0 and delta[:, 2:].abs().sum() == 0


def test_dropout_only_in_training(mp_world, tiny_hf):
    """lora_dropout applies in the update's forward (train mode), never in log-prob passes (eval)."""
    actor = _lora_actor(tiny_hf, LoraConfig(rank=2, alpha=2.0, dropout=0.5))
    from rltrain.megatron.lora import adapted_linears

    for _, _, lin in adapted_linears(actor.chunks):
        with torch.no_grad():
            for p in lin.lora_B.values():
                p.normal_()
    batch = make_batch(2)
    a = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
    b = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
    assert torch.equal(a, b)


def test_qwen3_moe_lora_on_attention(mp_world, tmp_path):
    """A tiny Qwen3-MoE HF folder (layer 1 dense): all-linear adapts the attention linears only (no expert,
    router or MLP: PEFT reads MLP names of a MoE model as the experts); it trains, adapters off is the base
    model, and PEFT loads the adapter on the source folder with the engine's log-probs."""
    from rltrain.megatron.lora import adapted_linears, adapters_disabled
    from rltrain.megatron.peft_io import save_peft_adapter

    from .test_moe import MOE_DEPTH, _batch, _layout_cfg, make_tiny_moe

    src = make_tiny_moe(tmp_path / "moe", "qwen3_moe")
    model_cfg = ModelConfig(path=str(src), attention_backend="sdpa")
    cfg = replace(_layout_cfg(), lora=LoraConfig(rank=4, alpha=8.0))
    actor = actor_of(model_cfg, cfg, "cpu", total_steps=4)
    adapted = {(layer, name) for layer, name, _ in adapted_linears(actor.chunks)}
    assert adapted == {(i, n) for i in range(3) for n in ("linear_qkv", "linear_proj")}
    trainable = [n for n, p in actor.modules()[0].named_parameters() if p.requires_grad]
    assert trainable and not any("experts" in n or "router" in n for n in trainable)
    batch = _batch()
    base = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
    _train(actor, batch)
    after = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
    assert (after - base).abs().max() > 1e-3
    with adapters_disabled(actor.chunks):
        assert torch.equal(actor.compute_log_prob(batch, with_entropy=False)["log_probs"], base)
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    save_peft_adapter(actor.chunks, actor.spec.lora, actor.arch, tmp_path / "adapter", str(src))
    conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(conf["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32),
                                           str(tmp_path / "adapter")).eval()  # fmt: skip
    position_ids = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=position_ids
        ).logits
    assert_tiny_close(after, reference_log_probs(logits, batch), depth=MOE_DEPTH)


@pytest.mark.slow
@pytest.mark.parametrize("dist_opt", [True, False], ids=["distributed_optimizer", "plain_optimizer"])
def test_adapter_only_checkpoint_resumes_exactly(mp_world, tiny_hf, tmp_path, dist_opt):
    """With model.path the checkpoint holds the adapters and their optimizer state, not the base weights;
    a fresh engine (base from model.path) loads it and its next update equals the uninterrupted one."""
    from rltrain.checkpoint import engine_io
    from rltrain.megatron.actor import MegatronActor

    def make() -> MegatronActor:
        cfg = replace(actor_cfg(), lora=LoraConfig(rank=RANK, alpha=ALPHA))
        cfg = replace(cfg, megatron=replace(cfg.megatron, use_distributed_optimizer=dist_opt))
        return actor_of(tiny_model_cfg(str(tiny_hf)), cfg, "cpu", total_steps=4)

    a = make()
    batch = make_batch(4)
    _train(a, batch, steps=1)
    folder = tmp_path / "actor"
    folder.mkdir()
    assert engine_io.save_engine(a, folder, ("model", "optimizer", "extra"), {"step": 1}, role="actor")
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["lora_adapters_only"] is True and meta["lora"]["rank"] == RANK
    saved = sum(f.stat().st_size for f in (folder / "dist_ckpt").rglob("*") if f.is_file())
    base_bytes = sum(p.numel() * 4 for n, p in a.modules()[0].named_parameters() if not p.requires_grad)
    assert saved < base_bytes  # adapters + optimizer state only
    expected_lp = a.compute_log_prob(batch, with_entropy=False)["log_probs"]
    _train(a, batch, steps=1)
    a_next = {n: p.detach().clone() for n, p in a.modules()[0].named_parameters()}

    b = make()
    assert engine_io.load_engine(b, folder, ("model", "optimizer", "extra"), role="actor") == {"step": 1}
    assert torch.equal(b.compute_log_prob(batch, with_entropy=False)["log_probs"], expected_lp)
    _train(b, batch, steps=1)
    for n, p in b.modules()[0].named_parameters():
        assert torch.equal(p, a_next[n]), n
