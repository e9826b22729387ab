"""The plan's memory estimate: per device, per pool and phase, from the layouts, batches and models."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from rlconf.config import (
    ModelArch,
    OverrideTransformerConfig,
    RLConfig,
)
from rlconf.model_spec import (
    is_moe_layer,
    layer_params,
)
from rlconf.plan.compile import _cdiv, _kv_channels, _Models, rollout_resharded, rollout_tp
from rlconf.plan.types import (
    DTYPE_BYTES,
    GIB,
    BatchPlan,
    MemoryPart,
    MemoryPlan,
    ModelSpec,
    PhaseMemory,
    PoolMemory,
    Resources,
    RoleLayout,
    RoleMemory,
    RolloutRefit,
    StageLayers,
    _by_role,
    _megatron_of,
    forward_batching,
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
    logits_infer: float
    in_flight: int
    tokens: int
    rollout_kv: float = 0.0
    """Embedded rollout's KV cache during generate_sequences (actor only; 0 for other roles)."""
    rollout_weights: float = 0.0
    """The resharded rollout's own weights + one refit bucket during generate_sequences (actor only)."""


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
    return moe_layers * _cdiv(layer_params(arch, True).experts, lay.ep * lay.etp)


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
        n += count * (_cdiv(p.tp_sharded, tp) + p.replicated + _cdiv(p.experts, lay.ep * lay.etp))
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


def _activation_bytes_per_token(
    arch: ModelArch, lay: RoleLayout, ov: OverrideTransformerConfig, elem: int
) -> tuple[float, float]:
    """(bytes stored per token by one layer for backward, bytes of one layer input per token).

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"), adapted to
    SwiGLU, grouped-query attention and flash/SDPA attention (no s^2 softmax term): per layer the two
    norm inputs and outputs (4h), q/k/v (q + 2g) and the attention output (q), the gate/up output (2f)
    and the SwiGLU output (f). Tensor-parallel regions are split by tp; the norm region only with
    sequence parallel. Dropout masks (1 byte) when hidden_dropout > 0.
    """
    h, f = arch.hidden_size, arch.ffn_hidden_size
    kv = _kv_channels(arch)
    q, g = arch.num_attention_heads * kv, arch.num_query_groups * kv
    selective = ov.recompute_modules if ov.recompute_granularity == "selective" else ()
    replicated = 4 * h
    if "layernorm" in selective:
        replicated -= 2 * h  # norm outputs are recomputed from the stored inputs
    mlp = 3 * f
    if "mlp" in selective:
        mlp = 0  # only the MLP input (a norm output, counted above) is kept
    elif "moe_act" in selective:
        mlp -= f
    # core_attn recompute saves nothing with flash attention: q, k, v are kept as the checkpoint's inputs.
    sharded = 2 * q + 2 * g + mlp
    rep_div = lay.tp if lay.sequence_parallel else 1
    per_token = elem * (replicated / rep_div + sharded / lay.tp)
    if ov.hidden_dropout > 0:
        per_token += 2 * h / rep_div
    return per_token, elem * h / rep_div


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
    return _cdiv(chunks, lay.vpp), chunks / lay.vpp


def _stage_activation_bytes(
    arch: ModelArch, lay: RoleLayout, stage: StageLayers, ov: OverrideTransformerConfig, elem: int, tokens: int,
    held: float,
) -> float:  # fmt: skip
    full, inp = _activation_bytes_per_token(arch, lay, ov, elem)
    layers = stage.num_layers
    if ov.recompute_granularity != "full" or layers == 0:
        return held * layers * full * tokens
    if ov.recompute_method == "block":
        per_chunk = ov.recompute_num_layers if ov.recompute_num_layers is not None else layers
        recomputed = sum(min(per_chunk, ch.num_layers) for ch in stage.chunks)
        stored = recomputed * inp + (layers - recomputed) * full
        working = full if recomputed else 0.0  # one layer re-materialised during backward
    else:  # uniform (megatron's default when a method is missing)
        group = ov.recompute_num_layers or 1
        stored = sum(_cdiv(ch.num_layers, group) for ch in stage.chunks) * inp
        working = min(group, layers) * full  # one group re-materialised during backward
    return (held * stored + working) * tokens


def _rollout_kv_bytes(c: RLConfig, lay: RoleLayout, arch: ModelArch, num_layers: int) -> float:
    """The embedded engine's KV cache on one actor device: keys and values of every layer of this stage,
    kv_heads / tp heads, at the full sequence length, for the rows one DP rank generates (rltrain/megatron/
    inference.py allocates [P + N, rows, groups/tp, head_dim] twice per layer in params_dtype).

    0 for vLLM (its own pool, capped by rollout.gpu_memory_utilization) and with context parallel (the
    engine then falls back to the cache-less path).
    """
    if c.rollout.engine != "embedded" or lay.cp > 1:
        return 0.0
    rows = _cdiv(c.data.train_batch_size * c.rollout.n, lay.dp)
    seq = c.data.max_prompt_length + c.rollout.max_response_length
    kv_heads = max(arch.num_query_groups // lay.tp, 1)
    return float(
        2 * num_layers * kv_heads * _kv_channels(arch) * seq * rows * DTYPE_BYTES[c.model.params_dtype]
    )


REFIT_BUCKET_MIB = 256
"""Largest gathered bucket of one refit collective (rltrain/rollout/reshard.py reads it from the plan)."""
REFIT_BYTES_PER_S: Mapping[str, float] = {"cuda": 100e9, "npu": 50e9, "cpu": 1e9}
"""Conservative all-gather + copy bandwidths for the refit time estimate (H200 NVLink moves ~3x more)."""


def _refit_extra_bytes(c: RLConfig, spec: ModelSpec, r_tp: int) -> float:
    """Per device while generating: the rollout replica's weights (every layer, 1/r_tp of the tp-split
    matrices; norms are negligible) plus one gathered bucket and its local part in flight."""
    full = spec.params_total * DTYPE_BYTES[c.model.params_dtype]
    return full / r_tp + 2 * min(REFIT_BUCKET_MIB * 2**20, full)


def _rollout_refit(c: RLConfig, layouts: tuple[RoleLayout, ...], models: _Models) -> RolloutRefit:
    actor, rollout = _by_role(layouts, "actor"), _by_role(layouts, "rollout")
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
    rows = _cdiv(c.data.train_batch_size * c.rollout.n, lay.dp)
    logits = rows * lay.padded_vocab_size / lay.tp * 4.0
    gen = [("rollout weights", weights), ("rollout kv cache", kv), ("rollout kv compaction", kv / 2),
           ("rollout logits", logits)]  # fmt: skip
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


def _role_mem_model(
    c: RLConfig, role: str, lay: RoleLayout, spec: ModelSpec, batch: BatchPlan | None
) -> _RoleMemModel:
    _, m = _megatron_of(c, role)
    elem = DTYPE_BYTES[c.model.params_dtype]
    trained = role in ("actor", "critic")
    max_seq = c.data.max_prompt_length + c.rollout.max_response_length
    ov = m.override_transformer_config
    ddp = m.override_ddp_config
    infer_micro, dynamic, budget = forward_batching(c, role)
    infer_phase = _INFER_PHASE[role]
    infer_tokens = budget if dynamic else _cdiv(infer_micro * max_seq, lay.cp)
    out_width = lay.padded_vocab_size / lay.tp if spec.head == "lm" else 1.0
    stages = []
    for st in lay.stages:
        params = _stage_params(spec.arch, lay, st, spec.head)
        pbytes = float(params * elem)
        grads = optim = acts = logits_train = 0.0
        in_flight, tokens = 0, 0
        if trained and batch is not None:
            grads = float(params * (4 if ddp.grad_reduce_in_fp32 else elem))
            o = c.actor.optim if role == "actor" else c.critic.optim
            per_param = (4 if elem != 4 else 0) + (8 if o.optimizer == "adam" else 4)
            experts = _stage_expert_params(spec.arch, lay, st)
            if m.use_distributed_optimizer:
                # megatron's distributed optimizer: dense state over dp x cp, experts' over expert dp.
                dense_shards = lay.dp * lay.cp
                optim = (params - experts) * per_param / dense_shards + experts * per_param / lay.expert_dp
            else:
                optim = params * per_param
            tokens = batch.tokens_per_micro_batch_per_rank
            in_flight, held = _in_flight(lay, st.stage, batch.max_micro_batches_per_mini_batch)
            acts = _stage_activation_bytes(spec.arch, lay, st, ov, elem, tokens, held)
            if st.output_layer:
                logits_train = tokens * out_width * 4.0
        logits_infer = infer_tokens * out_width * 4.0 if st.output_layer else 0.0
        colocated = c.rollout.placement == "colocated"
        kv = _rollout_kv_bytes(c, lay, spec.arch, st.num_layers) if role == "actor" and colocated else 0.0
        refit = 0.0
        if role == "actor" and colocated and rollout_resharded(c) and c.rollout.engine == "embedded":
            # The rollout replica holds every layer at its own tp and generates rows / rollout dp.
            r_tp = rollout_tp(c)
            r_lay = replace(lay, tp=r_tp, pp=1, cp=1, dp=max(lay.world_size // r_tp, 1))
            kv = _rollout_kv_bytes(c, r_lay, spec.arch, spec.arch.num_layers)
            refit = _refit_extra_bytes(c, spec, r_tp)
        mem = _StageMem(
            params, pbytes, grads, optim, acts, logits_train, logits_infer, in_flight, tokens, kv, refit
        )
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
                (f"{r.role} logits", s.logits_train),
            ]
            calls.append((f"{r.role}_update", own))
        _, go, oo = r.offload
        infer = [(f"{r.role} params", s.param_bytes)]
        if r.trained:
            infer += [] if go else [(f"{r.role} grads", s.grad_bytes)]
            infer += [] if oo else [(f"{r.role} optimizer", s.optim_bytes)]
        infer.append((f"{r.role} logits", s.logits_infer))
        calls.append((r.infer_phase, infer))
        if s.rollout_kv > 0:
            # generate_sequences on the actor's weights: what stays resident for the actor (as in its
            # log-prob call) plus the KV cache; compacting the cache (when at most half of the rows still
            # run) briefly holds the old cache and the new one of at most half its rows.
            gen = [
                *infer[:-1],
                ("rollout weights (resharded)", s.rollout_weights),
                ("rollout kv cache", s.rollout_kv),
                ("rollout kv compaction", s.rollout_kv / 2),
            ]
            calls.append(("generate_sequences", gen))
        for name, own_parts in calls:
            parts = tuple(MemoryPart(label, _gib(b)) for label, b in own_parts + others if b > 0)
            phases.append(PhaseMemory(name, _gib(sum(b for _, b in own_parts + others)), parts))
    return phases


def _gib(nbytes: float) -> float:
    return round(nbytes / GIB, 6)


def _memory(
    c: RLConfig,
    resources: Resources,
    layouts: tuple[RoleLayout, ...],
    models: _Models,
    batches: tuple[BatchPlan, ...],
) -> MemoryPlan:
    mem_roles = [lay for lay in layouts if lay.role != "rollout"]
    role_models = {
        lay.role: _role_mem_model(
            c,
            lay.role,
            lay,
            models.for_role(lay.role),
            next((b for b in batches if b.role == lay.role), None),
        )
        for lay in mem_roles
    }
    role_mems = []
    for lay in mem_roles:
        rm = role_models[lay.role]

        def own(s: _StageMem) -> float:
            return (
                s.param_bytes
                + s.grad_bytes
                + s.optim_bytes
                + s.act_bytes
                + max(s.logits_train, s.logits_infer)
            )

        idx = max(range(len(rm.stages)), key=lambda i: own(rm.stages[i]))
        s = rm.stages[idx]
        role_mems.append(
            RoleMemory(
                role=lay.role,
                pool=lay.pool,
                stage=idx,
                trained=rm.trained,
                params_per_device=s.params,
                params_gib=_gib(s.param_bytes),
                grads_gib=_gib(s.grad_bytes),
                optimizer_gib=_gib(s.optim_bytes),
                activations_gib=_gib(s.act_bytes),
                logits_gib=_gib(max(s.logits_train, s.logits_infer)),
                total_gib=_gib(own(s)),
                in_flight_micro_batches=s.in_flight,
                tokens_per_micro_batch=s.tokens,
                offloaded=tuple(
                    name
                    for name, flag in zip(("params", "grads", "optimizer"), rm.offload, strict=True)
                    if flag
                ),
            )
        )
    dev = c.cluster.device_memory_gib
    pools = []
    for pool in resources.pools:
        members = [lay for lay in mem_roles if lay.pool == pool.name]
        if not members:
            continue
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
        pools.append(
            PoolMemory(
                pool=pool.name,
                roles=tuple(lay.role for lay in members),
                rank=rank,
                peak_phase=top.phase,
                peak_gib=peak,
                phases=tuple(phases),
                fits=None if dev is None else peak <= dev,
            )
        )
    if c.rollout.placement == "separate":
        pools.append(
            _separate_rollout_memory(c, resources, _by_role(layouts, "rollout"), models.for_role("actor"))
        )
    peak = max(p.peak_gib for p in pools)
    notes = [
        "estimate per device; parameters on the most loaded pipeline stage; megatron's allocator overhead, "
        "NCCL buffers and fragmentation are not included (keep ~10-20% headroom)",
        "rollout: the embedded engine generates with the actor's weights; its KV cache (2 x layers x "
        "kv_heads/tp x head_dim x (max_prompt_length + max_response_length) x rows per DP rank x dtype bytes, "
        "+50% while compacting) is counted in generate_sequences and freed after it; "
        "rollout.gpu_memory_utilization caps only a vLLM engine's pool and is not used here",
        "optimizer: fp32 master weights (when params are not fp32) + Adam m and v, sharded over dp x cp "
        "with use_distributed_optimizer; gradients in fp32 with grad_reduce_in_fp32",
        "activations: Korthikanti et al. per layer without the attention s^2 term (flash/SDPA attention), "
        "for the micro-batches in flight under 1F1B, reduced by recompute; plus one fp32 logits slice",
    ]
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
    offloaded = [f"{r.role}: {', '.join(r.offloaded)}" for r in role_mems if r.offloaded]
    if offloaded:
        notes.append(
            "offloaded to host while other roles run (counted only in the role's own calls): "
            + "; ".join(offloaded)
        )
    return MemoryPlan(
        device_memory_gib=dev,
        peak_gib=peak,
        fits=None if dev is None else peak <= dev,
        roles=tuple(role_mems),
        pools=tuple(pools),
        notes=tuple(notes),
    )
