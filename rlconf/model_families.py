"""The model families rlplan reads from config.json (`FAMILIES`): what each Hugging Face model_type fixes about
the architecture and the defaults of its transformers config class, the model_types people try that rlplan
cannot build, and the rope types it reads. rlconf.model_spec reads and writes config.json with them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Family:
    """What one Hugging Face model_type fixes about the architecture."""

    model_type: str
    hf_architecture: str
    """The transformers class an exported checkpoint names in `architectures`."""
    qkv_bias: bool | None
    """q/k/v projections have biases: always (True), never (False), or per config (None: qwen2_moe's
    qkv_bias key)."""
    qk_layernorm: bool
    """RMSNorm per query / key head (q_norm, k_norm)."""
    moe: bool
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """transformers' class defaults for the keys config.json may omit (tests/test_model_spec.py checks them
    against the installed transformers)."""
    windows: str = "none"
    """Which layers attend within `sliding_window` when config.json has no `layer_types` (the family's config
    class): none (llama), all (mistral, mixtral; qwen3_moe with use_sliding_window), from_max_window_layers
    (qwen2, qwen3: layers i >= max_window_layers), odd_below_max_window_layers (qwen2_moe: layers with
    (i + 1) % 2 and i < max_window_layers)."""
    layer_types: bool = False
    """The config class has `layer_types` (and its modeling code reads it): the per-layer attention pattern
    comes from it first. Elsewhere transformers ignores the key."""
    derives: frozenset[str] = frozenset()
    """Keys whose JSON null transformers replaces (head_dim -> hidden / heads, num_key_value_heads -> heads);
    a null elsewhere makes transformers fail, so the reader refuses it."""


_COMMON = {
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
}
_HEAD_DIM = {"head_dim": None}  # the class has the field; None: hidden_size / num_attention_heads
_QWEN_MOE = {
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": False,
    "router_aux_loss_coef": 0.001,
    "use_sliding_window": False,
}
FAMILIES: Mapping[str, Family] = {
    "llama": Family("llama", "LlamaForCausalLM", False, False, False,
                    {**_COMMON, **_HEAD_DIM, "num_key_value_heads": None, "attention_bias": False, "mlp_bias": False},
                    "none", False, frozenset({"head_dim", "num_key_value_heads"})),
    "mistral": Family("mistral", "MistralForCausalLM", False, False, False,
                      {**_COMMON, **_HEAD_DIM, "num_key_value_heads": 8, "sliding_window": 4096},
                      "all", False, frozenset({"head_dim"})),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", True, False, False,
                    {**_COMMON, "num_key_value_heads": 32, "use_sliding_window": False, "sliding_window": 4096,
                     "max_window_layers": 28}, "from_max_window_layers", True, frozenset({"num_key_value_heads"})),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", False, True, False,
                    {**_COMMON, "num_key_value_heads": 32, "head_dim": 128, "attention_bias": False,
                     "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28},
                    "from_max_window_layers", True, frozenset({"num_key_value_heads"})),
    "qwen2_moe": Family("qwen2_moe", "Qwen2MoeForCausalLM", None, False, True,
                        {**_COMMON, **_QWEN_MOE, "num_key_value_heads": 16, "qkv_bias": True, "num_experts": 60,
                         "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                         "shared_expert_intermediate_size": 5632, "sliding_window": 4096,
                         "max_window_layers": 28}, "odd_below_max_window_layers", True),
    "qwen3_moe": Family("qwen3_moe", "Qwen3MoeForCausalLM", False, True, True,
                        {**_COMMON, **_QWEN_MOE, "num_key_value_heads": 4, "attention_bias": False,
                         "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                         "sliding_window": 4096}, "all"),
    "mixtral": Family("mixtral", "MixtralForCausalLM", False, False, True,
                      {**_COMMON, **_HEAD_DIM, "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                       "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001,
                       "router_jitter_noise": 0.0, "sliding_window": None}, "all", False, frozenset({"head_dim"})),
    # DeepseekV3Config (DeepSeek-V3, Moonlight, Kimi-K2): MLA, sigmoid group-limited routing, shared experts.
    "deepseek_v3": Family("deepseek_v3", "DeepseekV3ForCausalLM", False, False, True,
                          {**_COMMON, "num_key_value_heads": 128, "attention_bias": False, "vocab_size": 129280,
                           "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
                           "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
                           "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
                           "first_k_dense_replace": 3, "norm_topk_prob": True, "moe_intermediate_size": 2048,
                           "rope_interleave": True, "num_nextn_predict_layers": 1, "max_position_embeddings": 4096,
                           "intermediate_size": 18432},
                          "none", False, frozenset({"num_key_value_heads", "q_lora_rank"})),
}  # fmt: skip
SUPPORTED = ", ".join(FAMILIES)
# model_types people try whose defining feature rlplan does not build (the message names it).
KNOWN_UNSUPPORTED: Mapping[str, str] = {
    "qwen2_vl": "a vision encoder (vision-language model)",
    "qwen2_5_vl": "a vision encoder (vision-language model)",
    "qwen3_vl": "a vision encoder (vision-language model)",
    "qwen3_vl_moe": "a vision encoder (vision-language model)",
    "qwen2_5_omni": "audio and vision encoders (omni model)",
    "llava": "a vision encoder (vision-language model)",
    "mllama": "cross-attention to a vision encoder (vision-language model)",
    "gemma3": "a vision encoder and local / global attention layers",
    "qwen3_next": "hybrid linear attention (Gated DeltaNet layers)",
    "gpt_oss": "attention sinks, alternating sliding-window layers and MXFP4 experts",
    "deepseek_v2": "multi-head latent attention (MLA)",
    "kimi_k2": "multi-head latent attention (MLA)",
    "glm4_moe": "multi-token prediction and partial rotary embeddings",
}
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn"}
