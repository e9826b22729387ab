"""deepseek_v3's multi-head latent attention (MLA) on megatron-core 0.16.1's own modules: the
MLATransformerConfig fields of a `ModelArch`, the local (non-Transformer-Engine) layer spec and its SDPA core
attention. rltrain.megatron.model builds the engine with them (DeepSeek's sigmoid routing:
`deepseek_routing`), rltrain.megatron.hf_weights maps the weights, rltrain.megatron.mla_cache generates
with a latent KV cache.

What megatron-core 0.16.1's local MLA spec needs on CPU (measured):
- its MLASelfAttention passes `k_channels` / `v_channels` to the core attention, which megatron's local
  DotProductAttention does not accept: `MlaSdpaAttention` (rltrain's SDPA core attention) takes them and
  sizes its output by v_head_dim;
- multi_latent_attention.py sets HAVE_TE from an import that succeeds without Transformer Engine (its
  TELinear is then None, and `isinstance(x, None)` raises): `mla_layer_spec` clears that flag there;
- megatron applies RoPE to MLA's rope dims de-interleaved (x[0::2], x[1::2]), exactly transformers'
  `rope_interleave: true`, so those weights map unpermuted (`rope_interleave: false` is refused:
  rlconf.model_spec.training_gaps).
Megatron's router differs from transformers' DeepseekV3TopkRouter in two places (training_gaps refuses the
configs where that changes the model): it scores a group by its top (topk / group_topk) experts
(transformers: top 2) and always renormalises sigmoid top-k weights (transformers: only with norm_topk_prob).
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


def mla_config_fields(arch: ModelArch) -> dict[str, Any]:
    """MLATransformerConfig's attention and rope fields of a deepseek_v3 `arch` (routing: model.moe_config)."""
    assert arch.multi_latent_attention
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
                "original_max_position_embeddings": rs.original_max_position_embeddings
                or arch.max_position_embeddings}  # fmt: skip
    return dict(
        q_lora_rank=arch.q_lora_rank, kv_lora_rank=arch.kv_lora_rank, qk_head_dim=arch.qk_head_dim,
        qk_pos_emb_head_dim=arch.qk_pos_emb_head_dim, v_head_dim=arch.v_head_dim, rotary_base=arch.rotary_base,
        qk_layernorm=True,  # MLA's q_a / kv_a latent norms
        rotary_interleaved=False,  # megatron's MLA de-interleaves the rope dims itself (rope_interleave: true)
        **rope,
    )  # fmt: skip


def mla_layer_spec(num_experts: int | None) -> Any:
    """megatron's local MLA layer spec (routed experts when `num_experts`), core attention MlaSdpaAttention."""
    import warnings

    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from rltrain.megatron.model import te_available

    if not te_available():
        mla.HAVE_TE = False  # its TE import "succeeds" without Transformer Engine, its TELinear unusable
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Apex is not installed": torch RMSNorm is what is wanted
        spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=True,
                                        multi_latent_attention=True, normalization="RMSNorm")  # fmt: skip
    spec.submodules.self_attention.submodules.core_attention = MlaSdpaAttention
    return spec


def deepseek_routing(arch: ModelArch) -> dict[str, Any]:
    """TransformerConfig's router fields for DeepSeek's sigmoid routing (deepseek_v3; model.moe_config adds
    the rest): a sigmoid score per expert in fp32 as transformers' DeepseekV3TopkRouter computes it, the top-k
    chosen on score + e_score_correction_bias (megatron's expert_bias buffer) within the
    `moe_router_group_topk` best of `moe_router_num_groups` groups, weights renormalised over the k and
    multiplied by routed_scaling_factor). The expert bias is frozen during RL (update rate 0): DeepSeek
    adjusts it in pre-training to balance expert load, a correction RL does not need and that would change
    which experts a token takes between the rollout and the update. Where megatron's router computes
    another model than transformers' (group scores, renormalisation) rlconf.model_spec.training_gaps has
    refused the config before this point."""
    groups = arch.moe_router_num_groups if (arch.moe_router_num_groups or 1) > 1 else None
    return {
        "moe_router_score_function": "sigmoid",
        "moe_router_pre_softmax": False,
        "moe_router_enable_expert_bias": arch.moe_router_enable_expert_bias,
        "moe_router_bias_update_rate": 0.0,
        "moe_router_num_groups": groups,
        "moe_router_group_topk": arch.moe_router_group_topk if groups else None,
        "moe_router_topk_scaling_factor": arch.moe_router_topk_scaling_factor,
        "moe_router_dtype": "fp32",
    }


def freeze_expert_bias(model: torch.nn.Module) -> None:
    """Keep the routers' expert_bias (deepseek_v3's e_score_correction_bias) as loaded: routing still adds it,
    but the routers stop counting tokens per expert for its update (`deepseek_routing` sets the update rate
    to 0, so the count would be unused; megatron 0.16.1's count also fails with a padding mask, which it
    broadcasts over experts instead of tokens)."""
    for module in model.modules():
        if getattr(module, "expert_bias", None) is not None:
            module.enable_expert_bias = False
