"""A run's config as the run folder keeps it: plain data (`ConfigDocument`: the nested values config.yaml holds
and each checkpoint records) and how a resume's config is compared with the folder's (`config_changes`).

The CLI layer makes the document from the loaded config (`ConfigDocument.of`); rltrain's run folder
(rltrain/runfolder.py) writes, records and compares it without seeing a config section. Which changed
fields are not changes of the run is `free_reason`'s (see rltrain/runfolder.py's module docstring).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlconf.config import RLConfig
from rlconf.errors import ConfigError
from rlconf.fields import get_path, replace_paths
from rlconf.load import config_from_dict, config_to_dict, dump_yaml, parse_yaml
from rlconf.render import diff_dicts, flatten

__all__ = [
    "ConfigChange",
    "ConfigDocument",
    "canonical_yaml",
    "config_changes",
    "flatten",
    "free_reason",
    "parse_flat",
    "unflatten",
    "yaml_scalar",
]


@dataclass(frozen=True)
class ConfigDocument:
    """A run's resolved config as plain data: {section: {field: value}}, as config.yaml holds it."""

    values: dict[str, Any]
    """The nested values (rlconf.load.config_to_dict)."""

    @classmethod
    def of(cls, config: RLConfig) -> ConfigDocument:
        return cls(config_to_dict(config))

    @property
    def flat(self) -> dict[str, Any]:
        """{dotted path: value}."""
        return flatten(self.values)

    @property
    def text(self) -> str:
        """config.yaml's text."""
        return dump_yaml(self.values)


def canonical_yaml(values: Mapping[str, Any]) -> str:
    """config.yaml's text of recorded nested values, in the config's field order (a record's JSON has its
    keys sorted); a record with a field this version no longer has: as it is."""
    try:
        return dump_yaml(config_to_dict(config_from_dict(dict(values))))
    except ConfigError:
        return dump_yaml(dict(values))


def parse_flat(text: str, source: str) -> dict[str, Any]:
    """{dotted path: value} of a config.yaml's text."""
    return flatten(parse_yaml(text, source=source) or {})


def yaml_scalar(value: Any) -> str:
    """A value as one line of YAML (how changes are shown)."""
    return dump_yaml(value).strip().removesuffix("...").strip()


_FREE_PREFIXES = {"logging.": "logging", "profile.": "profiling", "rollout.val.": "validation"}
_FREE_PATHS = {
    "trainer.output_dir": "a name",
    "trainer.project_name": "a name",
    "trainer.experiment_name": "a name",
    "trainer.resume_mode": "how this start resumes",
    "trainer.resume_from_path": "how this start resumes",
    "trainer.accept_config_changes": "how this start resumes",
    "trainer.save_freq": "saving",
    "trainer.max_ckpt_to_keep": "saving",
    "trainer.test_freq": "validation",
    "trainer.val_before_train": "validation",
    "cluster.ray_address": "where it runs",
    "cluster.cpus_per_worker": "where it runs",
    "cluster.connect_timeout_s": "where it runs",
    "cluster.device_memory_gib": "the memory check",
    "rollout.push_timeout_s": "a failure timeout",
}


def free_reason(path: str) -> str | None:
    """Why a changed field is not a change of the run (None when it is one); total_steps is judged apart."""
    if path in _FREE_PATHS:
        return _FREE_PATHS[path]
    if path.endswith((".checkpoint.async_save", ".checkpoint.save_contents")):
        return "saving"
    return next((why for prefix, why in _FREE_PREFIXES.items() if path.startswith(prefix)), None)


def _default(path: str) -> Any:
    try:
        return config_to_dict(get_path(RLConfig(), path))
    except AttributeError:
        return None


@dataclass(frozen=True)
class ConfigChange:
    """A field whose value differs from the run folder's config."""

    path: str
    old: Any
    new: Any
    free: str | None = None
    """Why it is not a change of the run (None: it is one)."""
    note: str = ""
    removed: bool = False

    def describe(self) -> str:
        return f"{self.path}: {yaml_scalar(self.old)} -> {yaml_scalar(self.new)}" + (
            f" ({self.note})" if self.note else ""
        )

    def record(self, kind: str) -> dict[str, Any]:
        out = {"path": self.path, "old": self.old, "new": self.new, "kind": kind}
        if self.free:
            out["why"] = self.free
        if self.removed:
            out["removed"] = True
        return out


def _lr_rows(config: RLConfig, first: int, last: int) -> dict[str, list[tuple]]:
    """{role: [(step, scheduler step, update, lr, weight decay) for steps first..last]} of the plan."""
    from rlconf.plan import compile_plan

    plan = compile_plan(config)
    return {
        o.role: [
            (r.step, r.scheduler_step, r.update, r.lr, r.weight_decay) for r in o.table[first - 1 : last]
        ]
        for o in plan.optim
    }


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """{dotted path: value} -> nested dict (the inverse of rlconf.render.flatten)."""
    out: dict[str, Any] = {}
    for path, value in flat.items():
        node = out
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def _total_steps_change(old_flat: Mapping[str, Any], done: int, old: int, new: int) -> str:
    """'' when steps done+1..min(old, new) keep their learning rates under the new total_steps, else why
    not (the schedule follows total_steps)."""
    first, last = done + 1, min(old, new)
    try:
        recorded = config_from_dict(unflatten(old_flat))
        before = _lr_rows(replace_paths(recorded, {"trainer.total_steps": old}), first, last)
        after = _lr_rows(replace_paths(recorded, {"trainer.total_steps": new}), first, last)
    except ConfigError:
        return "the folder's config no longer compiles, so its lr schedule cannot be compared"
    for role, rows in before.items():
        for a, b in zip(rows, after.get(role, []), strict=False):
            if a != b:
                return (
                    f"the {role} lr schedule follows total_steps: step {a[0]} would use lr {b[3]:.6g} instead of "
                    f"{a[3]:.6g}"
                )
    return ""


def config_changes(old_flat: Mapping[str, Any], new_flat: Mapping[str, Any], done: int) -> list[ConfigChange]:
    """Every field where the config `new_flat` differs from the folder's `old_flat`, classified; `done` is the
    step the run resumes after (0: it starts at step 1)."""
    changes = []
    for ch in diff_dicts(dict(old_flat), dict(new_flat)):
        if ch.kind == "added" and ch.new == _default(ch.path):
            continue  # a field newer than the folder's config.yaml, at its default: nothing changed
        if ch.kind == "removed":
            changes.append(ConfigChange(ch.path, ch.old, None, "no longer a config field", removed=True))
            continue
        if ch.path == "trainer.total_steps" and isinstance(ch.old, int):
            why = _total_steps_change(old_flat, done, ch.old, ch.new)
            free = None if why else ("an extension" if ch.new > ch.old else "a shorter run")
            changes.append(ConfigChange(ch.path, ch.old, ch.new, free, why))
            continue
        changes.append(ConfigChange(ch.path, ch.old, ch.new, free_reason(ch.path)))
    return changes
