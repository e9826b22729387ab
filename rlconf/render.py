"""Human-facing renderings of configs: annotated YAML (`rlconf show`) and semantic diffs (`rlconf diff`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from rlconf.config import RLConfig
from rlconf.errors import Issue
from rlconf.load import config_to_dict, dump_yaml


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted paths of every leaf of a nested dict (lists are leaves)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


@dataclass(frozen=True)
class Change:
    kind: Literal["changed", "added", "removed"]
    path: str
    old: Any
    new: Any

    def format(self) -> str:
        if self.kind == "changed":
            return f"~ {self.path}: {scalar_text(self.old)} -> {scalar_text(self.new)}"
        if self.kind == "added":
            return f"+ {self.path}: {scalar_text(self.new)}"
        return f"- {self.path}: {scalar_text(self.old)}"


_ABSENT = object()


def diff_dicts(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[Change]:
    """Semantic diff of two nested dicts by dotted path, in a's order then b's new paths."""
    fa, fb = flatten(a), flatten(b)
    changes: list[Change] = []
    for path in list(fa) + [p for p in fb if p not in fa]:
        old, new = fa.get(path, _ABSENT), fb.get(path, _ABSENT)
        if old is _ABSENT:
            changes.append(Change("added", path, None, new))
        elif new is _ABSENT:
            changes.append(Change("removed", path, old, None))
        elif old != new or (type(old) is not type(new) and not _same_number(old, new)):
            changes.append(Change("changed", path, old, new))
    return changes


def _same_number(a: Any, b: Any) -> bool:
    return isinstance(a, int | float) and isinstance(b, int | float) and a == b and not isinstance(a, bool)


def scalar_text(value: Any) -> str:
    text = dump_yaml(value).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def render_config(config: RLConfig, issues: Iterable[Issue] = (), *, mark_changes: bool = True) -> str:
    """The resolved config as YAML; values that differ from the dataclass defaults carry a
    `# default: X` comment and values a warning changes or questions carry `# warning: ...`."""
    defaults = flatten(config_to_dict(RLConfig()))
    notes: dict[str, list[str]] = {}
    for issue in issues:
        notes.setdefault(issue.path.split("[")[0], []).append(f"{issue.severity}: {issue.message}")
    lines: list[str] = []

    def walk(data: Mapping[str, Any], prefix: str, indent: int) -> None:
        for key, value in data.items():
            path = f"{prefix}{key}"
            pad = "  " * indent
            if isinstance(value, Mapping):
                lines.append(f"{pad}{key}:" + (f"  # {'; '.join(notes[path])}" if path in notes else ""))
                walk(value, path + ".", indent + 1)
                continue
            comments = []
            if mark_changes and path in defaults and defaults[path] != value:
                comments.append(f"default: {scalar_text(defaults[path])}")
            comments += notes.get(path, [])
            line = f"{pad}{key}: {scalar_text(value)}"
            lines.append(line + (f"  # {'; '.join(comments)}" if comments else ""))

    walk(config_to_dict(config), "", 0)
    return "\n".join(lines) + "\n"
