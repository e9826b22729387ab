"""Every dense family rlconf.model_spec reads runs in the megatron engine as transformers runs it (CPU, fp32,
gloo world of 1): log-probs equal transformers' on tiny random models of llama (with Llama 3.1 rope scaling),
mistral, qwen2 and qwen3 (QK-norm, a head_dim that is not hidden / heads), and HF -> megatron -> HF export is
bit-identical with the same model_type and config values (mixtures of experts: tests/megatron/test_moe.py).
The same holds in a gloo world of 2 processes at TP=2 (kv heads split over ranks, Qwen3's per-head QK-norm
replicated), TP=2 with sequence parallel, PP=2 and PP=2 x virtual PP=2, where greedy generation also equals TP=1's (and TP=1's
equals transformers' `generate`).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlconf.config import ModelConfig
from tests.megatron._common import spawn

from ._common import (
    TINY,
    actor_cfg,
    actor_of,
    assert_export_round_trips,
    assert_tiny_close,
    free_port,
    hf_logits,
    init_groups,
    make_batch,
    reference_log_probs,
    run_spawned,
)
from .test_parity import assert_same_safetensors

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]

# Llama 3.1's rope scaling with a short original context, so that the tiny model's 8 frequencies fall in all
# three of its regimes (kept, interpolated, divided by factor).
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 10000.0}  # fmt: skip
FAMILY_CONFIGS = {
    "llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True},
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None, "head_dim": 16}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": False}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "tie_word_embeddings": False}),
}
# config.json values an export must keep (model_type and the architecture).
KEPT_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps",
             "tie_word_embeddings", "rope_parameters")  # fmt: skip


def make_tiny_family(path: Path, family: str, seed: int = 0, **sizes: int) -> Path:
    """A random tiny model of `family` (TINY with `sizes` changed) saved by transformers (weights scaled up
    so logits are not flat)."""
    import transformers

    config_cls, model_cls, extra = FAMILY_CONFIGS[family]
    base = {k: v for k, v in TINY.items() if k != "rope_theta"} | sizes
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(**base, **extra)
    model = getattr(transformers, model_cls)(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
            else:
                p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module", params=list(FAMILY_CONFIGS))
def family_folder(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, make_tiny_family(tmp_path_factory.mktemp(request.param) / "hf", request.param)


def _actor(path: Path):

    return actor_of(
        ModelConfig(path=str(path), attention_backend="sdpa"), actor_cfg(), "cpu", trainable=False
    )


def test_log_probs_match_transformers(mp_world, family_folder):
    family, path = family_folder
    actor = _actor(path)
    assert actor.arch.family == json.loads((path / "config.json").read_text())["model_type"]
    # Positions up to 60: past the llama3 original context of 32, where scaling changes the rotation.
    for batch in (make_batch(b=4), make_batch(b=4, p=40, r=20, seed=1)):
        logits = hf_logits(path, batch["input_ids"], batch["attention_mask"])
        assert_tiny_close(actor.compute_log_prob(batch, with_entropy=False)["log_probs"],
                          reference_log_probs(logits, batch), msg=family)  # fmt: skip


def test_static_decode_step_matches_the_dynamic_path(mp_world, family_folder):
    """The static decode step (what CUDA graphs capture; eager here) computes its attention inputs with
    `fused.decode_attention_inputs` (split, Qwen3's q/k norm, RoPE, cache write in one function) and hands
    SDPA an additive mask; the dynamic path runs megatron's modules one by one. Greedy tokens and rollout
    log-probs agree for every family: the QKV bias added by that function (qwen2), q/k norm and a head_dim
    that is not hidden / heads (qwen3), Llama 3.1 rope scaling, grouped KV heads."""
    from rltrain.megatron.inference import KVCacheGenerator

    family, path = family_folder
    actor = _actor(path)
    engine = KVCacheGenerator(actor, torch.zeros((1, 4), dtype=torch.long))
    layers = [layer for model in actor.modules() for layer in model.decoder.layers]
    assert all(id(layer.self_attention) in engine.fused_inputs for layer in layers), family
    assert engine.additive_mask
    if family == "qwen3":
        assert all(engine.fused_inputs[id(layer.self_attention)][0] is not None for layer in layers)
        # Engines with fused kernels build their q/k norms as TritonRMSNorm (the same function): taken too.
        from rltrain.megatron.triton_rms_norm import TritonRMSNorm

        originals = [(layer.self_attention, n, getattr(layer.self_attention, n)) for layer in layers
                     for n in ("q_layernorm", "k_layernorm")]  # fmt: skip
        try:
            for attention, name, norm in originals:
                twin = TritonRMSNorm(norm.normalized_shape, eps=norm.eps)
                twin.load_state_dict(norm.state_dict())
                setattr(attention, name, twin)
            again = KVCacheGenerator(actor, torch.zeros((1, 4), dtype=torch.long))
            assert all(again.fused_inputs[id(layer.self_attention)][0] is not None for layer in layers)
        finally:
            for attention, name, norm in originals:
                setattr(attention, name, norm)
    # The QKV bias (qwen2) is added by the inputs' function, the projection run without it.
    biased = {layer.self_attention.linear_qkv.bias is not None for layer in layers}
    assert biased == {family == "qwen2"}, family
    assert all(
        (engine.fused_inputs[id(layer.self_attention)][3] is not None) == (family == "qwen2")
        for layer in layers
    )
    prompts = make_batch(b=5)["input_ids"][:, :7]
    prompts[1, :3] = 0  # left padding in one row
    kw = dict(temperature=0.0, pad_id=0, eos_id=None)
    dynamic = actor.generate(prompts, 9, **kw)
    static = actor.generate(prompts, 9, cuda_graph=True, **kw)
    assert torch.equal(dynamic["responses"], static["responses"]), family
    assert_tiny_close(static["rollout_log_probs"], dynamic["rollout_log_probs"])


def test_the_loader_reads_exactly_the_tensors_validate_checks(mp_world, family_folder, monkeypatch):
    """rlconf.model_files.hf_tensors is the one list: the megatron loader reads every tensor on it, and no
    other (so `rlconf validate` checks what the load needs, no more, no less)."""
    from rlconf.model_files import hf_tensors
    from rltrain.megatron import hf_weights

    family, path = family_folder
    read: set[str] = set()
    get = hf_weights._HFReader.get
    monkeypatch.setattr(hf_weights._HFReader, "get", lambda self, name: (read.add(name), get(self, name))[1])
    actor = _actor(path)
    assert read == set(hf_tensors(actor.arch)), family


def test_hf_round_trip_keeps_weights_model_type_and_config(mp_world, family_folder, tmp_path):
    family, src = family_folder
    assert_export_round_trips(_actor(src), src, tmp_path, KEPT_KEYS, FAMILY_CONFIGS[family][1], family)


# ------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_tiny_grpo_on_a_family_folder_trains_and_exports(tmp_path, family):
    """`rltrain tiny-grpo --model.path DIR` on a random Qwen3 / Llama-3 (llama3 rope scaling) folder with the
    built-in tokenizer beside it (about 30-40 s each here), then `rltrain export-hf` of its checkpoint loads in
    transformers as the same model_type with the same config values."""
    import transformers

    from rltrain.tokenizer import CharTokenizer

    from ..test_e2e import rltrain

    # vocab_size 32: the built-in tokenizer's ids; 256 positions: tiny-grpo's prompt + response fit.
    src = make_tiny_family(
        tmp_path / "hf", family, vocab_size=32, num_hidden_layers=2, max_position_embeddings=256
    )
    CharTokenizer().save_pretrained(src)
    out = tmp_path / "run"
    result = rltrain("tiny-grpo", "--model.path", str(src), "--trainer.total_steps", "3", "--trainer.save_freq",
                     "3", "--trainer.output_dir", str(out))  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    exported = tmp_path / "exported"
    result = rltrain("export-hf", str(out / "checkpoints" / "global_step_3"), str(exported))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    before = transformers.AutoConfig.from_pretrained(str(src)).to_dict()
    after = transformers.AutoConfig.from_pretrained(str(exported)).to_dict()
    assert {k: after.get(k) for k in KEPT_KEYS} == {k: before.get(k) for k in KEPT_KEYS}
    # The export's config.json is the source's own file (fp32 weights, as the source's dtype says).
    assert json.loads((exported / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    model = transformers.AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32)
    assert type(model).__name__ == FAMILY_CONFIGS[family][1]


# ------------------------------------------------------------------------------------ TP=2, PP=2
# (name, tensor parallel, pipeline parallel, virtual pipeline, sequence parallel) run by the 2-process test.
PARALLEL_LAYOUTS = [
    ("tp2", 2, 1, None, False),
    ("tp2_sp", 2, 1, None, True),
    ("pp2", 1, 2, None, False),
    ("pp2_vpp2", 1, 2, 2, False),  # one layer per model chunk: export finds layers by global number
]
# Sizes changed from TINY per family in the 2-process test: TINY's 2 kv heads put one query group on each TP
# rank; mistral gets 4 kv heads of 2 query heads each, so a rank holds two groups (their order inside the
# fused linear_qkv shard matters too).
PARALLEL_SIZES = {"mistral": {"num_attention_heads": 8, "num_key_value_heads": 4}}
# Layouts whose export is compared with the source folder (sequence parallel does not change the weights).
EXPORTED_LAYOUTS = ("tp2", "pp2", "pp2_vpp2")
# Greedy generation: the second batch's 40-column left-padded prompts and 8 new tokens reach positions up to
# 47, past the llama3 original context of 32. The smallest top-2 logit gap of these greedy steps is 2.5e-3
# (qwen3), a thousand times the log-prob differences between layouts: no near-tie can flip a token.
GEN_PROMPT_LEN, GEN_NEW_TOKENS = 40, 8


def _parity_batches() -> list[dict[str, torch.Tensor]]:
    """The TP=1 test's batches: short sequences, and positions up to 60 (llama3 scaling regimes)."""
    return [make_batch(b=4), make_batch(b=4, p=40, r=20, seed=1)]


def _hf_greedy(path: Path, prompts: torch.Tensor) -> torch.Tensor:
    """transformers' greedy continuation [B, GEN_NEW_TOKENS] of left-padded `prompts` (pad id 0, no EOS)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    # The engine is called without an EOS; llama / mistral configs name one (2) that would stop rows early
    # (and min_new_tokens would instead mask its logit, changing the argmax).
    model.generation_config.eos_token_id = None
    mask = (prompts != 0).long()
    out = model.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=GEN_NEW_TOKENS, do_sample=False,
                         pad_token_id=0)  # fmt: skip
    return out[:, prompts.shape[1] :]


def _family_reference(family: str, path: Path) -> dict:
    """transformers' log-probs of the parity batches and the TP=1 engine's greedy tokens (this process)."""
    batches = _parity_batches()
    log_probs = [
        reference_log_probs(hf_logits(path, b["input_ids"], b["attention_mask"]), b) for b in batches
    ]
    prompts = batches[1]["input_ids"][:, :GEN_PROMPT_LEN]
    gen = _actor(path).generate(prompts, GEN_NEW_TOKENS, temperature=0.0, pad_id=0)["responses"]
    return {"family": family, "path": str(path), "batches": batches, "log_probs": log_probs,
            "prompts": prompts, "gen": gen}  # fmt: skip


def _layouts_worker(rank: int, world: int, port: int, refs: list[dict], out_dir: str) -> None:
    run_spawned(_run_family_layouts, rank, world, port, refs, out_dir)


def _run_family_layouts(rank: int, world: int, port: int, refs: list[dict], out_dir: str) -> None:
    """Every family in every PARALLEL_LAYOUTS layout: log-probs vs transformers, greedy tokens vs TP=1, and
    an export of EXPORTED_LAYOUTS into out_dir/FAMILY_LAYOUT; rank 0 writes the largest log-prob
    differences to out_dir/diffs.json."""
    from rltrain.megatron.hf_weights import export_hf_weights
    from rltrain.megatron.model import unwrap
    from rltrain.megatron.parallel import destroy_parallel, init_distributed

    init_distributed("cpu", rank=rank, world_size=world, master_port=port)
    diffs: dict[str, float] = {}
    for name, tp, pp, vpp, sequence_parallel in PARALLEL_LAYOUTS:
        cfg = actor_cfg(tp, pp, vpp)
        cfg = replace(cfg, megatron=replace(cfg.megatron, sequence_parallel=sequence_parallel))
        init_groups(cfg.megatron, "cpu")
        for ref in refs:
            where = f"{ref['family']} {name}"
            actor = actor_of(ModelConfig(path=ref["path"], attention_backend="sdpa"), cfg, "cpu",
                                  trainable=False)  # fmt: skip
            attention = unwrap(actor.chunks[0]).decoder.layers[0].self_attention
            # TP=2 splits the kv heads (GQA) over the ranks; PP=2 keeps them whole.
            assert attention.num_query_groups_per_partition == actor.arch.num_query_groups // tp, where
            for i, (batch, expected) in enumerate(zip(ref["batches"], ref["log_probs"], strict=True)):
                got = actor.compute_log_prob(batch, with_entropy=False)["log_probs"]
                diffs[f"{where} batch{i}"] = float((got - expected).abs().max())
                assert_tiny_close(got, expected, msg=where)
            gen = actor.generate(ref["prompts"], GEN_NEW_TOKENS, temperature=0.0, pad_id=0)["responses"]
            assert torch.equal(gen, ref["gen"]), f"{where}: greedy tokens differ from TP=1"
            if name in EXPORTED_LAYOUTS:
                export_hf_weights(actor.chunks, actor.arch, os.path.join(out_dir, f"{ref['family']}_{name}"))
            del actor
    if rank == 0:
        with open(os.path.join(out_dir, "diffs.json"), "w") as f:
            json.dump(diffs, f, indent=1)
    destroy_parallel()


@pytest.mark.slow
@pytest.mark.multiproc
def test_families_at_tp2_and_pp2_match_transformers_and_round_trip(mp_world, tmp_path):
    """Two gloo processes run every family at TP=2, TP=2 + sequence parallel, PP=2 and PP=2 x VPP=2 (one
    spawn: each process pays ~8 s of imports): log-probs equal transformers', greedy tokens equal TP=1's
    (which equal transformers' generate), and the TP=2 / PP=2 / VPP exports are bit-identical to the source
    folder, with the same config values, and load in transformers as the family's class with the source's
    logits."""
    import transformers

    folders = {f: make_tiny_family(tmp_path / f, f, **PARALLEL_SIZES.get(f, {})) for f in FAMILY_CONFIGS}
    refs = [_family_reference(f, path) for f, path in folders.items()]
    for ref in refs:
        assert torch.equal(ref["gen"], _hf_greedy(Path(ref["path"]), ref["prompts"])), ref["family"]
    out_dir = tmp_path / "exports"
    out_dir.mkdir()
    spawn(_layouts_worker, args=(2, free_port(), refs, str(out_dir)), nprocs=2, join=True)

    batch = _parity_batches()[1]
    for family, src in folders.items():
        # Every config value the source has, model_type and rope parameters included (the path differs).
        before = transformers.AutoConfig.from_pretrained(str(src)).to_dict()
        before.pop("_name_or_path")
        src_logits = hf_logits(src, batch["input_ids"], batch["attention_mask"])
        for name in EXPORTED_LAYOUTS:
            exported = out_dir / f"{family}_{name}"
            where = f"{family} {name}"
            assert_same_safetensors(src, exported)
            after = transformers.AutoConfig.from_pretrained(str(exported)).to_dict()
            after.pop("_name_or_path")
            assert after == before, where
            loaded = transformers.AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32)
            assert type(loaded).__name__ == FAMILY_CONFIGS[family][1], where
            # transformers reads the export (PP=2: one file per stage through the index) as the source.
            assert torch.equal(
                hf_logits(exported, batch["input_ids"], batch["attention_mask"]), src_logits
            ), where
        for name in ("pp2", "pp2_vpp2"):
            assert (out_dir / f"{family}_{name}" / "model.safetensors.index.json").exists()
    print(json.dumps(json.loads((out_dir / "diffs.json").read_text()), indent=1))
