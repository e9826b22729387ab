"""The memory check of a compiled plan and its advice: variants of the config (re-compiled) that fit."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from rlconf.config import (
    RLConfig,
)
from rlconf.errors import ConfigError, error
from rlconf.fields import get_path
from rlconf.host_memory import memory_budget
from rlconf.plan.assemble import _compile
from rlconf.plan.engine import megatron_of
from rlconf.plan.types import TrainerPlan


# ============================================================================================ memory check
def _check_memory(config: RLConfig, plan: TrainerPlan) -> None:
    budget = memory_budget(config)  # on cpu without device_memory_gib: this host's RAM per worker
    if budget is None:
        return
    dev = budget.gib
    issues = []
    for pool in plan.memory.pools:
        if pool.peak_gib <= dev:
            continue
        phase = next(p for p in pool.phases if p.phase == pool.peak_phase)
        big = [p for p in sorted(phase.parts, key=lambda p: -p.gib) if p.gib >= 0.05]
        parts = " + ".join(f"{p.label} {p.gib:.1f}" for p in big) or "small parts"
        others = [p.phase for p in pool.phases if p.total_gib > dev and p.phase != pool.peak_phase]
        message = (
            f"estimated peak memory per device is {pool.peak_gib:,.1f} GiB, more than {budget.text}: on "
            f"{pool.pool} rank {pool.rank}, {pool.peak_phase} needs {parts} GiB"
            + (f" ({', '.join(others)} also exceed{'s' if len(others) == 1 else ''} it)" if others else "")
            + "; the run would run out of memory after start-up"
        )
        options = _memory_options(config, pool.pool, pool.peak_gib, dev)
        fix = "change one or more of (estimated peak after each change alone): " + "; ".join(options)
        issues.append(error("cluster.device_memory_gib", message, fix, "memory-exceeds-device"))
    if issues:
        raise ConfigError(issues)


def _set(config: object, dotted: str, value: object) -> RLConfig:
    """`config` with the field at a dotted path replaced (frozen dataclasses all the way down)."""
    head, _, rest = dotted.partition(".")
    inner = value if not rest else _set(getattr(config, head), rest, value)
    return replace(config, **{head: inner})  # type: ignore[type-var]


def _role_variants(
    config: RLConfig, plan: TrainerPlan, role: str, shared: bool
) -> Iterator[tuple[str, RLConfig]]:
    """Single changes that lower one role's memory on its devices: (flag text, changed config)."""
    lay = plan.layout(role)
    arch = plan.model(lay.model).arch
    prefix, m = megatron_of(config, role)
    tp2, pp2 = lay.tp * 2, lay.pp * 2
    if (
        lay.world_size % (tp2 * lay.pp * lay.cp) == 0
        and arch.num_attention_heads % tp2 == 0
        and arch.num_query_groups % tp2 == 0
    ):
        yield (
            f"{prefix}.tensor_model_parallel_size={tp2}",
            _set(config, f"{prefix}.tensor_model_parallel_size", tp2),
        )
    if lay.world_size % (lay.tp * pp2 * lay.cp) == 0 and arch.num_layers % (pp2 * (lay.vpp or 1)) == 0:
        yield (
            f"{prefix}.pipeline_model_parallel_size={pp2}",
            _set(config, f"{prefix}.pipeline_model_parallel_size", pp2),
        )
    if role in ("actor", "critic"):
        rc = config.actor if role == "actor" else config.critic
        if not m.use_distributed_optimizer and lay.dp * lay.cp > 1:
            yield (
                f"{prefix}.use_distributed_optimizer=true",
                _set(config, f"{prefix}.use_distributed_optimizer", True),
            )
        ov = m.override_transformer_config
        if ov.recompute_granularity != "full":
            full = replace(
                ov, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
            )
            yield (
                f"{prefix}.override_transformer_config.recompute_granularity=full (with recompute_method=uniform, "
                "recompute_num_layers=1)",
                _set(config, f"{prefix}.override_transformer_config", full),
            )
        if rc.use_dynamic_bsz:
            half = rc.ppo_max_token_len_per_gpu // 2
            if half >= config.data.max_prompt_length + config.rollout.max_response_length:
                yield (
                    f"{role}.ppo_max_token_len_per_gpu={half}",
                    _set(config, f"{role}.ppo_max_token_len_per_gpu", half),
                )
        elif rc.ppo_micro_batch_size_per_gpu > 1:
            half = rc.ppo_micro_batch_size_per_gpu // 2
            yield (
                f"{role}.ppo_micro_batch_size_per_gpu={half}",
                _set(config, f"{role}.ppo_micro_batch_size_per_gpu", half),
            )
        # Offloading frees the device for the other roles' calls.
        if shared and not (m.param_offload and m.grad_offload and m.optimizer_offload):
            off = replace(m, param_offload=True, grad_offload=True, optimizer_offload=True)
            yield (
                f"{prefix}.param_offload=true, grad_offload=true, optimizer_offload=true",
                _set(config, prefix, off),
            )
    elif shared and not m.param_offload:
        yield f"{prefix}.param_offload=true", _set(config, f"{prefix}.param_offload", True)
    # Log-prob / value / reward forwards materialise fp32 logits for their whole micro-batch.
    micro_field = {
        "actor": "actor.log_prob_micro_batch_size_per_gpu",
        "ref": "ref.log_prob_micro_batch_size_per_gpu",
        "reward_model": "reward.reward_model.micro_batch_size_per_gpu",
    }
    dynamic = config.actor.use_dynamic_bsz and role in ("actor", "ref")
    if role in micro_field and not dynamic:
        path = micro_field[role]
        value = get_path(config, path)
        if isinstance(value, int) and value > 1:
            yield f"{path}={value // 2}", _set(config, path, value // 2)


def _evaluate_variants(config: RLConfig, pool: str) -> list[tuple[float, str, RLConfig]]:
    """Every single change that lowers the pool's peak: (new peak, flag text, changed config), best first."""
    base = _compile(config)
    current = next(p.peak_gib for p in base.memory.pools if p.pool == pool)
    members = next(p for p in base.resources.pools if p.name == pool).roles
    shared = len([r for r in members if r != "rollout"]) > 1
    results: list[tuple[float, str, RLConfig]] = []
    for role in members:
        if role == "rollout":
            continue
        for label, changed in _role_variants(config, base, role, shared):
            try:
                plan = _compile(changed)
            except ConfigError:
                continue  # the change breaks another rule (e.g. a batch no longer divides): not offered
            peak = next(p.peak_gib for p in plan.memory.pools if p.pool == pool)
            if peak < current - 1e-6:
                results.append((peak, label, changed))
    results.sort(key=lambda r: (r[0], r[1]))
    return results


def _memory_options(config: RLConfig, pool: str, current: float, dev: float) -> list[str]:
    """Concrete config changes for an over-full pool, each with the pool's re-estimated peak, best first;
    when no single change fits, also a combination found greedily (best change, then the next, ...)."""
    singles = _evaluate_variants(config, pool)
    out = [f"{label} -> {peak:.1f} GiB{' (fits)' if peak <= dev else ''}" for peak, label, _ in singles[:8]]
    if singles and singles[0][0] > dev:
        chosen: dict[str, str] = {}  # field -> its latest change (tp=2 then tp=4 shows tp=4)
        cfg, peak = config, current
        for _ in range(4):
            step = _evaluate_variants(cfg, pool)
            if not step:
                break
            peak, label, cfg = step[0]
            chosen.pop(label.split("=")[0], None)
            chosen[label.split("=")[0]] = label
            if peak <= dev:
                break
        if len(chosen) > 1 or (chosen and peak < singles[0][0]):
            verdict = "fits" if peak <= dev else "still too much: add devices"
            head = "together: " if len(chosen) > 1 else ""
            out.insert(0, f"{head}{' AND '.join(chosen.values())} -> {peak:.1f} GiB ({verdict})")
    out.append("more devices (a larger dp shards the distributed optimizer further)")
    out.append(
        "cluster.device_memory_gib, if the device really has more memory (null skips this check on "
        "accelerators; on cpu null checks this machine's memory)"
    )
    return out
