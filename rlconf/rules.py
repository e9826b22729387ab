"""The rule registry: named cross-field checks that see the whole config and report every problem at once.

Each rule is a small generator registered with `@rule(name, fields...)` (the check modules of rlconf.checks
register theirs when imported; rlconf.validate imports them all); it yields `Issue`s (errors or warnings)
that name the config path to change and the fix. rlconf.validate.check_config runs all of them, so a file with three
independent mistakes reports three errors. Rules never raise on odd values: sizes are checked for
positivity by one rule and the others guard against zero.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from rlconf.config import RLConfig
from rlconf.errors import Issue

RuleFn = Callable[[RLConfig], Iterator[Issue]]
TYPE_RULE = "type"
"""The rule every value's type is checked under (run first, and alone when it finds anything)."""


@dataclass(frozen=True)
class Rule:
    """A named cross-field check; `fields` are glob patterns of the config paths it reads (for the docs)."""

    name: str
    doc: str
    fn: RuleFn
    fields: tuple[str, ...]
    filesystem: bool = False
    """Reads the filesystem (paths the run reads or writes); runs only when check_config is asked to."""

    def involves(self, path: str) -> bool:
        return any(fnmatch.fnmatchcase(path, pattern) for pattern in self.fields)


RULES: dict[str, Rule] = {}
# Names that a rule reports under, more specific than the rule itself (documented with their rule).
SUB_RULES: dict[str, str] = {
    "mini-batch-divides-batch": "batch-layout",
    "batch-divisible-by-dp-micro": "batch-layout",
    "mini-batch-covers-micro": "batch-layout",
    "token-budget-fits-sequence": "batch-layout",
    "log-prob-budget-unused": "batch-layout",
}


def rule(name: str, *fields: str, filesystem: bool = False) -> Callable[[RuleFn], RuleFn]:
    def register(fn: RuleFn) -> RuleFn:
        RULES[name] = Rule(name, " ".join((fn.__doc__ or "").split()), fn, fields, filesystem)
        return fn

    return register
