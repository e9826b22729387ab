"""Hypothesis strategies driven by the config types: structurally valid configs, random dicts and overrides.

`typed_configs()` draws any value each field's type allows (cross-field rules are not applied), which is
what the loader's round trip must preserve. `tests/strategies.py` builds configs that also pass validation.
"""

from __future__ import annotations

import dataclasses
import string
from typing import Any

from hypothesis import strategies as st

from rlconf.config import RLConfig
from rlconf.fields import (
    field_types,
    is_dataclass_type,
    leaf_paths,
    literal_values,
    section_paths,
    strip_optional,
    tuple_item_types,
)

# Printable text without surrogates: what a user can type into a YAML file.
TEXT = st.text(alphabet=string.printable + "äéλ中", max_size=12)


def for_type(tp: Any, text: st.SearchStrategy[str] = TEXT) -> st.SearchStrategy[Any]:
    inner, optional = strip_optional(tp)
    if is_dataclass_type(inner):
        base = typed_sections(inner, text)
    elif (choices := literal_values(inner)) is not None:
        base = st.sampled_from(choices)
    elif (items := tuple_item_types(inner)) is not None:
        item, variadic = items
        base = (
            st.lists(for_type(item, text), max_size=3).map(tuple)
            if variadic
            else st.tuples(*[for_type(t, text) for t in item])
        )
    elif inner is bool:
        base = st.booleans()
    elif inner is int:
        base = st.integers(-3, 10_000)
    elif inner is float:
        base = st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([1e-6, 0.0, 3e-4])
    elif inner is str:
        base = text
    else:
        raise TypeError(tp)
    return (st.none() | base) if optional else base


def typed_sections(cls: type, text: st.SearchStrategy[str] = TEXT) -> st.SearchStrategy[Any]:
    return st.builds(
        cls, **{f.name: for_type(field_types(cls)[f.name], text) for f in dataclasses.fields(cls)}
    )


def typed_configs(text: st.SearchStrategy[str] = TEXT) -> st.SearchStrategy[RLConfig]:
    return typed_sections(RLConfig, text)


SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | TEXT
KEYS = (
    st.sampled_from([p.rsplit(".", 1)[-1] for p in leaf_paths(RLConfig)] + list(section_paths(RLConfig)))
    | TEXT
)
random_values = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
    max_leaves=12,
)


def _nest(path: str, value: Any) -> dict[str, Any]:
    out: Any = value
    for part in reversed(path.split(".")):
        out = {part: out}
    return out


# Mostly-real dicts: real paths with random values, plus random junk keys.
near_valid_dicts = st.lists(
    st.tuples(st.sampled_from(leaf_paths(RLConfig) + section_paths(RLConfig)), random_values), max_size=5
).map(lambda items: {k: v for path, value in items for k, v in _nest(path, value).items()}) | st.dictionaries(
    KEYS, random_values, max_size=5
)

override_keys = (
    st.sampled_from(leaf_paths(RLConfig) + section_paths(RLConfig))
    | st.builds(lambda a, b: f"{a}.{b}", st.sampled_from(section_paths(RLConfig)), TEXT)
    | TEXT
)
overrides = st.lists(
    st.builds(lambda k, sep, v: f"{k}{sep}{v}", override_keys, st.sampled_from(["=", "=", ":", ""]), TEXT),
    max_size=4,
)
