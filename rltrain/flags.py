"""`--section.field VALUE` flags of `rltrain`, read with the config loader's own checks.

Every config field is a flag (rlconf.fields walks the dataclasses). A flag's value is read the way
`rlconf --set PATH=VALUE` reads one (rlconf.load.parse_override_value: YAML, strings kept as written, `None`
for null) and then goes through the loader's structural walk, so a bad flag value gets the same rule, message
and fix as the same value in a YAML file, and `rltrain` reports it in rlplan's error format. This module
stays light (no torch, Ray or megatron): `rltrain --help` imports it.

Syntax: `--a.b VALUE` or `--a.b=VALUE`; list fields take several values (`--profile.steps 2 3`), a YAML
list (`--profile.steps [2, 3]`) or none (an empty list); booleans take YAML spellings and 1 / 0; a token
that does not start with `--` is a value, so `--algorithm.gamma -1` reads -1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlconf.config import RLConfig
from rlconf.errors import ConfigError, Issue, error
from rlconf.fields import get_path, iter_leaves, strip_optional, tuple_item_types, type_name

_BOOLS = {
    "true": True,
    "yes": True,
    "on": True,
    "1": True,
    "false": False,
    "no": False,
    "off": False,
    "0": False,
}
"""What a boolean flag takes, in any case: YAML's spellings, and 1 / 0."""
_NULLS = ("None", "null", "~", "")
"""What a field that may be null reads as null (`None` is how `--help` shows it)."""


def _leaf_types() -> dict[str, Any]:
    return {leaf.path: leaf.type for leaf in iter_leaves(RLConfig)}


def _token_value(path: str, tp: Any, text: str) -> Any:
    """One value token for a field (or list item) of type `tp`: null words for a nullable field, the text
    as written for a string, a boolean word for a boolean, else YAML (raises ConfigError on bad YAML)."""
    from rlconf.load import parse_yaml

    inner, optional = strip_optional(tp)
    word = text.strip()
    if optional and word in _NULLS:
        return None
    if inner is str:
        if len(word) >= 2 and word[0] == word[-1] and word[0] in "'\"":
            return parse_yaml(
                word, source=f"flag --{path}"
            )  # a YAML-quoted string: `'null'` is the text null
        return text
    if inner is bool and word.lower() in _BOOLS:
        return _BOOLS[word.lower()]
    return parse_yaml(text, source=f"flag --{path}")


def _item_type(tp: Any, index: int) -> Any:
    items = tuple_item_types(strip_optional(tp)[0])
    assert items is not None
    item, variadic = items
    return item if variadic else item[min(index, len(item) - 1)]


def _flag_value(path: str, tp: Any, values: Sequence[str]) -> Any:
    """The value of `--path VALUES...` for a field of type `tp` (raises ConfigError on YAML it cannot
    read, or on a count of values the field cannot take)."""
    inner, optional = strip_optional(tp)
    if tuple_item_types(inner) is not None:
        if len(values) == 1 and values[0].lstrip().startswith("["):
            from rlconf.load import parse_yaml

            return parse_yaml(values[0], source=f"flag --{path}")  # a YAML list, `[2, 3]`
        if len(values) == 1 and optional and values[0].strip() in _NULLS:
            return None
        return [_token_value(f"{path}[{i}]", _item_type(tp, i), text) for i, text in enumerate(values)]
    if len(values) != 1:
        got = "none" if not values else f"{len(values)}: {' '.join(values)}"
        raise ConfigError(
            [
                error(
                    path,
                    f"--{path} takes one value ({type_name(tp)}), got {got}",
                    f"write --{path} VALUE (quote a value that has spaces)",
                    "flag-syntax",
                )
            ]
        )
    return _token_value(path, tp, values[0])


def split_flags(args: Sequence[str]) -> tuple[list[tuple[str, list[str]]], list[Issue]]:
    """`[(path, [value tokens])]` in command-line order, and a `flag-syntax` issue for each value that
    follows no flag. `--a-b` is read as `--a_b`; `--a.b=V` gives one value."""
    flags: list[tuple[str, list[str]]] = []
    issues: list[Issue] = []
    for token in args:
        if token.startswith("--"):
            name, eq, value = token[2:].partition("=")
            flags.append((name.replace("-", "_"), [value] if eq else []))
        elif flags:
            flags[-1][1].append(token)
        else:
            issues.append(
                error(
                    "",
                    f"`{token}` is not a flag and follows no flag",
                    "write --section.field VALUE (`rltrain PRESET --help` lists the flags)",
                    "flag-syntax",
                )
            )
    return flags, issues


def flags_to_data(args: Sequence[str]) -> tuple[dict[str, Any], list[Issue]]:
    """The nested config dict the flags set (last one wins), and the issues of flags that cannot be
    read: unknown paths (with a did-you-mean), values after no flag, YAML that does not parse, a scalar
    given several values. Values are not type-checked here: rlconf.load.build_config does that."""
    from rlconf.load import unknown_path_issue

    types = _leaf_types()
    flags, issues = split_flags(args)
    data: dict[str, Any] = {}
    for path, values in flags:
        if path not in types:
            issues.append(unknown_path_issue(path))
            continue
        try:
            value = _flag_value(path, types[path], values)
        except ConfigError as exc:
            issues.extend(_at(i, path) for i in exc.issues)
            continue
        node = data
        *parents, last = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return data, issues


def _at(issue: Issue, path: str) -> Issue:
    import dataclasses

    return issue if issue.path else dataclasses.replace(issue, path=path)


def apply_flags(base: RLConfig, args: Sequence[str]) -> tuple[RLConfig, list[Issue]]:
    """`base` with the flags applied, and every problem of the flags as issues (the config keeps
    `base`'s value where a flag's value is bad, so the other rules still run on the rest)."""
    from rlconf.load import build_config

    data, issues = flags_to_data(args)
    config, structural = build_config(data, base=base)
    return config, issues + list(structural)


def config_to_flags(config: RLConfig) -> list[str]:
    """Flags that reproduce `config` from the defaults (only fields that differ are written)."""
    default = RLConfig()
    flags: list[str] = []
    for leaf in iter_leaves(RLConfig):
        value = get_path(config, leaf.path)
        if value == get_path(default, leaf.path):
            continue
        flags.append(f"--{leaf.path}")
        flags.extend(flag_values(value))
    return flags


def flag_values(value: Any) -> list[str]:
    """The tokens of a value on the command line (None -> `None`, a list -> one token per item)."""
    if value is None:
        return ["None"]
    if isinstance(value, tuple):
        return [v for item in value for v in flag_values(item)]
    if isinstance(value, str) and (
        value.strip() in _NULLS or (len(value) >= 2 and value[0] == value[-1] in "'\"")
    ):
        return ["'" + value.replace("'", "''") + "'"]  # YAML-quoted: read back as this text, not null
    return [repr(value) if isinstance(value, float) else str(value)]


def flag_text(value: Any) -> str:
    """A value as a user types it after its flag (`1e-06`, `None`, `2 3`, an empty list as `[]`, an empty
    string as `''`), quoted for a POSIX shell where it needs it."""
    import shlex

    if isinstance(value, tuple) and not value:
        return "[]"
    return " ".join(shlex.quote(token) for token in flag_values(value))
