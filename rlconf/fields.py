"""Introspection of the config dataclasses: resolved field types, field docstrings and leaf paths.

One walker over the dataclass tree serves the loader, the JSON Schema, the CLI flags and the docs, so they
cannot disagree about what a field is.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import MISSING, dataclass
from functools import cache
from typing import Any, Literal, Union


@cache
def field_types(cls: type) -> dict[str, Any]:
    """Resolved type hints of a dataclass's fields (the config module uses postponed annotations)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written as a string literal right under each field (the convention of rlconf.config)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs


def field_default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def strip_optional(tp: Any) -> tuple[Any, bool]:
    """(inner type, whether None is allowed) for `X | None`."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def literal_values(tp: Any) -> tuple[Any, ...] | None:
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else None


def tuple_item_types(tp: Any) -> tuple[Any, bool] | None:
    """For tuple[X, ...] -> (X, True); for tuple[X, Y] -> ((X, Y), False); else None."""
    if typing.get_origin(tp) is not tuple:
        return None
    args = typing.get_args(tp)
    if len(args) == 2 and args[1] is Ellipsis:
        return args[0], True
    return args, False


def type_name(tp: Any) -> str:
    """A short, user-facing name of a field type (`float`, `int or null`, `list of int`, `one of a, b`)."""
    inner, optional = strip_optional(tp)
    lits = literal_values(inner)
    if lits is not None:
        name = "one of " + ", ".join(str(v) for v in lits)
    elif (items := tuple_item_types(inner)) is not None:
        item, variadic = items
        name = (
            f"list of {type_name(item)}"
            if variadic
            else f"list of {len(item)} " + "/".join(type_name(t) for t in item)
        )
    elif is_dataclass_type(inner):
        name = f"section {inner.__name__}"
    else:
        name = getattr(inner, "__name__", str(inner))
        name = {"str": "string", "bool": "boolean", "int": "integer"}.get(name, name)
    return f"{name} or null" if optional else name


@dataclass(frozen=True)
class Leaf:
    """One settable config field: its dotted path, type, default and docstring."""

    path: str
    type: Any
    default: Any
    doc: str
    owner: type


def iter_leaves(cls: type, prefix: str = "") -> Iterator[Leaf]:
    """Every non-section field of the tree rooted at `cls`, depth first, in declaration order."""
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        tp = field_types(cls)[f.name]
        path = f"{prefix}{f.name}"
        if is_dataclass_type(tp):
            yield from iter_leaves(tp, path + ".")
        else:
            yield Leaf(path=path, type=tp, default=field_default(f), doc=docs.get(f.name, ""), owner=cls)


@cache
def leaf_paths(cls: type) -> tuple[str, ...]:
    return tuple(leaf.path for leaf in iter_leaves(cls))


@cache
def section_paths(cls: type, prefix: str = "") -> tuple[str, ...]:
    """Dotted paths of every section (nested dataclass) under `cls`."""
    out: list[str] = []
    for f in dataclasses.fields(cls):
        tp = field_types(cls)[f.name]
        if is_dataclass_type(tp):
            out.append(prefix + f.name)
            out.extend(section_paths(tp, prefix + f.name + "."))
    return tuple(out)


def get_path(obj: Any, path: str) -> Any:
    """The value at a dotted path of a config: `get_path(cfg, "actor.optim.lr")`."""
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def replace_paths(obj: Any, updates: dict[str, Any]) -> Any:
    """`dataclasses.replace` for dotted paths: `replace_paths(cfg, {"actor.optim.lr": 1e-6})`.

    Presets derive from each other with this, so a derived preset states only what differs.
    """
    grouped: dict[str, dict[str, Any]] = {}
    direct: dict[str, Any] = {}
    for path, value in updates.items():
        head, _, rest = path.partition(".")
        if head not in field_types(type(obj)):
            raise KeyError(f"{type(obj).__name__} has no field {head!r} (in {path!r})")
        if rest:
            grouped.setdefault(head, {})[rest] = value
        else:
            direct[head] = value
    for head, sub in grouped.items():
        direct[head] = replace_paths(direct.get(head, getattr(obj, head)), sub)
    return dataclasses.replace(obj, **direct)
