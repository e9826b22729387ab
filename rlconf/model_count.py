"""Parameter counts of a `ModelArch`: the plan reports them (total and, for MoE, active per token) and sizes
its memory estimate with the same per-layer pieces (re-exported by rlconf.model_spec).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlconf.config import ModelArch


def head_dim(arch: ModelArch) -> int:
    """Per-head width (kv_channels, else hidden_size / num_attention_heads)."""
    return arch.kv_channels if arch.kv_channels is not None else arch.hidden_size // arch.num_attention_heads


def is_moe_layer(arch: ModelArch, layer: int) -> bool:
    """Whether 0-based `layer` has routed experts."""
    return arch.num_moe_experts is not None and layer not in arch.moe_dense_layers


def num_moe_layers(arch: ModelArch) -> int:
    """Layers with routed experts."""
    if arch.num_moe_experts is None:
        return 0
    return arch.num_layers - len({i for i in arch.moe_dense_layers if 0 <= i < arch.num_layers})


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one transformer layer, split by how megatron distributes them."""

    tp_sharded: int
    """Split across tensor-parallel ranks: q/k/v (+ biases), output projection, a dense MLP or the
    shared expert."""
    replicated: int
    """On every tensor-parallel rank: RMSNorm weights, QK-norm weights, the router, the shared-expert gate."""
    experts: int
    """All routed experts (split across expert-parallel x expert-tensor-parallel ranks)."""
    active_experts: int
    """The routed experts one token passes through (moe_router_topk of them)."""


def layer_params(arch: ModelArch, moe: bool) -> LayerParams:
    """Parameter counts of one layer with routed experts (`moe`, see is_moe_layer) or a dense MLP (SwiGLU
    MLPs: gate, up and down projections)."""
    h, kv = arch.hidden_size, head_dim(arch)
    q, g = arch.num_attention_heads * kv, arch.num_query_groups * kv
    if arch.multi_latent_attention:
        sharded, replicated = _mla_params(arch)
    else:
        sharded = h * (q + 2 * g) + q * h
        if arch.add_qkv_bias:
            sharded += q + 2 * g
        replicated = 2 * h + (2 * kv if arch.qk_layernorm else 0)
    experts = active = 0
    if moe and arch.num_moe_experts is not None:
        expert = 3 * h * (arch.moe_ffn_hidden_size or arch.ffn_hidden_size)
        experts, active = arch.num_moe_experts * expert, arch.moe_router_topk * expert
        # the router (DeepSeek's e_score_correction_bias is a buffer in transformers: not a parameter)
        replicated += arch.num_moe_experts * h
        if arch.moe_shared_expert_intermediate_size is not None:
            sharded += 3 * h * arch.moe_shared_expert_intermediate_size
            replicated += h if arch.moe_shared_expert_gate else 0
    else:
        sharded += 3 * h * arch.ffn_hidden_size
    return LayerParams(sharded, replicated, experts, active)


def _mla_params(arch: ModelArch) -> tuple[int, int]:
    """(tp-sharded, replicated) parameters of one MLA attention block with its two layer norms, as
    DeepseekV3Attention builds it: q_a_proj + q_a_layernorm + q_b_proj (or one q_proj without q_lora_rank),
    kv_a_proj_with_mqa (latent + the shared rope key), kv_a_layernorm, kv_b_proj (per-head nope keys and
    values) and o_proj. The down-projections and their norms are replicated across TP ranks (megatron)."""
    h, n = arch.hidden_size, arch.num_attention_heads
    qk = arch.qk_head_dim + arch.qk_pos_emb_head_dim
    replicated = 2 * h + h * (arch.kv_lora_rank + arch.qk_pos_emb_head_dim) + arch.kv_lora_rank
    sharded = arch.kv_lora_rank * n * (arch.qk_head_dim + arch.v_head_dim) + n * arch.v_head_dim * h
    if arch.q_lora_rank is None:
        sharded += h * n * qk
    else:
        replicated += h * arch.q_lora_rank + arch.q_lora_rank
        sharded += arch.q_lora_rank * n * qk
    return sharded, replicated


def kv_cache_width(arch: ModelArch, tp: int = 1) -> int:
    """Cached elements per token per layer on one TP rank: MLA's compressed latent (kv_lora_rank + the shared
    rope key, whole on every rank, as vLLM and SGLang cache it), else keys and values of num_query_groups / tp
    heads (at least one)."""
    if arch.multi_latent_attention:
        return arch.kv_lora_rank + arch.qk_pos_emb_head_dim
    return 2 * max(arch.num_query_groups // tp, 1) * head_dim(arch)


def count_parameters(arch: ModelArch, head: str) -> tuple[int, int]:
    """(total, active per token) parameters of the unpadded, unsharded model: embedding, layers, final norm
    and the output layer (`head` lm: vocabulary logits, untied unless share_embeddings_and_output_weights;
    value: hidden -> 1). Equal for dense models."""
    total = active = arch.vocab_size * arch.hidden_size + arch.hidden_size
    if head == "value":
        total += arch.hidden_size
        active += arch.hidden_size
    elif not arch.share_embeddings_and_output_weights:
        total += arch.vocab_size * arch.hidden_size
        active += arch.vocab_size * arch.hidden_size
    moe_layers = num_moe_layers(arch)
    for moe, count in ((True, moe_layers), (False, arch.num_layers - moe_layers)):
        p = layer_params(arch, moe)
        total += count * (p.tp_sharded + p.replicated + p.experts)
        active += count * (p.tp_sharded + p.replicated + p.active_experts)
    return total, active
