"""The plan as text (`rlconf plan`, `rltrain --dry-run`)."""

from __future__ import annotations

from rlconf.arch import ModelArch
from rlconf.plan.types import VOCAB_DIVISIBLE_BY, ModelSpec, RoleLayout, TrainerPlan


# ============================================================================================ text
def _table(headers: tuple[str, ...], rows: list[tuple[object, ...]], indent: str = "  ") -> list[str]:
    cells = [tuple(str(x) for x in headers)] + [tuple("-" if x is None else str(x) for x in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return [indent + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in cells]


def _elide(lines: list[str], head: int, tail: int, indent: str = "    ") -> list[str]:
    if len(lines) <= head + tail + 1:
        return lines
    return [*lines[:head], f"{indent}... ({len(lines) - head - tail} more)", *lines[-tail:]]


def _fmt_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _ranks_text(ranks: tuple[int, ...] | list[int]) -> str:
    if not ranks:
        return "none"
    rs = sorted(ranks)
    if rs == list(range(rs[0], rs[-1] + 1)) and len(rs) > 2:
        return f"{rs[0]}-{rs[-1]}"
    text = ",".join(str(r) for r in rs[:12])
    return text + (f",... ({len(rs)})" if len(rs) > 12 else "")


def _layers_text(lay: RoleLayout) -> str:
    if lay.vpp is None:
        return ", ".join(str(n) for n in lay.layers_per_stage)
    return " | ".join(
        "+".join(
            f"{ch.first_layer}-{ch.first_layer + ch.num_layers - 1}" if ch.num_layers else "none"
            for ch in st.chunks
        )
        for st in lay.stages
    )


def _grid_lines(lay: RoleLayout) -> list[str]:
    """One line per (pp, dp) block: its tp x cp ranks are contiguous."""
    block = lay.tp * lay.cp
    lines = []
    for pp in range(lay.pp):
        for dp in range(lay.dp):
            start = lay.rank_of(pp, 0, 0, dp)
            if block <= 16:
                groups = [
                    " ".join(str(lay.rank_of(pp, t, c, dp)) for t in range(lay.tp)) for c in range(lay.cp)
                ]
                ranks = " | ".join(groups)
            else:
                ranks = f"{start}-{start + block - 1}"
            lines.append(f"    pp={pp} dp={dp}: {ranks}")
    return _elide(lines, 8, 2, "    ")


def _expert_grid_lines(lay: RoleLayout) -> list[str]:
    """One line per (pp, expert dp) block of the expert layers' grid, megatron's order etp-ep-edp-pp: each
    expert-parallel rank's etp ranks (they hold num_moe_experts / ep experts)."""
    block = lay.etp * lay.ep
    lines = []
    for pp in range(lay.pp):
        for edp in range(lay.expert_dp):
            start = lay.etp * lay.ep * (edp + lay.expert_dp * pp)
            if block <= 16:
                ranks = " | ".join(
                    f"ep{e}: " + " ".join(str(start + e * lay.etp + t) for t in range(lay.etp))
                    for e in range(lay.ep)
                )
            else:
                ranks = f"{start}-{start + block - 1}"
            lines.append(f"    pp={pp} edp={edp}: {ranks}")
    return _elide(lines, 8, 2, "    ")


def _model_of_role(plan: TrainerPlan, role: str) -> ModelSpec | None:
    return next((m for m in plan.models if role in m.used_by), None)


def _vocab_padding_note(plan: TrainerPlan, model: str, vocab: int) -> str:
    """' (padded to N in layouts)' when a layout of this model pads its vocabulary, else ''."""
    padded = sorted({lay.padded_vocab_size for lay in plan.layouts
                     if (spec := _model_of_role(plan, lay.role)) is not None and spec.name == model})  # fmt: skip
    padded = [p for p in padded if p != vocab]
    return f" (padded to {' / '.join(map(str, padded))} in layouts)" if padded else ""


def _vocab_lines(plan: TrainerPlan) -> list[str]:
    """Why a layout's vocab differs from the model's: megatron pads the embedding and output layer to a
    multiple of VOCAB_DIVISIBLE_BY x tp so every tp rank holds an equal slice; logits past the real
    vocabulary are cut off before sampling and log-probs."""
    seen: set[tuple[int, int, int]] = set()
    lines = []
    for lay in plan.layouts:
        spec = _model_of_role(plan, lay.role)
        if spec is None or (spec.arch.vocab_size, lay.tp, lay.padded_vocab_size) in seen:
            continue
        seen.add((spec.arch.vocab_size, lay.tp, lay.padded_vocab_size))
        if lay.padded_vocab_size != spec.arch.vocab_size:
            lines.append(
                f"  vocab {lay.padded_vocab_size} = {spec.arch.vocab_size} padded to a multiple of "
                f"{VOCAB_DIVISIBLE_BY} x tp {lay.tp} (megatron's make_vocab_size_divisible_by: equal slices per "
                f"tp rank; the padded rows are never sampled or scored)"
            )
    return lines


def _kernels_line(plan: TrainerPlan) -> str:
    """Which kernels every megatron engine runs (`EnginePlan.fused_kernels`), and why."""
    settings = plan.engines[0]  # one setting for every engine of the run
    setting = settings.fused_kernels_setting
    why = f"model.fused_kernels {setting}" + (f": {plan.resources.device}" if setting == "auto" else "")
    if settings.fused_kernels:
        what = "SwiGLU, RoPE, log-prob / entropy, weight gradients summed in their products"
        return f"  kernels: fused ({what}; {why})"
    return f"  kernels: eager (one torch op at a time; {why})"


def _sequence_layout_line(plan: TrainerPlan) -> str:
    """Which micro-batch layout each megatron engine's forward and update passes use
    (`EngineSettings.remove_padding`), and why."""
    groups: dict[tuple[bool, str], list[str]] = {}
    for s in plan.engines:
        if s.role != "rollout":  # a separate rollout only generates
            groups.setdefault((s.remove_padding, s.remove_padding_reason), []).append(s.role)
    parts = [
        f"{', '.join(roles)} {'packed (THD, no padding)' if packed else 'padded'}: {why}"
        for (packed, why), roles in groups.items()
    ]
    return "  sequences: " + "; ".join(parts) if parts else ""


def _refit_lines(plan: TrainerPlan) -> list[str]:
    """How the rollout gets the actor's weights each step, with the refit's extra memory and time."""
    r = plan.refit
    if r is None:
        return []
    if r.mode == "zero-copy":
        return ["  rollout refit: zero-copy (generates on the actor's own weights, actor layout)"]
    if r.mode == "push":
        stale = plan.passes.off_policy_steps if plan.passes is not None else 0
        ahead = (
            f"generation runs up to {stale} step{'s' if stale > 1 else ''} ahead of the update (off-policy)"
            if stale
            else "on-policy: each batch waits for the push of the update before it"
        )
        return [
            f"  rollout weight push: trainer (tp {r.actor_tp} x pp {r.actor_pp}, {r.senders} sending rank"
            f"{'s' if r.senders > 1 else ''}) -> separate rollout pool (tp {r.rollout_tp} x dp {r.rollout_dp}) "
            f"after every update: {r.push_gib:.2f} GiB in buckets of {r.bucket_mib} MiB, ~{r.estimated_s:.2g} s "
            f"(estimate), versioned and checksummed; {ahead}"
        ]
    how = "resharded on the actor's devices" if r.mode == "reshard" else "loaded into vLLM"
    return [
        f"  rollout refit: {how}, actor tp {r.actor_tp} x pp {r.actor_pp} -> rollout tp {r.rollout_tp} x dp "
        f"{r.rollout_dp}; +{r.extra_gib:.2f} GiB per device while generating (buckets of {r.bucket_mib} MiB), "
        f"~{r.estimated_s:.2g} s per step (estimate)"
    ]


def format_plan(plan: TrainerPlan) -> str:
    """A compact, readable rendering of the plan (what `rlconf plan FILE` prints)."""
    out: list[str] = [f"rlplan trainer plan (v{plan.version}): roles {', '.join(plan.roles)}", ""]
    out += _model_lines(plan)
    out += _placement_lines(plan)
    out += _batch_lines(plan)
    out += _passes_lines(plan)
    out += _optim_lines(plan)
    out += _profile_lines(plan)
    out += _checkpoint_lines(plan)
    out += _memory_lines(plan)
    return "\n".join(out) + "\n"


def _attention_text(a: ModelArch) -> str:
    """The attention kind: heads over key/value groups, or MLA's latent widths and what is routed how."""
    if not a.multi_latent_attention:
        return f"heads {a.num_attention_heads}/{a.num_query_groups} groups"
    q = f"q latent {a.q_lora_rank}" if a.q_lora_rank is not None else "full-rank q"
    text = (f"multi-head latent attention: heads {a.num_attention_heads}, {q}, kv latent {a.kv_lora_rank} "
            f"(cached) + rope {a.qk_pos_emb_head_dim}, values {a.v_head_dim}")  # fmt: skip
    if a.moe_router_score_function == "sigmoid":
        groups = a.moe_router_num_groups or 1
        limit = f", {a.moe_router_group_topk} of {groups} expert groups" if groups > 1 else ""
        text += (f"; sigmoid routing{limit}, score bias {'frozen' if a.moe_router_enable_expert_bias else 'none'}"
                 f", weights x {a.moe_router_topk_scaling_factor or 1:g}")  # fmt: skip
    return text


def _router_dtype_text(plan: TrainerPlan, m: ModelSpec) -> str:
    """ ", routing in fp32" where model.moe_router_dtype sets the routers' precision (every role alike)."""
    moe = plan.engine(m.used_by[0]).settings.moe
    return f", routing in {moe.router_dtype}" if moe is not None and moe.router_dtype else ""


def _model_lines(plan: TrainerPlan) -> list[str]:
    """The models: parameters, architecture, LoRA."""
    out: list[str] = []
    out.append("models")
    for m in plan.models:
        a = m.arch
        out.append(
            f"  {m.name}: {_fmt_count(m.params_total)} params"
            + (
                f" ({_fmt_count(m.params_active)} active: {a.num_moe_experts} experts, {a.moe_router_topk} per token"
                + (", router replay" if m.name == "policy" and plan.rollout.router_replay else "")
                + _router_dtype_text(plan, m)
                + ")"
                if a.num_moe_experts is not None
                else ""
            )
            + f", {a.family}, {a.num_layers} layers, hidden {a.hidden_size}, "
            f"ffn {a.ffn_hidden_size}, {_attention_text(a)}, vocab "
            f"{a.vocab_size}{_vocab_padding_note(plan, m.name, a.vocab_size)}, {m.head} head{', tied embeddings' if a.share_embeddings_and_output_weights and m.head == 'lm' else ''}"
            f" [{m.source}]"
        )
        if m.name == "policy" and plan.lora is not None:
            lo = plan.lora
            share = m.params_trainable / max(m.params_total, 1)
            out.append(
                f"    LoRA rank {lo.rank}, alpha {lo.alpha:g} (scaling {lo.scaling:g}), dropout {lo.dropout:g}: "
                f"{_fmt_count(m.params_trainable)} trainable ({share:.2%}) on {len(lo.modules)} linears "
                f"({', '.join(lo.hf_targets)}); base weights frozen (no gradients, no optimizer state)"
            )
    return out


def _placement_lines(plan: TrainerPlan) -> list[str]:
    """Resources, pools, layouts, rank grids, refit and kernels."""
    out: list[str] = []
    r = plan.resources
    out += ["", f"resources: {r.total_devices} x {r.device} ({r.nnodes} node(s) x {r.gpus_per_node})"]
    out += _table(
        ("pool", "devices", "nodes", "roles"),
        [
            (p.name, f"{_ranks_text(list(range(p.first_device, p.first_device + p.num_devices)))} ({p.num_devices})",
             _ranks_text(p.nodes), ", ".join(p.roles))
            for p in r.pools
        ],
    )  # fmt: skip

    out += ["", "layouts (rank = tp + TP*(cp + CP*(dp + DP*pp)), megatron order tp-cp-ep-dp-pp)"]
    out += _table(
        ("role", "pool", "world", "tp", "pp", "vpp", "cp", "ep", "etp", "dp", "sp", "vocab", "layers/stage"),
        [
            (lay.role, lay.pool, lay.world_size, lay.tp, lay.pp, lay.vpp, lay.cp, lay.ep, lay.etp, lay.dp,
             "on" if lay.sequence_parallel else "off", lay.padded_vocab_size,
             _layers_text(lay) + ("" if lay.even_layers else " (uneven)"))
            for lay in plan.layouts
        ],
    )  # fmt: skip
    out += _vocab_lines(plan)
    seen: dict[tuple[int, int, int, int], str] = {}
    for lay in plan.layouts:
        key = (lay.world_size, lay.tp, lay.pp, lay.cp)
        if key in seen:
            out.append(f"  {lay.role} grid: same as {seen[key]}")
            continue
        seen[key] = lay.role
        cp_note = ", cp groups split by |" if lay.cp > 1 else ""
        out.append(f"  {lay.role} grid (ranks by tp{cp_note}):")
        out += _grid_lines(lay)
        if lay.ep > 1:
            out.append(f"  {lay.role} expert grid (ranks by expert tp, per expert-parallel rank):")
            out += _expert_grid_lines(lay)
    out += _refit_lines(plan)
    out.append(_kernels_line(plan))
    if line := _sequence_layout_line(plan):
        out.append(line)
    return out


def _validation_line(plan: TrainerPlan) -> str:
    """When the run validates, and the generations it records as text (logging.*)."""
    run, log = plan.run, plan.run.logging
    when = ["before the first step"] if run.val_before_train else []
    if run.test_freq:
        when.append(f"every {run.test_freq} steps and after the last")
    records = []
    if when and log.val_generations:
        records.append(f"{log.val_generations} fixed rows per validation -> val_generations.jsonl")
    if when and log.validation_data_dir:
        records.append(f"every validation's responses -> {log.validation_data_dir}/STEP.jsonl")
    if log.rollout_data_dir:
        records.append(f"every step's responses -> {log.rollout_data_dir}/STEP.jsonl")
    line = f"validation: {', '.join(when) if when else 'none'}"
    return line + (f"; records {'; '.join(records)}" if records else "")


def _batch_lines(plan: TrainerPlan) -> list[str]:
    """The run length and the batch schedule."""
    out: list[str] = []
    if plan.length is not None:
        out += ["", f"run: {plan.length.describe()}", _validation_line(plan)]
    if plan.batch:
        out += ["", "batch schedule (per training step; mini-batches count prompts)"]
        rows = []
        for b in plan.batch:
            micro = (
                f"budget {b.max_token_len_per_micro_batch} tok, <= {b.max_micro_batches_per_mini_batch} micro"
                if b.use_dynamic_bsz
                else f"{b.micro_batch_size_per_rank} x {b.micro_batches_per_mini_batch}"
            )
            rows.append(
                (b.role, b.prompts_per_step, b.responses_per_step, f"{b.mini_batches_per_step} x {b.mini_batch_prompts}",
                 b.responses_per_mini_batch, b.dp, b.responses_per_mini_batch_per_rank, micro, b.max_seq_len,
                 b.ppo_epochs, b.optimizer_steps_per_training_step, b.optimizer_steps_total,
                 "" if b.even else "uneven!")
            )  # fmt: skip
        out += _table(
            ("role", "prompts", "responses", "mini-batches", "resp/mini", "dp", "resp/rank", "micro x accum",
             "max seq", "epochs", "opt steps/step", "opt steps", ""),
            rows,
        )  # fmt: skip
    return out


def _passes_lines(plan: TrainerPlan) -> list[str]:
    """The log-prob passes of a step."""
    out: list[str] = []
    if plan.passes is not None:
        sp = plan.passes
        old = {"recompute": "an actor forward pass", "rollout": "the rollout's", "update": "no pass"}
        ref = "none (no KL term)"
        if sp.ref_log_prob:
            ref = "a ref forward pass"
            if sp.ref_from == "adapters-off":
                ref += " of the actor's engine with its LoRA adapters off (the base model: no ref worker, no copy)"
            ref += ", in one call with the old log-probs" if sp.fused else ""
        out += [
            "",
            f"log-prob passes per step: old log-probs {old[sp.old_log_prob]} ({sp.reason}); ref log-probs {ref}",
        ]
    forward = []
    for role in plan.roles:
        if role == "rollout":  # (its log-probs come with generation; a separate rollout's engine samples)
            continue
        s = plan.engine(role).settings
        cut = (
            f"budget {s.forward_max_token_len} tok"
            if s.forward_use_dynamic_bsz
            else f"{s.forward_micro_batch_size} rows"
        )
        forward.append(f"{role} {cut}")
    out.append(f"forward passes' micro-batches: {', '.join(forward)}")
    return out


def _optim_lines(plan: TrainerPlan) -> list[str]:
    """The lr schedules, with their table elided to the rows that change."""
    out: list[str] = []
    for o in plan.optim:
        wsd = (
            f", WSD tail {counted(o.wsd_decay_steps, 'step')} {o.wsd_decay_style}"
            if o.wsd_decay_steps is not None
            else ""
        )
        out += [
            "",
            f"lr schedule {o.role}: {o.optimizer}, lr {o.lr:g} -> min {o.min_lr:g}, warmup {counted(o.warmup_steps, 'step')} "
            f"from {o.lr_warmup_init:g}, {_after_warmup(o.decay_style, o.decay_steps)}{wsd}; "
            f"weight decay {o.weight_decay:g}; one lr per training step",
        ]
        rows = [
            (row.step, row.scheduler_step, f"{row.lr:.6g}", "" if row.update else "no update")
            for row in o.table
        ]
        keep: set[int] = {0, 1, 2, len(rows) - 3, len(rows) - 2, len(rows) - 1}
        first_update = next((i for i, row in enumerate(o.table) if row.update), 0)
        for offset in (o.warmup_steps - 1, o.warmup_steps):
            keep.add(first_update + offset)
        if o.wsd_decay_steps is not None:
            keep.add(first_update + o.decay_steps - o.wsd_decay_steps)
        lines = _table(("step", "sched", "lr", ""), rows, "    ")
        shown = [lines[0]]
        last = -1
        for i in sorted(k for k in keep if 0 <= k < len(rows)):
            if i > last + 1:
                shown.append(f"    ... ({_rows(i - last - 1)})")
            shown.append(lines[i + 1])
            last = i
        if last < len(rows) - 1:
            shown.append(f"    ... ({_rows(len(rows) - 1 - last)})")
        out += shown
    return out


def _profile_lines(plan: TrainerPlan) -> list[str]:
    """The profile targets and folders."""
    out: list[str] = []
    p = plan.profile
    out += [
        "",
        f"profile: tool {p.tool}"
        + (f", {p.mode}, steps {list(p.steps)} -> {p.save_path}" if p.enabled else " (off)"),
    ]
    if p.enabled:
        out += _table(
            ("role", "worker", "ranks"), [(t.role, t.worker, _ranks_text(t.ranks)) for t in p.targets]
        )
        out += _elide([f"    {f}" for f in p.folders], 6, 2)
    out += [f"  note: {n}" for n in p.notes]
    return out


def _checkpoint_lines(plan: TrainerPlan) -> list[str]:
    """Checkpoint steps, contents and resume."""
    out: list[str] = []
    ck = plan.checkpoint
    out += [""]
    if ck.enabled:
        out.append(
            f"checkpoints: steps {_ranks_text(ck.save_steps) if len(ck.save_steps) > 12 else list(ck.save_steps)} "
            f"(every {ck.save_freq} and the last), keep "
            f"{'all' if ck.max_ckpt_to_keep is None else ck.max_ckpt_to_keep}{', async' if ck.async_save else ''}, "
            f"about {_size_text(ck.size_bytes)} each (the free space each save needs)"
        )
        for rc in ck.roles:
            hf = f" + {rc.hf_path_template}" if rc.hf_path_template else ""
            out.append(
                f"  {rc.role}: save {', '.join(rc.save_contents)}; load {', '.join(rc.load_contents)} -> {rc.path_template}{hf}"
            )
        out.append(f"  latest: {ck.latest_file}")
    else:
        out.append("checkpoints: none (trainer.save_freq = 0)")
    out.append(f"  resume ({ck.resume_mode}): {ck.resume}")
    return out


def _memory_lines(plan: TrainerPlan) -> list[str]:
    """The memory estimate per device, stage and pool."""
    out: list[str] = []
    mem = plan.memory
    if mem.device_memory_gib is not None:
        dev = f"{mem.device_memory_gib:g} GiB"
    elif plan.resources.device == "cpu":  # rlconf.host_memory: the check uses this machine's RAM
        dev = "cpu: checked against this machine's memory per worker"
    else:
        dev = "not checked (cluster.device_memory_gib: null)"
    out += ["", f"memory estimate per device (GiB; device {dev})"]
    out += _table(
        ("role", "pool", "stage", "params", "weights", "grads", "optimizer", "activations", "logits", "total", "offloaded"),
        [
            (m.role, m.pool, m.stage, _fmt_count(m.params_per_device), f"{m.params_gib:.2f}", f"{m.grads_gib:.2f}",
             f"{m.optimizer_gib:.2f}", f"{m.activations_gib:.2f}", f"{m.logits_gib:.2f}", f"{m.total_gib:.2f}",
             ", ".join(m.offloaded) or "-")
            for m in mem.roles
        ],
    )  # fmt: skip
    layers = {lay.role: lay.layers_per_stage for lay in plan.layouts}
    for m in mem.roles:
        if len(m.stage_totals_gib) > 1:
            per_stage = " | ".join(
                f"{i}: {counted(n, 'layer')} {gib:.2f}"
                for i, (n, gib) in enumerate(zip(layers[m.role], m.stage_totals_gib, strict=True))
            )
            out.append(f"  {m.role} per stage (layers, GiB): {per_stage}")
    for pm in mem.pools:
        verdict = "" if pm.fits is None else (" fits" if pm.fits else " DOES NOT FIT")
        out.append(
            f"  {pm.pool}: peak {pm.peak_gib:.2f} GiB during {pm.peak_phase} (rank {pm.rank}){verdict}"
        )
    out += [f"  note: {n}" for n in mem.notes]
    return out


def _size_text(nbytes: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 1024:.0f} KiB"


def counted(n: int, noun: str) -> str:
    """`1 step`, `2 steps`: a count with its noun in the number it needs."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _rows(n: int) -> str:
    return counted(n, "row")


def _after_warmup(style: str, steps: int) -> str:
    """The lr schedule after warmup: a constant lr holds, it does not decay."""
    span = counted(steps, "step")
    return f"then constant for {span}" if style == "constant" else f"{style} decay over {span}"
