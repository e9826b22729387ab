"""Reading and rewriting `metrics.jsonl` safely: one JSON object with an integer `step` per line.

A run killed while it appended a line leaves that last line torn (no newline, not JSON): `parse` sets it
apart, and `repair` (called under the run lock before a resume, rltrain.runfolder) removes it with a
warning, so the resumed run does not append onto it. Any other line that is not a step record (`42`,
invalid JSON in the middle, an object without an integer step) is a ConfigError naming the file and the
line (exit 2). Every rewrite goes through a temporary file and os.replace: a crash leaves the old file or
the new one, never half of one. Imports no torch (the run folder checks run before anything heavy).
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlconf.errors import ConfigError, error

RULE = "metrics-file"


@dataclass(frozen=True)
class MetricsLines:
    """The parsed file: (line number, raw line, record) of each step record, and the torn last line."""

    records: list[tuple[int, str, dict[str, Any]]]
    torn: str | None = None
    torn_lineno: int = 0


def _malformed(path: Path, lineno: int, line: str, why: str) -> ConfigError:
    shown = line if len(line) <= 60 else line[:57] + "..."
    return ConfigError([error(
        "trainer.output_dir", f"{path}:{lineno}: {why}: {shown!r}; each line of {path.name} is one step's "
        "JSON object with an integer `step`",
        f"fix or delete line {lineno} of {path}, or start over with --trainer.resume_mode disable or "
        "another --trainer.output_dir", RULE)], str(path))  # fmt: skip


def parse(path: str | os.PathLike) -> MetricsLines:
    """Every step record of `path` (none when it does not exist). ConfigError for a line that is not one,
    except a torn last line (no newline at the end, not JSON), which is returned apart."""
    path = Path(path)
    if not path.exists():
        return MetricsLines([])
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        lineno = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise _malformed(path, lineno, "", "not UTF-8 text") from None
    lines = text.split("\n")
    last_terminated = lines[-1] == ""
    if last_terminated:
        lines.pop()
    records = []
    torn, torn_lineno = None, 0
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            if i == len(lines) and not last_terminated:
                torn, torn_lineno = line, i
                continue
            raise _malformed(path, i, line, "not JSON") from None
        if not isinstance(record, dict):
            raise _malformed(path, i, line, f"not a JSON object ({type(record).__name__})")
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise _malformed(path, i, line, "no integer `step`")
        records.append((i, line, record))
    return MetricsLines(records, torn, torn_lineno)


def write_lines(path: str | os.PathLike, lines: list[str]) -> None:
    """Replace `path` by these lines, atomically (temporary file, fsync, os.replace)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def repair(path: str | os.PathLike) -> MetricsLines:
    """Check `path` (ConfigError for a malformed line) and remove a torn last line, with a warning."""
    parsed = parse(path)
    if parsed.torn is not None:
        # MetricsLogger writes `step` first: the torn line still names its step when enough of it is left.
        match = re.match(r'\{"step": (\d+)[,}]', parsed.torn)
        which = f"the line of step {match.group(1)}" if match else "the last line"
        print(f"warning: {path}:{parsed.torn_lineno}: {which} was cut off (a run killed while writing it, "
              "or an edit): removed, the run's later lines follow its last complete one",
              file=sys.stderr, flush=True)  # fmt: skip
        write_lines(path, [line for _, line, _ in parsed.records])
    return MetricsLines(parsed.records)


def truncate_after(path: str | os.PathLike, step: int) -> None:
    """Keep the records of steps <= `step` (a resume redoes the others), atomically; a missing file stays
    missing."""
    if not Path(path).exists():
        return
    if step <= 0:
        write_lines(path, [])
        return
    parsed = parse(path)
    write_lines(path, [line for _, line, record in parsed.records if record["step"] <= step])
