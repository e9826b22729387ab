"""The embedded rollout's KV cache for multi-head latent attention (deepseek_v3), used by
rltrain.megatron.inference.KVCacheGenerator in place of its per-head key / value cache.

What is cached: the compressed latent. Per layer and token, the normalised kv latent (kv_layernorm of
linear_kv_down_proj's first kv_lora_rank outputs) and the rope key (its last qk_pos_emb_head_dim outputs,
rotated at the token's position), as [max_len, rows, 1, kv_lora_rank] and [max_len, rows, 1, rope] in the
params dtype, whole on every TP rank: kv_lora_rank + rope elements per token and layer (576 for DeepSeek-V3)
instead of heads x (qk_head_dim + rope + v_head_dim) for the expanded per-head keys and values (40,960 for
DeepSeek-V3, 71x more), which decides how many rows fit in a rollout. rlconf.plan.memory sizes the same
(rlconf.model_count.kv_cache_width).

Why it is exact: MLA's key of head h is [W_uk,h c ; k_pe] and its value W_uv,h c for the cached latent c, so
q . k = (W_uk,h^T q_nope) . c + q_pe . k_pe and softmax(.) V = W_uv,h (softmax(.) C): the query is absorbed
into the latent space (`linear_kv_up_proj`'s key rows), attention runs over the cache [c ; k_pe] shared by all
heads (values: c), and the value rows map each head's attended latent back to v_head_dim. The same model as
the training forward (megatron's MLASelfAttention, which up-projects every key and value), a different order
of the same sums: tests/megatron/test_mla_cache.py checks generated log-probs against a recompute.
Megatron's own latent cache (`cache_mla_latents`) needs its dynamic inference engine and FlashMLA.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region


def cache_shapes(attn: Any, max_len: int, rows: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of one layer's (latent, rope key) cache tensors."""
    cfg = attn.config
    return (max_len, rows, 1, cfg.kv_lora_rank), (max_len, rows, 1, cfg.qk_pos_emb_head_dim)


def rope_table(attn: Any, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [length, rope] of positions 0..length-1 as megatron's MLA applies them (its rotary module's
    angles, times YaRN's mscale, in the activations' dtype: rope_utils._apply_rotary_pos_emb_bshd)."""
    out = attn.rotary_pos_emb(length)
    freqs, mscale = out if isinstance(out, tuple) else (out, 1.0)
    freqs = freqs[:, 0, 0, :]
    return (torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype)


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """megatron's MLA RoPE of t [s, n, heads, rope] with cos / sin [s, n, 1, rope]: de-interleave, then rotate
    the halves (the ops of rope_utils._apply_rotary_pos_emb_bshd with multi_latent_attention)."""
    t = torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)
    x1, x2 = torch.chunk(t, 2, dim=-1)
    return t * cos + torch.cat((-x2, x1), dim=-1) * sin


def _full(out: torch.Tensor, width: int) -> torch.Tensor:
    """A column-parallel projection's output whole on every TP rank (megatron's MLA gathers it likewise)."""
    return out if out.shape[-1] == width else gather_from_tensor_model_parallel_region(out)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
          scale: float) -> torch.Tensor:  # fmt: skip
    """SDPA over [s, n, heads, d] queries and [L, n, 1, d] keys / values shared by the heads, with
    SdpaAttention's mask conventions (megatron mask: True = hidden; causal aligned bottom-right)."""
    sq, sk = q.shape[0], k.shape[0]
    attn_mask = None if mask is None else ~mask
    if causal and mask is None and sq != sk:
        attn_mask, causal = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq), False
    out = F.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), attn_mask=attn_mask,
        is_causal=causal and mask is None, scale=scale, enable_gqa=True,
    )  # fmt: skip
    return out.permute(2, 0, 1, 3)  # [s, n, heads, d]


def cached_attention(
    attn: Any,
    x: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    start: int | torch.Tensor,
    keys: int,
    rope: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor | None,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """MLASelfAttention.forward of the normalised input `x` [s, n, h] against the latent cache `kv`: the new
    columns' latents and rope keys go to cache columns `start` (an int, or a 1-element device tensor for the
    static decode step), attention reads the first `keys` columns. Returns linear_proj's (output, bias)."""
    cfg = attn.config
    s, n = x.shape[:2]
    heads, nope, rope_dim = attn.num_attention_heads_per_partition, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim
    if cfg.q_lora_rank is not None:
        q_latent = attn.q_layernorm(_full(attn.linear_q_down_proj(x)[0], cfg.q_lora_rank))
        q = attn.linear_q_up_proj(q_latent)[0]
    else:
        q = attn.linear_q_proj(x)[0]
    q_nope, q_pe = q.view(s, n, heads, nope + rope_dim).split([nope, rope_dim], dim=-1)
    combined = _full(attn.linear_kv_down_proj(x)[0], cfg.kv_lora_rank + rope_dim)
    latent, k_pe = combined.split([cfg.kv_lora_rank, rope_dim], dim=-1)
    latent = attn.kv_layernorm(latent).unsqueeze(2)  # [s, n, 1, kv_lora_rank]
    q_pe, k_pe = _rope(q_pe, *rope), _rope(k_pe.unsqueeze(2), *rope)
    if isinstance(start, torch.Tensor):
        kv[0].index_copy_(0, start, latent)
        kv[1].index_copy_(0, start, k_pe)
    else:
        kv[0][start : start + s] = latent
        kv[1][start : start + s] = k_pe
    up = attn.linear_kv_up_proj.weight.view(heads, nope + cfg.v_head_dim, cfg.kv_lora_rank)
    q_absorbed = torch.einsum("snhd,hdc->snhc", q_nope, up[:, :nope])  # query in the latent space
    cached = kv[0][:keys]
    context = _sdpa(torch.cat([q_absorbed, q_pe], -1), torch.cat([cached, kv[1][:keys]], -1), cached, mask,
                    causal, attn.softmax_scale)  # fmt: skip
    out = torch.einsum("snhc,hvc->snhv", context, up[:, nope:])  # each head's attended latent -> its values
    return attn.linear_proj(out.reshape(s, n, heads * cfg.v_head_dim))
