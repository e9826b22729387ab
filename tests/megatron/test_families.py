"""Every dense family rlconf.model_spec reads runs in the megatron engine as transformers runs it (CPU, fp32,
gloo world of 1): log-probs equal transformers' on tiny random models of llama (with Llama 3.1 rope scaling),
mistral, qwen2 and qwen3 (QK-norm, a head_dim that is not hidden / heads), and HF -> megatron -> HF export is
bit-identical with the same model_type and config values. MoE models are refused by name, never built dense.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlconf.config import ModelConfig

from ._common import TINY, actor_cfg, assert_tiny_close, hf_logits, make_batch, reference_log_probs
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
    from rltrain.megatron.actor import MegatronActor

    return MegatronActor(
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


def test_hf_round_trip_keeps_weights_model_type_and_config(mp_world, family_folder, tmp_path):
    import transformers

    from rltrain.megatron.hf_weights import export_hf_weights

    family, src = family_folder
    actor = _actor(src)
    export_hf_weights(actor.chunks, actor.arch, tmp_path)
    assert_same_safetensors(src, tmp_path)
    before = transformers.AutoConfig.from_pretrained(str(src)).to_dict()
    after = transformers.AutoConfig.from_pretrained(str(tmp_path)).to_dict()
    assert {k: after.get(k) for k in KEPT_KEYS} == {k: before.get(k) for k in KEPT_KEYS}, family
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert type(loaded).__name__ == FAMILY_CONFIGS[family][1]


def test_moe_models_are_refused_by_name_not_built_dense(mp_world):
    from rlconf.config import ModelArch
    from rltrain.megatron.model import EngineSupportError, build_model_chunks

    arch = ModelArch(family="qwen3_moe", add_qkv_bias=False, qk_layernorm=True, num_moe_experts=4)
    with pytest.raises(EngineSupportError, match="mixture-of-experts"):
        build_model_chunks(arch, ModelConfig(arch=arch), actor_cfg().megatron, "cpu")


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
    model = transformers.AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32)
    assert type(model).__name__ == FAMILY_CONFIGS[family][1]
