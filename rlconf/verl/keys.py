"""The verl key table's row type: `VerlKey`, the reasons a key has no rlplan path, and what a converter may
return or raise (SKIP, VerlValueError)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

Reason = Literal["unsupported", "ignored-by-verl", "not-needed", "deprecated-in-verl"]
REASONS: dict[str, str] = {
    "unsupported": "rlplan has no such feature",
    "ignored-by-verl": "verl itself ignores this key",
    "not-needed": "rlplan derives or does not need it",
    "deprecated-in-verl": "an older verl name",
    "unknown": "unknown verl key",
    "unresolved": "an interpolation that cannot be resolved",
}


class _Skip:
    """Returned by a converter when the verl value asks for nothing to be set (rlplan's default holds)."""

    def __repr__(self) -> str:
        return "SKIP"


SKIP: Any = _Skip()
NO_DEFAULT: Any = object()


class VerlValueError(ValueError):
    """A verl value with no rlplan translation; the message says why and the fix what to do."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


Converter = Callable[[Any, Mapping[str, Any]], Any]


@dataclass(frozen=True)
class VerlKey:
    """One verl key and its rlplan translation.

    `verl` is the dotted verl key (a trailing `.*` covers every key under it). `rlplan` is the dotted
    rlplan path, or None when there is none; then `reason` says why. `convert(value, verl_values)` turns
    the verl value into the rlplan value (it may return SKIP, or raise VerlValueError); on a row without an
    rlplan path it only checks the value (raising VerlValueError for a value rlplan cannot run). `verl_default` is
    verl's default, applied when the input leaves the key unset (only where it differs from rlplan's and
    changes the run; it may be a `${...}` interpolation of another verl key).
    """

    verl: str
    rlplan: str | None
    note: str = ""
    convert: Converter | None = None
    reason: Reason | None = None
    verl_default: Any = NO_DEFAULT
    family: str = ""

    def __post_init__(self) -> None:
        if (self.rlplan is None) != (self.reason is not None):
            raise ValueError(f"{self.verl}: a row has either an rlplan path or a reason, not both")

    @property
    def has_default(self) -> bool:
        return self.verl_default is not NO_DEFAULT
