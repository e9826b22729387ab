"""The plan's memory estimate: per device, per pool and phase, from the layouts, batches and models."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from rlconf.config import (
    ModelArch,
    OverrideTransformerConfig,
    RLConfig,
)
from rlconf.lora import COLUMN_PARALLEL, LoraPlan, part_dims, stage_adapter_params
from rlconf.model_spec import (
    head_dim,
    is_moe_layer,
    kv_cache_width,
    layer_params,
)
from rlconf.plan.compile import Models, cdiv
from rlconf.plan.engine import fused_kernels
from rlconf.plan.roles import forward_batching, megatron_of, rollout_resharded, rollout_tp
from rlconf.plan.types import (
    DTYPE_BYTES,
    GIB,
    BatchPlan,
    MemoryPart,
    MemoryPlan,
    ModelSpec,
    PhaseMemory,
    Pool,
    PoolMemory,
    Resources,
    RoleLayout,
    RoleMemory,
    RolloutRefit,
    StageLayers,
    by_role,
)


# ============================================================================================ memory
@dataclass(frozen=True)
class _StageMem:
    """Bytes one role needs on one device at one pipeline stage."""

    params: int
    param_bytes: float
    grad_bytes: float
    optim_bytes: float
    act_bytes: float
    logits_train: float
    """The update's 16-bit [tokens, V/tp] logits (saved by the log-prob function) and their gradient."""
    logits_infer: float
    """A forward-only pass's logits [s, b, V/tp] (with sequence parallel also GPTModel's [b, s, V/tp] copy)."""
    in_flight: int
    tokens: int
    logprob_chunk: float = 0.0
    """The log-prob backward's chunk working set, on top of logits_train (`_logprob_chunk_bytes`)."""
    rollout_kv: float = 0.0
    """Embedded rollout's KV cache during generate_sequences (actor only; 0 for other roles)."""
    rollout_weights: float = 0.0
    """The resharded rollout's own weights + one refit bucket during generate_sequences (actor only)."""
    rollout_sampling: float = 0.0
    """The decode step's [rows, V] logits and sampling temporaries (actor only, last stage)."""
    rollout_experts: float = 0.0
    """The embedded engine's stacked copy of this stage's routed expert weights (rltrain/megatron/moe_decode.py:
    MoE at ep = etp = 1), held for one generate_sequences call."""
    rollout_kv_compaction: float = 0.0
    """One layer's keys and values: what compacting the KV cache holds on top of it (the engine replaces the
    cache a layer at a time, rltrain/megatron/inference.py KVCacheGenerator.select_rows)."""
    infer_stacks: float = 0.0
    """Grouped-GEMM experts' stacked weights of every MoE layer of the stage, held for a whole forward-only
    pass (rltrain/megatron/moe_experts.py cached_expert_stacks; not where megatron recomputes the MoE layer,
    which stacks per call)."""


@dataclass(frozen=True)
class _RoleMemModel:
    role: str
    trained: bool
    offload: tuple[bool, bool, bool]  # params, grads, optimizer
    stages: tuple[_StageMem, ...]
    infer_phase: str


def _stage_expert_params(arch: ModelArch, lay: RoleLayout, stage: StageLayers) -> int:
    """The routed experts' share of `_stage_params` (num_moe_experts / ep experts per rank, sharded by etp):
    the distributed optimizer shards their state over the expert-data-parallel group, not dp x cp."""
    moe_layers = sum(
        is_moe_layer(arch, layer) for ch in stage.chunks for layer in range(ch.first_layer, ch.first_layer + ch.num_layers)
    )  # fmt: skip
    return moe_layers * cdiv(layer_params(arch, True).experts, lay.ep * lay.etp)


def _stage_params(arch: ModelArch, lay: RoleLayout, stage: StageLayers, head: str) -> int:
    """Parameters one rank of `stage` holds: tp shards of attention and dense MLPs, routed experts split
    over ep x etp ranks (num_moe_experts / ep experts, each sharded by etp), replicated norms and router."""
    tp = lay.tp
    moe_layers = sum(
        is_moe_layer(arch, layer) for ch in stage.chunks for layer in range(ch.first_layer, ch.first_layer + ch.num_layers)
    )  # fmt: skip
    n = 0
    for moe, count in ((True, moe_layers), (False, stage.num_layers - moe_layers)):
        p = layer_params(arch, moe)
        n += count * (cdiv(p.tp_sharded, tp) + p.replicated + cdiv(p.experts, lay.ep * lay.etp))
    emb = lay.padded_vocab_size * arch.hidden_size // tp
    if stage.embedding:
        n += emb
    if stage.output_layer:
        n += arch.hidden_size  # final norm
        if head == "value":
            n += arch.hidden_size  # value head: hidden -> 1
        elif not arch.share_embeddings_and_output_weights or lay.pp > 1:
            # Tied embeddings with pp > 1: megatron keeps a copy of the embedding on the last stage.
            n += emb
    return n


@dataclass(frozen=True)
class _LayerActs:
    """What one transformer layer keeps for its backward, in bytes (per token, plus per layer)."""

    norms: float
    """Per token: the two RMSNorm inputs (the residual stream) and outputs (the inputs of linear_qkv and
    linear_fc1); split by tp only with sequence parallel."""
    attention: float
    """Per token: megatron's linear_qkv output (kept whole: `value` is a view of it and SDPA saves it), the
    rotated query and key (RoPE's outputs, saved by SDPA), SDPA's output and its [s, b, h] copy (the
    input linear_proj saves); with QK-norm also the query norm's input (a copy of the split)."""
    mlp: float
    """Per token: dense SwiGLU: linear_fc1's output [2f] and linear_fc2's input [f], plus the silu output [f]
    when the SwiGLU is unfused (eager; the fused kernel's backward recomputes it from fc1's output). Routed
    experts: the top-k permuted token copies [k h] and each copy's fc1 output [k 2f_e] (plus, unfused
    sequential experts, the silu output and product [k 2f_e]); a shared expert like a dense MLP."""
    per_layer: float = 0.0
    """Not per token: grouped-GEMM experts stack the layer's local expert weights (fc1 and fc2), saved for
    the backward: once per mini-batch for all micro-batches in flight (held until the mini-batch's last
    backward), or per call under full recompute (one layer re-materialised at a time)."""

    @property
    def per_token(self) -> float:
        return self.norms + self.attention + self.mlp


def _layer_activations(
    arch: ModelArch, lay: RoleLayout, ov: OverrideTransformerConfig, elem: int, moe: bool, fused: bool,
    grouped_gemm: bool,
) -> _LayerActs:  # fmt: skip
    """Bytes one layer stores for the backward (megatron-core's local GPT layer spec with torch RMSNorm,
    SDPA core attention and rltrain's grouped-GEMM experts), read from what the modules save; flash/SDPA
    attention has no s^2 term. Tensor-parallel regions are split by tp, the norm region only with sequence
    parallel. Selective recompute drops what its modules recompute. Dropout masks (1 byte) when
    hidden_dropout > 0."""
    h, f = arch.hidden_size, arch.ffn_hidden_size
    kv = head_dim(arch)
    q, g = arch.num_attention_heads * kv, arch.num_query_groups * kv
    selective = ov.recompute_modules if ov.recompute_granularity == "selective" else ()
    norms = 4 * h
    if "layernorm" in selective:
        norms -= 2 * h  # norm outputs are recomputed from the stored inputs
    # qkv output (q + 2g), rotated q and k (q + g), SDPA output + its contiguous copy (2q).
    attention = (q + 2 * g) + (q + g) + 2 * q + (q if arch.qk_layernorm else 0)
    silu = 0 if fused else 1  # the unfused SwiGLU's saved silu output, in units of the inner width
    per_layer = 0.0
    if moe and arch.num_moe_experts is not None:
        k, fe = arch.moe_router_topk, arch.moe_ffn_hidden_size or f
        # grouped: GroupedSwiGLU saves its input rows and fc1's output; sequential: megatron's MLP per expert
        # (moe_act recompute keeps only fc1's output of it).
        act = 0 if "moe_act" in selective else 1 + silu
        mlp = k * h + k * 2 * fe if grouped_gemm else k * h + k * (2 + act) * fe
        if arch.moe_shared_expert_intermediate_size is not None:
            mlp += (3 + silu) * arch.moe_shared_expert_intermediate_size
        if grouped_gemm:
            local = cdiv(arch.num_moe_experts, lay.ep)
            per_layer = float(local * 3 * h * cdiv(fe, lay.etp) * elem)
    else:
        mlp = (3 + silu) * f
    if "mlp" in selective:
        mlp = 0  # only the MLP input (a norm output, counted above) is kept
    rep_div = lay.tp if lay.sequence_parallel else 1
    dropout = 2 * h / rep_div if ov.hidden_dropout > 0 else 0.0
    return _LayerActs(
        norms=elem * norms / rep_div + dropout,
        attention=elem * attention / lay.tp,
        mlp=elem * mlp / lay.tp,
        per_layer=per_layer,
    )


def _in_flight(lay: RoleLayout, stage: int, micro_batches: int) -> tuple[int, float]:
    """(micro-batches in flight, stage activations held as a multiple of one micro-batch's)."""
    m = max(micro_batches, 1)
    if lay.pp == 1:
        return 1, 1.0
    if lay.vpp is None:
        n = min(lay.pp - stage, m)
        return n, float(n)
    # Interleaved 1F1B (megatron get_pp_rank_microbatches): warmup chunks + 1, each a 1/vpp share.
    chunks = min((lay.pp - stage - 1) * 2 + (lay.vpp - 1) * lay.pp + 1, m * lay.vpp)
    return cdiv(chunks, lay.vpp), chunks / lay.vpp


def _stage_activation_bytes(
    arch: ModelArch, lay: RoleLayout, stage: StageLayers, ov: OverrideTransformerConfig, elem: int, tokens: int,
    held: float, fused: bool, grouped_gemm: bool,
) -> float:  # fmt: skip
    """Activations one device holds for the backward at the update's peak: every layer of the stage for the
    micro-batches in flight (`held`), or with full recompute the stored layer inputs plus the layers being
    re-materialised."""
    layers = stage.num_layers
    if layers == 0:
        return 0.0
    moe_layers = sum(
        is_moe_layer(arch, layer) for ch in stage.chunks for layer in range(ch.first_layer, ch.first_layer + ch.num_layers)
    )  # fmt: skip
    kinds = [(_layer_activations(arch, lay, ov, elem, moe, fused, grouped_gemm), n)
             for moe, n in ((True, moe_layers), (False, layers - moe_layers)) if n]  # fmt: skip
    total = sum(n * (a.per_token * tokens + a.per_layer) for a, n in kinds)
    full = total / layers  # one layer's share (layers of both kinds averaged)
    largest = max(a.per_token * tokens + a.per_layer for a, _ in kinds)
    inp = elem * arch.hidden_size / (lay.tp if lay.sequence_parallel else 1) * tokens  # a layer's input
    if ov.recompute_granularity != "full":
        # The stacked expert weights are made once per mini-batch and shared by the micro-batches in flight
        # (rltrain/megatron/moe_experts.py cached_expert_stacks), so they count once, not `held` times.
        stacks = sum(n * a.per_layer for a, n in kinds)
        return held * (total - stacks) + stacks
    if ov.recompute_method == "block":
        per_chunk = ov.recompute_num_layers if ov.recompute_num_layers is not None else layers
        recomputed = sum(min(per_chunk, ch.num_layers) for ch in stage.chunks)
        stored = recomputed * inp + (layers - recomputed) * full
        working = largest if recomputed else 0.0  # one layer re-materialised during backward
    else:  # uniform (megatron's default when a method is missing)
        group = ov.recompute_num_layers or 1
        stored = sum(cdiv(ch.num_layers, group) for ch in stage.chunks) * inp
        working = min(group, layers) * largest  # one group re-materialised during backward
    return held * stored + working


SYNTHETIC_PROMPT_CHARS = 5
"""The longest prompt of every built-in synthetic task ("3 4 5", "12 7" style, "99+9=", "99*9=":
rltrain/data.py synthetic_sample); tests/test_memory_estimate.py checks it against the generator."""
CHAT_TEMPLATE_TOKENS = 64
"""Tokens a model's own tokenizer and chat template may wrap a short synthetic prompt in (Qwen's template
around 5 characters is ~30)."""


def rollout_prompt_tokens(c: RLConfig) -> int:
    """The prompt width the rollout pads a batch to (its longest prompt, rltrain/data.py left_pad):
    data.max_prompt_length for prompt files (the worst case; the loader drops or cuts longer ones) and for
    multi-turn contexts; a synthetic task's own prompts otherwise: <bos> + 5 characters with the built-in
    character tokenizer, at most CHAT_TEMPLATE_TOKENS with a model's tokenizer."""
    if c.data.train_files or c.rollout.multi_turn.enable:
        return c.data.max_prompt_length
    own = (
        1 + SYNTHETIC_PROMPT_CHARS
        if c.model.path is None and c.model.tokenizer_path is None
        else CHAT_TEMPLATE_TOKENS
    )
    return min(own, c.data.max_prompt_length)


def _rollout_kv_bytes(c: RLConfig, lay: RoleLayout, arch: ModelArch, num_layers: int) -> float:
    """The embedded engine's KV cache on one actor device: keys and values of every layer of this stage,
    kv_heads / tp heads, over the prompt width (`rollout_prompt_tokens`) + max_response_length columns, for
    the rows one DP rank generates (rltrain/megatron/inference.py allocates [P + N, rows, groups/tp,
    head_dim] twice per layer in params_dtype, P the batch's padded prompt width). MLA models (deepseek_v3) are
    sized with the compressed latent cache (kv_lora_rank + qk_rope_head_dim per token and layer, whole on
    each TP rank), what rltrain/megatron/mla_cache.py allocates ([P + N, rows, 1, kv_lora_rank] and
    [P + N, rows, 1, rope] per layer).

    0 for vLLM (its own pool, capped by rollout.gpu_memory_utilization) and with context parallel (the
    engine then falls back to the cache-less path).
    """
    if c.rollout.engine != "embedded" or lay.cp > 1:
        return 0.0
    rows = cdiv(c.data.train_batch_size * c.rollout.n, lay.dp)
    seq = rollout_prompt_tokens(c) + c.rollout.max_response_length
    # MLA (deepseek_v3): the compressed latent + shared rope key per token, whole on every TP rank.
    return float(num_layers * kv_cache_width(arch, lay.tp) * seq * rows * DTYPE_BYTES[c.model.params_dtype])


def _rollout_sampling_bytes(c: RLConfig, lay: RoleLayout, vocab: int) -> float:
    """The decode step's last-position logits on the last stage: the [rows, V] 16-bit output, its fp32 copy,
    inverse_cdf's fp32 weights, and one more fp32 [rows, V] when the temperature divides them (inference.py
    sample_tokens); the output layer gathers the whole vocabulary on every TP rank."""
    rows = cdiv(c.data.train_batch_size * c.rollout.n, lay.dp)
    per = DTYPE_BYTES[c.model.params_dtype] + 4 + 4 + (4 if c.rollout.temperature not in (0.0, 1.0) else 0)
    return float(rows * vocab * per)


LOGPROB_CHUNK_ELEMENTS = 2**25
"""Elements of one eager log-prob chunk [chunk tokens, V/tp] (rltrain/megatron/logprob.py
DEFAULT_CHUNK_ELEMENTS; tests/test_memory_estimate.py keeps the two equal)."""


def _logprob_chunk_bytes(tokens: int, width: float, elem: int, fused: bool) -> float:
    """The chunked log-prob/entropy backward's working set (logprob.py), on top of the logits and their
    gradient: eager, the chunk gathered from the logits, its fp32 copy, the fp32 probabilities and the fp32
    gradient coefficient (3 fp32 + 1 16-bit [chunk, V/tp]); fused, nothing: the compiled kernel reads the
    16-bit logits and stores each row's gradient straight into the gradient of the logits."""
    if width <= 1 or fused:
        return 0.0
    chunk = min(tokens, max(1, int(LOGPROB_CHUNK_ELEMENTS // width)))
    return chunk * width * (3 * 4 + elem)


REFIT_BUCKET_MIB = 256
"""Largest gathered bucket of one refit collective (rltrain/rollout/reshard.py reads it from the plan)."""
REFIT_BYTES_PER_S: Mapping[str, float] = {"cuda": 100e9, "npu": 50e9, "cpu": 1e9}
"""Conservative all-gather + copy bandwidths for the refit time estimate (H200 NVLink moves ~3x more)."""


def _refit_extra_bytes(c: RLConfig, spec: ModelSpec, r_tp: int) -> float:
    """Per device while generating: the rollout replica's weights (every layer, 1/r_tp of the tp-split
    matrices; norms are negligible) plus one gathered bucket and its local part in flight."""
    full = spec.params_total * DTYPE_BYTES[c.model.params_dtype]
    return full / r_tp + 2 * min(REFIT_BUCKET_MIB * 2**20, full)


def rollout_refit(c: RLConfig, layouts: tuple[RoleLayout, ...], models: Models) -> RolloutRefit:
    actor, rollout = by_role(layouts, "actor"), by_role(layouts, "rollout")
    spec = models.for_role("actor")
    mode = (
        "push"
        if c.rollout.placement == "separate"
        else "zero-copy"
        if not rollout_resharded(c)
        else ("reshard" if c.rollout.engine == "embedded" else "vllm")
    )
    full = spec.params_total * DTYPE_BYTES[c.model.params_dtype]
    # A pushed rollout keeps its weights (its own devices); the trainer side holds one bucket in flight.
    extra = {"zero-copy": 0.0, "push": 2 * min(REFIT_BUCKET_MIB * 2**20, full)}.get(
        mode, _refit_extra_bytes(c, spec, rollout.tp)
    )
    seconds = 0.0 if mode == "zero-copy" else full / REFIT_BYTES_PER_S.get(c.cluster.device, 1e9)
    return RolloutRefit(
        mode=mode,
        actor_tp=actor.tp,
        actor_pp=actor.pp,
        rollout_tp=rollout.tp,
        rollout_dp=rollout.dp,
        bucket_mib=REFIT_BUCKET_MIB,
        extra_gib=_gib(extra),
        estimated_s=round(seconds, 4),
        push_gib=_gib(full) if mode == "push" else 0.0,
        senders=actor.pp if mode == "push" else 0,
    )


def _separate_rollout_memory(
    c: RLConfig, resources: Resources, lay: RoleLayout, spec: ModelSpec
) -> PoolMemory:
    """The separate rollout pool's device: its own model (every layer at the rollout's tp), the KV cache of
    the rows its DP rank generates, one push bucket while receiving and the last position's logits."""
    elem = DTYPE_BYTES[c.model.params_dtype]
    full = spec.params_total * elem
    weights = full / lay.tp
    kv = _rollout_kv_bytes(c, lay, spec.arch, spec.arch.num_layers)
    bucket = 2 * min(REFIT_BUCKET_MIB * 2**20, full)
    sampling = _rollout_sampling_bytes(c, lay, lay.padded_vocab_size)
    gen = [("rollout weights", weights), ("rollout kv cache", kv),
           ("rollout kv compaction", kv / spec.arch.num_layers), ("rollout sampling", sampling)]  # fmt: skip
    push = [("rollout weights", weights), ("weight push bucket", bucket)]
    phases = tuple(
        PhaseMemory(
            name, _gib(sum(b for _, b in parts)), tuple(MemoryPart(k, _gib(b)) for k, b in parts if b > 0)
        )
        for name, parts in (("generate_sequences", gen), ("weight_push", push))
    )
    top = max(phases, key=lambda p: p.total_gib)
    dev = c.cluster.device_memory_gib
    pool = next(p for p in resources.pools if "rollout" in p.roles)
    return PoolMemory(pool.name, ("rollout",), 0, top.phase, top.total_gib, phases,
                      None if dev is None else top.total_gib <= dev)  # fmt: skip


# The phase of each megatron role's forward-only pass (as the workers' profiled calls name it).
_INFER_PHASE = {
    "actor": "actor_compute_log_prob",
    "critic": "critic_compute_values",
    "ref": "ref_compute_log_prob",
    "reward_model": "reward_compute",
}


def _lora_stage(
    lora: LoraPlan, arch: ModelArch, lay: RoleLayout, st: StageLayers, elem: int
) -> tuple[int, float]:
    """(adapter parameters on one rank of this stage, the adapters' activation bytes per token): each
    adapted projection saves its rank-r hidden [r] for B's backward, and with dropout the dropped input
    (A's input; without dropout A reads the tensor the base linear saves anyway) and its mask."""
    params, per_token = 0, 0.0
    for ch in st.chunks:
        layers = range(ch.first_layer, ch.first_layer + ch.num_layers)
        params += stage_adapter_params(lora, arch, layers, lay.tp)
        for mod in lora.modules:
            if mod.layer in layers:
                for part in mod.parts:
                    fan_in = part_dims(arch, part)[0]
                    per_token += lora.rank * elem
                    if lora.dropout > 0:
                        per_token += (
                            fan_in * (elem + 1) / (lay.tp if mod.linear not in COLUMN_PARALLEL else 1)
                        )
    return params, per_token


def _role_mem_model(
    c: RLConfig,
    role: str,
    lay: RoleLayout,
    spec: ModelSpec,
    batch: BatchPlan | None,
    lora: LoraPlan | None = None,
) -> _RoleMemModel:
    _, m = megatron_of(c, role)
    elem = DTYPE_BYTES[c.model.params_dtype]
    trained = role in ("actor", "critic")
    # A micro-batch is padded to its longest row: the rollout's prompt width + the response at most.
    seq = rollout_prompt_tokens(c) + c.rollout.max_response_length
    ov = m.override_transformer_config
    ddp = m.override_ddp_config
    infer_micro, dynamic, budget = forward_batching(c, role)
    infer_phase = _INFER_PHASE[role]
    infer_tokens = budget if dynamic else cdiv(infer_micro * seq, lay.cp)
    out_width = lay.padded_vocab_size / lay.tp if spec.head == "lm" else 1.0
    fused = fused_kernels(c)
    grouped = bool(c.model.moe_grouped_gemm)
    stages = []
    for st in lay.stages:
        params = _stage_params(spec.arch, lay, st, spec.head)
        # LoRA (the actor): the adapters join the frozen base weights; only they have gradients and optimizer
        # state (megatron DDP and the optimizer see requires_grad parameters only).
        adapters, lora_acts = (
            _lora_stage(lora, spec.arch, lay, st, elem) if lora and role == "actor" else (0, 0.0)
        )
        trainable = adapters if adapters else params
        pbytes = float((params + adapters) * elem)
        grads = optim = acts = logits_train = chunk = 0.0
        in_flight, tokens = 0, 0
        if trained and batch is not None:
            grads = float(trainable * (4 if ddp.grad_reduce_in_fp32 else elem))
            o = c.actor.optim if role == "actor" else c.critic.optim
            per_param = (4 if elem != 4 else 0) + (8 if o.optimizer == "adam" else 4)
            experts = _stage_expert_params(spec.arch, lay, st) if not adapters else 0
            if m.use_distributed_optimizer:
                # megatron's distributed optimizer: dense state over dp x cp, experts' over expert dp.
                dense_shards = lay.dp * lay.cp
                optim = (trainable - experts) * per_param / dense_shards + experts * per_param / lay.expert_dp
            else:
                optim = trainable * per_param
            tokens = (
                batch.tokens_per_micro_batch_per_rank
                if batch.use_dynamic_bsz
                else cdiv(batch.tokens_per_micro_batch_per_rank * seq, batch.max_seq_len)
            )
            in_flight, held = _in_flight(lay, st.stage, batch.max_micro_batches_per_mini_batch)
            acts = _stage_activation_bytes(spec.arch, lay, st, ov, elem, tokens, held, fused, grouped)
            acts += lora_acts * tokens * held
            if st.output_layer:
                logits_train = 2.0 * tokens * out_width * elem
                chunk = _logprob_chunk_bytes(tokens, out_width, elem, fused)
        # The output layer writes batch-first logits, so GPTModel's [b, s] copy is free, except with
        # sequence parallel (rltrain/megatron/model.py batch_first_logits).
        copies = 2.0 if m.sequence_parallel and lay.tp > 1 else 1.0
        logits_infer = copies * infer_tokens * out_width * elem if st.output_layer else 0.0
        colocated = c.rollout.placement == "colocated"
        kv = _rollout_kv_bytes(c, lay, spec.arch, st.num_layers) if role == "actor" and colocated else 0.0
        kv_layers = st.num_layers
        sampling = 0.0
        if kv > 0 and st.output_layer:
            sampling = _rollout_sampling_bytes(c, lay, lay.padded_vocab_size)
        refit = 0.0
        if role == "actor" and colocated and rollout_resharded(c) and c.rollout.engine == "embedded":
            # The rollout replica holds every layer at its own tp and generates rows / rollout dp.
            r_tp = rollout_tp(c)
            r_lay = replace(lay, tp=r_tp, pp=1, cp=1, dp=max(lay.world_size // r_tp, 1))
            kv = _rollout_kv_bytes(c, r_lay, spec.arch, spec.arch.num_layers)
            kv_layers = spec.arch.num_layers
            sampling = _rollout_sampling_bytes(c, r_lay, lay.padded_vocab_size) if kv > 0 else 0.0
            refit = _refit_extra_bytes(c, spec, r_tp)
        # The engine's static-shape MoE layers stack the expert weights once per generate call (ep = etp = 1).
        stacked = 0.0
        if kv > 0 and lay.ep == 1 and lay.etp == 1 and refit == 0.0:
            stacked = _stage_expert_params(spec.arch, lay, st) * DTYPE_BYTES[c.model.params_dtype]
        recomputed = ov.recompute_granularity == "full" or (
            ov.recompute_granularity == "selective" and "moe" in (ov.recompute_modules or ())
        )
        infer_stacks = _stage_expert_params(spec.arch, lay, st) * elem if grouped and not recomputed else 0.0
        mem = _StageMem(
            params, pbytes, grads, optim, acts, logits_train, logits_infer, in_flight, tokens, chunk, kv, refit,
            sampling, stacked, rollout_kv_compaction=kv / max(kv_layers, 1), infer_stacks=infer_stacks,
        )  # fmt: skip
        stages.append(mem)
    offload = (bool(m.param_offload), bool(m.grad_offload) and trained, bool(m.optimizer_offload) and trained)
    return _RoleMemModel(role, trained, offload, tuple(stages), infer_phase)


def _resident(r: _RoleMemModel, s: _StageMem) -> list[tuple[str, float]]:
    """What a role keeps on the device while another role's call runs."""
    po, go, oo = r.offload
    parts = [] if po else [(f"{r.role} params", s.param_bytes)]
    if r.trained:
        parts += [] if go else [(f"{r.role} grads", s.grad_bytes)]
        parts += [] if oo else [(f"{r.role} optimizer", s.optim_bytes)]
    return parts


def _phases(models: list[_RoleMemModel], stage_of: dict[str, int]) -> list[PhaseMemory]:
    phases = []
    for r in models:
        s = r.stages[stage_of[r.role]]
        others = [p for o in models if o is not r for p in _resident(o, o.stages[stage_of[o.role]])]
        calls: list[tuple[str, list[tuple[str, float]]]] = []
        if r.trained:
            own = [
                (f"{r.role} params", s.param_bytes),
                (f"{r.role} grads", s.grad_bytes),
                (f"{r.role} optimizer", s.optim_bytes),
                (f"{r.role} activations", s.act_bytes),
                (f"{r.role} logits and grad", s.logits_train),
                (f"{r.role} log-prob chunk", s.logprob_chunk),
            ]
            calls.append((f"{r.role}_update", own))
        _, go, oo = r.offload
        infer = [(f"{r.role} params", s.param_bytes)]
        if r.trained:
            infer += [] if go else [(f"{r.role} grads", s.grad_bytes)]
            infer += [] if oo else [(f"{r.role} optimizer", s.optim_bytes)]
        calls.append((r.infer_phase, [*infer, (f"{r.role} stacked experts", s.infer_stacks),
                                      (f"{r.role} logits", s.logits_infer)]))  # fmt: skip
        if s.rollout_kv > 0:
            # generate_sequences on the actor's weights: what stays resident for the actor (as in its
            # log-prob call) plus the KV cache; compacting the cache (as rows finish) replaces it a layer at a
            # time, so it briefly holds one layer's old keys and values beside the new ones.
            gen = [
                *infer,
                ("rollout weights (resharded)", s.rollout_weights),
                ("rollout kv cache", s.rollout_kv),
                ("rollout kv compaction", s.rollout_kv_compaction),
                ("rollout sampling", s.rollout_sampling),
                ("rollout stacked experts", s.rollout_experts),
            ]
            calls.append(("generate_sequences", gen))
        for name, own_parts in calls:
            parts = tuple(MemoryPart(label, _gib(b)) for label, b in own_parts + others if b > 0)
            phases.append(PhaseMemory(name, _gib(sum(b for _, b in own_parts + others)), parts))
    return phases


def _gib(nbytes: float) -> float:
    return round(nbytes / GIB, 6)


def _own_bytes(s: _StageMem) -> float:
    """A role's own bytes at one stage (weights, gradients, optimizer, activations, the larger logits)."""
    return (
        s.param_bytes
        + s.grad_bytes
        + s.optim_bytes
        + s.act_bytes
        + max(s.logits_train + s.logprob_chunk, s.logits_infer + s.infer_stacks)
    )


def _role_memory(lay: RoleLayout, rm: _RoleMemModel) -> RoleMemory:
    """A role's memory on its most loaded stage."""
    idx = max(range(len(rm.stages)), key=lambda i: _own_bytes(rm.stages[i]))
    s = rm.stages[idx]
    return RoleMemory(
        role=lay.role,
        pool=lay.pool,
        stage=idx,
        trained=rm.trained,
        params_per_device=s.params,
        params_gib=_gib(s.param_bytes),
        grads_gib=_gib(s.grad_bytes),
        optimizer_gib=_gib(s.optim_bytes),
        activations_gib=_gib(s.act_bytes),
        logits_gib=_gib(max(s.logits_train + s.logprob_chunk, s.logits_infer)),
        total_gib=_gib(_own_bytes(s)),
        in_flight_micro_batches=s.in_flight,
        tokens_per_micro_batch=s.tokens,
        offloaded=tuple(
            name for name, flag in zip(("params", "grads", "optimizer"), rm.offload, strict=True) if flag
        ),
        stage_totals_gib=tuple(_gib(_own_bytes(st)) for st in rm.stages),
    )


def _pool_memory(
    pool: Pool, mem_roles: list[RoleLayout], role_models: dict[str, _RoleMemModel], dev: float | None
) -> PoolMemory | None:
    """The peak of a pool over its phases, at the rank whose stages load it most (None: no role of the estimate)."""
    members = [lay for lay in mem_roles if lay.pool == pool.name]
    if not members:
        return None
    # Each device is at one pipeline stage per role; evaluate every distinct combination once.
    combos: dict[tuple[int, ...], int] = {}
    for rank in range(pool.num_devices):
        combos.setdefault(tuple(lay.grid[rank].pp for lay in members), rank)
    best: tuple[float, int, list[PhaseMemory]] | None = None
    for combo, rank in combos.items():
        stage_of = {lay.role: st for lay, st in zip(members, combo, strict=True)}
        phases = _phases([role_models[lay.role] for lay in members], stage_of)
        peak = max(p.total_gib for p in phases)
        if best is None or peak > best[0]:
            best = (peak, rank, phases)
    assert best is not None
    peak, rank, phases = best
    top = max(phases, key=lambda p: p.total_gib)
    return PoolMemory(
        pool=pool.name,
        roles=tuple(lay.role for lay in members),
        rank=rank,
        peak_phase=top.phase,
        peak_gib=peak,
        phases=tuple(phases),
        fits=None if dev is None else peak <= dev,
    )


def _memory_notes(
    c: RLConfig, pools: list[PoolMemory], role_mems: list[RoleMemory], lora: LoraPlan | None
) -> list[str]:
    """What the estimate counts and how, with each pool's phases."""
    notes = [
        "estimate per device; parameters on the most loaded pipeline stage; megatron's allocator overhead, "
        "NCCL buffers and fragmentation are not included (keep ~10-20% headroom)",
        "rollout: the embedded engine generates with the actor's weights; its KV cache (2 x layers x "
        "kv_heads/tp x head_dim, or with multi-head latent attention layers x (kv_lora_rank + "
        f"qk_rope_head_dim) whole on every TP rank, x (prompt width {rollout_prompt_tokens(c)} + max_response_length) x rows per DP "
        "rank x dtype bytes; the prompt width is data.max_prompt_length with prompt files, the synthetic "
        "task's own otherwise; + one layer's share while compacting) and the sampler's [rows, V] logits (16-bit + 2 fp32 "
        "temporaries) are counted in generate_sequences and freed after it, for MoE at ep = etp = 1 also "
        "the engine's stacked copy of the routed expert weights; "
        "rollout.gpu_memory_utilization caps only a vLLM engine's pool and is not used here",
        "optimizer: fp32 master weights (when params are not fp32) + Adam m and v, sharded over dp x cp "
        "with use_distributed_optimizer; gradients in fp32 with grad_reduce_in_fp32",
        "activations: what megatron's local layer saves for the backward, per token and layer: norms 4h "
        "(2 inputs, 2 outputs); attention 4q + 3g (qkv output, rotated q and k, SDPA output and its copy; "
        "+q with QK-norm; no s^2 term); SwiGLU MLP 4f eager (fc1 2f, silu f, product f) or 3f fused; "
        "routed experts k(h + 2f_e) per token + the stacked expert weights per layer (grouped GEMM: once per "
        "mini-batch, not per micro-batch in flight, except under full recompute); for the micro-batches "
        "in flight under 1F1B, reduced by recompute"
        + (
            " (model.fused_kernels on: fused SwiGLU and log-prob)" if fused_kernels(c) else " (eager kernels)"
        ),
        "logits: the update's 16-bit [tokens, V/tp] logits + their gradient, and with eager kernels the "
        "log-prob backward's chunk (2**25 elements: 16-bit + 3 fp32 temporaries; the fused kernels have none); "
        "a forward pass's logits (+ GPTModel's [b, s] copy with sequence parallel); a forward pass with "
        "grouped-GEMM experts also holds every MoE layer's stacked expert weights (made once per pass)",
    ]
    for pm in pools:
        for ph in pm.phases:
            parts = ", ".join(f"{p.label} {p.gib:.2f}" for p in ph.parts)
            notes.append(f"{pm.pool} {ph.phase}: {ph.total_gib:.2f} GiB = {parts}")
    if c.rollout.placement == "separate":
        notes.append(
            "separate rollout pool: the whole model at the rollout's tp (kept between pushes), its KV cache at "
            "the rollout's tp and dp, and one received push bucket; the trainer's pools hold no KV cache"
        )
    elif rollout_resharded(c) and c.rollout.engine == "embedded":
        notes.append(
            "rollout in its own layout: generate_sequences also holds the rollout replica's weights (params x "
            "dtype bytes / rollout tp) and one refit bucket, from the refit to the end of generation; its KV "
            "cache uses the rollout's tp and dp"
        )
    if lora is not None:
        notes.append(
            f"LoRA: the actor's parameters are the frozen base weights + {lora.params:,} adapter parameters; "
            "gradients and optimizer state are the adapters' only; the ref log-probs are the actor's engine with "
            "its adapters off, so no reference copy of the weights is held; generation merges the adapters into the "
            "weights for the call and keeps the base copies of the adapted weights in host memory meanwhile"
        )
    offloaded = [f"{r.role}: {', '.join(r.offloaded)}" for r in role_mems if r.offloaded]
    if offloaded:
        notes.append(
            "offloaded to host while other roles run (counted only in the role's own calls): "
            + "; ".join(offloaded)
        )
    return notes


def memory_plan(
    c: RLConfig,
    resources: Resources,
    layouts: tuple[RoleLayout, ...],
    models: Models,
    batches: tuple[BatchPlan, ...],
    lora: LoraPlan | None = None,
) -> MemoryPlan:
    """The memory estimate per device: each role's most loaded stage, each pool's peak phase, the notes."""
    mem_roles = [lay for lay in layouts if lay.role != "rollout"]
    role_models = {
        lay.role: _role_mem_model(
            c,
            lay.role,
            lay,
            models.for_role(lay.role),
            next((b for b in batches if b.role == lay.role), None),
            lora,
        )
        for lay in mem_roles
    }
    role_mems = [_role_memory(lay, role_models[lay.role]) for lay in mem_roles]
    dev = c.cluster.device_memory_gib
    pools = []
    for pool in resources.pools:
        if (pm := _pool_memory(pool, mem_roles, role_models, dev)) is not None:
            pools.append(pm)
    if c.rollout.placement == "separate":
        pools.append(
            _separate_rollout_memory(c, resources, by_role(layouts, "rollout"), models.for_role("actor"))
        )
    peak = max(p.peak_gib for p in pools)
    notes = _memory_notes(c, pools, role_mems, lora)
    return MemoryPlan(
        device_memory_gib=dev,
        peak_gib=peak,
        fits=None if dev is None else peak <= dev,
        roles=tuple(role_mems),
        pools=tuple(pools),
        notes=tuple(notes),
    )
