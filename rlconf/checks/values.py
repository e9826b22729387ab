"""Single-field checks of every value: each field's type (rule `type`, run first and alone) and the sizes that must be positive (rule `positive-size`).

Each rule registers itself in rlconf.rules with `@rule(name, fields...)` when this module is imported
(rlconf.validate imports every check module, in the order the docs list the rules).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from functools import cache
from typing import Any

from rlconf.config import (
    RLConfig,
)
from rlconf.errors import Issue, error
from rlconf.fields import (
    Leaf,
    field_types,
    get_path,
    is_dataclass_type,
    iter_leaves,
    literal_values,
    strip_optional,
    tuple_item_types,
    type_name,
)
from rlconf.rules import TYPE_RULE, rule

_POSITIVE_INT_FIELDS = re.compile(
    r"(_size|_size_per_gpu|_per_gpu|num_layers|hidden_size|num_attention_heads|num_query_groups|vocab_size"
    r"|max_position_embeddings|kv_channels|_length|total_steps|nnodes|gpus_per_node|ppo_epochs|^rollout\.n"
    r"|max_num_seqs|horizon|val\.n|num_moe_experts|sliding_window)$"
)
# Fields that match the pattern above but may legitimately be zero or negative.
_MAY_BE_NON_POSITIVE = {
    "rollout.top_k",
    "rollout.val.top_k",
    "rollout.num_devices",
    "critic.num_devices",
    "reward.reward_model.num_devices",
}


@cache
def _shape(tp: Any) -> tuple[str, bool, Any]:
    """(kind, whether None is allowed, detail) of a field type, worked out once per type (the walk below
    visits every field of every config compiled)."""
    inner, optional = strip_optional(tp)
    if is_dataclass_type(inner):
        return "section", optional, inner
    if (choices := literal_values(inner)) is not None:
        return "literal", optional, choices
    if (items := tuple_item_types(inner)) is not None:
        return "tuple", optional, items
    kinds = {bool: "bool", int: "int", float: "float", str: "str"}
    return kinds.get(inner, "any"), optional, inner


def _mistyped(value: Any, tp: Any, path: str) -> Iterator[Issue]:
    """The loader's type coercion (rlconf.load), as a check of a config built in Python."""
    kind, optional, detail = _shape(tp)
    if value is None:
        if not optional:
            yield error(path, f"expected {type_name(tp)}, got null", f"set {type_name(tp)}", TYPE_RULE)
        return
    if kind == "section":
        if not isinstance(value, detail):
            yield error(path, f"expected section {detail.__name__}, got {type(value).__name__}",
                        f"give {path} as a {detail.__name__}", TYPE_RULE)  # fmt: skip
            return
        for name, field_tp in field_types(detail).items():
            yield from _mistyped(getattr(value, name), field_tp, f"{path}.{name}" if path else name)
        return
    if kind == "tuple" and isinstance(value, tuple):
        item, variadic = detail
        if not variadic and len(value) != len(item):
            yield error(path, f"expected {len(item)} items, got {len(value)}", f"give {type_name(tp)}",
                        TYPE_RULE)  # fmt: skip
            return
        for i, v in enumerate(value):
            yield from _mistyped(v, item if variadic else item[i], f"{path}[{i}]")
        return
    if kind == "float" and isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):
            yield error(path, f"must be a finite number, got {value}", "write a finite number", TYPE_RULE)
        return
    if kind == "literal":
        ok = value in detail
    elif kind in ("bool", "str"):
        ok = isinstance(value, bool if kind == "bool" else str)
    elif kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = kind == "any"  # a float or tuple field holding something else; no other field types exist
    if not ok:
        yield error(path, f"expected {type_name(tp)}, got {type(value).__name__} {value!r:.60}",
                    f"set {type_name(tp)}", TYPE_RULE)  # fmt: skip


@rule(TYPE_RULE)  # every field: not listed field by field in the docs
def field_value_types(c: RLConfig) -> Iterator[Issue]:
    """Every value has its field's type, and floats are finite. Files and flags are checked for this when
    they are read (rlconf.load); this rule holds configs built in Python to the same standard, and the other
    rules run only on a config that passes it."""
    yield from _mistyped(c, RLConfig, "")


@rule(
    "positive-size",
    "*_size",
    "*_size_per_gpu",
    "*_per_gpu",
    "model.arch.*",
    "*_length",
    "trainer.total_steps",
    "cluster.nnodes",
    "cluster.gpus_per_node",
    "*.ppo_epochs",
    "rollout.n",
    "rollout.max_num_seqs",
    "*.horizon",
    "rollout.val.n",
)
def positive_sizes(c: RLConfig) -> Iterator[Issue]:
    """Sizes, counts, lengths and parallel degrees must be >= 1."""
    for path in _positive_paths():
        value = get_path(c, path)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            yield error(path, f"must be >= 1, got {value}", "use a positive integer", "positive-size")


@cache
def leaves() -> tuple[Leaf, ...]:
    return tuple(iter_leaves(RLConfig))


@cache
def _positive_paths() -> tuple[str, ...]:
    """Fields positive-size checks (the rules that divide call it often: computed once)."""
    return tuple(
        leaf.path
        for leaf in leaves()
        if leaf.path not in _MAY_BE_NON_POSITIVE and _POSITIVE_INT_FIELDS.search(leaf.path)
    )


def sizes_ok(c: RLConfig) -> bool:
    """Whether every size the arithmetic rules divide by is positive (the positivity rule reports the rest)."""
    return not any(True for _ in positive_sizes(c))
