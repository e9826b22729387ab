"""JSON Schema (draft 2020-12) of the whole config tree, for editors' YAML completion and validation.

Generated from the dataclasses, so it cannot drift: descriptions are the field docstrings, defaults the
dataclass defaults, enums the Literal values. A YAML file may also carry the top-level `preset` key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from rlconf.config import RLConfig
from rlconf.fields import (
    field_default,
    field_docs,
    field_types,
    is_dataclass_type,
    literal_values,
    strip_optional,
    tuple_item_types,
)
from rlconf.load import config_to_dict


def _type_schema(tp: Any, defs: dict[str, Any]) -> dict[str, Any]:
    inner, optional = strip_optional(tp)
    if is_dataclass_type(inner):
        name = inner.__name__
        if name not in defs:
            defs[name] = {}  # reserve: the tree has no cycles, but sections repeat (MegatronConfig)
            defs[name] = _section_schema(inner, defs)
        schema: dict[str, Any] = {"$ref": f"#/$defs/{name}"}
    elif (choices := literal_values(inner)) is not None:
        schema = {"enum": list(choices)}
    elif (items := tuple_item_types(inner)) is not None:
        item_tp, variadic = items
        if variadic:
            schema = {"type": "array", "items": _type_schema(item_tp, defs)}
        else:
            schema = {
                "type": "array",
                "prefixItems": [_type_schema(t, defs) for t in item_tp],
                "minItems": len(item_tp),
                "maxItems": len(item_tp),
            }
    else:
        schema = {"type": {bool: "boolean", int: "integer", float: "number", str: "string"}[inner]}
    if optional:
        schema = {"anyOf": [schema, {"type": "null"}]}
    return schema


def _section_schema(cls: type, defs: dict[str, Any]) -> dict[str, Any]:
    props: dict[str, Any] = {}
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        tp = field_types(cls)[f.name]
        prop = _type_schema(tp, defs)
        if docs.get(f.name):
            prop = {**prop, "description": docs[f.name]}
        if not is_dataclass_type(strip_optional(tp)[0]):
            default = field_default(f)
            prop["default"] = list(default) if isinstance(default, tuple) else default
        props[f.name] = prop
    out: dict[str, Any] = {"type": "object", "additionalProperties": False, "properties": props}
    if cls.__doc__:
        out["description"] = " ".join(cls.__doc__.split())
    return out


def config_schema(preset_names: Sequence[str] = ()) -> dict[str, Any]:
    """The JSON Schema of an rlplan config file; `preset_names` (from the command layer, which knows the
    presets) become the allowed values of the top-level `preset` key (any string when none are given)."""
    defs: dict[str, Any] = {}
    root = _section_schema(RLConfig, defs)
    preset: dict[str, Any] = {"enum": list(preset_names)} if preset_names else {"type": "string"}
    root["properties"] = {
        "preset": {**preset, "description": "Preset whose values this file overlays."},
        **root["properties"],
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://rlplan.dev/schema/config.json",
        "title": "rlplan config",
        **root,
        "$defs": defs,
        "default": config_to_dict(RLConfig()),
    }
