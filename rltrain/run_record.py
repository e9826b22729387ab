"""What a checkpoint records about the run that wrote it, so that a resume is checked against the checkpoint
itself and not against files of the run folder a user may have deleted or edited (config.yaml).

Every COMPLETE marker carries a `run` record (`RunRecord.to_json`):

    config          the resolved config of the start that wrote the checkpoint (nested, as config.yaml holds it)
    config_sha256   sha256 of its canonical JSON (a short name for the config in `rltrain inspect` and logs)
    data            {file as data.train_files / data.val_files name it: {size, sha256, key}} of every data file

The data files are hashed once per start (sha256, streamed in 1 MiB blocks: about 1 s per GB here, less than
reading them into the dataloader costs); only regular files are opened, so a FIFO or a device given as a data
file never blocks here (the data loader reports it). `RunFolder` compares a resume against the record of the
checkpoint it resumes from; checkpoints written before the record existed fall back to config.yaml with a
warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlconf.plan.run import DataPlan
from rlconf.run_config import ConfigDocument, flatten, unflatten

RECORD_KEY = "run"
"""The key of the record in a checkpoint's COMPLETE marker."""
RECORD_VERSION = 1
_DATA_KEYS = ("data.train_files", "data.val_files")
_HASH_BLOCK = 1 << 20


@dataclass(frozen=True)
class FileIdentity:
    """A data file's size and content hash (what decides whether the run still reads the same prompts)."""

    size: int
    sha256: str

    def describe(self) -> str:
        return f"{self.size} bytes, sha256 {self.sha256[:16]}"


def file_identity(path: str | os.PathLike) -> FileIdentity | None:
    """Size and sha256 of a regular file; None when it is missing, unreadable or not a regular file (the
    data loader names that problem itself)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        h = hashlib.sha256()
        size = 0
        while block := os.read(fd, _HASH_BLOCK):
            h.update(block)
            size += len(block)
        return FileIdentity(size, h.hexdigest())
    except OSError:
        return None
    finally:
        os.close(fd)


def _canonical_sha256(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, allow_nan=True).encode()).hexdigest()


@dataclass(frozen=True)
class DataChange:
    """A data file whose content differs from the checkpoint's record of it."""

    key: str
    """The config path that names it (data.train_files or data.val_files)."""
    file: str
    old: FileIdentity
    new: FileIdentity

    def describe(self) -> str:
        return f"{self.file}: {self.old.describe()} -> {self.new.describe()}"

    def record(self, kind: str) -> dict[str, Any]:
        return {
            "path": self.key,
            "file": self.file,
            "old": vars(self.old),
            "new": vars(self.new),
            "kind": kind,
        }


@dataclass(frozen=True)
class RunRecord:
    """The resolved config and the data files' identities of one start of a run."""

    config: dict[str, Any]
    data: dict[str, tuple[str, FileIdentity | None]]
    """{file as the config names it: (config path, identity or None when it could not be read)}."""

    @classmethod
    def of(cls, document: ConfigDocument, prompts: DataPlan) -> RunRecord:
        """This start's record: its config and the identities of the plan's prompt files."""
        data: dict[str, tuple[str, FileIdentity | None]] = {}
        for key, files in zip(_DATA_KEYS, (prompts.train_files, prompts.val_files), strict=True):
            for name in files:
                data.setdefault(name, (key, file_identity(name)))
        return cls(document.values, data)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": RECORD_VERSION,
            "config": self.config,
            "config_sha256": _canonical_sha256(self.config),
            "data": {
                name: {"key": key, **(vars(ident) if ident is not None else {"size": None, "sha256": None})}
                for name, (key, ident) in self.data.items()
            },
        }

    @classmethod
    def from_json(cls, obj: Any) -> RunRecord | None:
        """The record of a marker, or None when it is not a well-formed record (the caller warns)."""
        if not isinstance(obj, dict) or not isinstance(obj.get("config"), dict):
            return None
        raw = obj.get("data")
        if not isinstance(raw, dict):
            return None
        data: dict[str, tuple[str, FileIdentity | None]] = {}
        for name, entry in raw.items():
            if not (isinstance(entry, dict) and entry.get("key") in _DATA_KEYS):
                return None
            size, digest = entry.get("size"), entry.get("sha256")
            ok = isinstance(size, int) and not isinstance(size, bool) and isinstance(digest, str)
            data[str(name)] = (entry["key"], FileIdentity(size, digest) if ok else None)
        return cls(obj["config"], data)

    @property
    def sha256(self) -> str:
        return _canonical_sha256(self.config)

    def anchor(self, step: int) -> dict[str, Any]:
        """How a config_history.jsonl entry names the checkpoint (of `step`, with this record) it resumed from."""
        return {"step": step, "config_sha256": self.sha256}

    def with_history(self, entries: list[dict[str, Any]], step: int) -> RunRecord:
        """This record (of the checkpoint of `step`) with the changes that earlier starts resuming from the
        same checkpoint accepted (their history entries name it), in order: what the next step runs with."""
        anchor = self.anchor(step)
        flat = flatten(self.config)
        data = dict(self.data)
        for entry in entries:
            if not isinstance(entry, dict) or entry.get("from_checkpoint") != anchor:
                continue
            for change in entry.get("changes", []):
                if change.get("removed"):
                    flat.pop(change["path"], None)
                else:
                    flat[change["path"]] = change["new"]
            for change in entry.get("data_changes", []):
                new = change.get("new") or {}
                if change.get("file") in data and isinstance(new.get("size"), int):
                    data[change["file"]] = (change["path"], FileIdentity(new["size"], str(new.get("sha256"))))
        return RunRecord(unflatten(flat), data)

    def data_changes(self, now: RunRecord) -> list[DataChange]:
        """Files named by both records whose size or content differ (a file only one names is a change of
        data.train_files / val_files, which the config comparison reports)."""
        out = []
        for name, (key, old) in self.data.items():
            if name not in now.data:
                continue
            new = now.data[name][1]
            if old is not None and new is not None and old != new:
                out.append(DataChange(key, name, old, new))
        return out


def checkpoint_record(marker: Mapping[str, Any] | None) -> tuple[RunRecord | None, str | None]:
    """(record, None) from a checkpoint's COMPLETE marker; (None, why) when it has none or a malformed one."""
    if marker is None:
        return None, "it has no readable COMPLETE marker"
    if RECORD_KEY not in marker:
        return None, "it was written by an rlplan version that did not record the run's config"
    record = RunRecord.from_json(marker[RECORD_KEY])
    if record is None:
        return None, f"its {RECORD_KEY!r} record is malformed"
    return record, None


def record_file(folder: str | os.PathLike) -> Path:
    """The file that holds the record of checkpoint `folder` (its COMPLETE marker)."""
    from rltrain.checkpoint.manifest import COMPLETE

    return Path(folder) / COMPLETE


__all__ = [
    "RECORD_KEY",
    "DataChange",
    "FileIdentity",
    "RunRecord",
    "checkpoint_record",
    "file_identity",
    "record_file",
    "unflatten",
]
