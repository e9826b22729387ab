"""deepseek_v3 (multi-head latent attention, DeepSeek routing) on megatron-core 0.16.1's own modules: the
MLATransformerConfig fields of a `ModelArch`, the local (non-Transformer-Engine) layer specs, and the
Hugging Face -> megatron weight mapping. A building block, not yet wired into the engine (rltrain refuses
deepseek_v3 at start: rlconf.model_spec.training_gaps); tests/megatron/test_mla_parity.py checks its
logits against transformers' DeepseekV3ForCausalLM.

What megatron-core 0.16.1's local MLA spec needs on CPU (measured):
- its MLASelfAttention passes `k_channels` / `v_channels` to the core attention, which megatron's local
  DotProductAttention does not accept: `MlaSdpaAttention` (rltrain's SDPA core attention) takes them and
  sizes its output by v_head_dim;
- multi_latent_attention.py sets HAVE_TE from an import that succeeds without Transformer Engine (its
  TELinear is then None, and `isinstance(x, None)` raises): `local_mla_block_spec` clears that flag;
- megatron applies RoPE to MLA's rope dims de-interleaved (x[0::2], x[1::2]), exactly transformers'
  `rope_interleave: true`, so those weights map unpermuted.
Megatron's router differs from transformers' DeepseekV3TopkRouter in two places (rlconf.model_spec
training_gaps names them): it scores a group by its top (topk / group_topk) experts (transformers: top 2)
and always renormalises sigmoid top-k weights (transformers: only with norm_topk_prob).
"""

from __future__ import annotations

from typing import Any

import torch

from rlconf.arch import ModelArch
from rltrain.megatron.model import SdpaAttention


class MlaSdpaAttention(SdpaAttention):
    """SDPA core attention for MLA: query / key width qk_head_dim + rope dims, values v_head_dim."""

    def __init__(self, config: Any, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(config, *args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels


def mla_config_kwargs(arch: ModelArch) -> dict[str, Any]:
    """MLATransformerConfig fields of a deepseek_v3 `arch` (attention, rope, routing; no parallel sizes)."""
    assert arch.multi_latent_attention and arch.num_moe_experts is not None
    rs = arch.rope_scaling
    rope: dict[str, Any] = {
        "rope_type": "rope",
        "rotary_scaling_factor": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.0,
    }
    if rs.type == "yarn":
        rope = {"rope_type": "yarn", "rotary_scaling_factor": rs.factor, "beta_fast": rs.beta_fast,
                "beta_slow": rs.beta_slow, "mscale": rs.mscale if rs.mscale is not None else 1.0,
                "mscale_all_dim": rs.mscale_all_dim or 0.0,
                "original_max_position_embeddings": rs.original_max_position_embeddings}  # fmt: skip
    layers = arch.num_layers
    return dict(
        num_layers=layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads, q_lora_rank=arch.q_lora_rank,
        kv_lora_rank=arch.kv_lora_rank, qk_head_dim=arch.qk_head_dim, qk_pos_emb_head_dim=arch.qk_pos_emb_head_dim,
        v_head_dim=arch.v_head_dim, rotary_base=arch.rotary_base, normalization="RMSNorm",
        layernorm_epsilon=arch.norm_epsilon, qk_layernorm=True,  # MLA's q_a / kv_a layernorms
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        num_moe_experts=arch.num_moe_experts, moe_router_topk=arch.moe_router_topk,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=arch.moe_shared_expert_intermediate_size,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_num_groups=arch.moe_router_num_groups, moe_router_group_topk=arch.moe_router_group_topk,
        moe_router_topk_scaling_factor=arch.moe_router_topk_scaling_factor, moe_router_pre_softmax=False,
        moe_layer_freq=[0 if i in arch.moe_dense_layers else 1 for i in range(layers)],
        moe_router_dtype="fp32", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall", attention_dropout=0.0, hidden_dropout=0.0,
        **rope,
    )  # fmt: skip


def local_mla_block_spec(config: Any) -> Any:
    """megatron's decoder block spec for `config` (an MLATransformerConfig) without Transformer Engine, its
    core attention replaced by MlaSdpaAttention."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    mla.HAVE_TE = False  # its TE import "succeeds" with TELinear None; nothing here uses TE
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # as rltrain.megatron.model.define_missing_te_names
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = MlaSdpaAttention
    return spec


def hf_to_megatron(
    arch: ModelArch, hf: dict[str, torch.Tensor], ep_rank: int = 0, ep_size: int = 1
) -> dict[str, torch.Tensor]:
    """megatron GPTModel state (TP = 1; expert parallel rank `ep_rank` of `ep_size`, holding the contiguous
    block of num_moe_experts / ep_size experts) from a DeepseekV3ForCausalLM state dict: names mapped, SwiGLU
    gate / up concatenated into linear_fc1, the router's e_score_correction_bias into expert_bias."""
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}  # fmt: skip
    out["output_layer.weight"] = hf[
        "lm_head.weight" if "lm_head.weight" in hf else "model.embed_tokens.weight"
    ]
    attn = {"q_proj": "linear_q_proj", "q_a_proj": "linear_q_down_proj", "q_a_layernorm": "q_layernorm",
            "q_b_proj": "linear_q_up_proj", "kv_a_proj_with_mqa": "linear_kv_down_proj",
            "kv_a_layernorm": "kv_layernorm", "kv_b_proj": "linear_kv_up_proj", "o_proj": "linear_proj"}  # fmt: skip

    def fc(src: str, dst: str) -> None:
        out[dst + "linear_fc1.weight"] = torch.cat([hf[src + "gate_proj.weight"], hf[src + "up_proj.weight"]])
        out[dst + "linear_fc2.weight"] = hf[src + "down_proj.weight"]

    for i in range(arch.num_layers):
        s, d = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[d + "input_layernorm.weight"] = hf[s + "input_layernorm.weight"]
        out[d + "pre_mlp_layernorm.weight"] = hf[s + "post_attention_layernorm.weight"]
        for name, meg in attn.items():
            if s + f"self_attn.{name}.weight" in hf:
                out[d + f"self_attention.{meg}.weight"] = hf[s + f"self_attn.{name}.weight"]
        if i in arch.moe_dense_layers:
            fc(s + "mlp.", d + "mlp.")
            continue
        assert arch.num_moe_experts is not None
        out[d + "mlp.router.weight"] = hf[s + "mlp.gate.weight"]
        out[d + "mlp.router.expert_bias"] = hf[s + "mlp.gate.e_score_correction_bias"]
        local = arch.num_moe_experts // ep_size
        for e in range(local):
            fc(s + f"mlp.experts.{ep_rank * local + e}.", d + f"mlp.experts.local_experts.{e}.")
        if arch.moe_shared_expert_intermediate_size is not None:
            fc(s + "mlp.shared_experts.", d + "mlp.shared_experts.")
    return out


def megatron_to_hf(arch: ModelArch, meg: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `hf_to_megatron`: DeepseekV3ForCausalLM safetensors names (per-expert, as
    transformers saves them) from a megatron GPTModel state (TP = EP = 1); `_extra_state` entries dropped."""
    attn = {"linear_q_proj": "q_proj", "linear_q_down_proj": "q_a_proj", "q_layernorm": "q_a_layernorm",
            "linear_q_up_proj": "q_b_proj", "linear_kv_down_proj": "kv_a_proj_with_mqa",
            "kv_layernorm": "kv_a_layernorm", "linear_kv_up_proj": "kv_b_proj", "linear_proj": "o_proj"}  # fmt: skip
    out = {"model.embed_tokens.weight": meg["embedding.word_embeddings.weight"],
           "model.norm.weight": meg["decoder.final_layernorm.weight"]}  # fmt: skip
    if not arch.share_embeddings_and_output_weights:
        out["lm_head.weight"] = meg["output_layer.weight"]

    def fc(src: str, dst: str) -> None:
        gate, up = meg[src + "linear_fc1.weight"].chunk(2)
        out.update({dst + "gate_proj.weight": gate.contiguous(), dst + "up_proj.weight": up.contiguous(),
                    dst + "down_proj.weight": meg[src + "linear_fc2.weight"]})  # fmt: skip

    for i in range(arch.num_layers):
        s, d = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[d + "input_layernorm.weight"] = meg[s + "input_layernorm.weight"]
        out[d + "post_attention_layernorm.weight"] = meg[s + "pre_mlp_layernorm.weight"]
        for name, hf in attn.items():
            if s + f"self_attention.{name}.weight" in meg:
                out[d + f"self_attn.{hf}.weight"] = meg[s + f"self_attention.{name}.weight"]
        if i in arch.moe_dense_layers:
            fc(s + "mlp.", d + "mlp.")
            continue
        assert arch.num_moe_experts is not None
        out[d + "mlp.gate.weight"] = meg[s + "mlp.router.weight"]
        out[d + "mlp.gate.e_score_correction_bias"] = meg[s + "mlp.router.expert_bias"]
        for e in range(arch.num_moe_experts):
            fc(s + f"mlp.experts.local_experts.{e}.", d + f"mlp.experts.{e}.")
        if arch.moe_shared_expert_intermediate_size is not None:
            fc(s + "mlp.shared_experts.", d + "mlp.shared_experts.")
    return out
