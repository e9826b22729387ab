"""Config problems as data: every problem names the dotted config path, what is wrong and the fix."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Issue:
    """One problem with a config.

    `path` is the dotted config path including list indices (`profile.ranks[2]`); `rule` is a stable
    name for the check (tests and docs refer to it); `fix` tells the user what to change.
    """

    path: str
    message: str
    fix: str
    rule: str
    severity: Literal["error", "warning"] = "error"

    def format(self) -> str:
        label = "error" if self.severity == "error" else "warning"
        return f"{label} [{self.rule}] {self.path or '<root>'}: {self.message}\n    fix: {self.fix}"


class IssueSet:
    """Errors and warnings of a tuple `issues` (ConfigError and reports that carry issues)."""

    issues: tuple[Issue, ...]

    @property
    def errors(self) -> tuple[Issue, ...]:
        return tuple(i for i in self.issues if i.severity == "error")

    @property
    def warnings(self) -> tuple[Issue, ...]:
        return tuple(i for i in self.issues if i.severity == "warning")


class ConfigError(IssueSet, Exception):
    """A config that cannot run. Carries every error found (not just the first) and any warnings."""

    def __init__(self, issues: Iterable[Issue], source: str | None = None) -> None:
        self.issues: tuple[Issue, ...] = tuple(issues)
        self.source = source
        if not self.errors:
            raise ValueError("ConfigError needs at least one error issue")
        super().__init__(self.format())

    def __reduce__(self) -> tuple[type, tuple[tuple[Issue, ...], str | None]]:
        # Pickled with its issues (a worker process raises it; the driver reports it): Exception's own
        # reduce would rebuild it from the formatted text.
        return (type(self), (self.issues, self.source))

    @property
    def path(self) -> str:
        """Path of the first error."""
        return self.errors[0].path

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(i.path for i in self.errors)

    def format(self) -> str:
        n = len(self.errors)
        head = f"{self.source}: " if self.source else ""
        lines = [f"{head}invalid config: {n} error{'s' if n != 1 else ''}"]
        lines += [issue.format() for issue in self.issues]
        return "\n".join(lines)


def error(path: str, message: str, fix: str, rule: str) -> Issue:
    return Issue(path=path, message=message, fix=fix, rule=rule, severity="error")


def warning(path: str, message: str, fix: str, rule: str) -> Issue:
    return Issue(path=path, message=message, fix=fix, rule=rule, severity="warning")
