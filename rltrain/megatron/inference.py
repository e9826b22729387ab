"""The embedded rollout engine: batched sampling with a KV cache on the actor's own megatron weights.

Role: `MegatronActor.generate` (colocated rollout, no weight copy) routes here. The prompts are prefilled
once (identical prompts, e.g. the `rollout.n` copies of a GRPO group, only once: their cache rows are
copied), then one token per step is decoded against the cached keys/values. Sampling: temperature (0 is
greedy), top-k, top-p, min-p, stop on EOS + `rollout.stop_token_ids`, at most `max_new_tokens`, early exit
once every row is done, and finished rows leave the decode batch (the cache is compacted when at most half
of its rows are still running). Each sampled token comes with its log-prob under the temperature-scaled
distribution before filtering (`rollout_log_probs`), which is what `compute_log_prob` recomputes at the
same temperature.

Design (issue 5 item 5). Two candidates were built and measured (bench/rollout_cpu.py):

  (1) megatron-core's static inference path: `StaticInferenceContext` passed as `inference_context` to
      `GPTModel.forward`; megatron's `Attention` appends to a per-layer cache, keeps the keys *before* RoPE
      and re-rotates the whole cached prefix in every layer at every step, with one position per column
      (a left-padded row is shifted: equal only through RoPE's shift invariance, i.e. up to rounding).
  (2) this module: our own per-layer cache driven through megatron's own submodules (embedding, norms,
      `get_query_key_value_tensors`, megatron's RoPE (`rotate`: its ops), the core attention module,
      `linear_proj`, the bias-dropout-add functions, MLP, final norm, output layer), keys cached after RoPE
      at each row's training positions (0 at its first real token).

  Generated tokens/s, greedy, 2-core CPU, one thread, fp32, random weights; "bare" = the same greedy loop
  without sampling, prompt sharing or compaction for both designs (the like-for-like pair):

                                   no-cache  (1) bare  (1) bare, per-row RoPE  (2) bare  (2) engine
  tiny  4x64,   B64 P16  N32          1.9k      9.3k                   8.0k      13.1k      12.1k
  wide  4x256,  B64 P32  N64          0.14k     2.5k*                  1.7k       3.1k       3.0k
  grpo  4x256,  8x8 rows P128 N32     0.05k     1.0k                   0.9k       1.2k       2.6k
  * 3 of 4096 tokens differ from the no-cache path: a near-tie (top-2 logit gap 5e-6) flipped by the
    position shift; (2) matched every token in every case.
  One H200, bf16, Qwen2.5-0.5B shape (24 layers), B64 P128 N128 (`--device cuda --cases qwen05b`):
  no-cache 0.35k, (1) bare 2.1k, (1) per-row RoPE 2.2k, (2) bare 2.5k, (2) engine 2.1k tok/s. Decode
  there is bound by kernel launches and Python (~30 ms per step for 24 layers), not by the GPU.

  (2) is chosen: 1.2-1.4x faster than (1) like for like (1.2x on the H200) (megatron's per-layer inference bookkeeping and
  the re-rotation of the cached keys; exact positions would cost (1) another 15-30%), exact training
  positions, and the decode step is our own code, so it can later be made shape-static and captured in a
  CUDA graph (issue 10), which megatron's static path only allows with flash-decode. Its cost is a second
  copy of the layer *composition* (norm -> attention -> residual -> norm -> MLP -> residual; all math is
  megatron's modules): `kv_cache_unsupported` names every layer feature it does not follow (cross
  attention, attention output gate, non-RoPE positions, Transformer Engine / custom core attention,
  context parallel), `MegatronActor.generate` then takes the no-cache path, and the tests compare with
  the no-cache path (megatron's own forward) in every layout.

Multi-head latent attention (deepseek_v3) caches the compressed latent and its rope key instead of per-head
keys and values, and attends in the latent space (rltrain/megatron/mla_cache.py says why that is exact).

Parallelism: every TP rank runs the same steps (megatron's column/row-parallel modules do the TP
communication) and the logits are all-gathered over TP (`runtime_gather_output`); every rank samples with
the same seeded generator, drawing one uniform per batch row per step whether the row is still active or
not (samples do not depend on compaction, and the draws equal the no-cache path's). Pipeline parallel (and
virtual pipeline) runs its own forward-only pass per step through the stages: point-to-point of the
[s, b, h] hidden state in stage order (megatron's interleaved schedule wants >= PP micro-batches; a decode
step is one); the last stage samples and broadcasts (token, log-prob) to the others. Sequence parallel is
switched off on the modules while generating (one decode token cannot be split over TP ranks; megatron's
own inference does the same) and restored afterwards. Context parallel is not supported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp

from rltrain import device as devices
from rltrain.megatron import decode_kernels, fused, mla_cache, moe_decode, triton_rms_norm
from rltrain.megatron.kv_session import KVSession
from rltrain.megatron.lora import generation_weights
from rltrain.megatron.model import SdpaAttention, fused_rotate, rotate
from rltrain.rollout.batch import rollout_batch

# Module attributes megatron reads to decide on sequence-parallel communication (cf. megatron's
# `set_model_to_sequence_parallel`, which cannot restore mixed original values).
_SP_ATTRS = ("sequence_parallel", "reduce_scatter_embeddings")


# ------------------------------------------------------------------------------------ sampling
def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = -1,
    min_p: float = 0.0,
    uniform: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from full-vocabulary logits [B, V]: (tokens [B], log-probs [B]).

    The log-prob is under the temperature-scaled distribution before filtering (what `compute_log_prob`
    recomputes at that temperature). temperature <= 0 is greedy. Filters apply in the order top-k, top-p,
    min-p (as in transformers): top-p keeps the smallest prefix of the sorted distribution whose mass
    reaches top_p, min-p drops tokens below min_p x the most likely token's probability (a ratio, so it
    does not matter whether it is taken before or after renormalising). Sampling is inverse-CDF with one
    uniform per row (`uniform` [B] in [0, 1), else drawn from `generator`), so every rank that holds the
    same logits and uniforms picks the same tokens (`inverse_cdf`).
    """
    if uniform is None:
        uniform = torch.rand(logits.shape[0], generator=generator)
    if temperature > 0.0 and not filtered_sampling(top_p, top_k, min_p, logits.shape[-1]):
        return sample_unfiltered(logits, logits.shape[-1], temperature, uniform)
    logits = logits.float()
    if temperature <= 0.0:
        tok = logits.argmax(-1)
        return tok, torch.log_softmax(logits, -1).gather(1, tok[:, None]).squeeze(1)
    scaled = logits / temperature if temperature != 1.0 else logits
    top = scaled.amax(-1, keepdim=True)
    filtered = scaled
    vocab = filtered.shape[-1]
    if top_k is not None and 0 < top_k < vocab:
        kth = torch.topk(filtered, top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, -1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        filtered = torch.full_like(filtered, float("-inf")).scatter(1, order, sorted_logits)
    if min_p > 0.0:
        # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p): no softmax needed.
        filtered = filtered.masked_fill(filtered < top + torch.log(torch.tensor(min_p)), float("-inf"))
    tok, mass = inverse_cdf(filtered, top, uniform)
    # log Z of the unfiltered distribution: the sampled weights' own sum when nothing was filtered.
    log_z = top.squeeze(1) + (mass.log() if filtered is scaled else torch.logsumexp(scaled - top, -1))
    return tok, scaled.gather(1, tok[:, None]).squeeze(1) - log_z


def filtered_sampling(top_p: float, top_k: int, min_p: float, vocab: int) -> bool:
    """Whether top-p, top-k or min-p drop any token (else sampling is from the whole distribution)."""
    return top_p < 1.0 or (top_k is not None and 0 < top_k < vocab) or min_p > 0.0


def sample_unfiltered(
    logits: torch.Tensor, vocab: int, temperature: float | torch.Tensor, uniform: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_tokens` at temperature > 0 without filters, from the output layer's logits as they are
    ([B, >= vocab] in its dtype; the columns past `vocab` are the padded vocabulary): (tokens, log-probs).

    `temperature` may be a 0-d fp32 tensor on the logits' device (the static step's buffer): the compiled
    form (`fused_sample_unfiltered`) then serves every temperature with one graph (a Python float is a
    constant it specialises on). Dividing by 1.0 is exact, so both forms give the same numbers."""
    return _draw_unfiltered(logits, vocab, temperature, uniform, at_reads=False)


def _draw_unfiltered(
    logits: torch.Tensor,
    vocab: int,
    temperature: float | torch.Tensor,
    uniform: torch.Tensor,
    at_reads: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_unfiltered`. `at_reads`: the cast and temperature are applied wherever the logits are read
    (the maximum, the block sums, the gathers), so a compiled caller never writes the fp32 [B, V] copy
    (~0.45 ms of a 1.5B decode step at 256 rows, docs/benchmarks.md); eagerly they are applied once, into
    that copy (applied at every read, eager kernels would write it three times). The same numbers."""
    divide = isinstance(temperature, torch.Tensor) or temperature != 1.0

    def scale(raw: torch.Tensor) -> torch.Tensor:
        return raw.float() / temperature if divide else raw.float()

    raw = logits[:, :vocab]
    if not at_reads:
        raw, scale = scale(raw), _identity
    top = scale(raw).amax(-1, keepdim=True)
    tok, mass = inverse_cdf(raw, top, uniform, scale)
    return tok, scale(raw.gather(1, tok[:, None])).squeeze(1) - (top.squeeze(1) + mass.log())


def _sample_unfiltered_rows(
    logits: torch.Tensor, vocab: int, temperature: float | torch.Tensor, uniform: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_unfiltered` over unbacked rows (the same count for the logits and the uniforms), the scale
    applied at every read."""
    torch._check(uniform.shape[0] == logits.shape[0])
    return _draw_unfiltered(logits, vocab, temperature, uniform, at_reads=True)


def fused_sample_unfiltered(
    logits: torch.Tensor, vocab: int, temperature: float | torch.Tensor, uniform: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_unfiltered` torch.compile'd once per logits dtype (the row count unbacked; a float
    temperature adds one graph per value, a tensor one does not). Past torch's recompile limit it runs
    eagerly, with a warning (`fused.compiled_or_eager`)."""
    logits, uniform = fused.unbacked_rows(logits, uniform)
    return fused.compiled_or_eager(
        fused.compiled(_sample_unfiltered_rows), sample_unfiltered, logits, vocab, temperature, uniform
    )


# Vocabulary entries per block of `inverse_cdf`'s two-level search.
CDF_BLOCK = 1024


def inverse_cdf(
    logits: torch.Tensor,
    top: torch.Tensor,
    uniform: torch.Tensor,
    scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draw from softmax(logits) [B, V] (-inf = excluded) with one uniform per row: (the first
    token whose cumulative weight reaches u x the total, that total [B]). With `scale`, the distribution
    is softmax(scale(logits)), `scale` elementwise (the unfiltered sampler's cast and temperature).

    `top` [B, 1] is at least each row's largest (scaled) logit, so the weights exp(scale(logits) - top)
    cannot overflow.
    Two levels instead of a cumulative sum over the whole vocabulary (a [B, V] scan was 0.48 ms of a
    10 ms 1.5B decode step at B = 512, docs/benchmarks.md): per-block sums pick the block, then a scan
    over that block's CDF_BLOCK weights picks the token. Searches look for the first cumulative weight >=
    the draw, clamped into (0, total], so a zero-weight token is never picked: the cumulative weight only
    reaches a positive draw where the weight is positive.
    """
    if scale is None:
        scale = _identity
    b, v = logits.shape
    full, tail = divmod(v, CDF_BLOCK)
    # The weights exp(logits - top) per block, summed; the last block is ragged when CDF_BLOCK does not
    # divide V. The chosen block's weights are computed again below from its logits (the same numbers),
    # so a compiled caller never writes the [B, V] weights.
    blocks = scale(logits[:, : full * CDF_BLOCK].view(b, full, CDF_BLOCK))
    sums = torch.exp(blocks - top[:, :, None]).sum(-1)
    if tail:
        last = scale(logits[:, full * CDF_BLOCK :])
        sums = torch.cat([sums, torch.exp(last - top).sum(-1, keepdim=True)], 1)
    nb = sums.shape[1]
    block_cdf = sums.cumsum(-1)  # [B, nb]
    total = block_cdf[:, -1:]
    tiny = torch.finfo(torch.float32).tiny
    draw = torch.minimum((uniform.to(total.device, total.dtype).view(-1, 1) * total).clamp(min=tiny), total)
    j = torch.searchsorted(block_cdf, draw).clamp(max=nb - 1)  # [B, 1]
    before = torch.where(j > 0, block_cdf.gather(1, (j - 1).clamp(min=0)), 0.0)
    cols = j * CDF_BLOCK + torch.arange(CDF_BLOCK, device=logits.device)  # [B, block]
    chosen = scale(logits.gather(1, cols.clamp(max=v - 1)))
    inside = torch.where(cols < v, torch.exp(chosen - top), 0.0).cumsum(-1)
    rest = torch.minimum((draw - before).clamp(min=tiny), inside[:, -1:])
    k = torch.searchsorted(inside, rest).clamp(max=CDF_BLOCK - 1)
    return (j * CDF_BLOCK + k).squeeze(1).clamp(max=v - 1), total.squeeze(1)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


# ------------------------------------------------------------------------------------ layout helpers
def left_pad(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Move each row's valid (contiguous) prompt tokens to the right end: (ids [B, P], mask [B, P])."""
    p = prompt_ids.shape[1]
    prompt_mask = prompt_mask.long()
    plen = prompt_mask.sum(-1)
    start = prompt_mask.int().argmax(-1)
    cols = torch.arange(p, device=prompt_ids.device)
    src = (start.unsqueeze(1) + cols - (p - plen).unsqueeze(1)).clamp(0, p - 1)
    left_mask = (cols.unsqueeze(0) >= (p - plen).unsqueeze(1)).long()
    left = torch.where(
        left_mask.bool(), torch.gather(prompt_ids, 1, src), torch.full_like(prompt_ids, pad_id)
    )
    return left, left_mask


def prefill_mask(valid: torch.Tensor) -> torch.Tensor | None:
    """megatron-convention mask (True = masked) [b, 1, P, P] for left-padded prompts; None when unpadded.

    Causal, pad keys hidden, and each pad query sees itself: a fully masked row would make SDPA return NaN
    there, and those NaN keys/values would leak through 0-weight products into real rows.
    """
    if bool(valid.all()):
        return None
    p = valid.shape[1]
    idx = torch.arange(p, device=valid.device)
    future = idx.view(1, p) > idx.view(p, 1)  # [q, k]
    pad_key = ~valid[:, None, :] & (idx.view(1, p, 1) != idx.view(1, 1, p))  # [b, q, k]
    return (future.unsqueeze(0) | pad_key).unsqueeze(1)


def block_mask(valid: torch.Tensor, start: int) -> torch.Tensor:
    """megatron-convention mask (True = masked) [b, 1, P - start, P] of a prefill of columns start.. over
    cached columns: causal, pad keys hidden (`valid` [b, P]), each pad query sees itself (cf. prefill_mask)."""
    p = valid.shape[1]
    q = torch.arange(start, p, device=valid.device)
    k = torch.arange(p, device=valid.device)
    future = k.view(1, p) > q.view(-1, 1)  # [q, k]
    pad_key = ~valid[:, None, :] & (q.view(1, -1, 1) != k.view(1, 1, p))  # [b, q, k]
    return (future.unsqueeze(0) | pad_key).unsqueeze(1)


def unique_rows(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first row of each distinct prompt, in row order; per row, the index of its distinct prompt)."""
    _, inverse = torch.unique(torch.cat([ids, mask], 1), dim=0, return_inverse=True)
    n = int(inverse.max()) + 1
    first = torch.full((n,), ids.shape[0], dtype=torch.long, device=ids.device)
    first = first.scatter_reduce(0, inverse, torch.arange(ids.shape[0], device=ids.device), "amin")
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(n, device=ids.device)
    return first[order], rank[inverse]


@contextlib.contextmanager
def sequence_parallel_off(modules: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Run with sequence parallel off on every (sub)module and the shared config; restore the exact values."""
    saved: list[tuple[object, str]] = []
    for model in modules:
        config = getattr(model, "config", None)
        if config is not None and getattr(config, "sequence_parallel", False):
            saved.append((config, "sequence_parallel"))
        for sub in model.modules():
            saved.extend((sub, attr) for attr in _SP_ATTRS if getattr(sub, attr, None) is True)
    for obj, attr in saved:
        setattr(obj, attr, False)
    try:
        yield
    finally:
        for obj, attr in saved:
            setattr(obj, attr, True)


def _attention_input_args(
    attn: torch.nn.Module,
) -> tuple[torch.Tensor | None, torch.Tensor | None, float, torch.Tensor | None] | None:
    """(q norm weight, k norm weight, eps, QKV bias to add) of a self-attention whose decode-step inputs
    `fused.decode_attention_inputs` computes exactly; None where it cannot: an output gate, fewer query
    groups than TP ranks (megatron gathers and re-slices the QKV), a QKV split other than megatron's
    SelfAttention's, or a q/k norm other than an affine torch.nn.RMSNorm over the head dimension. The bias
    is the QKV projection's where it is megatron's own ColumnParallelLinear adding it (`_bias_deferred`
    then runs the projection without it and the inputs' function adds it: a kernel fewer per layer)."""
    cfg = attn.config
    if getattr(cfg, "attention_output_gate", False) or cfg.num_query_groups < attn.world_size:
        return None
    # megatron's own QKV split (a subclass with its own would not be what the fused function computes).
    if type(attn).get_query_key_value_tensors is not SelfAttention.get_query_key_value_tensors:
        return None
    weights: list[torch.Tensor | None] = []
    eps = 0.0
    for norm in (attn.q_layernorm, attn.k_layernorm):
        if norm is None or isinstance(norm, IdentityOp):
            weights.append(None)
            continue
        if type(norm) not in triton_rms_norm.RMS_NORMS or norm.weight is None or norm.eps is None:
            return None
        if tuple(norm.normalized_shape) != (attn.hidden_size_per_attention_head,):
            return None
        if eps and norm.eps != eps:
            return None
        weights.append(norm.weight)
        eps = norm.eps
    qkv = attn.linear_qkv
    own_bias = type(qkv) is ColumnParallelLinear and not qkv.skip_bias_add and qkv.bias is not None
    return weights[0], weights[1], eps, qkv.bias if own_bias else None


@contextlib.contextmanager
def _bias_deferred(linear: torch.nn.Module, defer: bool) -> Iterator[None]:
    """megatron's linear returning its output without its bias for the calls inside (`skip_bias_add`, whose
    returned bias megatron's QKV split drops) where `defer`: the caller adds the bias itself."""
    if not defer:
        yield
        return
    linear.skip_bias_add = True
    try:
        yield
    finally:
        linear.skip_bias_add = False


def _head_shape(attn: torch.nn.Module) -> tuple[int, int]:
    """(head dim, query heads per KV group) of a self-attention module on this rank: the shape the decode
    step's kernels are asked about."""
    return (
        attn.hidden_size_per_attention_head,
        attn.num_attention_heads_per_partition // attn.num_query_groups_per_partition,
    )


def kv_cache_unsupported(actor) -> str | None:
    """Why the KV-cache engine cannot run this actor's model (None: it can).

    The engine re-composes megatron's GPT layer (see the module docstring); anything it does not follow
    is named here so that `generate` takes the no-cache path instead of computing something else.
    """
    if parallel_state.get_context_parallel_world_size() > 1:
        return "context parallel"
    for model in actor.modules():
        cfg = model.config
        if model.position_embedding_type != "rope":
            return f"position embedding {model.position_embedding_type!r} (needs rope)"
        if getattr(cfg, "attention_output_gate", False):
            return "attention output gate"
        if cfg.rotary_interleaved:
            return "interleaved rotary embeddings"
        for layer in model.decoder.layers:
            if not isinstance(layer.cross_attention, IdentityOp):
                return "cross attention"
            if not isinstance(layer.self_attention.core_attention, DotProductAttention):
                # Transformer Engine's attention takes other mask conventions; untested here.
                return f"core attention {type(layer.self_attention.core_attention).__name__}"
    return None


def static_moe_unsupported(actor) -> str | None:
    """Why this actor's MoE layers cannot run inside the static (CUDA-graph) decode step (None: they can,
    or the model has none): megatron's own MoELayer sizes its expert batches on the host."""
    for model in actor.modules():
        for layer in model.decoder.layers:
            if moe_decode.is_moe(layer.mlp):
                if not KVCacheGenerator.static_moe:
                    return "static MoE layers switched off"
                reason = moe_decode.unsupported(layer.mlp)
                if reason is not None:
                    return reason
    return None


FORCE_EOS_ENV = "RLPLAN_BENCH_FORCE_EOS"
"""Benchmarks only (bench/grpo_step_gpu.py's `realistic` workload): a share of max_new_tokens, e.g. 0.4. Each
row of a generate call then emits its first stop token at a length drawn from a long-tailed distribution
(`forced_lengths`) whose mean is that share: a random-init model never samples EOS, so without it every
benchmark decodes every row to the maximum and never measures the padding of a real run. The forced token
keeps the log-prob of the token sampled in its place."""


def forced_lengths(rows: int, max_new_tokens: int, seed: int) -> torch.Tensor | None:
    """[rows] response lengths in [1, max_new_tokens] under `FORCE_EOS_ENV` (None when it is unset): log-normal
    (sigma 1, a long right tail) clipped to the range, its scale set so the clipped mean is the share."""
    share = os.environ.get(FORCE_EOS_ENV)
    if not share:
        return None
    target = float(share) * max_new_tokens
    z = torch.randn(rows, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    lo, hi = -10.0, 20.0
    for _ in range(60):  # bisection on the log-scale: the clipped mean grows with it
        mid = (lo + hi) / 2
        mean = float((mid + z).exp().clamp(1, max_new_tokens).mean())
        lo, hi = (mid, hi) if mean < target else (lo, mid)
    return ((lo + hi) / 2 + z).exp().clamp(1, max_new_tokens).round().long()


# ------------------------------------------------------------------------------------ the engine
class KVCacheGenerator:
    """Per-layer KV cache and the cached forward through this rank's model chunks (all PP/VPP stages).

    Cache layout per layer: keys (after RoPE) and values [max_len, rows, groups/TP, head_dim], megatron's
    sequence-first layout, written at column offset `start` and read as the prefix [:start + s]; with MLA
    the latent [max_len, rows, 1, kv_lora_rank] and rope key [max_len, rows, 1, rope] (mla_cache).

    MoE layers run `moe_decode.moe_forward` (static shapes, no host sync) where `moe_decode.unsupported`
    accepts them and `static_moe` is on (the class switch; benchmarks turn it off to time megatron's
    MoELayer), else megatron's MoELayer; their glue around the grouped GEMMs is `moe_decode.DecodeGlue`'s
    (dispatch by rank, compiled under the plan's fused kernels) while `fuse_moe_glue` is on, and with it
    their router runs as the gating GEMM and `moe_decode.route` while `fuse_moe_router` is on. The static
    step's attention inputs (QKV bias, split, q/k norm, RoPE, cache write) run as one function
    (`fused.decode_attention_inputs`, compiled under the plan's fused kernels, on CUDA one Triton kernel:
    `_pick_attention_inputs`) where `_attention_input_args` accepts the layer, and its mask is SDPA's
    additive one, built once per step. On CUDA under the plan's fused kernels the static step's attention is
    `decode_kernels.decode_attention` (each row's own columns, `_pick_decode_attention`) and the static MoE
    layers' experts at decode sizes `decode_kernels.expert_swiglu` (`_pick_moe_glue`).
    `routing` holds the top-k experts of the last forward's static MoE
    layers (by router layer number); `silent_routing` keeps them from an attached replay recorder.
    """

    static_moe = True
    # The static decode step's glue: fused attention inputs, one additive mask per step, sampling straight
    # from the output layer's logits (the class switch: benchmarks turn it off to time the step as before).
    fuse_step_glue = True
    # The static MoE layers' glue (dispatch by rank for decode-sized batches, SwiGLU-times-probability,
    # combine) as `moe_decode.DecodeGlue`'s functions, compiled under the plan's fused kernels (the class
    # switch: off runs the argsort path, which benchmarks time against it).
    fuse_moe_glue = True
    # The static MoE layers' router with the glue: the gating GEMM, then megatron's top-k routing as one
    # function up to the [T, k] probabilities the glue takes (`moe_decode.route`, compiled under the plan's
    # fused kernels) where `moe_decode.moe_forward` finds it gives megatron's routing (the class switch: off
    # runs megatron's TopKRouter, which benchmarks time against it).
    fuse_moe_router = True
    # The static step's attention inputs as one handwritten Triton kernel per layer
    # (`decode_kernels.attention_inputs`) where `_pick_attention_inputs` finds it can run, instead of
    # torch.compile's five to seven (the class switch: off runs the compiled function, which benchmarks time
    # against it).
    triton_attention_inputs = True
    # The static step's attention as `decode_kernels.decode_attention` (each row's own columns, one graph per
    # row set) where `_pick_decode_attention` finds it can run, instead of SDPA over whole key buckets (the
    # class switch: off runs SDPA, which benchmarks time against it).
    triton_decode_attention = True
    # The static MoE layers' experts at decode sizes as `decode_kernels.expert_swiglu` (two Triton kernels,
    # SwiGLU in the first one's epilogue, experts without rows skipped) where `_pick_moe_glue` finds it can
    # run, instead of two torch._grouped_mm and the compiled SwiGLU between them (the class switch: off
    # runs those, which benchmarks time against it).
    triton_moe_experts = True
    # The static step's residual adds each with the RMSNorm after it (the next layer's input norm, the final
    # norm after the last layer) as one Triton kernel (`decode_kernels.add_rms_norm`) where `_pick_add_norm`
    # finds it can run: two kernels a layer instead of four (the class switch: off runs megatron's
    # bias-dropout-add and norms, which benchmarks time against it).
    fuse_add_norm = True

    def __init__(self, actor, positions: torch.Tensor, zero_cache: bool = False) -> None:
        self.actor = actor
        # The static decode step attends over whole buckets of cache columns, unwritten ones masked; they
        # must hold finite numbers (a masked NaN still poisons the 0-weight product), hence zeros.
        self.zero_cache = zero_cache
        self.models = actor.modules()
        self.device = actor.torch_device
        self.vocab_size = actor.vocab_size
        self.config = self.models[0].config
        self.pipe_dtype = self.config.pipeline_dtype or self.config.params_dtype
        # Per-row positions [B, max_len] and the RoPE cos / sin of every position [max_len, D].
        self.positions = positions
        # Multi-head latent attention (deepseek_v3): a latent cache and its own attention (mla_cache).
        self.mla = bool(getattr(self.config, "multi_latent_attention", False))
        if self.mla:
            first = next(layer for model in self.models for layer in model.decoder.layers)
            self.cos, self.sin = mla_cache.rope_table(
                first.self_attention, positions.shape[1], self.config.params_dtype
            )
        else:
            freqs = self.models[0].rotary_pos_emb(positions.shape[1])[:, 0, 0, :]
            # RoPE of every position in the activations' dtype (megatron recomputes cos/sin in every layer).
            self.cos = freqs.cos().to(self.config.params_dtype)
            self.sin = freqs.sin().to(self.config.params_dtype)
        # The plan's fused kernels: RoPE as one compiled kernel (SwiGLU is fused in the model itself).
        self.rotate = fused_rotate if actor.fused_kernels else rotate
        self.sample_unfiltered = fused_sample_unfiltered if actor.fused_kernels else sample_unfiltered
        # The static decode step's attention inputs (QKV bias, split, q/k norm, RoPE, cache write) as one
        # function: per layer, the arguments it takes past the tensors (`_attention_input_args`; layers it
        # cannot follow are absent and run megatron's modules one by one); the function itself is
        # `_pick_attention_inputs`'s.
        layers = [layer for model in self.models for layer in model.decoder.layers]
        self.fused_inputs = {
            id(layer.self_attention): args
            for layer in layers
            if self.fuse_step_glue
            and not self.mla
            and (args := _attention_input_args(layer.self_attention)) is not None
        }
        self.attention_inputs, self.triton_inputs_unsupported = self._pick_attention_inputs(layers)
        self.decode_attention, self.triton_attention_unsupported = self._pick_decode_attention(layers)
        # SdpaAttention takes SDPA's additive mask as is: the static step builds it once, not per layer.
        # The exact class: MLA's core attention subclasses it and inverts a boolean mask itself.
        self.additive_mask = self.fuse_step_glue and all(
            type(layer.self_attention.core_attention) is SdpaAttention for layer in layers
        )
        self.add_norm, self.add_norm_unsupported = self._pick_add_norm()
        self.cache: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.models]
        self.expert_weights = moe_decode.ExpertWeights()
        self.routing: dict[int, torch.Tensor] = {}
        self.silent_routing = False
        # Decided once per engine: the same MoE code in prefill, dynamic and static decode.
        self.moe_static = {
            id(layer.mlp)
            for layer in layers
            if self.static_moe and moe_decode.is_moe(layer.mlp) and moe_decode.unsupported(layer.mlp) is None
        }
        self.moe_glue, self.triton_experts_unsupported = self._pick_moe_glue()
        self.moe_route = (
            (moe_decode.fused_route if actor.fused_kernels else moe_decode.route)
            if self.fuse_moe_router
            else None
        )

    def code_path(self) -> tuple[Any, ...]:
        """What decides the code the static step runs, all picked once per engine from the class switches,
        the plan's kernels and the model: two engines of one actor with equal code paths run the same
        functions (and compiled code) on tensors of equal shapes, so a capture of one may skip its warm-up
        after a capture of the other (`StaticDecodeStep`)."""
        return (
            self.attention_inputs, self.decode_attention, self.additive_mask, self.add_norm, self.moe_glue,
            self.moe_route, self.rotate, self.sample_unfiltered, self.fuse_step_glue, self.mla,
            frozenset(self.fused_inputs), frozenset(self.moe_static), self.config.bias_activation_fusion,
            self.config.apply_rope_fusion, self.config.params_dtype,
        )  # fmt: skip

    def _pick_attention_inputs(
        self, layers: list[torch.nn.Module]
    ) -> tuple[Callable[..., torch.Tensor], str | None]:
        """The static step's attention-inputs function, chosen once per engine, and why it is not the Triton
        kernel (None when it is): `decode_kernels.attention_inputs` (one launch per layer) on CUDA with the
        plan's fused kernels, `triton_attention_inputs` on and every fused layer's shapes supported;
        otherwise `fused.decode_attention_inputs`, torch.compile'd under the plan's fused kernels."""
        if not self.actor.fused_kernels:
            return fused.decode_attention_inputs, "the plan's kernels are eager"
        compiled = fused.fused_decode_attention_inputs
        if not self.triton_attention_inputs:
            return compiled, "KVCacheGenerator.triton_attention_inputs is off"
        shapes = {
            _head_shape(layer.self_attention)
            for layer in layers
            if id(layer.self_attention) in self.fused_inputs
        }
        if not shapes:
            return compiled, "no layer takes the fused attention inputs"
        for d, per_group in sorted(shapes):
            why = decode_kernels.unsupported(
                self.device, self.config.params_dtype, d, per_group, self.cos.shape[-1]
            )
            if why is not None:
                return compiled, why
        return decode_kernels.attention_inputs, None

    def _pick_decode_attention(
        self, layers: list[torch.nn.Module]
    ) -> tuple[Callable[..., torch.Tensor] | None, str | None]:
        """The static step's attention, chosen once per engine: `decode_kernels.decode_attention` and None,
        or None (the layers' own core attention, SDPA over whole key buckets) and why not: the kernel runs on
        CUDA with the plan's fused kernels, `triton_decode_attention` on, every layer's core attention
        exactly `SdpaAttention` (whose math it computes) and its shapes supported."""
        if not self.actor.fused_kernels:
            return None, "the plan's kernels are eager"
        if not self.triton_decode_attention:
            return None, "KVCacheGenerator.triton_decode_attention is off"
        if self.mla:
            return None, "multi-head latent attention (its own cached attention)"
        shapes = set()
        for layer in layers:
            a = layer.self_attention
            if type(a.core_attention) is not SdpaAttention:
                return (
                    None,
                    f"core attention {type(a.core_attention).__name__} (the kernel computes SdpaAttention's)",
                )
            shapes.add(_head_shape(a))
        if not shapes:
            return None, "no attention layers"
        for d, per_group in sorted(shapes):
            why = decode_kernels.attention_unsupported(self.device, self.config.params_dtype, d, per_group)
            if why is not None:
                return None, why
        return decode_kernels.decode_attention, None

    def _pick_add_norm(
        self,
    ) -> tuple[Callable[..., tuple[torch.Tensor, torch.Tensor]] | None, str | None]:
        """The static step's residual add with the next RMSNorm as one Triton kernel
        (`decode_kernels.add_rms_norm`), chosen once per engine, or None and why not: the plan's fused
        kernels, `fuse_add_norm` on, one model chunk, every norm of the layers and the final norm exactly
        torch.nn.RMSNorm with a weight, no bias on the attention's and MLP's outputs (megatron's
        bias-dropout-add would add it), no fp32 residual stream, and what the kernel needs
        (`decode_kernels.add_norm_unsupported`: CUDA, triton, the dtype, the width)."""
        if not self.fuse_add_norm:
            return None, "KVCacheGenerator.fuse_add_norm is off"
        if not self.actor.fused_kernels:
            return None, "the plan's kernels are eager"
        if len(self.models) != 1:
            return None, "several model chunks (the static step runs one)"
        cfg, (model,) = self.config, self.models
        if cfg.add_bias_linear:
            return None, "biases on the attention's and MLP's outputs (add_bias_linear)"
        if cfg.fp32_residual_connection:
            return None, "an fp32 residual stream (fp32_residual_connection)"
        norms = [
            n for layer in model.decoder.layers for n in (layer.input_layernorm, layer.pre_mlp_layernorm)
        ]
        for norm in [*norms, model.decoder.final_layernorm]:
            if type(norm) not in triton_rms_norm.RMS_NORMS or norm.weight is None:
                return None, f"a norm {type(norm).__name__} (the kernel is torch.nn.RMSNorm's)"
        why = decode_kernels.add_norm_unsupported(self.device, cfg.params_dtype, cfg.hidden_size)
        return (None, why) if why is not None else (decode_kernels.add_rms_norm, None)

    def _pick_moe_glue(self) -> tuple[moe_decode.DecodeGlue | None, str | None]:
        """The static MoE layers' glue, chosen once per engine (None: the argsort path, `fuse_moe_glue` off),
        and why its experts are not `decode_kernels.expert_swiglu` (None when they are: CUDA, the plan's
        fused kernels, `triton_moe_experts` on, a dtype the kernels take)."""
        if not self.fuse_moe_glue:
            return None, "KVCacheGenerator.fuse_moe_glue is off"
        if not self.actor.fused_kernels:
            return moe_decode.EAGER_GLUE, "the plan's kernels are eager"
        if not self.triton_moe_experts:
            return moe_decode.FUSED_GLUE, "KVCacheGenerator.triton_moe_experts is off"
        why = decode_kernels.experts_unsupported(self.device, self.config.params_dtype)
        if why is not None:
            return moe_decode.FUSED_GLUE, why
        return dataclasses.replace(moe_decode.FUSED_GLUE, experts=decode_kernels.expert_swiglu), None

    # --------------------------------------------------------------------------------- cache rows
    def _allocate(self, rows: int) -> None:
        max_len = self.positions.shape[1]
        for v, model in enumerate(self.models):
            attn = [layer.self_attention for layer in model.decoder.layers]
            if self.mla:
                self.cache[v] = [
                    tuple(self._empty(shape) for shape in mla_cache.cache_shapes(a, max_len, rows))  # type: ignore[misc]
                    for a in attn
                ]
                continue
            self.cache[v] = [
                tuple(  # type: ignore[misc]
                    (torch.zeros if self.zero_cache else torch.empty)(
                        (max_len, rows, a.num_query_groups_per_partition, a.hidden_size_per_attention_head),
                        dtype=self.config.params_dtype,
                        device=self.device,
                    )
                    for _ in range(2)
                )
                for a in attn
            ]

    def _empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        make = torch.zeros if self.zero_cache else torch.empty
        return make(shape, dtype=self.config.params_dtype, device=self.device)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep (or repeat) cache rows: row i of the new cache is row `rows[i]` of the old one. A layer at a
        time, each layer's old tensors dropped before the next layer's are copied, so a compaction holds one
        layer's old keys and values beside the new cache, not a second cache (the plan's memory estimate
        counts it so: rlconf/plan/memory.py, "rollout kv compaction")."""
        for chunk in self.cache:
            for i, (k, v) in enumerate(chunk):
                chunk[i] = (k.index_select(1, rows), v.index_select(1, rows))

    # --------------------------------------------------------------------------------- forward
    def forward(
        self, tokens: torch.Tensor, start: int, rows: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Run `tokens` [n, s] (columns start..start+s-1 of batch rows `rows`) through every stage, writing
        their keys/values into the cache; return the logits [n, V] of the last column on the last stage
        (None elsewhere). `mask`: megatron convention [n, 1, s, start + s] or None (causal / all keys)."""
        n, s = tokens.shape
        if start == 0:
            self._allocate(n)
        pos = self.positions[rows, start : start + s]  # [n, s]
        rope = self.rope_at(pos)
        mask_type = AttnMaskType.causal if start == 0 else AttnMaskType.no_mask
        hidden = None
        for v, model in enumerate(self.models):
            if model.pre_process:
                hidden = model.embedding(input_ids=tokens, position_ids=pos)
            else:
                hidden = torch.empty(
                    (s, n, self.config.hidden_size), dtype=self.pipe_dtype, device=self.device
                )
                torch.distributed.recv(
                    hidden,
                    src=parallel_state.get_pipeline_model_parallel_prev_rank(),
                    group=parallel_state.get_pipeline_model_parallel_group(),
                )
            for layer, kv in zip(model.decoder.layers, self.cache[v], strict=True):
                hidden = self._layer(layer, hidden, kv, start, start + s, rope, mask, mask_type)
            if not model.post_process:
                torch.distributed.send(
                    hidden.contiguous(),
                    dst=parallel_state.get_pipeline_model_parallel_next_rank(),
                    group=parallel_state.get_pipeline_model_parallel_group(),
                )
        if not self.models[-1].post_process:
            return None
        assert hidden is not None
        return self.logits(hidden)

    def rope_at(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [s, n, 1, D] of positions `pos` [n, s], shared by every layer of a forward."""
        cols = pos.t()
        return self.cos[cols].unsqueeze(2), self.sin[cols].unsqueeze(2)

    def logits(self, hidden: torch.Tensor | Residual) -> torch.Tensor:
        """Full-vocabulary fp32 logits [n, V] of the last column of the last stage's `hidden` [s, n, h]."""
        return self.raw_logits(hidden)[:, : self.vocab_size].float()

    def raw_logits(self, hidden: torch.Tensor | Residual) -> torch.Tensor:
        """The output layer's logits [n, padded V] (its dtype) of the last column of the last stage's
        `hidden` [s, n, h] (or the static step's `Residual`, normed by the final norm already)."""
        last = self.models[-1]
        # Only the last column's logits are needed: norm and project [1, n, h], not the whole prefill.
        if isinstance(hidden, Residual):
            hidden = hidden.normed[-1:]
        else:
            hidden = hidden[-1:]
            if last.decoder.final_layernorm is not None:
                hidden = last.decoder.final_layernorm(hidden)
        weight = (
            last.shared_embedding_or_output_weight() if last.share_embeddings_and_output_weights else None
        )
        logits, _ = last.output_layer(hidden, weight=weight, runtime_gather_output=True)
        return logits[0]

    def _layer(
        self,
        layer: torch.nn.Module,
        hidden: torch.Tensor | Residual,
        kv: tuple[torch.Tensor, torch.Tensor],
        start: int | torch.Tensor,
        keys: int,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | StepKeys | None,
        mask_type: AttnMaskType,
        next_norm: torch.nn.Module | None = None,
    ) -> torch.Tensor | Residual:
        """megatron's TransformerLayer.forward (eval, no cross attention) with cached self-attention.

        The new keys/values go to cache columns `start` (an int: columns start.. of a slice; a 1-element
        device tensor: one column chosen on the device, as a CUDA graph needs) and the attention reads
        the first `keys` columns, or, given the static step's `StepKeys`, each row's own columns through
        `decode_attention`. With `next_norm` (the static step where the engine has `add_norm`) each residual
        add comes with the norm after it, and the layer returns a `Residual` normed by `next_norm`; `hidden`
        may be one, its input norm done.
        """
        cfg = layer.config
        attn = layer.self_attention
        if isinstance(hidden, Residual):
            residual, x = hidden.hidden, hidden.normed
        else:
            residual, x = hidden, layer.input_layernorm(hidden)
        if self.mla:
            causal = mask_type == AttnMaskType.causal
            out = mla_cache.cached_attention(attn, x, kv, start, keys, rope, mask, causal)
        else:
            query = self._attention_inputs(layer, x, kv, start, rope)
            if isinstance(mask, StepKeys):  # the static step with `decode_attention`: each row's own columns
                assert self.decode_attention is not None
                context = self.decode_attention(
                    query[0],
                    kv[0],
                    kv[1],
                    mask.masked,
                    mask.first,
                    mask.col,
                    attn.core_attention.softmax_scale,
                ).unsqueeze(0)
            else:
                context = attn.core_attention(
                    query, kv[0][:keys], kv[1][:keys], mask, attn_mask_type=mask_type
                )
            out = attn.linear_proj(context)
        if next_norm is None:
            return self._mlp(
                layer,
                layer.self_attn_bda(False, cfg.bias_dropout_fusion)(out, residual, layer.hidden_dropout),
            )
        assert self.add_norm is not None  # `_pick_add_norm`: no bias to add, every norm an RMSNorm
        norm = layer.pre_mlp_layernorm
        hidden, x = self.add_norm(out[0], residual, norm.weight, norm.eps)
        mlp_out, _ = self._mlp_out(layer, x)
        return Residual(*self.add_norm(mlp_out, hidden, next_norm.weight, next_norm.eps))

    def _attention_inputs(
        self,
        layer: torch.nn.Module,
        hidden: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        start: int | torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """The rotated query [s, n, heads, d] of `hidden` [s, n, h] (after the layer's input norm: megatron's
        QKV projection), its keys / values written into the cache at `start` (see `_layer`)."""
        attn = layer.self_attention
        args = self.fused_inputs.get(id(attn)) if isinstance(start, torch.Tensor) else None
        if args is not None:
            # One decode column: megatron's QKV projection (its bias deferred to the next function where
            # `_attention_input_args` gave one), then bias / split / norm / RoPE / cache write fused.
            with _bias_deferred(attn.linear_qkv, args[3] is not None):
                mixed, _ = attn.get_query_key_value_tensors(hidden, None, split_qkv=False)
            s, n = hidden.shape[:2]
            return self.attention_inputs(
                mixed.view(s * n, *mixed.shape[2:]), rope[0].view(s * n, 1, -1), rope[1].view(s * n, 1, -1),
                kv[0], kv[1], start, *args,
            ).view(s, n, -1, kv[0].shape[-1])  # fmt: skip
        query, key, value = attn.get_query_key_value_tensors(hidden, None)
        query = self.rotate(query, *rope)
        key = self.rotate(key, *rope)
        if isinstance(start, torch.Tensor):
            kv[0].index_copy_(0, start, key)
            kv[1].index_copy_(0, start, value)
        else:
            kv[0][start : start + hidden.shape[0]] = key
            kv[1][start : start + hidden.shape[0]] = value
        return query

    def _mlp(self, layer: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """The rest of megatron's TransformerLayer.forward after self-attention: norm, MLP, residual."""
        out = self._mlp_out(layer, layer.pre_mlp_layernorm(hidden))
        return layer.mlp_bda(False, layer.config.bias_dropout_fusion)(out, hidden, layer.hidden_dropout)

    def _mlp_out(self, layer: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's MLP (the static MoE path where `moe_static` has it) on its normed input: megatron's
        (output, bias)."""
        if id(layer.mlp) not in self.moe_static:
            return layer.mlp(x)
        out, index = moe_decode.moe_forward(
            layer.mlp, x, self.expert_weights, self.silent_routing, glue=self.moe_glue, route=self.moe_route
        )
        self.routing[layer.mlp.router.layer_number] = index
        return out

    def sample(
        self,
        logits: torch.Tensor | None,
        n: int,
        uniform: torch.Tensor,
        temperature: float,
        top_p: float,
        top_k: int,
        min_p: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample on the last stage (identically on its TP ranks); every stage gets (tokens, log-probs)."""
        packed = None
        if logits is not None:
            tok, lp = sample_tokens(logits, temperature, top_p, top_k, min_p, uniform=uniform)
            packed = torch.stack([tok.double(), lp.double()], 0)
        packed = self.actor.broadcast_from_last_stage(packed, (2, n), torch.float64)
        return packed[0].long(), packed[1].float()


# Cache columns per key-length bucket of the static decode step: attention reads the bucket holding the
# current length (unwritten columns masked), so one captured graph serves KEY_BUCKET consecutive steps.
KEY_BUCKET = 256
# A step over fewer rows reads wider buckets: KEY_BUCKET x (BUCKET_ROWS // rows) columns (at least
# KEY_BUCKET), so the columns it reads past the current length cost about what they cost at BUCKET_ROWS
# rows, while small row sets (a realistic rollout's tail, after compactions) capture fewer graphs. One H200,
# 1.5B: a capture costs 75-170 ms; a step over 64 rows 2.93 / 3.27 ms reading 256 / 1,088 columns.
BUCKET_ROWS = 256


def key_bucket(rows: int) -> int:
    """Cache columns per key-length bucket of a static decode step over `rows` rows."""
    return KEY_BUCKET * max(1, BUCKET_ROWS // max(rows, 1))


@dataclasses.dataclass(frozen=True)
class Residual:
    """The residual stream after a layer of the static step with `KVCacheGenerator.add_norm`: `hidden` and
    its RMSNorm by the norm after it (the next layer's input norm; the final norm after the last layer),
    both from one kernel."""

    hidden: torch.Tensor
    normed: torch.Tensor


@dataclasses.dataclass(frozen=True)
class StepKeys:
    """The keys a static decode step's rows see, for `decode_kernels.decode_attention`: `masked` [rows,
    max_len] (True = hidden), `first` [rows] each row's first visible column, `col` [1] the column written
    (all buffers of the step, read on the device)."""

    masked: torch.Tensor
    first: torch.Tensor
    col: torch.Tensor


CAPTURED: weakref.WeakKeyDictionary[Any, set[tuple[Any, ...]]] = weakref.WeakKeyDictionary()
"""Per actor, the signatures (rows, cache columns, key bucket, sampling, `KVCacheGenerator.code_path`) of the
static decode steps captured in this process (the first of each with its warm-up): a later capture of the same
signature skips the warm-up (`devices.capture_graph(warm_up=False)`). Lazy state of an engine (the MoE
layers' stacked expert weights) is built by its prefill, before any capture."""


class StaticDecodeStep:
    """The one-token decode step of a fixed set of cache rows with static shapes, optionally in CUDA graphs.

    Why: on a GPU an eager decode step of a 0.5B model is ~400 kernel launches and their Python, ~30 ms
    whatever the batch, while its math takes well under a millisecond; replaying a captured graph costs
    one launch. A graph replays fixed addresses and shapes, so every input lives in a buffer of this
    object (token, position, cache column, uniform draw) and the step reads whole buckets of
    `key_bucket(rows)` cache columns (wider for fewer rows): the key-padding mask `key_masked`
    [rows, max_len] (True = hidden) starts as the prompt pads plus every response column, and each step
    unmasks its own column on the device. One graph is
    captured per bucket the decode reaches, on first use, for this set of rows (compaction builds a new
    step over the new cache); where the engine has `decode_attention` (each row's own columns, read up to
    the column written) there are no buckets: one graph serves the row set's whole decode. Forward, logits and sampling are all inside the graph; sampling parameters
    are fixed per call (the temperature is a buffer, so one compiled sampler serves every temperature).
    The steps of one `generate` call (one per compaction) capture into one memory pool; a step a
    compaction replaced stays alive until the call ends (freeing its graphs would drop the pool's use
    count to 0, and capturing into it again trips the CUDA caching allocator's assert), so no graph
    memory outlives a rollout.

    Where the device layer has no graphs (cpu, npu) the same static-shape step runs eagerly (the CPU tests
    check it that way against the dynamic path). Pipeline parallel is not captured (the point-to-point
    sends would sit inside the graph); callers use the dynamic path there.
    """

    def __init__(
        self,
        engine: KVCacheGenerator,
        rows: torch.Tensor,
        key_masked: torch.Tensor,
        sampling: tuple[float, float, int, float],
        pool: object | None = None,
    ) -> None:
        dev = engine.device
        n = rows.numel()
        self.engine, self.rows, self.key_masked, self.sampling, self.pool = (
            engine,
            rows,
            key_masked,
            sampling,
            pool,
        )
        self.rows_cpu = rows.cpu()  # for a routing recorder (moe_replay.record_routing), copied once
        self.tokens = torch.zeros((n, 1), dtype=torch.long, device=dev)
        self.pos = torch.zeros((n, 1), dtype=torch.long, device=dev)
        self.col = torch.zeros((1,), dtype=torch.long, device=dev)
        # Each row's first visible column (past its prompt pads), for the kernel's loop; fixed for the step.
        self.first = (~key_masked).int().argmax(1)
        self.uniform = torch.zeros((n,), dtype=torch.float32, device=dev)
        # A buffer, not a constant: the compiled sampler then serves every temperature with one graph.
        self.temperature = torch.tensor(float(sampling[0]), dtype=torch.float32, device=dev)
        self.device = engine.actor.device  # the `cluster.device` name, for the device layer
        self.capture = devices.graphs_supported(self.device)
        self.graphs: dict[int, tuple[Any, tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]]] = {}
        # The last call's top-k experts per MoE layer [rows, k] (buffers the next call rewrites).
        self.routing: dict[int, torch.Tensor] = {}

    def _body(self, keys: int) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        engine = self.engine
        (model,) = engine.models  # one chunk, first and last stage (no pipeline parallel)
        self.key_masked.index_fill_(1, self.col, False)
        mask: torch.Tensor | StepKeys = self.key_masked[:, None, None, :keys]
        if engine.decode_attention is not None:
            mask = StepKeys(self.key_masked, self.first, self.col)
        elif engine.additive_mask:  # SDPA's own form, once per step (SdpaAttention converted it per layer)
            mask = torch.zeros(mask.shape, dtype=engine.config.params_dtype, device=mask.device).masked_fill_(
                mask, float("-inf")
            )
        rope = engine.rope_at(self.pos)
        hidden = model.embedding(input_ids=self.tokens, position_ids=self.pos)
        # A recorder attached to the routers would keep the capture's buffers: the step hands them out.
        engine.silent_routing, engine.routing = True, {}
        layers = model.decoder.layers
        # With `add_norm` each layer hands the next its input already normed (the last: the final norm).
        norms = (
            [*(layer.input_layernorm for layer in layers[1:]), model.decoder.final_layernorm]
            if engine.add_norm is not None
            else [None] * len(layers)
        )
        try:
            for layer, kv, norm in zip(layers, engine.cache[0], norms, strict=True):
                hidden = engine._layer(
                    layer, hidden, kv, self.col, keys, rope, mask, AttnMaskType.no_mask, norm
                )
        finally:
            engine.silent_routing = False
        temperature, top_p, top_k, min_p = self.sampling
        if (
            engine.fuse_step_glue
            and temperature > 0.0
            and not filtered_sampling(top_p, top_k, min_p, engine.vocab_size)
        ):
            # Straight from the output layer's logits (no fp32 copy of [rows, V] first).
            tok, lp = engine.sample_unfiltered(
                engine.raw_logits(hidden), engine.vocab_size, self.temperature, self.uniform
            )
        else:
            tok, lp = sample_tokens(engine.logits(hidden), *self.sampling, uniform=self.uniform)
        return tok, lp, dict(engine.routing)

    def __call__(
        self, tokens: torch.Tensor, start: int, uniform: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode `tokens` [n] at cache column `start`: (sampled tokens [n], their log-probs [n])."""
        self.tokens.copy_(tokens.view(-1, 1))
        self.pos.copy_(self.engine.positions[self.rows, start : start + 1])
        self.col.fill_(start)
        self.uniform.copy_(uniform)
        # `decode_attention` reads each row's own columns: one graph for the whole decode of these rows.
        width = self.key_masked.shape[1] if self.engine.decode_attention else key_bucket(self.rows.numel())
        keys = min(-(-(start + 1) // width) * width, self.key_masked.shape[1])
        if not self.capture:
            tok, lp, self.routing = self._body(keys)
            return tok, lp
        if keys not in self.graphs:
            # The warm-up and the capture both run the real step on the real buffers; it is idempotent: it
            # rewrites this column's keys/values and mask bit. A step of shapes and code an earlier capture
            # of this actor met (every rollout after a run's first one, each compaction included) skips the
            # warm-up: its functions are compiled and its kernels loaded for exactly these shapes.
            signature = (
                self.rows.numel(),
                self.key_masked.shape[1],
                keys,
                self.sampling,
                self.engine.code_path(),
            )
            seen = CAPTURED.setdefault(self.engine.actor, set())
            warm_up = signature not in seen
            self.graphs[keys] = devices.capture_graph(
                self.device, lambda: self._body(keys), self.pool, warm_up=warm_up
            )
            seen.add(signature)
        graph, (tok, lp, self.routing) = self.graphs[keys]
        graph.replay()
        return tok, lp


@torch.no_grad()
def generate_with_kv_cache(
    actor,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    min_p: float = 0.0,
    eos_id: int | None = None,
    pad_id: int = 0,
    stop_token_ids: Sequence[int] = (),
    seed: int = 0,
    static_decode: bool = False,
    session: KVSession | None = None,
    row_ids: Sequence[int] | None = None,
    row_seeds: Sequence[int] | None = None,
) -> dict[str, torch.Tensor]:
    """Sample up to `max_new_tokens` per row with a KV cache; the batch layout of `MegatronActor.generate`.

    prompt_ids [B, P] left or right padded (`prompt_mask` 1 on real tokens; default prompt_ids != pad_id).
    Returns CPU tensors, identical on every rank: `input_ids`, `attention_mask`, `position_ids` [B, P + N]
    (prompt left-padded, response right-padded), `responses`, `response_mask`, `rollout_log_probs` [B, N].

    `static_decode`: decode through `StaticDecodeStep`, captured in CUDA graphs on a CUDA device (eager
    elsewhere); without pipeline parallel only (with it the dynamic path runs). Same tokens as the dynamic
    path up to the rounding of a different attention kernel.

    `row_seeds` (one per row): row i draws its uniforms from its own stream seeded with row_seeds[i]
    instead of column i of the call's stream `seed`, so its tokens do not depend on which other rows share
    the call (multi-turn rows join and leave calls as their tools finish).
    `session` with `row_ids` (a multi-turn rollout, rltrain/rollout/agent.py): the rows' cached
    keys/values of earlier calls are reused: each context is taken from the session as far as it holds it
    and only the rest is prefilled (`KVSession`), and what this call computed is held for the next call.
    The layout is the same as without a session (contexts right-aligned, the same positions), so the
    result equals a call without one up to rounding (the cached prefix was computed in other batch shapes).
    """
    reason = kv_cache_unsupported(actor)
    if reason is not None:
        raise NotImplementedError(f"KV-cache generation does not support {reason}")
    if prompt_mask is None:
        prompt_mask = (prompt_ids != pad_id).long()
    prompt_ids, prompt_mask = prompt_ids.cpu(), prompt_mask.cpu().long()
    b, p = prompt_ids.shape
    n_new = max_new_tokens
    left, left_mask = left_pad(prompt_ids, prompt_mask, pad_id)
    stops = sorted(set(stop_token_ids) | ({eos_id} if eos_id is not None else set()))
    responses = torch.full((b, n_new), pad_id, dtype=torch.long)
    resp_mask = torch.zeros((b, n_new), dtype=torch.long)
    logps = torch.zeros((b, n_new), dtype=torch.float32)
    # megatron's MoELayer sizes its expert batches on the host (shapes a captured graph cannot replay):
    # MoE models decode statically only on the engine's own MoE layers (rltrain/megatron/moe_decode.py).
    static = (
        static_decode
        and parallel_state.get_pipeline_model_parallel_world_size() == 1
        and static_moe_unsupported(actor) is None
    )
    if n_new > 0 and b > 0:
        # Training's positions: 0 at each row's first real token (pads clamp to 0; they are masked).
        cols = torch.arange(p + n_new)
        lengths = left_mask.sum(-1)
        positions = (cols.unsqueeze(0) - (p - lengths).unsqueeze(1)).clamp(min=0)
        if row_seeds is not None:
            uniform = torch.stack(
                [torch.rand(n_new, generator=torch.Generator().manual_seed(int(s))) for s in row_seeds], 1
            )
        else:
            # One uniform per batch row per step, drawn up front (the same numbers as one draw per step).
            uniform = torch.rand((n_new, b), generator=torch.Generator().manual_seed(seed))
        reuse = None
        if session is not None:
            assert row_ids is not None and len(row_ids) == b
            ids = [int(r) for r in row_ids]
            contexts = [left[i, p - int(lengths[i]) :].tolist() for i in range(b)]
            new_tokens = [len(c) - session.reusable(r, c) for r, c in zip(ids, contexts, strict=True)]
            # One prefill block for every row: the last `s` columns (a row with less new context recomputes
            # some cached columns in it); the columns before it come from the session.
            s = max(new_tokens)
            session.reused_tokens += sum(max(len(c) - s, 0) for c in contexts)
            session.prefilled_tokens += sum(min(len(c), s) for c in contexts)
            reuse = (session, ids, contexts, p - s)
        with actor._ctx(), sequence_parallel_off(actor.modules()), generation_weights(actor):
            actor.eval()
            engine = KVCacheGenerator(
                actor, positions.to(actor.torch_device), zero_cache=static or session is not None
            )
            harvest = _decode(
                engine, left, left_mask, responses, resp_mask, logps, stops, uniform,
                (temperature, top_p, top_k, min_p), static, reuse, forced_lengths(b, n_new, seed),
            )  # fmt: skip
            if reuse is not None:
                generated = [responses[i][resp_mask[i].bool()].tolist() for i in range(b)]
                reuse[0].store(harvest, reuse[1], reuse[2], p, generated)
        if static:
            # Captures no longer empty the allocator's cache (devices.capture_graph); blocks the warm-ups
            # left cached for the capture stream would stay out of the training passes' reach (a stream's
            # cached blocks serve that stream only), so they go back once per rollout.
            devices.empty_cache(actor.device)
    elif session is not None and row_ids is not None:
        session.drop(list(row_ids))  # nothing generated: nothing to hold (the next call prefills them)
    return rollout_batch(left, left_mask, responses, resp_mask, logps)


class HostCount:
    """A count on the device read on the host one step later without stalling: `write` queues a copy into
    pinned host memory and records an event; `read` waits for that event only (the device is by then
    running the next step) and returns the value."""

    def __init__(self, device: torch.device, event: Any) -> None:
        self.event = event  # None on cpu: the copy is synchronous there
        self.host = torch.zeros((), dtype=torch.long, pin_memory=device.type == "cuda")

    def write(self, count: torch.Tensor) -> None:
        self.host.copy_(count, non_blocking=True)
        if self.event is not None:
            self.event.record()

    def read(self) -> int:
        if self.event is not None:
            self.event.synchronize()
        return int(self.host)


def _decode(
    engine: KVCacheGenerator,
    left: torch.Tensor,
    left_mask: torch.Tensor,
    responses: torch.Tensor,
    resp_mask: torch.Tensor,
    logps: torch.Tensor,
    stops: list[int],
    uniform: torch.Tensor,
    sampling: tuple[float, float, int, float],
    static: bool,
    reuse: tuple[KVSession, list[int], list[list[int]], int] | None = None,
    forced: torch.Tensor | None = None,
) -> list[tuple[torch.Tensor, list[list[tuple[torch.Tensor, torch.Tensor]]]]]:
    """The generation loop; fills responses / resp_mask / logps (CPU, [B, N]) in place.

    `reuse` (session, row ids, contexts, first prefill column): load columns before it from the session
    and prefill from there. Returns, with `reuse`, the cache rows of every batch row, harvested before
    compaction drops them and at the end: [(batch rows, per chunk and layer (keys, values))]."""
    dev = engine.device
    b, p = left.shape
    n_new = responses.shape[1]
    stop_t = torch.tensor(stops, dtype=torch.long, device=dev)
    valid = left_mask.bool().to(dev)
    padded = not bool(valid.all())
    uniform = uniform.to(dev)
    harvest: list[tuple[torch.Tensor, list[list[tuple[torch.Tensor, torch.Tensor]]]]] = []
    logits = _prefill(engine, left, left_mask, valid, reuse)
    active = torch.arange(b, device=dev)  # the batch row of each cache row
    tok, lp = engine.sample(logits, b, uniform[0], *sampling)
    step = None
    if static:
        # Keys a row may not see: its prompt pads and every response column not yet written.
        key_masked = torch.ones((b, engine.positions.shape[1]), dtype=torch.bool, device=dev)
        key_masked[:, :p] = ~valid
        step = StaticDecodeStep(engine, active, key_masked, sampling, devices.graph_pool(engine.actor.device))
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    last_tok = torch.zeros(b, dtype=torch.long, device=dev)
    resp_dev = torch.zeros((b, n_new), dtype=torch.long, device=dev)
    lp_dev = torch.zeros((b, n_new), dtype=torch.float32, device=dev)
    mask_dev = torch.zeros((b, n_new), dtype=torch.bool, device=dev)
    forced_dev = forced.to(dev) if forced is not None and stops else None
    live_count = HostCount(dev, devices.new_event(engine.actor.device))
    retired: list[StaticDecodeStep] = []  # steps before a compaction: their graphs hold the shared pool
    for t in range(n_new):
        if forced_dev is not None:  # FORCE_EOS_ENV (benchmarks): the row's stop token at its drawn length
            tok = torch.where(forced_dev[active] == t + 1, stop_t[0], tok)
        # Writes through integer indices and masks, not boolean indexing (which syncs with the device).
        live = ~done[active]
        resp_dev[active, t] = torch.where(live, tok, 0)
        lp_dev[active, t] = torch.where(live, lp, 0.0)
        mask_dev[active, t] = live
        last_tok[active] = tok
        if t == n_new - 1:
            break
        if stops:
            done[active] = ~live | torch.isin(tok, stop_t)
            still = ~done[active]
            # How many rows still run: exact after the first sample (rows that stop at once never enter a
            # decode step); after that the previous step's count, copied to the host while the device runs
            # this step, so the host never waits for the device between steps (a row that stops costs at
            # most one more step before compaction or the exit sees it).
            n_live = int(still.sum()) if t == 0 else live_count.read()
            live_count.write(still.sum())
            if n_live == 0:
                break
            target = compacted_rows(n_live, b)
            if target < active.numel() and _compaction_pays(step, active.numel() - target, n_new - 1 - t):
                # Drop finished rows from the cache (a copy of it; at most ~2 log2(B) times per call).
                if not bool(still.any()):  # every row stopped in the step the count had not seen
                    break
                # The count is the last step's, so at least the exact one: the row count the static step
                # rounds up to stays below the rows it has.
                kept = still if step is None else _ladder_rows(still)
                keep = kept.nonzero().squeeze(1)
                if reuse is not None:  # the session holds the leaving rows' keys/values
                    gone = (~kept).nonzero().squeeze(1)
                    harvest.append((active[gone], [[(k.index_select(1, gone), v.index_select(1, gone))
                                                    for k, v in c] for c in engine.cache]))  # fmt: skip
                engine.select_rows(keep)
                active = active[keep]
                if step is not None:
                    # New cache tensors: a new step with its own buffers and graphs, in the same pool (the
                    # old step stays alive until the call ends, so the pool's use count never drops to 0,
                    # which would trip the CUDA caching allocator's `use_count > 0` assert on the next
                    # capture into it).
                    retired.append(step)
                    step = StaticDecodeStep(engine, active, step.key_masked[keep], sampling, step.pool)
        if step is not None:
            tok, lp = step(last_tok[active], p + t, uniform[t + 1, active])
            continue
        # Keys of this step: the prompt (pads hidden), the response so far and the new token.
        mask = None
        if padded:
            key_valid = torch.ones((active.numel(), p + t + 1), dtype=torch.bool, device=dev)
            key_valid[:, :p] = valid[active]
            mask = ~key_valid[:, None, None, :]
        logits = engine.forward(last_tok[active].unsqueeze(1), p + t, active, mask)
        tok, lp = engine.sample(logits, int(active.numel()), uniform[t + 1, active], *sampling)
    # A row's response is every token sampled up to and including its stop token; the rest stays padding.
    filled = mask_dev.cpu()
    responses.copy_(torch.where(filled, resp_dev.cpu(), responses))
    resp_mask.copy_(filled.long())
    logps.copy_(torch.where(filled, lp_dev.cpu(), logps))
    if reuse is not None:
        harvest.append((active, engine.cache))
    return harvest


def compacted_rows(live: int, rows: int) -> int:
    """The rows a decode batch keeps once `live` of its rows still run: the smallest size of the ladder
    1, 2, 3, 4, 6, 8, 12, ... (powers of two and 1.5 times them) holding them, at most all `rows`; a batch
    compacts when that is fewer rows than it has. Why a ladder of 1.5x steps: a step's cost grows with its
    rows (on the H200, 1.5B: ~2 ms plus ~12 us a row at 768 columns), so halving only when half the rows
    finished keeps up to half of a batch's rows idle, while each compaction costs a cache copy and a graph
    capture (75-170 ms); a cost model of the benchmark's realistic rollout put the 1.5x ladder ~2% ahead of
    powers of two (bench/decode_tail_gpu.py measures the rollout)."""
    if live <= 1:
        return min(live, rows)
    power = 1 << (live - 1).bit_length()  # the power of two at or above live
    size = power * 3 // 4 if live <= power * 3 // 4 else power
    return min(size, rows)


# A captured decode compacts only where the row-steps it saves reach this: the rows it drops times the steps
# left at most. A compaction costs a cache copy and a graph capture (~45 ms for a shape met before, one H200,
# 1.5B), a row-step ~12 us of the step there, so near the end of the token budget (a realistic rollout's
# long tail) a compaction costs more than its remaining steps save.
COMPACTION_ROW_STEPS = 4096


def _compaction_pays(step: StaticDecodeStep | None, dropped: int, steps_left: int) -> bool:
    """Whether a decode compacts, dropping `dropped` rows with `steps_left` steps at most to go: always where
    the step has captured no graph (without graphs, or before its first capture, a compaction costs only its
    copy), else where the rows dropped times the steps left reach COMPACTION_ROW_STEPS."""
    if step is None or not step.capture or not step.graphs:
        return True
    return dropped * steps_left >= COMPACTION_ROW_STEPS


def _ladder_rows(still: torch.Tensor) -> torch.Tensor:
    """The rows a compaction of the static step keeps: the running ones (`still`), plus as many finished
    ones (first in row order) as make their count `compacted_rows`'s. Their decode steps then have the same
    shapes in every rollout of a process: compiled functions, cuDNN's attention plans and cuBLAS's
    heuristics meet no new row count after the first rollout (a capture after a compaction cost 140-170 ms
    on the H200 against 60-85 ms for a shape seen before). A finished row kept costs its share of the
    step; its tokens are not written (`done`)."""
    n = int(still.sum())
    extra = compacted_rows(n, still.numel()) - n
    if extra <= 0:
        return still
    kept = still.clone()
    kept[(~still).nonzero().squeeze(1)[:extra]] = True
    return kept


def _prefill(
    engine: KVCacheGenerator,
    left: torch.Tensor,
    left_mask: torch.Tensor,
    valid: torch.Tensor,
    reuse: tuple[KVSession, list[int], list[list[int]], int] | None,
) -> torch.Tensor | None:
    """Fill the cache with the prompts (the columns a session does not hold) and return the logits of the
    last prompt position of every batch row (None off the last pipeline stage)."""
    dev = engine.device
    b, p = left.shape
    c0 = reuse[3] if reuse is not None else 0
    if c0 > 0:
        assert reuse is not None
        engine._allocate(b)
        lengths = [len(c) for c in reuse[2]]
        reuse[0].load(engine, reuse[1], lengths, p, c0)
        return engine.forward(left[:, c0:].to(dev), c0, torch.arange(b, device=dev), block_mask(valid, c0))
    # Prefill each distinct prompt once; duplicate rows (rollout.n samples) copy its cache rows.
    uniq, inverse = unique_rows(left, left_mask)
    uniq, inverse = uniq.to(dev), inverse.to(dev)
    logits = engine.forward(left.to(dev)[uniq], 0, uniq, prefill_mask(valid[uniq]))
    if uniq.numel() != b:
        engine.select_rows(inverse)
        logits = logits[inverse] if logits is not None else None
    return logits


__all__ = [
    "FORCE_EOS_ENV",
    "KVCacheGenerator",
    "KVSession",
    "StaticDecodeStep",
    "block_mask",
    "forced_lengths",
    "generate_with_kv_cache",
    "inverse_cdf",
    "kv_cache_unsupported",
    "left_pad",
    "prefill_mask",
    "sample_tokens",
    "sample_unfiltered",
    "sequence_parallel_off",
    "static_moe_unsupported",
    "unique_rows",
]
