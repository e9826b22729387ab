"""Loading configs from dicts, YAML/JSON files, presets and dotted overrides.

Presets are not imported here: the command layer (rlconf.cli, rltrain.cli) hands the loader a catalogue
(`presets=presets.PRESETS`, any mapping of name -> object with `build() -> RLConfig`), which resolves both
`preset=NAME` and a file's `preset: NAME` key. rlconf's core stays free of the presets package.

The loader first walks the input against the dataclass types and collects *every* structural problem
(unknown keys with a did-you-mean, wrong types, values outside a Literal) with its dotted path, including
list indices. Only a clean input reaches dacite (strict mode), which builds the frozen tree. Cross-field
rules live in `rlconf.validate`; `load_config` runs both and raises one `ConfigError` with all errors.

Every config file, preset overlay and verl input is read through `read_config_file` / `parse_yaml`, which
bound what a file may cost before anything walks it: its size, its nesting depth and (for YAML) the number
of nodes once aliases are expanded, and they refuse duplicate keys (the later one would silently win).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

import dacite
import yaml

from rlconf.config import RLConfig
from rlconf.errors import ConfigError, Issue, error
from rlconf.fields import (
    field_types,
    is_dataclass_type,
    iter_leaves,
    literal_values,
    strip_optional,
    tuple_item_types,
    type_name,
)
from rlconf.files import LIMIT_RULE, FileProblem, read_limited

PRESET_KEY = "preset"


class PresetSource(Protocol):
    """What the loader needs of a preset (presets.Preset is one): the config it starts from."""

    def build(self) -> RLConfig: ...


PresetCatalog = Mapping[str, PresetSource]
"""Preset name -> preset, given by the command layer (`presets.PRESETS`)."""
NO_PRESETS: PresetCatalog = MappingProxyType({})

# Bounds on one config file. Real configs (ours, verl's with every default spelled out) are tens of KB,
# about 8 levels deep and a few thousand nodes; the bounds are far above that, and far below what makes a
# YAML anchor bomb or a deeply nested document cost seconds, gigabytes or a RecursionError.
# PyYAML is pure Python (tens of microseconds per node), so the node bound also bounds the parse time.
MAX_CONFIG_BYTES = 256 << 10
MAX_CONFIG_DEPTH = 64
MAX_CONFIG_NODES = 10_000
# A run of openers deeper than the bound; PyYAML's scanner is quadratic in the flow depth it sees within
# its 1024-character look-ahead, so such a run is refused before YAML reads it.
_DEEP_FLOW_RE = re.compile(rf"(?:[\[{{][ \t\r\n]*){{{MAX_CONFIG_DEPTH + 1}}}")


# ------------------------------------------------------------------------------------------------ YAML
# PyYAML follows YAML 1.1, where `1e-6` (no dot) is a string. Users write learning rates that way, so both
# the loader and the dumper resolve it as a float (the dumper must agree, or strings like "1e5" would be
# written unquoted and read back as floats).
_FLOAT_RE = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


class _Loader(yaml.SafeLoader):
    """SafeLoader that stops composing at MAX_CONFIG_DEPTH, before reading the rest of a too-deep file."""

    _depth = 0
    _nodes = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        self._depth += 1
        self._nodes += 1  # distinct nodes (an alias composes none); _check_yaml_graph counts expansions
        try:
            if self._depth > MAX_CONFIG_DEPTH:
                raise _GraphLimit(_too_deep(""))
            if self._nodes > MAX_CONFIG_NODES:
                raise _GraphLimit(_too_many_nodes())
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


class _Dumper(yaml.SafeDumper):
    pass


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))


def _limit_issue(message: str, fix: str) -> Issue:
    return error("", message, fix, "file-limits")


def _too_deep(path: str) -> Issue:
    where = f"`{path if len(path) <= 60 else path[:57] + '...'}`" if path else "the document"
    return _limit_issue(
        f"{where} is nested deeper than {MAX_CONFIG_DEPTH} levels",
        "flatten the file: config sections are a few levels deep",
    )


def _too_many_nodes() -> Issue:
    return _limit_issue(
        f"the document holds more than {MAX_CONFIG_NODES:,} values (counting each YAML alias as a copy "
        "of what it points to)",
        "check that this is the config file you meant; a config has a few hundred values, and aliases "
        "that repeat aliases multiply",
    )


def _key_text(node: yaml.Node) -> str | None:
    """A mapping key as it reads in a dotted path (None for a merge key or a non-scalar key)."""
    if not isinstance(node, yaml.ScalarNode) or node.tag == "tag:yaml.org,2002:merge":
        return None
    return str(node.value)


def _check_yaml_graph(root: yaml.Node) -> list[Issue]:
    """Duplicate keys, nesting depth and size with aliases expanded, walking each node once.

    PyYAML shares an aliased node (and the object built from it) instead of copying it, so loading a bomb
    is cheap; the cost comes later, from every walk that expands it. Sizes are memoized per node, so this
    check costs one visit per distinct node however often aliases repeat it. A node that contains itself
    (`&a [*a]`) is refused: no config is infinite.
    """
    issues: list[Issue] = []
    expanded: dict[int, int] = {}
    in_progress: set[int] = set()

    def size(node: yaml.Node, path: str, depth: int) -> int:
        key = id(node)
        if key in expanded:
            return expanded[key]
        if key in in_progress:
            raise _GraphLimit(
                _limit_issue(
                    f"`{path or '<root>'}` contains itself through a YAML alias",
                    "replace the alias by the values it should hold",
                )
            )
        if depth > MAX_CONFIG_DEPTH:
            raise _GraphLimit(_too_deep(path))
        in_progress.add(key)
        total = 1
        if isinstance(node, yaml.MappingNode):
            seen: set[str] = set()
            for key_node, value_node in node.value:
                name = _key_text(key_node)
                child = f"{path}.{name}" if path and name is not None else (name or path)
                if name is not None:
                    if name in seen:
                        line = key_node.start_mark.line + 1
                        issues.append(
                            error(
                                child,
                                f"`{child}` is given twice (again at line {line}); only one of them would count",
                                f"merge the two `{name}:` entries into one",
                                "duplicate-key",
                            )
                        )
                    seen.add(name)
                total += size(key_node, child, depth + 1) + size(value_node, child, depth + 1)
                if total > MAX_CONFIG_NODES:
                    break
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                total += size(item, f"{path}[{i}]", depth + 1)
                if total > MAX_CONFIG_NODES:
                    break
        in_progress.discard(key)
        if total > MAX_CONFIG_NODES:
            raise _GraphLimit(_too_many_nodes())
        expanded[key] = total
        return total

    size(root, "", 0)
    return issues


class _GraphLimit(Exception):
    def __init__(self, issue: Issue) -> None:
        super().__init__(issue.message)
        self.issue = issue


def parse_yaml(text: str, source: str = "<yaml>") -> Any:
    """Parse YAML text; syntax errors, duplicate keys and documents over the size, depth or alias
    expansion bounds become a ConfigError (with the line and column where YAML gives one)."""
    if _DEEP_FLOW_RE.search(text):
        raise ConfigError([_too_deep("")], source)
    loader: _Loader | None = None
    try:
        loader = _Loader(text)  # its reader rejects unprintable characters at once
        node = loader.get_single_node()
        if node is None:
            return None
        if issues := _check_yaml_graph(node):
            raise ConfigError(issues, source)
        return loader.construct_document(node)
    except _GraphLimit as exc:
        raise ConfigError([exc.issue], source) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(
            [error("", f"YAML syntax error{where}: {problem}", "fix the YAML syntax there", "yaml-syntax")],
            source,
        ) from None
    except RecursionError:  # PyYAML's parser recurses once per nesting level
        raise ConfigError([_too_deep("")], source) from None
    except (ValueError, TypeError, OverflowError) as exc:
        raise ConfigError(
            [error("", f"unreadable YAML value: {exc}", "fix the value", "yaml-syntax")], source
        ) from None
    finally:
        if loader is not None:
            loader.dispose()


def dump_yaml(data: Any) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=None, width=100)


# ------------------------------------------------------------------------------------------ to / from
def config_to_dict(config: Any) -> dict[str, Any]:
    """Plain nested dict of a config (tuples become lists), ready for YAML or JSON."""

    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, tuple | list):
            return [plain(v) for v in value]
        return value

    return plain(config)


def deep_merge(base: Mapping[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    """`overlay` on top of `base`; mappings merge key by key, anything else (lists included) replaces."""
    out = dict(base)
    for key, value in overlay.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


_INVALID = object()


def _did_you_mean(word: str, options: Sequence[str]) -> str | None:
    match = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return match[0] if match else None


def _leaf_suffix_index(root: type) -> dict[str, list[str]]:
    """Field name -> every dotted path ending in it (for 'did you mean actor.optim.lr' on `actor.lr`)."""
    index: dict[str, list[str]] = {}
    for leaf in iter_leaves(root):
        index.setdefault(leaf.path.rsplit(".", 1)[-1], []).append(leaf.path)
    return index


def _unknown_key_issue(key: str, cls: type, path: str, root: type) -> Issue:
    names = [f.name for f in dataclasses.fields(cls)]
    full = f"{path}.{key}" if path else key
    exact_elsewhere = _leaf_suffix_index(root).get(key)
    suggestion = _did_you_mean(key, names)
    if exact_elsewhere:
        fix = "did you mean " + " or ".join(f"`{p}`" for p in exact_elsewhere[:3]) + "?"
    elif suggestion:
        fix = f"did you mean `{(path + '.') if path else ''}{suggestion}`?"
    else:
        elsewhere = [
            p for name, ps in _leaf_suffix_index(root).items() if _did_you_mean(key, [name]) for p in ps
        ]
        if elsewhere:
            fix = "did you mean " + " or ".join(f"`{p}`" for p in elsewhere[:3]) + "?"
        else:
            fix = f"remove it; `{path or 'the root'}` accepts: {', '.join(names)}"
    return error(full, f"unknown field `{key}` in {cls.__name__}", fix, "unknown-key")


def unknown_path_issue(path: str) -> Issue:
    """The issue for a dotted path that names no config field (first unknown part, with a did-you-mean)."""
    cls: Any = RLConfig
    parts = path.split(".")
    for depth, part in enumerate(parts):
        prefix = ".".join(parts[:depth])
        if not is_dataclass_type(cls):
            return error(path, f"`{prefix}` is a value, not a section", f"use --{prefix}", "unknown-key")
        if part not in field_types(cls):
            issue = _unknown_key_issue(part, cls, prefix, RLConfig)
            return dataclasses.replace(issue, path=path)
        cls = field_types(cls)[part]
    return error(
        path,
        f"`{path}` is a section, not a field",
        f"set one of its fields, e.g. --{path}.<field>",
        "unknown-key",
    )


def _describe(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _coerce(value: Any, tp: Any, path: str, issues: list[Issue], root: type) -> Any:
    """Check `value` against `tp`, normalising YAML shapes (lists -> tuples, ints -> floats)."""
    inner, optional = strip_optional(tp)
    if value is None:
        if optional:
            return None
        issues.append(
            error(
                path, f"must not be null (expected {type_name(tp)})", "give a value or remove the key", "type"
            )
        )
        return _INVALID
    if is_dataclass_type(inner):
        return _coerce_section(value, inner, path, issues, root)
    if (choices := literal_values(inner)) is not None:
        if isinstance(value, str) and value in choices:
            return value
        allowed = ", ".join(str(c) for c in choices)
        hint = _did_you_mean(str(value), [str(c) for c in choices])
        fix = (f"did you mean `{hint}`? " if hint else "") + f"allowed values: {allowed}"
        issues.append(error(path, f"invalid value {value!r}", fix, "invalid-choice"))
        return _INVALID
    if (items := tuple_item_types(inner)) is not None:
        item_tp, variadic = items
        if isinstance(value, str | int | float | bool) and variadic:
            value = [value]  # a scalar where a list is expected: a one-element list
        if not isinstance(value, list | tuple):
            issues.append(
                error(path, f"expected a list, got {_describe(value)}", "write a YAML list", "type")
            )
            return _INVALID
        if not variadic and len(value) != len(item_tp):
            issues.append(
                error(
                    path,
                    f"expected {len(item_tp)} items, got {len(value)}",
                    f"give {type_name(inner)}",
                    "type",
                )
            )
            return _INVALID
        types_ = [item_tp] * len(value) if variadic else list(item_tp)
        out = [
            _coerce(v, t, f"{path}[{i}]", issues, root)
            for i, (v, t) in enumerate(zip(value, types_, strict=True))
        ]
        return _INVALID if any(v is _INVALID for v in out) else tuple(out)
    if inner is bool:
        if isinstance(value, bool):
            return value
        issues.append(
            error(path, f"expected true or false, got {_describe(value)}", "write true or false", "type")
        )
        return _INVALID
    if inner is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        fix = "write a whole number" + (" (not true/false)" if isinstance(value, bool) else "")
        issues.append(error(path, f"expected an integer, got {_describe(value)}", fix, "type"))
        return _INVALID
    if inner is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(value):
                issues.append(
                    error(path, f"must be a finite number, got {value}", "write a finite number", "type")
                )
                return _INVALID
            return float(value)
        issues.append(
            error(path, f"expected a number, got {_describe(value)}", "write a number like 1e-6", "type")
        )
        return _INVALID
    if inner is str:
        if isinstance(value, str):
            return value
        issues.append(
            error(path, f"expected a string, got {_describe(value)}", "quote the value in YAML", "type")
        )
        return _INVALID
    raise TypeError(f"unsupported config field type {tp!r} at {path}")  # a bug in rlconf.config


def _coerce_section(value: Any, cls: type, path: str, issues: list[Issue], root: type) -> Any:
    if not isinstance(value, Mapping):
        what = path or "the config"
        issues.append(
            error(
                path,
                f"{what} must be a mapping of fields, got {_describe(value)}",
                "write `key: value` lines",
                "type",
            )
        )
        return _INVALID
    types_ = field_types(cls)
    out: dict[str, Any] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            issues.append(error(path, f"field names must be strings, got {key!r}", "quote the key", "type"))
            continue
        if key not in types_:
            issues.append(_unknown_key_issue(key, cls, path, root))
            continue
        out[key] = _coerce(item, types_[key], f"{path}.{key}" if path else key, issues, root)
    return out


def _drop_invalid(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _drop_invalid(v) for k, v in data.items() if v is not _INVALID}
    return data


def build_config(
    data: Mapping[str, Any], *, base: RLConfig | None = None, source: str | None = None
) -> tuple[RLConfig, tuple[Issue, ...]]:
    """Best-effort build: the config with every invalid entry left at its base/default value, and the
    structural issues found. Lets validation report cross-field errors alongside type errors."""
    if not isinstance(data, Mapping):
        issue = error(
            "", f"a config must be a mapping, got {_describe(data)}", "write `section: ...` lines", "type"
        )
        return base or RLConfig(), (issue,)
    issues: list[Issue] = []
    merged = deep_merge(config_to_dict(base), data) if base is not None else dict(data)
    coerced = _drop_invalid(_coerce_section(merged, RLConfig, "", issues, RLConfig))
    try:
        config = dacite.from_dict(RLConfig, coerced, config=dacite.Config(strict=True, check_types=True))
    except dacite.DaciteError as exc:  # the walker above should have caught it; never show a traceback
        path = getattr(exc, "field_path", "") or ""
        issues.append(error(path, str(exc), "fix the value's type", "type"))
        config = base or RLConfig()
    return config, tuple(issues)


def config_from_dict(
    data: Mapping[str, Any], *, base: RLConfig | None = None, source: str | None = None
) -> RLConfig:
    """Build a config from a plain dict overlaid on `base` (default: dataclass defaults).

    Checks structure and types only; raises ConfigError listing every structural problem.
    """
    config, issues = build_config(data, base=base, source=source)
    if issues:
        raise ConfigError(issues, source)
    return config


# ------------------------------------------------------------------------------------------ overrides
_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _leaf_type(path: str) -> Any | None:
    cls: Any = RLConfig
    for part in path.split("."):
        if not is_dataclass_type(cls) or part not in field_types(cls):
            return None
        cls = field_types(cls)[part]
    return cls


def parse_override_value(path: str, text: str) -> Any:
    """Parse one override value as YAML, except that string fields keep the text as written."""
    tp = _leaf_type(path)
    if tp is not None:
        inner, optional = strip_optional(tp)
        if inner is str and not (optional and text.strip() in ("null", "~", "None", "")):
            return text
        if optional and text.strip() == "None":  # Python spelling of null, as shown by --help
            return None
    return parse_yaml(text, source=f"override {path}")


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply `dotted.path=value` overrides to a plain config dict (values parsed as YAML)."""
    out = json.loads(json.dumps(data)) if data else {}
    issues: list[Issue] = []
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip().removeprefix("--")
        if not sep or not _KEY_RE.match(key):
            issues.append(
                error(
                    key or item,
                    f"cannot read override {item!r}",
                    "write `section.field=value`",
                    "override-syntax",
                )
            )
            continue
        try:
            value = parse_override_value(key, text)
        except ConfigError as exc:
            issues.extend(dataclasses.replace(i, path=key) for i in exc.issues)
            continue
        node = out
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                issues.append(
                    error(
                        ".".join(parts[: depth + 1]),
                        f"is a value, not a section, so `{key}` cannot be set",
                        "override the field itself",
                        "override-syntax",
                    )
                )
                break
            node = child
        else:
            node[parts[-1]] = value
    if issues:
        raise ConfigError(issues, "overrides")
    return out


# ---------------------------------------------------------------------------------------------- files
def _read_limited(path: Path, source: str) -> str:
    """The text of a regular file of at most MAX_CONFIG_BYTES (rlconf.files: opened without blocking,
    fstat-checked, reading at most one byte more), its problems worded for a config file."""

    def fail(message: str, fix: str, rule: str = "file") -> ConfigError:
        return ConfigError([error("", message, fix, rule)], source)

    try:
        raw = read_limited(path, MAX_CONFIG_BYTES)
    except FileProblem as exc:
        if exc.kind == "missing":
            raise fail(f"config file {source} does not exist", "check the path") from None
        if exc.kind == "unreadable":
            raise fail(exc.message, exc.fix) from None
        if exc.kind == "folder":
            raise fail(
                f"{source} is a folder, not a config file", "name a .yaml or .json file inside it"
            ) from None
        if exc.kind == "too-large":
            raise fail(
                f"{source} is larger than {MAX_CONFIG_BYTES // 1024} KiB; a config is a few KiB",
                "check that this is the config file you meant",
                LIMIT_RULE,
            ) from None
        raise fail(exc.message, "save the config to a .yaml or .json file and pass that") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise fail(
            f"{source} is not UTF-8 text (byte {exc.start})", "save the config as UTF-8 text"
        ) from None


class _JsonObject(dict):
    """A JSON object that remembers the keys it was given more than once (json keeps the last silently)."""

    duplicates: tuple[str, ...] = ()


def _json_object(pairs: list[tuple[str, Any]]) -> _JsonObject:
    obj = _JsonObject(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        obj.duplicates = tuple(k for k, _ in pairs if k in seen or seen.add(k))
    return obj


def _json_issues(data: Any) -> list[Issue]:
    """Duplicate keys and nesting beyond MAX_CONFIG_DEPTH, with their dotted paths."""
    issues: list[Issue] = []

    def walk(value: Any, path: str, depth: int) -> None:
        if depth > MAX_CONFIG_DEPTH:
            raise _GraphLimit(_too_deep(path))
        if isinstance(value, dict):
            for key in getattr(value, "duplicates", ()):
                child = f"{path}.{key}" if path else key
                issues.append(
                    error(
                        child,
                        f"`{child}` is given twice; only the last one would count",
                        f'merge the two "{key}" entries into one',
                        "duplicate-key",
                    )
                )
            for key, item in value.items():
                walk(item, f"{path}.{key}" if path else str(key), depth + 1)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                walk(item, f"{path}[{i}]", depth + 1)

    try:
        walk(data, "", 0)
    except _GraphLimit as exc:
        return [exc.issue]
    return issues


def parse_json(text: str, source: str = "<json>") -> Any:
    """Parse JSON text; syntax errors, duplicate keys and documents nested too deep become a ConfigError."""
    try:
        data = json.loads(text, object_pairs_hook=_json_object)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            [
                error(
                    "",
                    f"JSON syntax error at line {exc.lineno}, column {exc.colno}: {exc.msg}",
                    "fix the JSON",
                    "json-syntax",
                )
            ],
            source,
        ) from None
    except RecursionError:  # the json scanner recurses once per nesting level
        raise ConfigError([_too_deep("")], source) from None
    except ValueError as exc:  # e.g. an integer longer than Python's digit limit
        raise ConfigError(
            [error("", f"unreadable JSON value: {exc}", "fix the value", "json-syntax")], source
        ) from None
    if issues := _json_issues(data):
        raise ConfigError(issues, source)
    return data


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON config file into a dict (the `preset:` key, if any, is kept).

    Refuses what is not a regular file (a folder, /dev/zero, a pipe) and files over MAX_CONFIG_BYTES
    before parsing, so a wrong path costs a message, not the machine's memory.
    """
    path = Path(path)
    source = str(path)
    text = _read_limited(path, source)
    data = parse_json(text, source) if path.suffix == ".json" else parse_yaml(text, source)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            [
                error(
                    "",
                    f"the file must hold a mapping of sections, got {_describe(data)}",
                    "write `section: ...` lines",
                    "type",
                )
            ],
            source,
        )
    return dict(data)


def _preset_base(name: Any, source: str | None, presets: PresetCatalog) -> RLConfig:
    if not isinstance(name, str) or name not in presets:
        if not presets:
            # A library caller that names a preset without handing over the catalogue.
            fix = "pass the preset catalogue to the loader: presets=presets.PRESETS (rltrain and rlconf do)"
        else:
            hint = _did_you_mean(str(name), list(presets))
            fix = (f"did you mean `{hint}`? " if hint else "") + "presets: " + ", ".join(presets)
        raise ConfigError([error(PRESET_KEY, f"unknown preset {name!r}", fix, "unknown-preset")], source)
    return presets[name].build()


def _gather(
    source: str | Path | Mapping[str, Any] | None,
    *,
    preset: str | None,
    overrides: Sequence[str],
    presets: PresetCatalog,
) -> tuple[dict[str, Any], RLConfig | None, str | None]:
    """The input dict (overrides applied), the preset base and the source name."""
    src_name = None if source is None or isinstance(source, Mapping) else str(source)
    if source is None:
        data: dict[str, Any] = {}
    elif isinstance(source, Mapping):
        data = dict(source)
    else:
        data = read_config_file(source)
    file_preset = data.pop(PRESET_KEY, None)
    if preset is not None and file_preset is not None and file_preset != preset:
        raise ConfigError(
            [
                error(
                    PRESET_KEY,
                    f"the file overlays preset {file_preset!r} but the command asks for {preset!r}",
                    "use the same preset in both places, or remove `preset:` from the file",
                    "preset-conflict",
                )
            ],
            src_name,
        )
    chosen = preset if preset is not None else file_preset
    base = _preset_base(chosen, src_name, presets) if chosen is not None else None
    if overrides:
        data = apply_overrides(data, overrides)
    return data, base, src_name


def resolve_config(
    source: str | Path | Mapping[str, Any] | None = None,
    *,
    preset: str | None = None,
    overrides: Sequence[str] = (),
    presets: PresetCatalog = NO_PRESETS,
) -> RLConfig:
    """Structural load with precedence overrides > file > preset > defaults (no cross-field rules).
    `presets` resolves `preset` and a file's `preset:` key (see the module docstring)."""
    data, base, src_name = _gather(source, preset=preset, overrides=overrides, presets=presets)
    return config_from_dict(data, base=base, source=src_name)


def build_from_sources(
    source: str | Path | Mapping[str, Any] | None = None,
    *,
    preset: str | None = None,
    overrides: Sequence[str] = (),
    presets: PresetCatalog = NO_PRESETS,
) -> tuple[RLConfig, tuple[Issue, ...], str | None]:
    """Best-effort config from a file / dict, preset and overrides, its structural issues and the source
    name. Unreadable files, unknown presets and bad override syntax still raise ConfigError (there is
    nothing to build); bad values are reported and left at the preset's or default value."""
    data, base, src_name = _gather(source, preset=preset, overrides=overrides, presets=presets)
    config, structural = build_config(data, base=base, source=src_name)
    return config, structural, src_name


def load_config(
    source: str | Path | Mapping[str, Any] | None = None,
    *,
    preset: str | None = None,
    overrides: Sequence[str] = (),
    filesystem: bool = False,
    presets: PresetCatalog = NO_PRESETS,
) -> RLConfig:
    """Load and fully validate a config; raises ConfigError with every error (and the warnings).

    `filesystem=True` adds the rules that check the paths a run reads and writes (see rlconf.validate).
    """
    return load_checked(source, preset=preset, overrides=overrides, filesystem=filesystem, presets=presets)[0]


def load_checked(
    source: str | Path | Mapping[str, Any] | None = None,
    *,
    preset: str | None = None,
    overrides: Sequence[str] = (),
    filesystem: bool = False,
    presets: PresetCatalog = NO_PRESETS,
) -> tuple[RLConfig, tuple[Issue, ...]]:
    """load_config's config and its warnings (it raises on an error), from one pass of the rules: the
    filesystem ones read model folders, which is not free for a large model."""
    from rlconf.validate import check_config

    config, structural, src_name = build_from_sources(
        source, preset=preset, overrides=overrides, presets=presets
    )
    issues = structural + check_config(config, filesystem=filesystem)
    if any(i.severity == "error" for i in issues):
        raise ConfigError(issues, src_name)
    return config, tuple(issues)
