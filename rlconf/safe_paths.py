"""The one containment check for file names read from a folder someone else wrote.

A model folder names files in `model.safetensors.index.json` (weight_map), its tokenizer files sit beside it,
a checkpoint's manifest and its distributed checkpoint's `.metadata` name the files they cover. Every reader
of such a name (rlconf's validate rules, rltrain's weight loader, tokenizer loader, checkpoint loaders) calls
`resolve_inside`: the name must be a relative path without `..`, and the file it reaches, symlinks resolved,
must lie inside the folder. A hostile folder cannot make rlplan read `../../secret.safetensors`, an absolute
path or a symlink to elsewhere.

One layout is accepted on purpose: a Hugging Face hub cache snapshot (`models--ORG--NAME/snapshots/REV/`)
holds symlinks into the same repository's `blobs/` folder, so for a folder whose parent is `snapshots`, its
repository's `blobs/` counts as inside too (nothing else of the cache does).

Pure Python (no torch): rlconf uses it at validate time.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any


class PathEscapeError(ValueError):
    """A file name read from a folder that points outside it. `folder`, `entry` and `what` say which."""

    def __init__(self, folder: str | os.PathLike, entry: object, what: str, why: str) -> None:
        self.folder, self.entry, self.what, self.why = str(folder), entry, what, why
        super().__init__(f"{what} names {entry!r}, which {why}; every file it names must lie inside {folder}")


def _roots(folder: Path) -> list[Path]:
    real = folder.resolve()
    roots = [real]
    # Hub cache: snapshots/REV/* are symlinks to ../../blobs/HASH of the same repository.
    if real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
        roots.append((real.parent.parent / "blobs").resolve())
    return roots


def resolve_inside(folder: str | os.PathLike, entry: object, what: str) -> Path:
    """The real path of `entry` (a file name read from `folder`'s files, e.g. a weight_map value) once it is
    known to lie inside `folder`; PathEscapeError otherwise.

    `what` says where the name was read (e.g. "model.safetensors.index.json weight_map entry
    'lm_head.weight'") for the message. Refused: a non-string or empty name, a NUL byte, an absolute path
    (POSIX or Windows drive / UNC), any `..` component, and a name whose resolved path (every symlink
    followed, also of a file that does not exist yet) is outside the folder."""
    if not isinstance(entry, str) or not entry:
        raise PathEscapeError(folder, entry, what, "is not a file name")
    if "\0" in entry:
        raise PathEscapeError(folder, entry, what, "holds a NUL byte")
    win = PureWindowsPath(entry)
    if PurePosixPath(entry).is_absolute() or win.drive or win.root:
        raise PathEscapeError(folder, entry, what, "is an absolute path")
    if ".." in PurePosixPath(entry.replace("\\", "/")).parts:
        raise PathEscapeError(folder, entry, what, "climbs out with '..'")
    root = Path(folder)
    real = (root / entry).resolve()
    if not any(real == r or real.is_relative_to(r) for r in _roots(root)):
        raise PathEscapeError(folder, entry, what, f"resolves to {real} (through a symlink)")
    return real


INDEX_FILE = "model.safetensors.index.json"
# The rule (rlconf validate, rltrain start, the loaders at run time) that names a folder whose names escape it.
FOLDER_PATHS_RULE = "model-folder-paths"
# Bound on the entries of a model folder walked for symlinks (a real one holds tens).
_WALK_LIMIT = 100_000


def model_folder_escapes(folder: str | os.PathLike) -> list[PathEscapeError]:
    """Every name in a Hugging Face model folder that points outside it: weight_map entries of its
    safetensors index, and symlinks anywhere in it (weights, config.json, tokenizer files). Empty when the
    folder is self-contained (or is no folder: the readers report that). An unreadable index is left to the
    weight loader, which names the file."""
    root = Path(folder)
    if not root.is_dir():
        return []
    found: list[PathEscapeError] = []
    index = root / INDEX_FILE
    if index.is_file() and not index.is_symlink():
        import json

        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
        except (OSError, ValueError, RecursionError, AttributeError):
            weight_map = None
        if isinstance(weight_map, dict):
            tensors: dict[Any, list[str]] = {}  # each file named once, with the tensors naming it
            for name, entry in weight_map.items():
                tensors.setdefault(entry if isinstance(entry, str) else repr(entry), []).append(name)
            for entry, names in tensors.items():
                more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
                try:
                    resolve_inside(root, entry, f"{INDEX_FILE} weight_map entry {names[0]!r}{more}")
                except PathEscapeError as exc:
                    found.append(exc)
    seen = 0
    for dirpath, dirs, files in os.walk(root):  # symlinked folders are not entered, only checked
        for name in (*dirs, *files):
            seen += 1
            path = Path(dirpath) / name
            if seen > _WALK_LIMIT:
                return found
            if path.is_symlink():
                rel = path.relative_to(root).as_posix()
                try:
                    resolve_inside(root, rel, f"the symlink {rel}")
                except PathEscapeError as exc:
                    found.append(exc)
    return found


__all__ = ["FOLDER_PATHS_RULE", "INDEX_FILE", "PathEscapeError", "model_folder_escapes", "resolve_inside"]
