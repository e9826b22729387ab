"""The model architecture vocabulary (Megatron names): `ModelArch` and its `RopeScaling`.

A leaf value type the plan carries verbatim (ModelSpec.arch) and the config holds as `model.arch`;
re-exported from rlconf.config, so `from rlconf.config import ModelArch` keeps working. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["ModelArch", "ModelFamily", "RopeScaling"]

ModelFamily = Literal[
    "llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3"
]
"""Hugging Face model_type values rlplan reads and writes (rlconf.model_spec.FAMILIES has their features)."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling for long context (Hugging Face rope_parameters / rope_scaling)."""

    type: Literal["none", "linear", "llama3", "yarn"] = "none"
    """none: plain RoPE; linear: positions divided by factor; llama3: Llama 3.1 / 3.2 per-frequency
    scaling; yarn: YaRN (Qwen long-context configs)."""
    factor: float = 1.0
    """Scaling factor (context extension ratio)."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths longer than original_max_position_embeddings / low_freq_factor are divided by
    factor."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths shorter than original_max_position_embeddings / high_freq_factor are kept."""
    original_max_position_embeddings: int | None = None
    """llama3 / yarn: the context length of pre-training; None means max_position_embeddings."""
    beta_fast: float = 32.0
    """yarn: rotations above which frequencies are kept (extrapolated)."""
    beta_slow: float = 1.0
    """yarn: rotations below which frequencies are interpolated."""
    mscale: float | None = None
    """yarn (DeepSeek): the attention factor's mscale (rope_scaling.mscale); None: 0.1 ln(factor) + 1."""
    mscale_all_dim: float | None = None
    """yarn (DeepSeek): mscale_all_dim; the softmax scale is multiplied by (0.1 mscale_all_dim ln(factor) + 1)^2
    and the rope attention factor divided by the same term."""


@dataclass(frozen=True)
class ModelArch:
    """A decoder-only transformer described with Megatron's names: the built-in random-init model, or what
    rlconf.model_spec reads from a Hugging Face config.json."""

    family: ModelFamily = "qwen2"
    """Hugging Face model_type this architecture follows; it fixes the weight names, the features that
    come with the family (qkv bias for qwen2, QK-norm for qwen3) and the config.json of exported
    checkpoints."""

    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 64
    """Width of the residual stream."""
    ffn_hidden_size: int = 176
    """Inner width of the MLP (SwiGLU: the size of each of the gate and up projections)."""
    num_attention_heads: int = 4
    """Number of query heads."""
    num_query_groups: int = 2
    """Number of key/value heads (grouped-query attention); equal to num_attention_heads for MHA."""
    vocab_size: int = 32
    """Vocabulary size (padded by the engine to a multiple of 128 x tensor parallel size)."""
    max_position_embeddings: int = 256
    """Longest sequence the rotary embedding is built for (prompt + response)."""
    kv_channels: int | None = None
    """Per-head width; None means hidden_size / num_attention_heads."""
    rotary_base: float = 10000.0
    """RoPE base (rope_theta in Hugging Face configs)."""
    norm_epsilon: float = 1e-6
    """RMSNorm epsilon."""
    add_qkv_bias: bool = True
    """Bias on the query/key/value projection (Qwen2: true, Llama: false)."""
    share_embeddings_and_output_weights: bool = True
    """Tie the output projection to the input embedding (tie_word_embeddings)."""
    qk_layernorm: bool = False
    """RMSNorm over each query and key head before RoPE (Qwen3's q_norm / k_norm)."""
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    """RoPE scaling for long context."""
    sliding_window: int | None = None
    """Attention window in tokens (Mistral, Qwen use_sliding_window); None: full causal attention. Runs are
    limited to sequences that fit in the window (where windowed and full attention agree)."""
    num_moe_experts: int | None = None
    """Routed experts per MoE layer (num_experts / num_local_experts); None: a dense model."""
    moe_router_topk: int = 2
    """Experts each token is routed to (num_experts_per_tok)."""
    moe_ffn_hidden_size: int | None = None
    """Inner width of each routed expert (moe_intermediate_size); None means ffn_hidden_size."""
    moe_shared_expert_intermediate_size: int | None = None
    """Inner width of the shared expert every token goes through (qwen2_moe); None: no shared expert."""
    moe_shared_expert_gate: bool = False
    """A sigmoid gate (hidden -> 1) scales the shared expert's output (qwen2_moe)."""
    moe_norm_topk_prob: bool = False
    """Renormalise the top-k routing probabilities to sum to 1 (norm_topk_prob)."""
    moe_dense_layers: tuple[int, ...] = ()
    """0-based layers whose MLP is dense (ffn_hidden_size) instead of experts (Hugging Face mlp_only_layers
    and the layers decoder_sparse_step skips)."""
    moe_aux_loss_coeff: float = 0.0
    """Router load-balancing loss coefficient (router_aux_loss_coef)."""
    multi_latent_attention: bool = False
    """Multi-head latent attention (DeepSeek-V3 MLA): low-rank q / kv projections and a decoupled rope head;
    the q_lora_rank ... v_head_dim fields below apply."""
    q_lora_rank: int | None = None
    """MLA: rank of the query down-projection (q_a_proj); None: a full-rank q_proj."""
    kv_lora_rank: int = 512
    """MLA: rank of the compressed key/value latent (kv_a_proj_with_mqa), what the latent KV cache holds."""
    qk_head_dim: int = 128
    """MLA: per-head query/key width without rope (qk_nope_head_dim)."""
    qk_pos_emb_head_dim: int = 64
    """MLA: per-head query/key rope width, one rope key shared by all heads (qk_rope_head_dim)."""
    v_head_dim: int = 128
    """MLA: per-head value width."""
    rotary_interleaved: bool = False
    """RoPE on interleaved (even, odd) pairs instead of the two halves (DeepSeek-V3's rope_interleave)."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax over experts, or a sigmoid per expert (DeepSeek-V3)."""
    moe_router_enable_expert_bias: bool = False
    """A per-expert bias added to the scores for choosing experts only (DeepSeek-V3 e_score_correction_bias)."""
    moe_router_num_groups: int | None = None
    """Group-limited routing: experts split into this many groups (n_group); None: no groups."""
    moe_router_group_topk: int | None = None
    """Group-limited routing: groups each token may choose experts from (topk_group)."""
    moe_router_topk_scaling_factor: float | None = None
    """Routing weights multiplied by this after top-k (routed_scaling_factor); None: 1."""
    num_mtp_layers: int = 0
    """Multi-token prediction layers stored after the decoder (num_nextn_predict_layers); transformers does not
    build them, and neither the parameter count nor training includes them."""
