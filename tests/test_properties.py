"""Property tests of the loader: round trips, only ConfigError on bad input, and paths that exist."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping

from hypothesis import example, given, settings
from hypothesis import strategies as st

from presets import PRESETS
from rlconf.config import RLConfig
from rlconf.errors import ConfigError
from rlconf.fields import leaf_paths, section_paths
from rlconf.load import (
    apply_overrides,
    config_from_dict,
    config_to_dict,
    dump_yaml,
    load_config,
    parse_yaml,
    resolve_config,
)
from tests.typed_strategies import TEXT, near_valid_dicts, overrides, random_values, typed_configs

KNOWN_PATHS = set(leaf_paths(RLConfig)) | set(section_paths(RLConfig)) | {"", "preset"}


def _input_paths(data, prefix: str = "") -> set[str]:
    paths = set()
    if isinstance(data, Mapping):
        for k, v in data.items():
            p = f"{prefix}{k}"
            paths.add(p)
            paths |= _input_paths(v, p + ".")
    return paths


def assert_paths_exist(exc: ConfigError, data=None, extra: set[str] = frozenset()) -> None:
    """(c) every issue names a path of the schema or of the input (list indices stripped)."""
    allowed = KNOWN_PATHS | _input_paths(data) | set(extra)
    for issue in exc.issues:
        # The path as written (an unreadable override is named verbatim) or with list indices stripped.
        base = re.sub(r"\[\d+\]", "", issue.path)
        assert issue.path in allowed or base in allowed, (
            f"{issue.path!r} is neither in the schema nor in the input"
        )


@given(typed_configs())
def test_any_typed_config_round_trips_through_yaml(config):
    """(a) dict -> YAML -> load gives the same config (structure; rules are not part of a round trip)."""
    assert config_from_dict(parse_yaml(dump_yaml(config_to_dict(config)))) == config


@settings(max_examples=800)
@given(near_valid_dicts)
def test_random_dicts_only_raise_config_error(data):
    """(b) random dicts either load or raise ConfigError, and (c) errors name real paths."""
    try:
        load_config(data)
    except ConfigError as exc:
        assert_paths_exist(exc, data)


@settings(max_examples=600)
@given(TEXT | random_values.map(dump_yaml) | st.text(max_size=200))
def test_random_yaml_text_only_raises_config_error(text):
    """(b) random YAML text either loads or raises ConfigError."""
    try:
        load_config(parse_yaml(text)) if isinstance(parse_yaml(text), dict) else config_from_dict(
            parse_yaml(text)
        )
    except ConfigError as exc:
        assert_paths_exist(exc, parse_yaml(text) if _parses(text) else None)


def _parses(text: str) -> bool:
    try:
        parse_yaml(text)
    except ConfigError:
        return False
    return True


@settings(max_examples=800)
@given(overrides)
@example(["model.path:[0]"])  # no `=`: the error names the override verbatim (CI found it)
@example(["model=::"])  # a mapping value: its keys are input paths under `model` (CI found it)
def test_random_overrides_only_raise_config_error(items):
    """(b) random dotted overrides either apply or raise ConfigError naming the override's path (or a path
    inside the value it gives)."""
    try:
        resolve_config(None, preset="tiny-grpo", overrides=items, presets=PRESETS)
        load_config(None, preset="tiny-grpo", overrides=items, presets=PRESETS)
    except ConfigError as exc:
        given_paths = {i.partition("=")[0].strip().removeprefix("--") for i in items} | {i for i in items}
        prefixes = {".".join(p.split(".")[: n + 1]) for p in given_paths for n in range(len(p.split(".")))}
        # Each readable override as a dict: paths inside a mapping value are the user's input too.
        inside: set[str] = set()
        for item in items:
            with contextlib.suppress(ConfigError):
                inside |= _input_paths(apply_overrides({}, [item]))
        assert_paths_exist(exc, extra=prefixes | inside)
