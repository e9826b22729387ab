"""Translation of a verl config: Hydra input (overrides, interpolations), the table applied key by key, verl's
defaults and rlplan's derived settings, then rlplan's rules and plan on the result.

No key is dropped silently: each input key is mapped, reported unmapped with its row's reason, or reported as
an unknown verl key with a did-you-mean against the table. verl's defaults are applied where they differ
from rlplan's and change the run (`verl_default` on a row; e.g. `trainer.device` is cuda in verl), so an
override list translates to the run verl would have made. rlplan-specific consequences (the ref in the
actor's layout, the critic enabled by gae) are added as derived settings.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rlconf.config import LAYOUT_FIELDS, RLConfig
from rlconf.errors import ConfigError, Issue, IssueSet, error, warning
from rlconf.fields import field_types, strip_optional
from rlconf.verl.keys import NO_DEFAULT, SKIP, VerlKey, VerlValueError
from rlconf.verl.table import (
    FSDP_KEYS,
    FSDP_ROWS,
    IN_ACTOR,
    MEGATRON_ROLES,
    VERL_KEYS,
    did_you_mean_key,
    find_row,
)


# --------------------------------------------------------------------------------------- Hydra input
@dataclass(frozen=True)
class Override:
    """One Hydra command-line override: `key=value` (set), `+key=value` (add), `++key=value` (force),
    `~key` (delete)."""

    op: Literal["set", "add", "force", "delete"]
    key: str
    value: Any
    text: str


_HYDRA_KEY = re.compile(r"^[A-Za-z_][\w-]*(\.[A-Za-z_0-9][\w-]*)*$")
_YAML_ONLY_BOOLS = {"yes", "no", "on", "off", "y", "n"}


def parse_value(text: str) -> Any:
    """A Hydra override value: quoted -> string; otherwise YAML (lists, null, true, 1e-6 -> float)."""
    from rlconf.load import parse_yaml

    stripped = text.strip()
    if stripped == "":
        return ""
    if len(stripped) >= 2 and stripped[0] == stripped[-1] and stripped[0] in "'\"":
        return stripped[1:-1]
    if stripped.lower() in _YAML_ONLY_BOOLS:
        return stripped
    try:
        value = parse_yaml(stripped, "override")
    except ConfigError:
        return stripped
    if isinstance(value, dict) and not stripped.startswith("{"):
        return stripped  # `a: b` is a string in Hydra
    return value


def parse_override(text: str) -> Override:
    """Parse one Hydra override; raises ConfigError naming the override when it cannot be read."""
    body, op = text.strip(), "set"
    if body.startswith("~"):
        op, body = "delete", body[1:]
    elif body.startswith("++"):
        op, body = "force", body[2:]
    elif body.startswith("+"):
        op, body = "add", body[1:]
    key, sep, raw = body.partition("=")
    key = key.strip()
    if not _HYDRA_KEY.match(key) or (op != "delete" and not sep):
        raise ConfigError(
            [error(key or text, f"cannot read the verl override {text!r}",
                   "write key=value, +key=value, ++key=value or ~key (dotted verl keys)", "override-syntax")],
            "overrides",
        )  # fmt: skip
    return Override(op, key, parse_value(raw) if sep else None, text)  # type: ignore[arg-type]


def flatten_verl(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys of every leaf of a nested verl config (lists are leaves; empty sections set nothing)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_verl(value, path + "."))
        else:
            out[path] = value
    return out


MAX_INTERPOLATED_CHARS = 64 << 10
"""Longest string an interpolation may expand to (verl's own values are paths and names)."""


def _interpolations(text: str) -> list[tuple[int, int, str]]:
    """(start, end, expression) of every top-level `${...}` in a string (braces inside may nest)."""
    found, i = [], text.find("${")
    while i >= 0:
        depth, j = 0, i + 1
        while j < len(text):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                break
            j += 1
        if depth:
            break  # unbalanced: not an interpolation
        found.append((i, j + 1, text[i + 2 : j]))
        i = text.find("${", j + 1)
    return found


class _Unresolved(Exception):
    pass


def _subtree(values: Mapping[str, Any], path: str) -> dict[str, Any] | None:
    sub = {k[len(path) + 1 :]: v for k, v in values.items() if k.startswith(path + ".")}
    return sub or None


def _lookup(expr: str, key: str, values: Mapping[str, Any]) -> Any:
    """The value of one interpolation `${expr}` written at `key`."""
    default: Any = NO_DEFAULT
    if expr.startswith("oc.select:"):
        path, comma, dflt = expr.removeprefix("oc.select:").partition(",")
        default = parse_value(dflt) if comma else None
        expr = path.strip()
    elif ":" in expr:
        raise _Unresolved(f"resolver `{expr.split(':', 1)[0]}` is not evaluated")
    if expr.startswith("."):
        dots = len(expr) - len(expr.lstrip("."))
        parent = key.split(".")[:-dots]
        expr = ".".join([*parent, expr.lstrip(".")])
    if expr in values:
        return values[expr]
    sub = _subtree(values, expr)
    if sub is not None:
        return sub
    if default is not NO_DEFAULT:
        return default
    raise _Unresolved(f"`{expr}` is not set")


def resolve_interpolations(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Resolve `${key}`, `${.sibling}` and `${oc.select:key,default}` against the other keys.

    Returns the resolved keys and, for keys that could not be resolved, the reason (those keys are
    removed from the result). A reference to a section copies its keys.
    """
    out = dict(values)
    failed: dict[str, str] = {}
    for _ in range(10):  # chains of references resolve in a few rounds
        changed = False
        for key in list(out):
            value = out[key]
            if not isinstance(value, str) or "${" not in value:
                continue
            spans = _interpolations(value.strip())
            if not spans:
                continue
            try:
                if len(spans) == 1 and spans[0][:2] == (0, len(value.strip())):
                    new = _lookup(spans[0][2], key, out)
                else:
                    new, last = "", 0
                    for start, end, expr in _interpolations(value):
                        new += value[last:start] + str(_lookup(expr, key, out))
                        last = end
                        if len(new) > MAX_INTERPOLATED_CHARS:
                            # ${a}${a} chained 40 times doubles 40 times: stop before the machine's memory does
                            raise ConfigError([error(key, f"its interpolation {value[:80]!r} expands to more than "
                                                     f"{MAX_INTERPOLATED_CHARS:,} characters",
                                                     "write the value itself instead of the chain of references",
                                                     "verl-import")])  # fmt: skip
                    new += value[last:]
            except _Unresolved as exc:
                failed[key] = str(exc)
                del out[key]
                changed = True
                continue
            if isinstance(new, dict):
                del out[key]
                out.update({f"{key}.{k}": v for k, v in flatten_verl(new).items()})
            else:
                out[key] = new
            changed = True
        if not changed:
            break
    for key in [k for k, v in out.items() if isinstance(v, str) and _interpolations(v)]:
        failed[key] = "a reference cycle"
        del out[key]
    return out, failed


# ---------------------------------------------------------------------------------------- translation
@dataclass(frozen=True)
class Mapped:
    """A verl key that set an rlplan field (`value` is None when the row asked for nothing to be set)."""

    verl: str
    verl_value: Any
    rlplan: str
    value: Any
    note: str
    applied: bool = True


@dataclass(frozen=True)
class Unmapped:
    """A verl key with no rlplan setting: why (`reason`, see REASONS) and what to do (`note`)."""

    verl: str
    verl_value: Any
    reason: str
    note: str


@dataclass(frozen=True)
class Derived:
    """An rlplan setting the input did not spell out: a verl default or a consequence of rlplan's design."""

    rlplan: str
    value: Any
    note: str


@dataclass(frozen=True)
class Translation(IssueSet):
    """The result of importing a verl config: settings, what mapped and what did not, and our verdict."""

    settings: dict[str, Any]
    mapped: tuple[Mapped, ...]
    unmapped: tuple[Unmapped, ...]
    derived: tuple[Derived, ...]
    notes: tuple[str, ...]
    issues: tuple[Issue, ...]
    origin: dict[str, str]
    config: RLConfig
    plan_checked: bool = False
    sources: tuple[str, ...] = field(default=())

    @property
    def valid(self) -> bool:
        return not self.errors


def _rlplan_type(path: str) -> Any:
    cls: Any = RLConfig
    for part in path.split("."):
        cls = field_types(cls)[part]
    return cls


def rlplan_default(path: str) -> Any:
    from rlconf.fields import get_path

    return get_path(RLConfig(), path)


def _current(settings: Mapping[str, Any], path: str, default: Any = NO_DEFAULT) -> Any:
    """The value an rlplan path gets: the imported setting, else `default`, else rlplan's own default."""
    if path in settings:
        return settings[path]
    return rlplan_default(path) if default is NO_DEFAULT else default


def plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def show(value: Any) -> str:
    from rlconf.render import scalar_text

    return scalar_text(plain(value))


def nest(settings: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, value in settings.items():
        node = out
        parts = path.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


def gather_input(
    data: Mapping[str, Any] | None, overrides: Sequence[str]
) -> tuple[dict[str, Any], list[str], dict[str, str]]:
    """Flat verl keys from a (nested) config and Hydra overrides, interpolations resolved.

    Returns the keys, notes for the report, and the keys whose interpolation could not be resolved.
    """
    notes: list[str] = []
    flat: dict[str, Any] = {}
    if data is not None:
        data = dict(data)
        defaults = data.pop("defaults", None)  # a Hydra input dict, not an rlplan config
        if defaults is not None and defaults != ["_self_"]:
            notes.append(
                f"the file's `defaults` list ({defaults!r}) is not resolved: only the keys written in the file "
                "are read. Pass a resolved config (`python -m verl.trainer.main_ppo --cfg job --resolve ...` "
                "prints one) or the override list of your run script."
            )
        flat = flatten_verl(data)
    parsed = [parse_override(text) for text in overrides]
    for ov in parsed:
        under = [k for k in flat if k == ov.key or k.startswith(ov.key + ".")]
        if ov.op == "delete":
            if not under:
                notes.append(f"`{ov.text}` deletes a key that is not set")
            for k in under:
                del flat[k]
            continue
        for k in under:
            del flat[k]
        if isinstance(ov.value, Mapping) and ov.value:
            flat.update({f"{ov.key}.{k}": v for k, v in flatten_verl(ov.value).items()})
        elif not (isinstance(ov.value, Mapping) and not ov.value):
            flat[ov.key] = ov.value
    missing = [k for k, v in flat.items() if v == "???"]
    for k in missing:
        notes.append(f"`{k}` is ??? (mandatory, unset) in the input: not translated")
        del flat[k]
    resolved, failed = resolve_interpolations(flat)
    return resolved, notes, failed


def _convert(row: VerlKey, value: Any, ctx: Mapping[str, Any]) -> Any:
    assert row.rlplan is not None
    new = row.convert(value, ctx) if row.convert is not None else value
    if new is None:
        _, optional = strip_optional(_rlplan_type(row.rlplan))
        if not optional:
            return SKIP
    return new


def translate(
    data: Mapping[str, Any] | None = None,
    overrides: Sequence[str] = (),
    *,
    sources: Sequence[str] = (),
    check_plan: bool = True,
) -> Translation:
    """Translate a verl config (nested dict) and Hydra overrides into rlplan settings, then validate them.

    Raises ConfigError only for input that cannot be read (an override that is not `key=value`);
    everything else (unknown keys, untranslatable values, rule violations) is in the Translation.
    """
    values, notes, failed = gather_input(data, overrides)
    mapped: list[Mapped] = []
    unmapped: list[Unmapped] = []
    derived: list[Derived] = []
    issues: list[Issue] = []
    settings: dict[str, Any] = {}
    origin: dict[str, str] = {}

    for key, why in failed.items():
        unmapped.append(Unmapped(key, None, "unresolved", f"its interpolation cannot be resolved: {why}; give "
                                 "the value explicitly"))  # fmt: skip

    # Verl defaults stand in for keys the input leaves unset (also inside interpolations and converters).
    ctx: dict[str, Any] = {r.verl: r.verl_default for r in VERL_KEYS if r.has_default}
    ctx, _ = resolve_interpolations({**ctx, **values})

    def put(path: str, value: Any, source: str) -> None:
        if path in settings and settings[path] != value:
            notes.append(f"{origin[path]} and {source} both set {path}: {source} = {show(value)} is used")
        settings[path] = value
        origin[path] = source

    fsdp = _fsdp_source(values)
    if fsdp:
        notes.insert(0, f"translated from FSDP to megatron ({fsdp}): FSDP shards every weight over all devices; "
                     "rlplan runs megatron with the layout in *.megatron.* (unset: tp = pp = 1, data parallel "
                     "over all devices, distributed optimizer); fsdp_config.param_offload / optimizer_offload "
                     "become *.megatron.param_offload / optimizer_offload. Check the plan's memory per device")  # fmt: skip
    located = [((-1, FSDP_ROWS[k]) if fsdp and k in FSDP_ROWS else find_row(k), k) for k in values]
    order = sorted(range(len(located)), key=lambda i: (located[i][0] is None, (located[i][0] or (0,))[0], i))
    for i in order:
        found, key = located[i]
        value = values[key]
        if found is None:
            unmapped.append(Unmapped(key, value, "unknown", did_you_mean_key(key) or "not a key of verl's "
                                     "ppo_megatron_trainer config known to rlplan"))  # fmt: skip
            continue
        _, row = found
        if row.rlplan is None:
            if row.convert is not None:  # a check: values rlplan cannot run are refused, not dropped
                try:
                    row.convert(value, ctx)
                except VerlValueError as exc:
                    issues.append(error(key, f"{key} = {show(value)}: {exc}", exc.fix, "verl-import"))
                    continue
            unmapped.append(Unmapped(key, value, row.reason or "unsupported", row.note))
            continue
        try:
            new = _convert(row, value, ctx)
        except VerlValueError as exc:
            issues.append(error(row.rlplan, f"{key} = {show(value)}: {exc}", exc.fix, "verl-import"))
            origin.setdefault(row.rlplan, key)
            continue
        if new is SKIP:
            mapped.append(Mapped(key, value, row.rlplan, plain(rlplan_default(row.rlplan)),
                                 row.note or "null in verl: rlplan's default is kept", applied=False))  # fmt: skip
            continue
        mapped.append(Mapped(key, value, row.rlplan, new, row.note))
        put(row.rlplan, new, key)

    def derive(path: str, value: Any, note: str) -> None:
        settings[path] = value
        origin[path] = f"derived: {note}"
        derived.append(Derived(path, value, note))

    _derive_verl_defaults(values, settings, ctx, derive)
    _derive_rlplan_rules(values, settings, derive)
    _derive_greedy_validation(ctx, settings, derive)
    _derive_profiled_roles(values, settings, derive)
    _derive_rollout_pool(values, settings, derive)
    if settings.get("reward.reward_model.enable") is True:
        # verl's reward managers return the reward model's scores alone when it runs (their rm_scores come first)
        if "reward.function" in settings:
            notes.append(f"{origin['reward.function']} is not called by verl while reward_model.enable is true "
                         "(its reward managers return the reward model's scores): reward.function none")  # fmt: skip
        derive("reward.function", "none", "with reward_model.enable verl's reward is the reward model's score "
               "alone (no rule reward)")  # fmt: skip
    elif "reward.function" not in settings and ("data.train_files" in settings):
        # verl's default reward manager scores each row by its data_source: so does this built-in.
        derive("reward.function", "default_compute_score", "verl scores each row by its data_source "
               "(default_compute_score: gsm8k, MATH, DAPO-math / AIME)")  # fmt: skip

    _missing_backends(settings, mapped, issues, origin)
    issues += _tools_not_loaded(values, settings)

    position = {key: i for i, key in enumerate(values)}
    mapped.sort(key=lambda m: position[m.verl])
    unmapped.sort(key=lambda u: position.get(u.verl, -1))
    config, verdict = _check(settings, check_plan)
    issues += verdict + _meaning_changes(config)
    return Translation(
        settings=settings, mapped=tuple(mapped), unmapped=tuple(unmapped), derived=tuple(derived),
        notes=tuple(notes), issues=tuple(issues), origin=origin, config=config,
        plan_checked=check_plan and not any(i.severity == "error" for i in issues), sources=tuple(sources),
    )  # fmt: skip


def _derive_verl_defaults(
    values: Mapping[str, Any],
    settings: dict[str, Any],
    ctx: dict[str, Any],
    derive: Callable[[str, Any, str], None],
) -> None:
    """verl's defaults where they differ from rlplan's, for keys the input leaves unset (the critic's only
    when the run has one)."""
    estimator = _current(settings, "algorithm.adv_estimator", ctx["algorithm.adv_estimator"])
    with_critic = _current(settings, "critic.enable", estimator == "gae") is True
    for row in VERL_KEYS:
        if row.rlplan is not None and row.rlplan.startswith("critic.") and not with_critic:
            continue
        if not row.has_default or row.rlplan is None or row.verl in values or row.rlplan in settings:
            continue
        if row.verl not in ctx:  # an interpolated default whose source is unset: rlplan's default holds
            continue
        new = _convert(row, ctx[row.verl], ctx)
        if new is not SKIP and new != rlplan_default(row.rlplan):
            derive(row.rlplan, new, f"verl's default {row.verl} = {show(ctx[row.verl])}")


def _fsdp_source(values: Mapping[str, Any]) -> str:
    """`key = value` that makes the input an FSDP script ('' for a megatron one)."""
    for key in FSDP_KEYS:
        if str(values.get(key, "")).startswith("fsdp"):
            return f"{key} = {values[key]}"
    for key in values:
        if ".fsdp_config." in key:
            return f"{key} is set"
    return ""


_BACKEND_MODULES = {"wandb": "wandb", "tensorboard": "tensorboard"}
"""logging.backends that need a package rlplan does not depend on (rltrain/metrics.py imports them)."""


def _missing_backends(
    settings: dict[str, Any], mapped: list[Mapped], issues: list[Issue], origin: Mapping[str, str]
) -> None:
    """Drop logger backends whose package is not importable here (the run would stop at its first step),
    keeping console and jsonl, with a warning that says how to get them back."""
    import importlib.util

    backends = settings.get("logging.backends")
    if not isinstance(backends, list):
        return
    missing = [
        b for b in backends if b in _BACKEND_MODULES and importlib.util.find_spec(_BACKEND_MODULES[b]) is None
    ]
    if not missing:
        return
    settings["logging.backends"] = [b for b in backends if b not in missing]
    names = ", ".join(missing)
    for i, m in enumerate(mapped):  # the report shows what the file gets
        if m.rlplan == "logging.backends" and m.applied:
            mapped[i] = dataclasses.replace(m, value=settings["logging.backends"],
                                            note=f"{m.note}; {names} dropped: not installed here")  # fmt: skip
    issues.append(warning(
        "logging.backends", f"{origin.get('logging.backends', 'trainer.logger')} asks for {names}, which is not "
        f"installed here: dropped (the run logs to {', '.join(settings['logging.backends'])})",
        f"pip install {' '.join(missing)} and add it back to logging.backends to log there", "logging"))  # fmt: skip


def _tools_not_loaded(values: Mapping[str, Any], settings: Mapping[str, Any]) -> list[Issue]:
    """A warning when verl's tool YAML named the tools of a multi-turn run and rlplan has none to call."""
    keys = [k for k in ("actor_rollout_ref.rollout.multi_turn.tool_config_path", "data.tool_config_path")
            if values.get(k)]  # fmt: skip
    if (
        not keys
        or settings.get("rollout.multi_turn.enable") is not True
        or settings.get("rollout.multi_turn.tools")
    ):
        return []
    return [warning(
        "rollout.multi_turn.tools", f"{keys[0]} = {values[keys[0]]} names the tools of verl's run; rlplan does not "
        "read verl's tool YAML, so this multi-turn rollout has no tool to call",
        "list the tools in rollout.multi_turn.tools (built-in calculator / python, or module:function / "
        "module:Class of your own)", "verl-import")]  # fmt: skip


def _derive_greedy_validation(
    ctx: Mapping[str, Any], settings: dict[str, Any], derive: Callable[[str, Any, str], None]
) -> None:
    """verl validates greedily unless val_kwargs.do_sample is true, whatever val_kwargs.temperature says."""
    key = "actor_rollout_ref.rollout.val_kwargs.do_sample"
    if ctx[key] is not True and _current(settings, "rollout.val.temperature") != 0:
        derive("rollout.val.temperature", 0.0, f"verl validates greedily while {key} = {show(ctx[key])} "
               "(val_kwargs.temperature is not used then)")  # fmt: skip


def _derive_rlplan_rules(
    values: Mapping[str, Any], settings: dict[str, Any], derive: Callable[[str, Any, str], None]
) -> None:
    """Settings rlplan's design needs where verl's structure differs (each one listed in the report)."""
    estimator = _current(settings, "algorithm.adv_estimator")
    if "critic.enable" not in settings and estimator == "gae":
        derive("critic.enable", True, "verl enables the critic for adv_estimator gae (critic.enable: null)")
    for name in LAYOUT_FIELDS:
        actor_path, ref_path = f"actor.megatron.{name}", f"ref.megatron.{name}"
        if actor_path in settings and ref_path not in settings:
            derive(ref_path, settings[actor_path], IN_ACTOR)
    for verl_prefix, ours in MEGATRON_ROLES:
        tp_key = f"{ours}.tensor_model_parallel_size"
        tp = _current(settings, tp_key)
        if f"{verl_prefix}.sequence_parallel" not in values and isinstance(tp, int) and tp > 1:
            derive(f"{ours}.sequence_parallel", True, "verl's default sequence_parallel = true (tp > 1)")
    if "actor_rollout_ref.model.lora.rank" in values and "actor.lora.alpha" not in settings:
        derive("actor.lora.alpha", 32.0, "verl's Megatron LoRA default lora.alpha = 32")
    if ("data.train_files" in settings or "data.val_files" in settings) and "data.answer_key" not in settings:
        derive("data.answer_key", "reward_model.ground_truth", "verl's parquet files keep the ground truth in "
               "the reward_model column")  # fmt: skip


# verl's workers profile only when their own profiler.enable is true (default false); the colocated actor /
# rollout / ref worker reads the actor's flag (verl/workers/megatron_workers.py), the critic and the reward model
# their own. rlplan's profile.roles names the role calls.
_PROFILED_BY: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("actor_rollout_ref.actor.profiler.enable",
     ("generate_sequences", "actor_compute_log_prob", "ref_compute_log_prob", "actor_update")),
    ("critic.profiler.enable", ("critic_compute_values", "critic_update")),
    ("reward_model.profiler.enable", ("reward_compute",)),
)  # fmt: skip


def _derive_profiled_roles(
    values: Mapping[str, Any], settings: dict[str, Any], derive: Callable[[str, Any, str], None]
) -> None:
    """profile.roles (or profile.tool none) from verl's per-role profiler.enable flags when a tool is set."""
    if _current(settings, "profile.tool") in (None, "none"):
        return
    enabled = [(key, roles) for key, roles in _PROFILED_BY if values.get(key) is True]
    flags = ", ".join(f"{key} = {show(values.get(key, False))}" for key, _ in _PROFILED_BY)
    if not enabled:
        derive("profile.tool", "none", f"verl profiles only workers whose profiler.enable is true ({flags}; "
               "verl's default false): nothing is profiled")  # fmt: skip
        return
    roles = [r for _, rs in enabled for r in rs]
    try:  # only the role calls this run makes (the ref runs only with a KL term, ...)
        from rlconf.load import build_config
        from rlconf.plan.roles import present_passes

        present = present_passes(build_config(nest(settings))[0])
        roles = [r for r in roles if r in present]
    except ConfigError:
        pass  # the settings do not build: validation reports why
    if len(enabled) < len(_PROFILED_BY) and "profile.roles" not in settings:
        derive("profile.roles", roles, f"the roles of the workers whose profiler.enable is true ({flags})")


def _derive_rollout_pool(
    values: Mapping[str, Any], settings: dict[str, Any], derive: Callable[[str, Any, str], None]
) -> None:
    """verl's one-step-off trainer (a config with a rollout pool of its own): rlplan's separate rollout that
    generates the next batch while the current one trains."""
    if "rollout.num_devices" not in settings:
        return
    derive(
        "rollout.placement", "separate", "verl's rollout.nnodes / n_gpus_per_node: a rollout pool of its own"
    )
    if (
        not any(k.startswith("async_training.") for k in values)
        and "algorithm.off_policy_steps" not in settings
    ):
        derive("algorithm.off_policy_steps", 1, "verl's one-step-off trainer generates the next batch while the "
               "current one trains (the batch of step s with the weights after step s - 2)")  # fmt: skip


def _meaning_changes(config: RLConfig) -> list[Issue]:
    """Warnings for translated settings that mean a different number in rlplan (docs/migrating-from-verl.md,
    "Where the numbers differ")."""
    a = config.actor
    if a.loss_agg_mode != "seq-mean-token-sum-norm":
        return []
    rows = "the responses of one micro-batch" if a.use_dynamic_bsz else (
        f"ppo_micro_batch_size_per_gpu = {a.ppo_micro_batch_size_per_gpu}")  # fmt: skip
    return [warning(
        "actor.loss_agg_mode",
        "seq-mean-token-sum-norm is Dr. GRPO's (1/G) sum_i sum_t loss / T in rlplan; verl's drops the 1/G and "
        f"divides by its micro-batch count, so verl's gradient is rlplan's times {rows}",
        "nothing changes the direction of the update; with Adam only actor.optim.clip_grad (now clipping a "
        "smaller gradient) and the eps see the scale: keep the mode, or scale clip_grad down by the same "
        "factor to clip as verl did", "verl-meaning")]  # fmt: skip


def _check(settings: Mapping[str, Any], check_plan: bool) -> tuple[RLConfig, list[Issue]]:
    from rlconf.load import build_config
    from rlconf.validate import check_config

    config, structural = build_config(nest(settings))
    issues = list(structural) + list(check_config(config))
    if check_plan and not any(i.severity == "error" for i in issues):
        from rlconf.plan import compile_plan

        planned = config
        missing = [f for f in config.data.train_files if not os.path.isfile(f)]
        if config.trainer.total_epochs is not None and missing:
            # The prompt files live where the run starts (a verl script's /data/...): plan the rest and say so.
            planned = dataclasses.replace(
                config, trainer=dataclasses.replace(config.trainer, total_epochs=None)
            )
            issues.append(warning(
                "trainer.total_epochs", f"{missing[0]} is not on this machine, so the steps of "
                f"{config.trainer.total_epochs} epochs are not counted here (the plan checked uses "
                f"trainer.total_steps = {config.trainer.total_steps})",
                "run `rlconf plan` where data.train_files are: it counts them and shows the steps", "total-epochs"))  # fmt: skip
        try:
            compile_plan(planned)
        except ConfigError as exc:
            issues += exc.issues
    return config, issues


def translate_sources(file: str | None, overrides: Iterable[str]) -> Translation:
    """Read an optional verl config file and translate it with the overrides (the CLI's entry point)."""
    from rlconf.load import read_config_file

    data = read_config_file(os.path.expanduser(file)) if file is not None else None
    overrides = list(overrides)
    if data is None and not overrides:
        raise ConfigError(
            [
                error(
                    "",
                    "nothing to import",
                    "pass a verl config file and/or verl overrides (key=value)",
                    "usage",
                )
            ],
            "rlconf import-verl",
        )
    sources = ([file] if file else []) + ([f"{len(overrides)} overrides"] if overrides else [])
    return translate(data, overrides, sources=sources)
