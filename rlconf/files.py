"""The one bounded reader of files other people hand us: config files, config.json, tokenizer files, chat
templates, safetensors headers, checkpoint manifests, data files.

Every read goes through `read_regular`: the path is opened without blocking (O_NONBLOCK: a FIFO with no
writer does not hang the open), the opened file is checked to be a regular file (fstat after resolving
symlinks, so a symlink to /dev/zero, a FIFO, a socket or a device is refused before a byte is read), a file
whose size is over the limit is refused unread, and at most `max_bytes` + 1 bytes are read (a file that grows
meanwhile), so a file over the limit costs one error and no memory. `read_json` adds a nesting limit.
Violations are ConfigError (exit 2 at `rlconf validate` / `rltrain`) naming the config path (`model.path`,
`data.train_files[0]`, ...) and the file.

Pure standard library (rlconf never imports torch).
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from pathlib import Path
from typing import Any

from rlconf.errors import ConfigError, error

KIB, MIB = 1 << 10, 1 << 20
FILE_RULE = "file"
LIMIT_RULE = "file-limits"
MAX_JSON_DEPTH = 64
"""Nesting limit of the JSON files a run reads (config.json, tokenizer files, manifests, safetensors headers);
the real ones nest fewer than 10 levels."""
# Size limits per kind of file: far above any real file of the kind, far below what hurts a machine.
MAX_MODEL_CONFIG_BYTES = 4 * MIB
"""config.json of a model (real ones are a few KiB)."""
MAX_TOKENIZER_BYTES = 256 * MIB
"""tokenizer.json / vocab / merges / tokenizer.model (the largest real ones, 256k-token vocabularies, are
about 35 MiB)."""
MAX_TOKENIZER_CONFIG_BYTES = 64 * MIB
"""tokenizer_config.json, special_tokens_map.json, added_tokens.json, chat templates."""
MAX_SAFETENSORS_HEADER_BYTES = 100 * MIB
"""The JSON header of one safetensors file (the safetensors library's own limit is 100 MB)."""
MAX_MANIFEST_BYTES = 64 * MIB
"""A checkpoint's JSON records (manifest, meta, index)."""
MAX_DATA_BYTES = 16 << 30
"""A prompt file (.jsonl / .parquet); the loader holds its rows in memory (real RL prompt sets are MBs to a
few GB)."""


class FileProblem(Exception):
    """Why a path cannot be read as a regular file (message, fix, rule)."""

    def __init__(self, message: str, fix: str, rule: str = FILE_RULE, kind: str = "other") -> None:
        super().__init__(message)
        self.message, self.fix, self.rule = message, fix, rule
        self.kind = kind
        """Which check failed: missing, unreadable (stat failed), folder, too-large or other (not a regular
        file, open or read failed); a reader words its own errors by it."""


def _describe(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def open_regular(path: Path) -> int:
    """A read-only descriptor of the regular file at `path` (symlinks resolved), never blocking."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileProblem(f"{path} does not exist", "check the path", kind="missing") from None
    except OSError as exc:
        raise FileProblem(
            f"cannot read {path}: {exc.strerror or exc}",
            "check the path and its permissions",
            kind="unreadable",
        ) from None
    if stat.S_ISDIR(mode):
        raise FileProblem(f"{path} is a folder, not a file", "name a file inside it", kind="folder")
    if not stat.S_ISREG(mode):
        # Checked before opening too: opening some devices has effects of its own.
        raise FileProblem(
            f"{path} is not a regular file ({_describe(mode)})", "replace it with a regular file"
        )
    try:
        fd = os.open(
            path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
        )
    except OSError as exc:
        raise FileProblem(
            f"cannot read {path}: {exc.strerror or exc}", "check the file's permissions"
        ) from None
    mode = os.fstat(fd).st_mode  # what was opened, in case the path changed since the stat
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise FileProblem(
            f"{path} is not a regular file ({_describe(mode)})", "replace it with a regular file"
        )
    return fd


class _Reader:
    """One bounded read: the error naming (config path, what the file is, rule) and the opened file."""

    def __init__(
        self, path: str | os.PathLike[str], key: str, what: str, rule: str | None, source: str | None
    ):
        self.path, self.key, self.what, self.rule, self.source = Path(path), key, what, rule, source

    def fail(self, message: str, fix: str, rule: str) -> ConfigError:
        return ConfigError([error(self.key, f"{self.what}: {message}", fix, self.rule or rule)], self.source)

    def open(self) -> int:
        try:
            return open_regular(self.path)
        except FileProblem as exc:
            raise self.fail(exc.message, exc.fix, exc.rule) from None

    def too_large(self, max_bytes: int) -> ConfigError:
        return self.fail(
            f"{self.path} is larger than {_size_text(max_bytes)}",
            "check that this is the file you meant",
            LIMIT_RULE,
        )

    def read(self, fd: int, offset: int, length: int) -> bytes:
        """Up to `length` bytes from `offset` (fewer at the end of the file)."""
        try:
            return read_fd(fd, self.path, offset, length)
        except FileProblem as exc:
            raise self.fail(exc.message, exc.fix, exc.rule) from None


def read_fd(fd: int, path: Path, offset: int, length: int) -> bytes:
    """Up to `length` bytes from `offset` of the open file `fd` at `path` (fewer at the end of the file)."""
    try:
        if offset:
            os.lseek(fd, offset, os.SEEK_SET)
        chunks, got = [], 0
        while got < length:
            chunk = os.read(fd, min(length - got, 8 * MIB))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    except OSError as exc:
        raise FileProblem(f"cannot read {path}: {exc.strerror or exc}", "check the file") from None
    return b"".join(chunks)


def read_limited(path: Path, max_bytes: int) -> bytes:
    """The bytes of the regular file at `path`, at most `max_bytes` (reading at most one more); FileProblem,
    whose `kind` says which check failed, otherwise. read_regular words its errors as ConfigErrors."""
    fd = open_regular(path)
    try:
        # A regular file's size is known before reading: one over the limit is refused unread. The read
        # stays bounded for a file that grows meanwhile.
        size = os.fstat(fd).st_size
        data = b"" if size > max_bytes else read_fd(fd, path, 0, max_bytes + 1)
    finally:
        os.close(fd)
    if size > max_bytes or len(data) > max_bytes:
        raise FileProblem(
            f"{path} is larger than {_size_text(max_bytes)}", "check that this is the file you meant", LIMIT_RULE,
            kind="too-large",
        )  # fmt: skip
    return data


def check_regular(
    path: str | os.PathLike[str], max_bytes: int, *, key: str, what: str, source: str | None = None
) -> int:
    """The size of the regular file at `path` (<= max_bytes), for readers that read it themselves (pyarrow);
    the same checks and errors as read_regular, without reading."""
    r = _Reader(path, key, what, None, source)
    fd = r.open()
    try:
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if size > max_bytes:
        raise r.too_large(max_bytes)
    return size


def _size_text(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", KIB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


def read_regular(
    path: str | os.PathLike[str],
    max_bytes: int,
    *,
    key: str,
    what: str,
    source: str | None = None,
    rule: str | None = None,
) -> bytes:
    """The bytes of the regular file at `path`, at most `max_bytes` (reading at most one more); a ConfigError
    naming config path `key` and the file (`what` says what the file is: "config.json of model.path") when
    it is missing, not a regular file, or longer. `rule` replaces the rule names of the errors (a reader's
    own rule, e.g. model-config-json)."""
    try:
        return read_limited(Path(path), max_bytes)
    except FileProblem as exc:
        raise _Reader(path, key, what, rule, source).fail(exc.message, exc.fix, exc.rule) from None


def read_span(
    path: str | os.PathLike[str], offset: int, length: int, *, key: str, what: str, rule: str | None = None
) -> tuple[bytes, int]:
    """(up to `length` bytes from `offset`, the file's size) of the regular file at `path`: for formats
    that say their own lengths (a safetensors header), with read_regular's checks."""
    r = _Reader(path, key, what, rule, None)
    fd = r.open()
    try:
        return r.read(fd, offset, length), os.fstat(fd).st_size
    finally:
        os.close(fd)


def _renamed(exc: ConfigError, rule: str) -> ConfigError:
    return ConfigError([dataclasses.replace(i, rule=rule) for i in exc.issues], exc.source)


def read_text(
    path: str | os.PathLike[str],
    max_bytes: int,
    *,
    key: str,
    what: str,
    source: str | None = None,
    rule: str | None = None,
) -> str:
    """read_regular decoded as UTF-8 (an error naming the byte otherwise)."""
    raw = read_regular(path, max_bytes, key=key, what=what, source=source, rule=rule)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [
                error(
                    key,
                    f"{what}: {path} is not UTF-8 text (byte {exc.start})",
                    "save it as UTF-8 text",
                    rule or FILE_RULE,
                )
            ],
            source,
        ) from None


def json_depth_exceeds(value: Any, max_depth: int) -> bool:
    """Whether a parsed JSON value nests deeper than `max_depth` (iterative: no recursion limit)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            if depth >= max_depth and item:
                return True
            stack.extend((v, depth + 1) for v in item if isinstance(v, (dict, list)))
    return False


def parse_json_bounded(
    text: str | bytes,
    *,
    key: str,
    what: str,
    name: str,
    max_depth: int = MAX_JSON_DEPTH,
    source: str | None = None,
) -> Any:
    """Parse JSON text with a nesting limit; errors name config path `key` and file `name`."""
    try:
        data = json.loads(text)
    except RecursionError:  # the scanner recurses once per level
        data = _DEEP
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(
            [
                error(
                    key,
                    f"{what}: cannot read {name}: not valid JSON: {exc}",
                    "replace it with a valid file",
                    FILE_RULE,
                )
            ],
            source,
        ) from None
    if data is _DEEP or json_depth_exceeds(data, max_depth):
        line = _deep_line(text.decode("utf-8", "replace") if isinstance(text, bytes) else text, max_depth)
        raise ConfigError(
            [error(key, f"{what}: {name}:{line}: JSON nested too deeply to read (nested deeper than {max_depth} "
                   "levels)", "replace it with a valid file", LIMIT_RULE)],
            source,
        )  # fmt: skip
    return data


def _deep_line(text: str, limit: int = 64) -> int:
    """The line where JSON `text` first nests deeper than `limit` levels (outside strings)."""
    depth, line, in_str, escaped = 0, 1, False, False
    for ch in text:
        if ch == "\n":
            line += 1
        elif in_str:
            escaped, in_str = (False, in_str) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return line
        elif ch in "]}":
            depth -= 1
    return line


_DEEP = object()


def read_json(
    path: str | os.PathLike[str],
    max_bytes: int,
    *,
    key: str,
    what: str,
    max_depth: int = MAX_JSON_DEPTH,
    source: str | None = None,
    rule: str | None = None,
) -> Any:
    """A JSON file read with read_regular's checks and a nesting limit."""
    raw = read_regular(path, max_bytes, key=key, what=what, source=source, rule=rule)
    try:
        return parse_json_bounded(raw, key=key, what=what, name=str(path), max_depth=max_depth, source=source)
    except ConfigError as exc:
        raise exc if rule is None else _renamed(exc, rule) from None
