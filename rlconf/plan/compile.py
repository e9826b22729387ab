"""Compiling a config into the plan's parts: models, device pools, rank grids and layer splits, batch
schedules, the lr table, profile targets and checkpoint steps.

The config arrives checked by rlconf.validate (assemble.compile_parts runs it first), the one checker of what
depends on the config alone. The checks here need what only the plan reads or derives: a config.json's
architecture (model-config-json, model-unsupported) against the resolved layouts (heads-divisible-by-tp,
layers-divisible-by-pp, engine-support), under the validator's rule names.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

from rlconf.config import (
    ROLES,
    MegatronConfig,
    ModelArch,
    NpuProfileOptions,
    NsysProfileOptions,
    Optim,
    RLConfig,
    TorchProfileOptions,
)
from rlconf.errors import ConfigError, Issue, error
from rlconf.model_spec import (
    count_parameters,
    expert_layout_issues,
    read_model_arch,
)
from rlconf.pipeline_split import chunk_layer_counts, chunk_starts, split_errors
from rlconf.plan.checkpoint_size import checkpoint_bytes
from rlconf.plan.model_fit import engine_gap_issues, sliding_window_issue
from rlconf.plan.roles import (
    checkpointed_roles,
    data_parallel,
    gathers_params_async,
    head_issues,
    layer_split_issues,
    megatron_of,
    pipeline_split,
    pool_sizes,
    ref_from_adapters,
    role_spec,
    rollout_resharded,
    rollout_tp,
)
from rlconf.plan.types import (
    CONTROLLER,
    MEGATRON_ORDER,
    PROFILE_ROLE_WORKER,
    VOCAB_DIVISIBLE_BY,
    BatchPlan,
    CheckpointPlan,
    CheckpointSave,
    LayerChunk,
    LrRow,
    ModelSpec,
    OptimPlan,
    Placement,
    Pool,
    ProfilePlan,
    ProfileTarget,
    RankCoord,
    Resources,
    RoleCheckpoint,
    RoleLayout,
    RolePath,
    StageLayers,
    StepPasses,
    by_role,
)
from rlconf.run_paths import in_run_folder

# ========================================================================================= roles
# The config was checked by rlconf.validate (assemble.compile_parts runs it first): sizes the arithmetic below
# divides by are positive and the layouts divide the pools. The checks left here need what the plan reads
# or derives: a config.json's architecture against the resolved layouts.
# The roles of a plan and their pools are the role table's (rlconf.plan.roles), which the validator reads too.


# ============================================================================================ model
def _check_sequence_fits(c: RLConfig, arch: ModelArch, source: str, path: str) -> None:
    """rlconf.validate's sliding-window check (rule model-unsupported) and engine gaps (model-engine-support,
    e.g. YaRN) on an architecture read from config.json: `rlconf plan` refuses what `rlconf validate` does."""
    if (issue := sliding_window_issue(c, arch, source, path)) is not None:
        raise ConfigError([issue])
    if gaps := engine_gap_issues(arch, path):
        raise ConfigError(gaps)


def _model_spec(
    name: str, source: str, arch: ModelArch, head: str, used_by: tuple[str, ...], weights: str | None
) -> ModelSpec:
    total, active = count_parameters(arch, head)
    return ModelSpec(name, source, arch, head, total, active, used_by, weights, params_trainable=total)


@dataclass(frozen=True)
class Models:
    policy: ModelSpec
    critic: ModelSpec | None
    reward_model: ModelSpec | None

    def for_role(self, role: str) -> ModelSpec:
        if role == "critic" and self.critic is not None:
            return self.critic
        if role == "reward_model" and self.reward_model is not None:
            return self.reward_model
        return self.policy

    def all(self) -> tuple[ModelSpec, ...]:
        return tuple(m for m in (self.policy, self.critic, self.reward_model) if m is not None)


def resolve_models(c: RLConfig, roles: tuple[str, ...]) -> Models:
    if c.model.path is not None:
        policy_arch, source = (
            read_model_arch(c.model.path, "model.path"),
            os.path.join(c.model.path, "config.json"),
        )
        _check_sequence_fits(c, policy_arch, source, "model.path")
    else:
        policy_arch, source = c.model.arch, "model.arch"  # rlconf.validate checked it (model-unsupported)
        if gaps := engine_gap_issues(policy_arch, None):  # validate's filesystem-free part does not ask
            raise ConfigError(gaps)
    policy_users = tuple(r for r in ("actor", "rollout", "ref") if r in roles)

    def value_model(name: str, path: str | None, path_name: str) -> ModelSpec:
        if path is not None:
            arch, src = read_model_arch(path, path_name), os.path.join(path, "config.json")
            _check_sequence_fits(c, arch, src, path_name)
        else:
            arch, src = policy_arch, source  # the policy's architecture with a value head
        return _model_spec(name, src, arch, "value", (name,), path if path is not None else c.model.path)

    critic = value_model("critic", c.critic.model_path, "critic.model_path") if "critic" in roles else None
    rm_cfg = c.reward.reward_model
    rm = (
        value_model("reward_model", rm_cfg.path, "reward.reward_model.path")
        if "reward_model" in roles
        else None
    )
    policy = _model_spec("policy", source, policy_arch, "lm", policy_users, c.model.path)
    return Models(policy, critic, rm)


# ============================================================================================ resources
def plan_resources(c: RLConfig, roles: tuple[str, ...]) -> Resources:
    gpn = c.cluster.gpus_per_node
    pools: list[Pool] = []
    first = 0
    for name, n, members in pool_sizes(c, roles):
        nodes = tuple(range(first // gpn, (first + n - 1) // gpn + 1))
        pools.append(Pool(name, first, n, nodes, members))
        first += n
    placements: list[Placement] = []
    for role in roles:
        pool = next(p for p in pools if role in p.roles)
        others = tuple(r for r in pool.roles if r != role)
        placements.append(
            Placement(role, pool.name, pool.num_devices, pool.num_devices, c.cluster.device, others)
        )
    return Resources(
        device=c.cluster.device,
        nnodes=c.cluster.nnodes,
        gpus_per_node=gpn,
        total_devices=c.cluster.nnodes * gpn,
        pools=tuple(pools),
        placements=tuple(placements),
    )


# ============================================================================================ layouts
def _split_layers(
    num_layers: int, pp: int, vpp: int | None, m: MegatronConfig | None = None
) -> tuple[tuple[StageLayers, ...], bool]:
    """Layers of each stage. Model order of the chunks is (virtual stage, stage): chunk v of stage p holds
    the (v * pp + p)-th block of layers, as megatron's interleaved schedule lays them out. With megatron's
    uneven options in `m` (num_layers_in_first/last_pipeline_stage, account_for_*) the counts are megatron's
    (rlconf.pipeline_split); an even split that does not divide (only possible without validation) gives
    the earlier chunks one layer more. The flag: every chunk holds the same number of layers."""
    v = vpp or 1
    split = pipeline_split(num_layers, pp, vpp, m)
    if split.uneven and not split_errors(split):
        counts = chunk_layer_counts(split)
        starts = chunk_starts(counts)
        sizes = [counts[p][k] for k in range(v) for p in range(pp)]
        start_of = [starts[p][k] for k in range(v) for p in range(pp)]
        even = len(set(sizes)) == 1
    else:
        base, extra = divmod(num_layers, pp * v)
        sizes = [base + (1 if i < extra else 0) for i in range(pp * v)]
        start_of = [sum(sizes[:i]) for i in range(pp * v)]
        even = extra == 0
    stages = []
    for p in range(pp):
        chunks = tuple(LayerChunk(k, start_of[k * pp + p], sizes[k * pp + p]) for k in range(v))
        stages.append(StageLayers(p, sum(ch.num_layers for ch in chunks), chunks, p == 0, p == pp - 1))
    return tuple(stages), even


def _grid(world: int, tp: int, cp: int, dp: int) -> tuple[RankCoord, ...]:
    coords = []
    for rank in range(world):
        rest, t = divmod(rank, tp)
        rest, c_ = divmod(rest, cp)
        pp_, d = divmod(rest, dp)
        coords.append(RankCoord(rank, pp_, t, c_, d))
    return tuple(coords)


def _padded_vocab(vocab: int, tp: int) -> int:
    multiple = VOCAB_DIVISIBLE_BY * tp
    return -(-vocab // multiple) * multiple


def role_layouts(
    c: RLConfig, roles: tuple[str, ...], resources: Resources, models: Models
) -> tuple[RoleLayout, ...]:
    issues: list[Issue] = []
    layouts: list[RoleLayout] = []
    for role in roles:
        place = next(p for p in resources.placements if p.role == role)
        world = place.world_size
        spec = models.for_role(role)
        arch = spec.arch
        m: MegatronConfig | None = None  # the rollout's own layout: no pipeline
        if role == "rollout" and rollout_resharded(c):
            tp, pp, vpp, cp, ep, etp, sp = rollout_tp(c), 1, None, 1, 1, None, False
            tp_path = "rollout.tensor_model_parallel_size"
        else:
            # Zero-copy: the embedded engine generates with the actor's own weights in the actor's layout.
            prefix, m = megatron_of(c, "actor" if role == "rollout" else role)
            tp, pp, vpp = (
                m.tensor_model_parallel_size,
                m.pipeline_model_parallel_size,
                m.virtual_pipeline_model_parallel_size,
            )
            cp, ep, etp = m.context_parallel_size, m.expert_model_parallel_size, m.expert_tensor_parallel_size
            sp = bool(m.sequence_parallel) and tp > 1
            tp_path = f"{prefix}.tensor_model_parallel_size"
        etp = etp or tp
        # rlconf.validate's world-divisible-by-model-parallel, cluster and rollout-placement rules made the
        # world a whole number of tp x pp x cp (and expert tp x ep x pp) groups.
        if spec.source != "model.arch":
            # validate.py checks model.arch; an architecture read from config.json is checked here, under
            # the same rule names.
            issues += _arch_layout_issues(spec, role, tp_path, tp, pp, vpp, m)
            for field, message, fix in (
                expert_layout_issues(arch, spec.source, ep, etp, tp, sp, gathers_params_async(prefix, m))
                if role != "rollout" and m is not None
                else ()
            ):
                path = tp_path.replace("tensor_model_parallel_size", field)
                issues.append(error(path, message, fix, "engine-support"))
        if arch.multi_latent_attention and cp > 1:
            issues.append(error(
                tp_path.replace("tensor_model_parallel_size", "context_parallel_size"),
                f"{spec.source}: multi-head latent attention (deepseek_v3) with context parallel is not built: "
                "megatron-core 0.16.1's MLA splits its rotary embedding over CP ranks itself, which this engine "
                "neither runs on CPU nor has tested against transformers",
                "use context_parallel_size: 1 (tensor, expert and pipeline parallel split MLA models)",
                "engine-support",
            ))  # fmt: skip
        dp = data_parallel(world, tp, pp, cp)
        stages, even = _split_layers(arch.num_layers, pp, vpp, m)
        layouts.append(
            RoleLayout(
                role=role,
                model=spec.name,
                pool=place.pool,
                world_size=world,
                tp=tp,
                pp=pp,
                vpp=vpp,
                cp=cp,
                ep=ep,
                etp=etp,
                dp=dp,
                expert_dp=world // (etp * ep * pp),
                sequence_parallel=sp,
                order=MEGATRON_ORDER,
                padded_vocab_size=_padded_vocab(arch.vocab_size, tp),
                num_layers=arch.num_layers,
                layers_per_stage=tuple(s.num_layers for s in stages),
                even_layers=even,
                stages=stages,
                grid=_grid(world, tp, cp, dp),
            )
        )
    if issues:
        raise ConfigError(issues)
    return tuple(layouts)


def _arch_layout_issues(
    spec: ModelSpec, role: str, tp_path: str, tp: int, pp: int, vpp: int | None, m: MegatronConfig | None
) -> list[Issue]:
    """rlconf.validate's heads-divisible-by-tp and layers-divisible-by-pp, on a config.json's architecture."""
    a = spec.arch
    issues = head_issues(
        a.num_attention_heads, a.num_query_groups, tp, tp_path, suffix=f" ({spec.source}, {role})"
    )
    if role != "rollout":
        issues += layer_split_issues(
            pipeline_split(a.num_layers, pp, vpp, m),
            tp_path.replace("tensor_model_parallel_size", "pipeline_model_parallel_size"),
            f"num_layers = {a.num_layers} from {spec.source}",
        )
    return issues


# ============================================================================================ batches
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def batch_plans(
    c: RLConfig, roles: tuple[str, ...], layouts: tuple[RoleLayout, ...]
) -> tuple[BatchPlan, ...]:
    plans = []
    max_seq = c.data.max_prompt_length + c.rollout.max_response_length
    for role in ("actor", "critic"):
        if role not in roles:
            continue
        rc = c.actor if role == "actor" else c.critic
        lay = by_role(layouts, role)
        prompts, n = c.data.train_batch_size, c.rollout.n
        mini = rc.ppo_mini_batch_size
        mini_batches = prompts // mini
        per_mini = mini * n
        per_rank = cdiv(per_mini, lay.dp)
        even = prompts % mini == 0 and per_mini % lay.dp == 0
        if rc.use_dynamic_bsz:
            budget = rc.ppo_max_token_len_per_gpu
            # verl packs sequences (before the cp split) up to budget x cp tokens; each cp rank then holds
            # about `budget` tokens. Worst case: every sequence has full length.
            seqs_per_micro = max(1, budget * lay.cp // max_seq)
            micro, micro_batches, max_micro_batches = None, None, cdiv(per_rank, seqs_per_micro)
            tokens = budget
            log_prob_micro = None
        else:
            micro = rc.ppo_micro_batch_size_per_gpu
            micro_batches = cdiv(per_rank, micro)
            max_micro_batches = micro_batches
            even = even and per_rank % micro == 0
            tokens = cdiv(micro * max_seq, lay.cp)
            log_prob_micro = c.actor.log_prob_micro_batch_size_per_gpu if role == "actor" else micro
        steps_per = mini_batches * rc.ppo_epochs
        first_update = 1
        if role == "actor" and "critic" in roles:
            first_update = c.trainer.critic_warmup + 1
        update_steps = max(0, c.trainer.total_steps - first_update + 1)
        plans.append(
            BatchPlan(
                role=role,
                prompts_per_step=prompts,
                responses_per_prompt=n,
                responses_per_step=prompts * n,
                mini_batch_prompts=mini,
                mini_batches_per_step=mini_batches,
                responses_per_mini_batch=per_mini,
                dp=lay.dp,
                responses_per_mini_batch_per_rank=per_rank,
                use_dynamic_bsz=bool(rc.use_dynamic_bsz),
                micro_batch_size_per_rank=micro,
                micro_batches_per_mini_batch=micro_batches,
                max_token_len_per_micro_batch=rc.ppo_max_token_len_per_gpu if rc.use_dynamic_bsz else None,
                max_micro_batches_per_mini_batch=max_micro_batches,
                max_seq_len=max_seq,
                tokens_per_micro_batch_per_rank=tokens,
                ppo_epochs=rc.ppo_epochs,
                optimizer_steps_per_training_step=steps_per,
                update_steps=update_steps,
                first_update_step=first_update,
                optimizer_steps_total=steps_per * update_steps,
                log_prob_micro_batch_size_per_rank=log_prob_micro,
                even=even,
            )
        )
    return tuple(plans)


def step_passes(c: RLConfig, roles: tuple[str, ...], batches: tuple[BatchPlan, ...]) -> StepPasses:
    actor = by_role(batches, "actor")
    on_policy = actor.mini_batches_per_step == 1 and actor.ppo_epochs == 1
    rc = c.algorithm.rollout_correction
    ref = "ref" in roles or ref_from_adapters(c)
    old = "recompute"
    stale = c.algorithm.off_policy_steps
    rollout_is, rollout_rs = rc.rollout_is, rc.rollout_rs
    if stale > 0 and not rc.bypass_mode and rollout_is is None and rollout_rs is None:
        # Decoupled PPO: the ratio compares with the trainer's weights before the update (recomputed) and
        # truncated token weights pi_old / pi_rollout correct for the older behaviour policy.
        rollout_is = "token"
    if rc.bypass_mode:
        old = "rollout"
        reason = "algorithm.rollout_correction.bypass_mode: the sampler's log-probs are the old ones"
    elif stale > 0:
        reason = (
            f"off-policy (algorithm.off_policy_steps = {stale}): the batch was generated with older weights, "
            f"so the ratio compares with the trainer's weights before the update and {rollout_is or 'no'} "
            "importance weights pi_old / pi_rollout"
            + (
                " (token-level, set by the plan: no rollout_correction was given)"
                if rc.rollout_is is None and rollout_is is not None
                else ""
            )
        )
    elif not on_policy:
        reason = (
            f"{actor.optimizer_steps_per_training_step} actor optimizer steps per training step "
            f"({actor.mini_batches_per_step} mini-batches x {actor.ppo_epochs} "
            f"epoch{'' if actor.ppo_epochs == 1 else 's'}) compare with the "
            "weights before the first"
        )
    elif c.algorithm.use_kl_in_reward:
        reason = "on-policy, but algorithm.use_kl_in_reward reads them before the update"
    elif rc.rollout_is is not None or rc.rollout_rs is not None:
        reason = "on-policy, but algorithm.rollout_correction (rollout_is / rollout_rs) weighs the loss"
    else:
        old = "update"
        reason = "on-policy (one mini-batch, one epoch): the update's own forward (ratio exactly 1)"
    return StepPasses(
        actor_on_policy=on_policy and stale == 0,
        old_log_prob=old,
        ref_log_prob=ref,
        fused=ref and old == "recompute",
        reason=reason,
        rollout_is=rollout_is,
        rollout_rs=rollout_rs,
        off_policy_steps=stale,
        ref_from="ref" if "ref" in roles or not ref else "adapters-off",
    )


# ============================================================================================ lr schedule
def _warmup_steps(o: Optim, total_steps: int) -> int:
    if o.lr_warmup_steps is not None:
        return o.lr_warmup_steps
    return round(o.lr_warmup_steps_ratio * total_steps)


def resolved_optim(o: Optim, total_steps: int) -> Optim:
    decay = o.lr_decay_steps if o.lr_decay_steps is not None else total_steps
    wsd = o.lr_wsd_decay_steps if o.lr_wsd_decay_steps is not None else max(1, round(0.1 * decay))
    return replace(
        o, lr_warmup_steps=_warmup_steps(o, total_steps), lr_decay_steps=decay, lr_wsd_decay_steps=wsd
    )


def lr_at(o: Optim, num_steps: int, total_steps: int) -> float:
    """megatron-core OptimizerParamScheduler.get_lr() at `num_steps` for a resolved optimizer config.

    Follows megatron exactly, plus two guards where megatron asserts instead: a decay span of zero
    steps (warmup >= decay steps) gives min_lr after warmup, and the result is clamped to >= min_lr.
    """
    r = resolved_optim(o, total_steps)
    warmup, decay, wsd = r.lr_warmup_steps or 0, r.lr_decay_steps or 0, r.lr_wsd_decay_steps or 0
    max_lr, min_lr, init = float(o.lr), float(o.min_lr), float(o.lr_warmup_init)
    if warmup > 0 and num_steps <= warmup:
        return init + (max_lr - init) * num_steps / warmup
    if o.lr_decay_style == "constant":
        return max_lr
    if num_steps > decay:
        return min_lr
    if o.lr_decay_style == "inverse-square-root":
        lr = max_lr * max(warmup, 1) ** 0.5 / max(num_steps, 1) ** 0.5
        return max(min_lr, lr)
    span = decay - warmup
    if span <= 0:
        return min_lr
    ratio = min(max((num_steps - warmup) / span, 0.0), 1.0)
    if o.lr_decay_style == "linear":
        coeff = 1.0 - ratio
    elif o.lr_decay_style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:  # WSD: stable at max_lr, then the last `wsd` steps of the decay span anneal
        anneal_start = decay - wsd
        if num_steps <= anneal_start or wsd <= 0:
            coeff = 1.0
        else:
            w = min((num_steps - anneal_start) / wsd, 1.0)
            if o.lr_wsd_decay_style == "linear":
                coeff = 1.0 - w
            elif o.lr_wsd_decay_style == "cosine":
                coeff = 0.5 * (math.cos(math.pi * w) + 1.0)
            elif o.lr_wsd_decay_style == "exponential":
                coeff = 2.0 * 0.5**w - 1.0
            else:  # minus_sqrt
                coeff = 1.0 - math.sqrt(w)
    return max(min_lr, min_lr + coeff * (max_lr - min_lr))


def optim_plans(c: RLConfig, batches: tuple[BatchPlan, ...]) -> tuple[OptimPlan, ...]:
    plans = []
    total = c.trainer.total_steps
    for b in batches:
        o = role_spec(b.role).section_of(c).optim
        r = resolved_optim(o, total)
        rows = []
        for step in range(1, total + 1):
            updates = step >= b.first_update_step
            sched = max(0, step - b.first_update_step)
            rows.append(LrRow(step, sched, updates, lr_at(o, sched, total), float(o.weight_decay)))
        wsd = o.lr_decay_style == "WSD"
        plans.append(
            OptimPlan(
                role=b.role,
                optimizer=o.optimizer,
                lr=float(o.lr),
                min_lr=float(o.min_lr),
                lr_warmup_init=float(o.lr_warmup_init),
                warmup_steps=r.lr_warmup_steps or 0,
                decay_steps=r.lr_decay_steps or 0,
                decay_style=o.lr_decay_style,
                wsd_decay_steps=r.lr_wsd_decay_steps if wsd else None,
                wsd_decay_style=o.lr_wsd_decay_style if wsd else None,
                weight_decay=float(o.weight_decay),
                betas=(float(o.betas[0]), float(o.betas[1])),
                eps=float(o.eps),
                clip_grad=float(o.clip_grad),
                granularity="training_step",
                table=tuple(rows),
            )
        )
    return tuple(plans)


# ============================================================================================ profile
def profile_plan(c: RLConfig, roles: tuple[str, ...], layouts: tuple[RoleLayout, ...]) -> ProfilePlan:
    p = c.profile
    save_path = in_run_folder(c.trainer.output_dir, p.save_path)
    mode = "discrete" if p.discrete else "continuous"
    options: TorchProfileOptions | NpuProfileOptions | NsysProfileOptions | None = None
    if p.tool == "torch":
        options = p.torch
    elif p.tool == "npu":
        options = p.npu
    elif p.tool == "nsys":
        options = p.nsys
    notes: list[str] = []
    steps = tuple(sorted({s for s in p.steps if 1 <= s <= c.trainer.total_steps}))
    dropped = sorted({s for s in p.steps if s not in steps})
    if dropped:
        notes.append(f"steps {dropped} are outside the run's steps 1..{c.trainer.total_steps}; not profiled")
    # LoRA: the ref log-probs run in the actor's worker (its adapters off), there is no ref worker.
    lora_ref = "ref" not in roles and ref_from_adapters(c)
    worker_of = {**PROFILE_ROLE_WORKER, **({"ref_compute_log_prob": "actor"} if lora_ref else {})}
    present = tuple(r for r in ROLES if worker_of[r] in roles or r == "reward_compute")
    wanted = tuple(dict.fromkeys(p.roles)) or present
    missing = [r for r in wanted if r not in present]
    if missing:
        notes.append(f"roles {missing} do not run in this config; not profiled")
    profiled = tuple(r for r in ROLES if r in wanted and r in present)

    def ranks_of(world: int, label: str) -> tuple[int, ...]:
        if p.all_ranks:
            return tuple(range(world))
        kept = tuple(sorted({r for r in p.ranks if r < world}))
        outside = sorted({r for r in p.ranks if r >= world})
        if outside:
            notes.append(f"{label}: ranks {outside} are outside its world of {world}; skipped there")
        return kept

    targets: list[ProfileTarget] = []
    if mode == "discrete":
        for role in profiled:
            worker = worker_of[role]
            if worker not in roles:  # reward_compute without a reward model runs in the controller
                targets.append(ProfileTarget(role, CONTROLLER, (0,)))
            else:
                targets.append(
                    ProfileTarget(role, worker, ranks_of(by_role(layouts, worker).world_size, role))
                )
    else:
        # One trace per step over the actor pool's processes (they run actor, rollout and ref).
        targets.append(ProfileTarget("e2e", "actor", ranks_of(by_role(layouts, "actor").world_size, "e2e")))
        if any(lay.pool != "actor_pool" for lay in layouts):
            notes.append("continuous mode records the actor pool's processes; separate pools are not traced")
    enabled = p.tool != "none" and bool(steps)
    if p.tool != "none" and not steps:
        notes.append("no step of the run is listed in profile.steps: nothing is profiled")
    folders = (
        tuple(f"{save_path}/step_{s}/{t.role}/rank_{r}" for s in steps for t in targets for r in t.ranks)
        if enabled
        else ()
    )
    return ProfilePlan(
        enabled=enabled,
        tool=p.tool,
        mode=mode,
        save_path=save_path,
        steps=steps if enabled else (),
        roles=profiled if enabled else (),
        targets=tuple(targets) if enabled else (),
        folders=folders,
        options=options if enabled else None,
        notes=tuple(notes) if p.tool != "none" else (),
    )


# ============================================================================================ checkpoint
def checkpoint_plan(
    c: RLConfig, roles: tuple[str, ...], models: Models, layouts: tuple[RoleLayout, ...]
) -> CheckpointPlan:
    t = c.trainer
    root = in_run_folder(t.output_dir, "checkpoints")
    if t.save_freq > 0:
        steps = sorted({s for s in range(t.save_freq, t.total_steps + 1, t.save_freq)} | {t.total_steps})
    else:
        steps = []
    role_cks = []
    for spec, ck in checkpointed_roles(c, roles):
        role = spec.name
        hf = "hf_model" in ck.save_contents
        tmpl = f"{root}/global_step_{{step}}/{role}"
        role_cks.append(
            RoleCheckpoint(
                role=role,
                save_contents=tuple(ck.save_contents),
                load_contents=tuple(ck.load_contents),
                async_save=bool(ck.async_save),
                path_template=tmpl,
                hf_path_template=f"{tmpl}/huggingface" if hf else None,
            )
        )
    saves = []
    for s in steps:
        step_dir = f"{root}/global_step_{s}"
        # Joined, not str.format-ed from the templates: trainer.output_dir may hold braces of its own.
        rps = tuple(
            RolePath(
                rc.role,
                f"{step_dir}/{rc.role}",
                f"{step_dir}/{rc.role}/huggingface" if rc.hf_path_template else None,
            )
            for rc in role_cks
        )
        saves.append(CheckpointSave(s, step_dir, rps))
    keep = t.max_ckpt_to_keep
    retained = tuple(steps[-keep:]) if keep is not None else tuple(steps)
    latest = f"{root}/latest_checkpointed_iteration.txt"
    resume_from = None
    if t.resume_mode == "auto":
        resume = f"resume from the step named in {latest} when it exists, else start at step 1"
    elif t.resume_mode == "resume_path":
        resume_from = t.resume_from_path
        resume = f"resume from {resume_from}"
    else:
        resume = "start at step 1 (existing checkpoints are ignored)"
    return CheckpointPlan(
        enabled=bool(steps),
        save_freq=t.save_freq,
        save_steps=tuple(steps),
        root=root,
        latest_file=latest,
        max_ckpt_to_keep=keep,
        retained_steps=retained,
        async_save=any(rc.async_save for rc in role_cks),
        roles=tuple(role_cks),
        saves=tuple(saves),
        resume_mode=t.resume_mode,
        resume_from=resume_from,
        resume=resume,
        size_bytes=checkpoint_bytes(
            c,
            tuple(role_cks),
            {rc.role: models.for_role(rc.role) for rc in role_cks},
            {lay.role: lay.world_size for lay in layouts},
        ),
    )
