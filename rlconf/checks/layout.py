"""Rules of the parallel layouts and device pools: model parallel against the worlds, engine support, MoE, the rollout's engine and placement, heads and layers against tp / pp, batch layouts over dp.

Each rule registers itself in rlconf.rules with `@rule(name, fields...)` when this module is imported
(rlconf.validate imports every check module, in the order the docs list the rules).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

from rlconf.checks.values import sizes_ok
from rlconf.config import (
    LAYOUT_FIELDS,
    MegatronConfig,
    RLConfig,
)
from rlconf.errors import Issue, error, warning
from rlconf.fields import get_path
from rlconf.model_spec import (
    expert_layout_issues,
)
from rlconf.plan.roles import (
    actor_world,
    builds_model_arch,
    configured_roles,
    data_parallel,
    forward_batching,
    gathers_params_async,
    head_issues,
    layer_split_issues,
    megatron_roles,
    model_parallel,
    pipeline_split,
    ref_from_adapters,
    role_spec,
    role_world,
    rollout_tp,
    separate_devices,
    total_devices,
    trained_roles,
    uses_ref,
)
from rlconf.rules import rule


@rule(
    "world-divisible-by-model-parallel",
    "cluster.nnodes",
    "cluster.gpus_per_node",
    "*.megatron.tensor_model_parallel_size",
    "*.megatron.pipeline_model_parallel_size",
    "*.megatron.context_parallel_size",
    "*.megatron.expert_model_parallel_size",
    "*.megatron.expert_tensor_parallel_size",
    "*.num_devices",
)
def world_divisible(c: RLConfig) -> Iterator[Issue]:
    """Each Megatron role's world size is divisible by tp x pp x cp, and by the expert layout."""
    if not sizes_ok(c):
        return
    for prefix, m, world in megatron_roles(c):
        mp = model_parallel(m)
        if world < 1:
            continue  # reported by the pool rule
        if world % mp:
            yield error(
                f"{prefix}.megatron.tensor_model_parallel_size",
                f"{prefix} world size {world} is not divisible by tp x pp x cp = "
                f"{m.tensor_model_parallel_size} x {m.pipeline_model_parallel_size} x {m.context_parallel_size} = {mp}",
                f"choose tp, pp and cp whose product divides {world}, or change cluster.nnodes x cluster.gpus_per_node",
                "world-divisible-by-model-parallel",
            )
            continue
        etp = m.expert_tensor_parallel_size or m.tensor_model_parallel_size
        ep_mp = etp * m.expert_model_parallel_size * m.pipeline_model_parallel_size
        if world % ep_mp:
            yield error(
                f"{prefix}.megatron.expert_model_parallel_size",
                f"{prefix} world size {world} is not divisible by expert tp x ep x pp = {ep_mp}",
                "choose expert_model_parallel_size and expert_tensor_parallel_size that divide the world / pp",
                "world-divisible-by-model-parallel",
            )


@rule(
    "engine-support",
    "*.megatron.context_parallel_size",
    "*.megatron.expert_model_parallel_size",
    "*.megatron.expert_tensor_parallel_size",
    "*.megatron.sequence_parallel",
    "model.arch.num_moe_experts",
    "model.arch.moe_ffn_hidden_size",
    "model.arch.ffn_hidden_size",
)
def engine_support(c: RLConfig) -> Iterator[Issue]:
    """Layouts the Megatron engine does not run yet. Context parallel runs through the engine's own SDPA
    attention (rltrain/megatron/context_parallel.py), with dense and mixture-of-experts layers (each CP rank
    routes its own tokens; megatron reduces the router's token counts over TP x CP) and with pipeline
    parallel (each stage's CP ranks send their own chunks' activations on), virtual pipeline parallel
    included: not with megatron's `local` or Transformer Engine attention. Expert parallel runs on mixture-of-experts models: for the
    built-in `model.arch` each role's ep divides num_moe_experts and its expert tp the expert width (the
    plan checks a config.json's architecture the same way), and a dense model takes no ep."""
    for prefix, m, _ in megatron_roles(c):
        if m.context_parallel_size > 1:
            cp_path = f"{prefix}.megatron.context_parallel_size"
            unsupported = [
                (c.model.attention_backend in ("local", "te"),
                 f"with model.attention_backend: {c.model.attention_backend}", "model.attention_backend: sdpa"),
            ]  # fmt: skip
            for bad, what, instead in unsupported:
                if bad:
                    yield error(
                        cp_path,
                        f"context parallel is not supported by the rlplan Megatron engine {what} yet",
                        f"use context_parallel_size: 1 or {instead}",
                        "engine-support",
                    )
        if not builds_model_arch(c, prefix) or not sizes_ok(c):
            continue  # config.json: the plan checks it; a size < 1: positive-size reports it
        for path, message, fix in expert_layout_issues(
            c.model.arch, "model.arch", m.expert_model_parallel_size,
            m.expert_tensor_parallel_size or m.tensor_model_parallel_size, m.tensor_model_parallel_size,
            m.sequence_parallel, gathers_params_async(f"{prefix}.megatron", m),
        ):  # fmt: skip
            yield error(f"{prefix}.megatron.{path}", message, fix, "engine-support")


@rule(
    "moe", "actor.router_replay", "model.arch.num_moe_experts", "rollout.engine", "rollout.multi_turn.enable"
)
def moe_options(c: RLConfig) -> Iterator[Issue]:
    """Mixture-of-experts options need a MoE model: actor.router_replay on the built-in `model.arch` needs
    num_moe_experts (a config.json model is checked when the run builds it), and the routing is recorded by
    the embedded rollout engine (in the actor's layout or resharded to a tp of its own), not by vLLM."""
    if not c.actor.router_replay:
        return
    if c.model.path is None and c.model.arch.num_moe_experts is None:
        yield error("actor.router_replay", "router replay needs a mixture-of-experts model; model.arch is dense "
                    "(num_moe_experts: null)", "set actor.router_replay: false, or a MoE model "
                    "(model.arch.num_moe_experts, or model.path to a MoE checkpoint)", "moe")  # fmt: skip
    if c.rollout.engine != "embedded":
        yield error("actor.router_replay", f"router replay records the routing of the embedded rollout engine, "
                    f"not rollout.engine: {c.rollout.engine}", "use rollout.engine: embedded or "
                    "actor.router_replay: false", "moe")  # fmt: skip
    if c.rollout.multi_turn.enable:
        yield error("actor.router_replay", "router replay records one generation call per batch; a multi-turn "
                    "rollout generates in turns, whose routings are not joined yet",
                    "set actor.router_replay: false, or rollout.multi_turn.enable: false", "moe")  # fmt: skip


@rule(
    "rollout-engine",
    "rollout.engine",
    "rollout.tensor_model_parallel_size",
    "actor.megatron.tensor_model_parallel_size",
    "actor.megatron.pipeline_model_parallel_size",
    "actor.megatron.expert_model_parallel_size",
)
def rollout_engine(c: RLConfig) -> Iterator[Issue]:
    """A rollout tp of its own must divide or be a multiple of the actor's tp (the refit gathers or splits
    inside tp groups); rollout.engine: vllm needs CUDA and an importable vLLM (an optional extra), and its
    refit streams the weights of an actor without pipeline or expert parallel."""
    r, tp = c.rollout, c.actor.megatron.tensor_model_parallel_size
    rtp = r.tensor_model_parallel_size
    # A separate rollout receives whole tensors (the push) and slices them for any tp of its own.
    regrouped = r.placement == "colocated"
    if (
        regrouped
        and isinstance(rtp, int)
        and isinstance(tp, int)
        and rtp >= 1
        and tp >= 1
        and max(rtp, tp) % min(rtp, tp)
    ):
        choices = sorted({d for d in range(1, tp + 1) if tp % d == 0} | {tp * 2, tp * 4})
        yield error(
            "rollout.tensor_model_parallel_size",
            f"rollout tp = {rtp} neither divides nor is a multiple of the actor's tp = {tp}, so the actor's "
            "tensor-parallel shards cannot be regrouped into the rollout's",
            f"use one of {', '.join(map(str, choices))} (or null: the actor's layout, no weight copy)",
            "rollout-engine",
        )
    if r.engine == "vllm":
        installed = importlib.util.find_spec("vllm") is not None
        if c.cluster.device != "cuda":
            missing = "" if installed else " (and vLLM, an optional extra, is not installed here)"
            yield error(
                "rollout.engine",
                f"vLLM runs on CUDA devices only, but cluster.device = {c.cluster.device}{missing}",
                "use rollout.engine: embedded (rlplan's own engine, any device)",
                "rollout-engine",
            )
        elif not installed:
            yield error(
                "rollout.engine",
                "rollout.engine is vllm, but vLLM is not installed here (it is an optional extra: a CUDA-only "
                "wheel that needs its own torch version)",
                "pip install 'rlplan[vllm]' on a CUDA host, or use rollout.engine: embedded",
                "rollout-engine",
            )
        m = c.actor.megatron
        # weight_sync.iter_hf_weights gathers tp shards only: the refit cannot stream pp stages or experts.
        for name, size in (("pipeline_model_parallel_size", m.pipeline_model_parallel_size),
                           ("expert_model_parallel_size", m.expert_model_parallel_size)):  # fmt: skip
            if isinstance(size, int) and size > 1:
                yield error(
                    f"actor.megatron.{name}",
                    f"rollout.engine: vllm refits from an actor without {name.split('_model')[0]} parallel; "
                    f"{name} = {size}",
                    f"use actor.megatron.{name}: 1 (raise tensor_model_parallel_size instead), or "
                    "rollout.engine: embedded (it reshards any actor layout)",
                    "rollout-engine",
                )


@rule(
    "ref-layout-matches-actor",
    "ref.megatron.*_size",
    "actor.megatron.*_size",
)
def ref_layout(c: RLConfig) -> Iterator[Issue]:
    """The reference policy lives in the actor's processes (colocated), so it uses the actor's layout (with
    actor.lora there is no reference engine: the ref log-probs are the actor's with its adapters off)."""
    if not uses_ref(c) or c.actor.lora.rank > 0:
        return
    for name in LAYOUT_FIELDS:
        ref_v, act_v = getattr(c.ref.megatron, name), getattr(c.actor.megatron, name)
        if ref_v != act_v:
            yield error(
                f"ref.megatron.{name}",
                f"ref {name} = {ref_v} differs from the actor's {act_v}; the reference policy runs in the actor's "
                "processes and shares its parallel groups",
                f"set ref.megatron.{name} = {act_v}",
                "ref-layout-matches-actor",
            )


@rule("device-pools", "*.placement", "*.num_devices", "cluster.gpus_per_node", "cluster.nnodes")
def device_pools(c: RLConfig) -> Iterator[Issue]:
    """Separate rollout / critic / reward-model pools have devices and leave some for the actor."""
    for role in configured_roles(c):
        spec = role_spec(role)
        if not spec.separable:
            continue
        prefix, section = spec.section, spec.section_of(c)
        placement, n = section.placement, section.num_devices
        if placement == "separate" and n < 1:
            yield error(
                f"{prefix}.num_devices",
                f"{prefix} has its own pool (placement: separate) but num_devices = {n}",
                "give it at least 1 device, or use placement: colocated",
                "device-pools",
            )
        if placement == "colocated" and n:
            yield warning(
                f"{prefix}.num_devices",
                f"num_devices = {n} is ignored with placement: colocated",
                "remove num_devices or use placement: separate",
                "device-pools",
            )
    if total_devices(c) >= 1 and actor_world(c) < 1:
        yield error(
            "cluster.gpus_per_node",
            f"separate pools use {separate_devices(c)} of {total_devices(c)} devices, none is left for the actor",
            "add devices or shrink the separate pools",
            "device-pools",
        )


PUSH_TIMEOUT_RANGE_S = (1.0, 86400.0)
"""rollout.push_timeout_s bounds: a store connect takes about a second at most; a day is far beyond any push."""


@rule(
    "rollout-placement",
    "rollout.placement",
    "rollout.num_devices",
    "rollout.engine",
    "rollout.tensor_model_parallel_size",
    "rollout.push_timeout_s",
    "algorithm.off_policy_steps",
    "actor.megatron.expert_model_parallel_size",
    "cluster.device",
)
def rollout_placement(c: RLConfig) -> Iterator[Issue]:
    """A separate rollout runs the embedded engine on whole tensor-parallel groups of its own devices and
    gets its weights by a push from the trainer; generating ahead (off_policy_steps > 0) needs it."""
    r, steps = c.rollout, c.algorithm.off_policy_steps
    if isinstance(steps, int) and steps < 0:
        yield error("algorithm.off_policy_steps", f"off_policy_steps = {steps} is negative",
                    "use 0 (on-policy) or the number of steps generation may run ahead", "rollout-placement")  # fmt: skip
    if not PUSH_TIMEOUT_RANGE_S[0] <= r.push_timeout_s <= PUSH_TIMEOUT_RANGE_S[1]:
        # Below a second the push groups cannot even connect to their store; above a day the process
        # groups' millisecond timeouts overflow (and a stuck push would hold the devices that long).
        yield error("rollout.push_timeout_s",
                    f"push_timeout_s = {r.push_timeout_s} is outside [{PUSH_TIMEOUT_RANGE_S[0]:g}, "
                    f"{PUSH_TIMEOUT_RANGE_S[1]:g}] seconds",
                    "use the most seconds a weight push may take, e.g. 600", "rollout-placement")  # fmt: skip
    if r.placement == "colocated":
        if isinstance(steps, int) and steps > 0:
            yield error(
                "algorithm.off_policy_steps",
                f"off_policy_steps = {steps} generates the next batch while the current one trains, which needs "
                "devices of its own for the rollout; rollout.placement is colocated",
                "set rollout.placement: separate and rollout.num_devices (the trainer keeps the other devices), "
                "or off_policy_steps: 0",
                "rollout-placement",
            )
        return
    if c.cluster.device == "npu":
        yield error(
            "rollout.placement",
            "the weight push to a separate rollout pool runs over gloo (cpu) or NCCL (cuda); HCCL is not wired",
            "use rollout.placement: colocated on npu",
            "rollout-placement",
        )
    if r.engine != "embedded":
        yield error(
            "rollout.engine",
            f"rollout.placement: separate runs the embedded engine; rollout.engine = {r.engine}",
            "use rollout.engine: embedded, or rollout.placement: colocated",
            "rollout-placement",
        )
    tp = rollout_tp(c)
    if r.num_devices >= 1 and isinstance(tp, int) and tp >= 1 and r.num_devices % tp:
        yield error(
            "rollout.num_devices",
            f"the separate rollout's {r.num_devices} devices do not hold whole tensor-parallel groups of {tp}",
            f"use a multiple of {tp} devices, or set rollout.tensor_model_parallel_size to a divisor of "
            f"{r.num_devices}",
            "rollout-placement",
        )
    ep = c.actor.megatron.expert_model_parallel_size
    if isinstance(ep, int) and ep > 1:
        yield error(
            "actor.megatron.expert_model_parallel_size",
            f"the weight push to a separate rollout streams tensor-parallel shards; with expert parallel = {ep} "
            "each trainer rank holds other experts",
            "use actor.megatron.expert_model_parallel_size: 1 with rollout.placement: separate, or "
            "rollout.placement: colocated",
            "rollout-placement",
        )


@rule(
    "heads-divisible-by-tp",
    "model.arch.num_attention_heads",
    "model.arch.num_query_groups",
    "*tensor_model_parallel_size",
)
def heads_divisible(c: RLConfig) -> Iterator[Issue]:
    """Attention heads are divisible by each role's tensor parallel size, and query groups (KV heads) divide
    it or are divisible by it (megatron replicates KV heads when tp exceeds their count; rlconf.tp_heads)."""
    if c.model.path is not None or not sizes_ok(c):
        return  # the architecture comes from config.json; the plan checks it
    a = c.model.arch
    layouts = [(p, m.tensor_model_parallel_size) for p, m, _ in megatron_roles(c) if builds_model_arch(c, p)]
    layouts.append(("rollout", rollout_tp(c)))
    for prefix, tp in layouts:
        field = f"{prefix}.tensor_model_parallel_size" if prefix == "rollout" else (
            f"{prefix}.megatron.tensor_model_parallel_size")  # fmt: skip
        yield from head_issues(
            a.num_attention_heads, a.num_query_groups, tp, field, "model.arch.", f" ({prefix})"
        )
    if a.num_attention_heads % a.num_query_groups:
        yield error(
            "model.arch.num_query_groups",
            f"num_attention_heads = {a.num_attention_heads} is not a multiple of num_query_groups = {a.num_query_groups}",
            "use a number of query groups that divides the number of heads",
            "heads-divisible-by-tp",
        )


@rule(
    "layers-divisible-by-pp",
    "model.arch.num_layers",
    "*.megatron.pipeline_model_parallel_size",
    "*.megatron.virtual_pipeline_model_parallel_size",
    "*.megatron.num_layers_in_first_pipeline_stage",
    "*.megatron.num_layers_in_last_pipeline_stage",
    "*.megatron.account_for_embedding_in_pipeline_split",
    "*.megatron.account_for_loss_in_pipeline_split",
)
def layers_divisible(c: RLConfig) -> Iterator[Issue]:
    """The layers split into pp (x vpp) stages as megatron-core splits them (rlconf.pipeline_split): evenly,
    or with num_layers_in_first/last_pipeline_stage or the account_for_* options; vpp needs pp > 1."""
    if not sizes_ok(c):
        return
    for prefix, m, _ in megatron_roles(c):
        pp, vpp = m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size
        if vpp is not None and pp <= 1:
            yield error(
                f"{prefix}.megatron.virtual_pipeline_model_parallel_size",
                "virtual pipeline stages need pipeline_model_parallel_size > 1",
                "set virtual_pipeline_model_parallel_size: null, or raise pipeline_model_parallel_size",
                "layers-divisible-by-pp",
            )
            continue
        if not builds_model_arch(c, prefix):
            continue  # the plan checks the layers of a config.json
        yield from layer_split_issues(
            pipeline_split(c.model.arch.num_layers, pp, vpp, m),
            f"{prefix}.megatron.pipeline_model_parallel_size",
            f"model.arch.num_layers = {c.model.arch.num_layers}",
        )


@rule("sequence-parallel-needs-tp", "*.megatron.sequence_parallel", "*.megatron.tensor_model_parallel_size")
def sequence_parallel(c: RLConfig) -> Iterator[Issue]:
    """sequence_parallel with tp = 1 is switched off (a warning, as megatron does; the plan shows it off)."""
    for prefix, m, _ in megatron_roles(c):
        if m.sequence_parallel and m.tensor_model_parallel_size == 1:
            yield warning(
                f"{prefix}.megatron.sequence_parallel",
                "sequence_parallel needs tensor_model_parallel_size > 1; it is switched off for this run",
                "set sequence_parallel: false, or raise tensor_model_parallel_size",
                "sequence-parallel-needs-tp",
            )


def _batch_checks(
    c: RLConfig,
    prefix: str,
    mini: int,
    micro: int,
    dynamic: bool,
    token_budget: int,
    world: int,
    m: MegatronConfig,
) -> Iterator[Issue]:
    n = c.rollout.n
    tbs = c.data.train_batch_size
    dp = data_parallel(
        world, m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    )
    if tbs % mini:
        yield error(
            f"{prefix}.ppo_mini_batch_size",
            f"ppo_mini_batch_size = {mini} does not divide data.train_batch_size = {tbs}",
            f"use a divisor of {tbs} (prompts per mini-batch)",
            "mini-batch-divides-batch",
        )
    if dynamic:
        need = c.data.max_prompt_length + c.rollout.max_response_length
        if token_budget < need:
            yield error(
                f"{prefix}.ppo_max_token_len_per_gpu",
                f"token budget {token_budget} is smaller than one full sequence "
                f"(max_prompt_length + max_response_length = {need})",
                f"set ppo_max_token_len_per_gpu >= {need}",
                "token-budget-fits-sequence",
            )
        return
    if dp < 1:
        return  # the layout rule reports it
    if (tbs * n) % (dp * micro):
        yield error(
            f"{prefix}.ppo_micro_batch_size_per_gpu",
            f"responses per step (train_batch_size x rollout.n = {tbs} x {n} = {tbs * n}) are not divisible by "
            f"data-parallel size x micro-batch = {dp} x {micro}",
            "choose train_batch_size, rollout.n and the micro-batch so the responses split evenly",
            "batch-divisible-by-dp-micro",
        )
    per_rank = mini * n / dp
    if per_rank < micro:
        yield error(
            f"{prefix}.ppo_micro_batch_size_per_gpu",
            f"a mini-batch gives each of {dp} data-parallel ranks {per_rank:g} responses, fewer than "
            f"ppo_micro_batch_size_per_gpu = {micro}",
            f"lower the micro-batch to <= {int(per_rank)} or raise ppo_mini_batch_size",
            "mini-batch-covers-micro",
        )
    elif per_rank != int(per_rank) or int(per_rank) % micro:
        yield error(
            f"{prefix}.ppo_mini_batch_size",
            f"a mini-batch of {mini} prompts x {n} responses over {dp} data-parallel ranks gives {per_rank:g} "
            f"responses per rank, not a multiple of ppo_micro_batch_size_per_gpu = {micro}",
            "make ppo_mini_batch_size x rollout.n / dp a multiple of the micro-batch",
            "mini-batch-covers-micro",
        )


@rule(
    "batch-layout",
    "data.train_batch_size",
    "rollout.n",
    "*.ppo_mini_batch_size",
    "*.ppo_micro_batch_size_per_gpu",
    "*.use_dynamic_bsz",
    "*.ppo_max_token_len_per_gpu",
    "*.log_prob_use_dynamic_bsz",
    "*.log_prob_max_token_len_per_gpu",
    "data.max_prompt_length",
    "rollout.max_response_length",
)
def batch_layout(c: RLConfig) -> Iterator[Issue]:
    """Batches split evenly: mini-batches divide the batch; responses divide over dp x micro-batch; a
    mini-batch covers a micro-batch per rank; the token budget fits one full sequence (the update's and the
    log-prob passes'); a reference budget that LoRA's reference (the actor's engine) would not use is
    reported."""
    if not sizes_ok(c) or actor_world(c) < 1:
        return
    for spec in trained_roles(c):
        r = spec.section_of(c)
        if (world := role_world(c, spec.name)) >= 1:
            yield from _batch_checks(
                c, spec.section, r.ppo_mini_batch_size, r.ppo_micro_batch_size_per_gpu, r.use_dynamic_bsz,
                r.ppo_max_token_len_per_gpu, world, r.megatron,
            )  # fmt: skip
    yield from _log_prob_budgets(c)


def _log_prob_budgets(c: RLConfig) -> Iterator[Issue]:
    """The log-prob passes' token budget (`forward_batching`: a log_prob_max_token_len_per_gpu, else the
    actor's ppo_max_token_len_per_gpu) fits one full sequence wherever they cut by tokens; reported at the
    field that gave it, once (an update budget that cuts the update too is _batch_checks' to report)."""
    need = c.data.max_prompt_length + c.rollout.max_response_length
    reported: set[str] = set()
    for name in configured_roles(c):
        spec = role_spec(name)
        if spec.log_prob_budget is None or spec.token_budget is None:
            continue
        if name == "ref" and ref_from_adapters(c):
            for field in ("log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu"):
                if getattr(c.ref, field) is not None:
                    yield warning(
                        f"ref.{field}",
                        f"ref.{field} has no effect: with LoRA the reference log-probs come from the actor's "
                        "engine with its adapters off, in the actor's log-prob micro-batches",
                        f"remove ref.{field}, or set actor.{field} (the old log-probs' and the reference's)",
                        "log-prob-budget-unused",
                    )
            continue
        _, dynamic, budget = forward_batching(c, name)
        if not dynamic or budget is None or budget >= need:
            continue
        if get_path(c, spec.log_prob_budget).log_prob_max_token_len_per_gpu is not None:
            path = f"{spec.log_prob_budget}.log_prob_max_token_len_per_gpu"
        elif get_path(c, spec.token_budget).use_dynamic_bsz:
            continue
        else:
            path = f"{spec.token_budget}.ppo_max_token_len_per_gpu"
        if path in reported:
            continue
        reported.add(path)
        yield error(
            path,
            f"the log-prob passes' token budget {budget} is smaller than one full sequence "
            f"(max_prompt_length + max_response_length = {need})",
            f"set {path.rsplit('.', 1)[1]} >= {need}",
            "token-budget-fits-sequence",
        )
