"""The embedded rollout engine: batched sampling with a KV cache on the actor's own megatron weights.

Role: `MegatronActor.generate` (colocated rollout, no weight copy) routes here. The prompts are prefilled
once (identical prompts, e.g. the `rollout.n` copies of a GRPO group, only once: their cache rows are
copied), then one token per step is decoded against the cached keys/values. Sampling: temperature (0 is
greedy), top-k, top-p, min-p, stop on EOS + `rollout.stop_token_ids`, at most `max_new_tokens`, early exit
once every row is done, and finished rows leave the decode batch (the cache is compacted when at most
half of its rows are still running). Each sampled token comes with its log-prob under the
temperature-scaled distribution before filtering (`rollout_log_probs`), which is what `compute_log_prob`
recomputes at the same temperature.

Design (issue 5 item 5; the two candidates were measured, numbers from bench/rollout_cpu.py on this 2-core
CPU, fp32, the actor and no-cache path of the same weights):

  (1) megatron-core's own static inference path: `StaticInferenceContext` passed as `inference_context` to
      `GPTModel.forward`. megatron's `Attention` appends this step's keys/values to a preallocated
      [max_seq, batch, groups, dim] buffer per layer, re-applies RoPE to the cached keys and hands the
      whole prefix to our core attention; the model only materialises the last position's logits.
  (2) our own KV cache around the megatron modules (re-implementing the layer loop: norm, qkv, RoPE with
      per-row positions, cache, attention, projection, MLP), caching keys after RoPE.

  Chosen: (1). It reuses the unmodified megatron modules (TP, PP, GQA, qkv bias, any layer spec), so a
  change of architecture or megatron version cannot make the rollout disagree with training; (2) copies
  megatron's layer internals. The one thing (2) saves is re-rotating the cached keys every step; measured
  with the prototype in the bench, (2) was within a few percent of (1) at these sizes (both 5-20x the
  no-cache path, see the bench and the report), because the projections and MLP dominate a decode step
  and the cached-key RoPE is elementwise work of the same order as attention itself.

  What (1) needs from us: `SdpaAttention` (model.py) takes the query shorter than the keys (decode: no
  mask, or a bottom-right causal mask; SDPA's `is_causal` is top-left aligned), and left-padded prompts get
  an explicit mask: causal, pad keys hidden, and every pad query sees itself (a fully masked row gives NaN
  in SDPA, and NaN values poison even masked attention through 0 * NaN). megatron's RoPE uses the column
  index as position, so a row with k pad columns is rotated k positions further than in training's
  left-aligned layout; rotary attention only depends on position differences, so the scores agree (to
  rounding; the tests check greedy tokens identical to the no-cache path and log-probs against
  `compute_log_prob`).

Parallelism: every TP rank runs the same steps; logits are all-gathered over TP (`runtime_gather_output`)
and every rank samples with the same seeded generator, drawing one uniform per row per step for all B rows
whether active or not (so sampling is independent of compaction and the draws are the same as the no-cache
path's). PP (and virtual PP) runs its own forward-only pass per step through the stages (point-to-point of
the [s, b, h] hidden state: megatron's interleaved schedule wants >= PP micro-batches, and one decode step
is one micro-batch); the last stage samples and broadcasts (token, log-prob) to the other stages. Sequence
parallel is switched off on the modules during generation (one decode token cannot be split over TP ranks,
megatron's own inference does the same) and restored after. Context parallel is not supported here
(`MegatronActor.generate` falls back to the no-cache path).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.utils import get_attr_wrapped_model

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
    same logits and uniforms picks the same tokens.
    """
    logits = logits.float()
    if uniform is None:
        uniform = torch.rand(logits.shape[0], generator=generator)
    if temperature <= 0.0:
        tok = logits.argmax(-1)
        return tok, torch.log_softmax(logits, -1).gather(1, tok[:, None]).squeeze(1)
    scaled = logits / temperature
    logp_all = torch.log_softmax(scaled, -1)
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
        top = filtered.max(-1, keepdim=True).values
        filtered = filtered.masked_fill(filtered < top + torch.log(torch.tensor(min_p)), float("-inf"))
    probs = torch.softmax(filtered, -1)
    cdf = probs.cumsum(-1)
    u = uniform.to(cdf.device, cdf.dtype).view(-1, 1)
    # right=True: the first index whose cdf exceeds the draw, which never lands on a zero-probability token.
    tok = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp(max=vocab - 1)
    return tok, logp_all.gather(1, tok[:, None]).squeeze(1)


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


@contextlib.contextmanager
def sequence_parallel_off(modules: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Run with sequence parallel off on every (sub)module and the shared config; restore the exact values."""
    saved: list[tuple[object, str, object]] = []
    for model in modules:
        config = getattr(model, "config", None)
        if config is not None and getattr(config, "sequence_parallel", False):
            saved.append((config, "sequence_parallel", True))
        for sub in model.modules():
            for attr in _SP_ATTRS:
                if getattr(sub, attr, None) is True:
                    saved.append((sub, attr, True))
    for obj, attr, _ in saved:
        setattr(obj, attr, False)
    try:
        yield
    finally:
        for obj, attr, value in saved:
            setattr(obj, attr, value)


def _unique_rows(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of distinct prompts and, per row, which distinct prompt it is (rows in first-seen order)."""
    key = torch.cat([ids, mask], 1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    # First occurrence of each distinct row, ordered by row index (keeps the prefill deterministic).
    n = int(inverse.max()) + 1 if inverse.numel() else 0
    first = torch.full((n,), ids.shape[0], dtype=torch.long, device=ids.device)
    first = first.scatter_reduce(0, inverse, torch.arange(ids.shape[0], device=ids.device), "amin")
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(n, device=ids.device)
    return first[order], rank[inverse]


# ------------------------------------------------------------------------------------ the engine
class KVCacheGenerator:
    """Prefill + cached decode through this rank's model chunks (all PP stages, virtual stages in turn)."""

    def __init__(self, actor) -> None:
        self.actor = actor
        self.chunks = actor.chunks
        self.device = actor.torch_device
        self.vocab_size = actor.vocab_size
        cfg = actor.config
        self.hidden_size = cfg.hidden_size
        self.pipe_dtype = cfg.pipeline_dtype or cfg.params_dtype
        self.pp = parallel_state.get_pipeline_model_parallel_world_size()
        self.vpp = len(self.chunks)

    def forward(
        self, tokens: torch.Tensor, mask: torch.Tensor | None, ctx: StaticInferenceContext
    ) -> torch.Tensor | None:
        """Logits [n, V] at the last position of every row (last stage), None on other stages."""
        n, s = tokens.shape
        positions = (ctx.sequence_len_offset + torch.arange(s, device=self.device)).expand(n, s)
        out = None
        for v, chunk in enumerate(self.chunks):
            vp = v if self.vpp > 1 else None
            first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp)
            last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
            if not first:
                hidden = torch.empty((s, n, self.hidden_size), dtype=self.pipe_dtype, device=self.device)
                torch.distributed.recv(
                    hidden,
                    src=parallel_state.get_pipeline_model_parallel_prev_rank(),
                    group=parallel_state.get_pipeline_model_parallel_group(),
                )
                get_attr_wrapped_model(chunk, "set_input_tensor")(hidden)
            out = chunk(
                input_ids=tokens,
                position_ids=positions,
                attention_mask=mask,
                inference_context=ctx,
                runtime_gather_output=True,
            )
            if not last:
                torch.distributed.send(
                    out.contiguous(),
                    dst=parallel_state.get_pipeline_model_parallel_next_rank(),
                    group=parallel_state.get_pipeline_model_parallel_group(),
                )
        if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            return None
        assert out is not None
        return out[:, -1, : self.vocab_size].float()

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
) -> dict[str, torch.Tensor]:
    """Sample up to `max_new_tokens` per row with a KV cache; the batch layout of `MegatronActor.generate`.

    prompt_ids [B, P] left or right padded (`prompt_mask` 1 on real tokens; default prompt_ids != pad_id).
    Returns CPU tensors, identical on every rank: `input_ids`, `attention_mask`, `position_ids` [B, P + N]
    (prompt left-padded, response right-padded), `responses`, `response_mask`, `rollout_log_probs` [B, N].
    """
    if prompt_mask is None:
        prompt_mask = (prompt_ids != pad_id).long()
    prompt_ids, prompt_mask = prompt_ids.cpu(), prompt_mask.cpu().long()
    b = prompt_ids.shape[0]
    n_new = max_new_tokens
    left, left_mask = left_pad(prompt_ids, prompt_mask, pad_id)
    stops = sorted(set(stop_token_ids) | ({eos_id} if eos_id is not None else set()))
    responses = torch.full((b, n_new), pad_id, dtype=torch.long)
    resp_mask = torch.zeros((b, n_new), dtype=torch.long)
    logps = torch.zeros((b, n_new), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    if n_new > 0 and b > 0:
        with actor._ctx(), sequence_parallel_off(actor.modules()):
            actor.eval()
            engine = KVCacheGenerator(actor)
            _decode(
                engine,
                left,
                left_mask,
                responses,
                resp_mask,
                logps,
                stops,
                gen,
                temperature,
                top_p,
                top_k,
                min_p,
            )
    attention_mask = torch.cat([left_mask, resp_mask], 1)
    return {
        "input_ids": torch.cat([left, responses], 1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": responses,
        "response_mask": resp_mask,
        "rollout_log_probs": logps,
    }


def _decode(
    engine: KVCacheGenerator,
    left: torch.Tensor,
    left_mask: torch.Tensor,
    responses: torch.Tensor,
    resp_mask: torch.Tensor,
    logps: torch.Tensor,
    stops: list[int],
    gen: torch.Generator,
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float,
) -> None:
    """The generation loop; fills responses / resp_mask / logps (CPU, [B, N]) in place."""
    dev = engine.device
    b, p = left.shape
    n_new = responses.shape[1]
    stop_t = torch.tensor(stops, dtype=torch.long, device=dev)
    valid = left_mask.bool().to(dev)
    padded = not bool(valid.all())
    # Prefill each distinct prompt once; duplicate rows (rollout.n samples) copy its cache rows.
    uniq, inverse = _unique_rows(left, left_mask)
    uniq, inverse = uniq.to(dev), inverse.to(dev)
    ctx = StaticInferenceContext(max_batch_size=int(uniq.numel()), max_sequence_length=p + n_new)
    logits = engine.forward(left.to(dev)[uniq], prefill_mask(valid[uniq]), ctx)
    ctx.sequence_len_offset += p
    if uniq.numel() != b:
        _select_cache_rows(ctx, inverse)
        logits = logits[inverse] if logits is not None else None
    active = torch.arange(b, device=dev)  # batch row of each cache row
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    tok_dev = torch.zeros(b, dtype=torch.long, device=dev)
    resp_dev = torch.zeros((b, n_new), dtype=torch.long, device=dev)
    lp_dev = torch.zeros((b, n_new), dtype=torch.float32, device=dev)
    mask_dev = torch.zeros((b, n_new), dtype=torch.bool, device=dev)
    for t in range(n_new):
        # One uniform per batch row every step: samples do not depend on which rows are still decoding.
        u = torch.rand(b, generator=gen).to(dev)
        tok, lp = engine.sample(logits, int(active.numel()), u[active], temperature, top_p, top_k, min_p)
        live = ~done[active]
        rows = active[live]
        resp_dev[rows, t] = tok[live]
        lp_dev[rows, t] = lp[live]
        mask_dev[rows, t] = True
        tok_dev[active] = tok
        if stops:
            done[rows] = torch.isin(tok[live], stop_t)
        if t == n_new - 1 or bool(done.all()):
            break
        still = ~done[active]
        if int(still.sum()) * 2 <= active.numel():
            # Drop finished rows from the cache (a copy of the cache; at most log2(B) times per call).
            keep = still.nonzero().squeeze(1)
            _select_cache_rows(ctx, keep)
            active = active[keep]
        # Keys of this decode step: the prompt (pads hidden) + every response token so far + the new one.
        k_len = p + t + 1
        mask = None
        if padded:
            key_valid = torch.ones((active.numel(), k_len), dtype=torch.bool, device=dev)
            key_valid[:, :p] = valid[active]
            mask = ~key_valid[:, None, None, :]
        logits = engine.forward(tok_dev[active].unsqueeze(1), mask, ctx)
        ctx.sequence_len_offset += 1
    # A row's response is every token sampled up to and including its stop token; the rest stays padding.
    filled = mask_dev.cpu()
    responses.copy_(torch.where(filled, resp_dev.cpu(), responses))
    resp_mask.copy_(filled.long())
    logps.copy_(torch.where(filled, lp_dev.cpu(), logps))


def _select_cache_rows(ctx: StaticInferenceContext, rows: torch.Tensor) -> None:
    """Keep (or repeat) cache rows: row i of the new cache is row `rows[i]` of the old one."""
    for layer, (k, v) in list(ctx.key_value_memory_dict.items()):
        ctx.key_value_memory_dict[layer] = (k.index_select(1, rows), v.index_select(1, rows))
    ctx.max_batch_size = int(rows.numel())


__all__ = ["KVCacheGenerator", "generate_with_kv_cache", "left_pad", "prefill_mask", "sample_tokens"]
