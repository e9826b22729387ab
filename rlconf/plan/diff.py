"""A plan as JSON (`plan_to_dict`, plan.json) and the difference of two plans (`rlconf diff --plan`)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import fields, is_dataclass

from rlconf.plan.types import TrainerPlan


def plan_to_dict(plan: TrainerPlan) -> dict[str, object]:
    """The plan as plain JSON data (dicts, lists, str, int, float, bool, None); `json.dumps` works on it."""
    out = _jsonable(plan)
    assert isinstance(out, dict)
    # Keyed by model name (`models.policy.params_total`): a model is looked up by name, never by position.
    out["models"] = {m["name"]: m for m in out["models"]}  # type: ignore[index, union-attr]
    return out


def diff_plans(
    a: TrainerPlan | Mapping[str, object],
    b: TrainerPlan | Mapping[str, object],
    *,
    collapse_records: bool = False,
) -> list[tuple[str, object, object]]:
    """Differences between two plans (or plan dicts) as (dotted path, value in a, value in b), sorted.

    Lists of records are keyed by their identity when they have one (`layouts[role=actor].tp`,
    `optim[role=actor].table[step=3].lr`), otherwise by index (`models[0]...`); lists of plain values
    compare whole. A value missing on one side is the string "<missing>". With `collapse_records`, a record
    or section only one plan has (a critic's `layouts[role=critic]`, `models.critic`) is one entry, `(path, "<missing>", "<added: N
    values>")` or `(path, "<removed: N values>", "<missing>")`, instead of one per value.
    """
    da = plan_to_dict(a) if isinstance(a, TrainerPlan) else dict(a)
    db = plan_to_dict(b) if isinstance(b, TrainerPlan) else dict(b)
    ra: set[str] = set()
    rb: set[str] = set()
    fa, fb = dict(_flatten(da, records=ra)), dict(_flatten(db, records=rb))
    out: list[tuple[str, object, object]] = []
    for key in sorted(fa.keys() | fb.keys()):
        va, vb = fa.get(key, MISSING), fb.get(key, MISSING)
        if va != vb or type(va) is not type(vb):
            out.append((key, va, vb))
    if not collapse_records:
        return out
    added, removed = _outermost(rb - ra), _outermost(ra - rb)

    def owner(key: str) -> str | None:
        return next((r for r in added | removed if key.startswith((r + ".", r + "["))), None)

    counts: dict[str, int] = {}
    kept: list[tuple[str, object, object]] = []
    for key, va, vb in out:
        record = owner(key)
        if record is None:
            kept.append((key, va, vb))
        else:
            counts[record] = counts.get(record, 0) + 1
    for record, n in counts.items():
        if record in added:
            kept.append((record, MISSING, f"<added: {n} values>"))
        else:
            kept.append((record, f"<removed: {n} values>", MISSING))
    return sorted(kept, key=lambda change: change[0])


def _outermost(records: set[str]) -> set[str]:
    """The records not inside another record of the set."""
    return {r for r in records if not any(r != o and r.startswith((o + ".", o + "[")) for o in records)}


MISSING = "<missing>"
_IDENTITY_KEYS = ("role", "name", "pool", "phase", "label", "step", "rank")


def _flatten(
    value: object, prefix: str = "", records: set[str] | None = None
) -> Iterator[tuple[str, object]]:
    """(dotted path, leaf value) of every leaf; `records` collects the paths of every section and
    identity-keyed record."""
    if isinstance(value, dict):
        if not value:
            yield prefix, {}
        elif prefix and records is not None:
            records.add(prefix)  # a section (`models.critic`) one plan may lack as a whole
        for k, v in value.items():
            yield from _flatten(v, f"{prefix}.{k}" if prefix else str(k), records)
        return
    if isinstance(value, list) and value and all(isinstance(x, dict) for x in value):
        key = next(
            (
                k
                for k in _IDENTITY_KEYS
                if all(k in x for x in value) and len({repr(x[k]) for x in value}) == len(value)
            ),
            None,
        )
        for i, item in enumerate(value):
            label = f"{key}={item[key]}" if key is not None else str(i)
            if key is not None and records is not None:
                records.add(f"{prefix}[{label}]")
            yield from _flatten(item, f"{prefix}[{label}]", records)
        return
    yield prefix, value


def _jsonable(obj: object) -> object:
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(x) for x in obj]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        # JSON has no NaN / Infinity; the plan never produces them from a checked config.
        return obj if math.isfinite(obj) else str(obj)
    return str(obj)
