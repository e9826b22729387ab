"""The checkpoint folder format: names, manifests (digests), atomic writes, COMPLETE markers, the latest file.

Shared by the worker side (`engine_io`), the controller side (`registry`) and the tools (`tools`); no torch, no
megatron. A role folder's `manifest.json` is written last, after every file is verified: the role's
completion mark. It lists every file's size and a CRC-32 of every byte, one per 64 MiB block, hashed by a pool
of threads (docs/checkpoints.md has the cost against the save). Commit, resume, `load_engine`, `rltrain
inspect` and `export-hf` verify against it; a mismatch names the file and the damaged byte range. Manifests of
older versions (sha256 of small files, sampled digests of large ones) are still verified as they were written.

Malformed input never crashes: a latest file that holds no step number (too long, non-ASCII digits, ...),
a COMPLETE marker or manifest that is not well formed each make the checkpoint "not complete" (the reason
names the file).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
import uuid
import zlib
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rlconf.errors import ConfigError
from rlconf.files import MAX_MANIFEST_BYTES
from rlconf.files import read_json as read_json_bounded
from rlconf.safe_paths import PathEscapeError, resolve_inside

FORMAT = "rlplan-megatron-checkpoint/1"
LATEST_FILE = "latest_checkpointed_iteration.txt"
COMPLETE = "COMPLETE"
MANIFEST = "manifest.json"
META = "meta.json"
EXTRA = "extra.json"
DIST_DIR = "dist_ckpt"
RNG_DIR = "rng"
HF_DIR = "huggingface"
# Manifest digests: a CRC-32 (zlib) of every byte of every file, one per block of _DIGEST_BLOCK bytes. Measured
# here at 2.7 GB/s per thread (sha256 1.3, blake2b 0.5; xxhash is not installed); zlib releases the GIL, so
# blocks hash in parallel threads. Per-block values also say where a file is damaged. A CRC detects damage
# (zeroed pages, flipped bits, truncation), not forgery: the manifest is no signature.
_DIGEST = "crc32"
_DIGEST_BLOCK = 64 << 20
_READ_BYTES = 4 << 20
_HASH_THREADS = max(1, min(8, os.cpu_count() or 1))
# ASCII digits only (re's \d also takes e.g. Arabic-Indic digits, which int() would then accept).
STEP_DIR = re.compile(r"^global_step_([0-9]+)$")
# Leftovers of a save (tmp), of replacing a step that already existed (old) and of retention (del).
WORK_DIR = re.compile(r"^global_step_([0-9]+)\.(tmp|old|del)-([0-9a-z]+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded as asked; the message names the config path to change."""


# ============================================================================================ small files
def fsync_dir(path: Path) -> None:
    # A rename is durable only once its directory entry is on disk.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `path` so that readers see the old content or the new one, never a torn file."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json(path: Path, obj: Any) -> None:
    write_atomic(path, (json.dumps(obj, indent=2, sort_keys=True, allow_nan=True) + "\n").encode())


def read_json(path: Path) -> Any:
    """A checkpoint's JSON record, read bounded (rlconf.files: a regular file of at most MAX_MANIFEST_BYTES,
    nested at most MAX_JSON_DEPTH, never blocking on a FIFO): FileNotFoundError when missing, ValueError
    naming the file for anything else (both in JSON_ERRORS)."""
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{path} does not exist")
    try:
        return read_json_bounded(path, MAX_MANIFEST_BYTES, key="", what="checkpoint record")
    except ConfigError as exc:
        raise ValueError(exc.issues[0].message) from None


# What reading a JSON file that someone damaged can raise: OSError, ValueError (bad JSON, bad UTF-8, a number
# past int's 4300-digit limit) and RecursionError (deeply nested brackets).
JSON_ERRORS = (OSError, ValueError, RecursionError)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _sampled_sha256(path: Path, size: int, blocks: int, block: int) -> str:
    """sha256 over `size` and `blocks` blocks spread evenly from the first byte to the last (manifests written
    before the full CRC-32 digests; still verified so that their checkpoints resume)."""
    h = hashlib.sha256(str(size).encode())
    last = max(size - block, 0)
    offsets = sorted({last * i // max(blocks - 1, 1) for i in range(blocks)})
    with open(path, "rb") as f:
        for offset in offsets:
            f.seek(offset)
            h.update(f.read(block))
    return h.hexdigest()


def _walk_files(root: Path) -> Iterator[Path]:
    for dirpath, _, files in os.walk(root):
        for name in files:
            yield Path(dirpath) / name


def is_scratch(path: Path) -> bool:
    """A temp file of an atomic write in progress (never part of a checkpoint)."""
    return path.name.startswith(".") and ".tmp-" in path.name


def _block_spans(size: int, block: int) -> list[tuple[int, int]]:
    """(offset, length) of each digest block of a file of `size` bytes (one empty block for an empty file)."""
    return [(start, min(block, size - start)) for start in range(0, size, block)] or [(0, 0)]


def _crc32_range(path: Path, offset: int, length: int) -> int:
    crc = 0
    buf = memoryview(bytearray(min(_READ_BYTES, max(length, 1))))
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        left = length
        while left > 0:
            n = f.readinto(buf[: min(len(buf), left)])
            if not n:
                break  # the file shrank while it was read: the size check names it
            crc = zlib.crc32(buf[:n], crc)
            left -= n
    return crc


def _crc32_blocks(files: Mapping[str, tuple[Path, int]], block: int) -> dict[str, list[int | OSError]]:
    """{key: CRC-32 of each block} of files given as {key: (path, size)}, hashed by a pool of threads; a
    block that cannot be read gives its OSError instead of a CRC."""
    jobs = [
        (key, path, off, n) for key, (path, size) in files.items() for off, n in _block_spans(size, block)
    ]

    def crc(job: tuple[str, Path, int, int]) -> int | OSError:
        try:
            return _crc32_range(job[1], job[2], job[3])
        except OSError as exc:
            return exc

    out: dict[str, list[int | OSError]] = {key: [] for key in files}
    if len(jobs) == 1:
        out[jobs[0][0]].append(crc(jobs[0]))
        return out
    with ThreadPoolExecutor(max(1, min(_HASH_THREADS, len(jobs)))) as pool:
        for job, value in zip(jobs, pool.map(crc, jobs), strict=True):
            out[job[0]].append(value)
    return out


def build_manifest(folder: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """{relative path: {size, crc32: [one per block]}} of every file under `folder` except the manifest."""
    root = Path(folder)
    files: dict[str, tuple[Path, int]] = {}
    for path in sorted(_walk_files(root)):
        rel = path.relative_to(root).as_posix()
        if rel != MANIFEST and not is_scratch(path):
            files[rel] = (path, path.stat().st_size)
    crcs = _crc32_blocks(files, _DIGEST_BLOCK)
    for rel, values in crcs.items():
        failed = [v for v in values if isinstance(v, OSError)]
        if failed:
            raise CheckpointError(f"{files[rel][0]}: cannot be read back for its digest ({failed[0]})")
    return {rel: {"size": size, _DIGEST: crcs[rel]} for rel, (_, size) in files.items()}


def _fsync_tree(root: Path) -> None:
    """Flush every file and folder under `root` to disk (torch.save, safetensors and megatron's common.pt do
    not fsync), so that a manifest or marker written afterwards never outlives the data after a power loss."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError), open(Path(dirpath) / name, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(dirpath))


def write_manifest(folder: str | os.PathLike, role: str) -> dict[str, Any]:
    """Write the manifest of a finished role folder (its completion mark); returns it."""
    root = Path(folder)
    _fsync_tree(root)
    manifest = {
        "format": FORMAT,
        "role": role,
        "time": time.time(),
        "digest": {"algorithm": _DIGEST, "block_bytes": _DIGEST_BLOCK},
        "files": build_manifest(root),
    }
    write_json(root / MANIFEST, manifest)
    return manifest


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_inner_path(rel: Any) -> bool:
    """A relative path that stays inside the folder (a manifest must not point elsewhere)."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel or "\0" in rel:
        return False
    return all(part not in ("", ".", "..") for part in rel.split("/"))


def _manifest_shape_problem(manifest: Any) -> str | None:
    """Why a parsed manifest cannot be trusted, or None; checked before any value in it is used."""
    if not isinstance(manifest, dict):
        return "not a JSON object"
    if manifest.get("format") != FORMAT:
        return f"format {manifest.get('format')!r}, expected {FORMAT!r}"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "no files table" if not isinstance(files, dict) else "it lists no files"  # meta.json, at least
    block = None
    if any(isinstance(e, dict) and _DIGEST in e for e in files.values()):
        digest = manifest.get("digest")
        if not (
            isinstance(digest, dict)
            and digest.get("algorithm") == _DIGEST
            and _is_count(digest.get("block_bytes"))
            and digest["block_bytes"] > 0
        ):
            return f"no digest block size for its {_DIGEST} values"
        block = digest["block_bytes"]
    for rel, entry in files.items():
        if not _is_inner_path(rel) or rel == MANIFEST:
            return f"file name {rel!r} is not a path inside the folder"
        if not isinstance(entry, dict) or not _is_count(entry.get("size")):
            return f"{rel}: no size"
        if _DIGEST in entry:
            crcs = entry[_DIGEST]
            if not (
                isinstance(crcs, list)
                and len(crcs) == len(_block_spans(entry["size"], block))  # type: ignore[arg-type]
                and all(_is_count(c) and c < 1 << 32 for c in crcs)
            ):
                return f"{rel}: its {_DIGEST} values do not fit its size"
        elif "sha256" in entry:
            if not (isinstance(entry["sha256"], str) and len(entry["sha256"]) == 64):
                return f"{rel}: malformed sha256"
        elif "sampled_sha256" in entry:
            sample = entry.get("sample")
            if not (
                isinstance(entry["sampled_sha256"], str)
                and isinstance(sample, list)
                and len(sample) == 2
                and all(_is_count(v) and v > 0 for v in sample)
            ):
                return f"{rel}: malformed sampled digest"
        else:
            return f"{rel}: no digest"
    return None


def read_manifest(folder: str | os.PathLike) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None) for a well-formed manifest of a role folder, else (None, why), naming the file."""
    root = Path(folder)
    mpath = root / MANIFEST
    if not mpath.is_file():
        return None, f"{root}: no {MANIFEST} (the save of this role never finished)"
    try:
        manifest = read_json(mpath)
    except JSON_ERRORS as exc:
        return None, f"{mpath}: unreadable ({type(exc).__name__}: {str(exc)[:200]})"
    why = _manifest_shape_problem(manifest)
    if why is not None:
        return None, f"{mpath}: malformed ({why})"
    return manifest, None


def verify_manifest(folder: str | os.PathLike, full: bool = True) -> list[str]:
    """Problems of a role folder against its manifest (empty when intact), each naming its file.

    Always: the manifest is well formed, every listed file exists with its size, and no file is missing from
    it. `full` also re-computes the digests: CRC-32 of every byte (blocks hashed in parallel threads), or for
    manifests of older rlplan versions a sha256 of small files and a sampled sha256 of large ones."""
    root = Path(folder)
    manifest, problem = read_manifest(root)
    if manifest is None:
        return [problem or f"{root}: no {MANIFEST}"]
    files: dict[str, dict[str, Any]] = manifest["files"]
    problems: list[str] = []
    intact: dict[str, tuple[Path, int]] = {}
    for rel, entry in files.items():
        path = root / rel
        try:
            # A listed name is relative without '..' (checked above); a symlink must not lead elsewhere.
            resolve_inside(root, rel, MANIFEST)
        except PathEscapeError as exc:
            problems.append(f"{path}: {exc}")
            continue
        try:
            size = path.stat().st_size if path.is_file() else None
        except OSError as exc:
            problems.append(f"{path}: cannot be read ({exc})")
            continue
        if size is None:
            problems.append(f"{path}: missing")
        elif size != entry["size"]:
            problems.append(f"{path}: {size} bytes, manifest says {entry['size']} (truncated or overwritten)")
        else:
            intact[rel] = (path, size)
    listed = set(files) | {MANIFEST}
    for path in sorted(_walk_files(root)):
        if not is_scratch(path) and path.relative_to(root).as_posix() not in listed:
            problems.append(f"{path}: not in the manifest (written after the save finished)")
    if not full:
        return problems
    crc_files = {rel: v for rel, v in intact.items() if _DIGEST in files[rel]}
    if crc_files:
        block = manifest["digest"]["block_bytes"]
        for rel, values in _crc32_blocks(crc_files, block).items():
            path, size = crc_files[rel]
            spans = _block_spans(size, block)
            for (offset, n), got, want in zip(spans, values, files[rel][_DIGEST], strict=True):
                if isinstance(got, OSError):
                    problems.append(f"{path}: cannot be read ({got})")
                    break
                if got != want:
                    problems.append(
                        f"{path}: content differs from the manifest ({_DIGEST} of bytes {offset}-{offset + n})"
                    )
                    break
    for rel, (path, size) in intact.items():
        entry = files[rel]
        try:
            if "sha256" in entry and _sha256(path) != entry["sha256"]:
                problems.append(f"{path}: content differs from the manifest (sha256)")
            elif "sampled_sha256" in entry:
                blocks, block = entry["sample"]
                if _sampled_sha256(path, size, blocks, block) != entry["sampled_sha256"]:
                    problems.append(f"{path}: content differs from the manifest (sampled sha256)")
        except OSError as exc:
            problems.append(f"{path}: cannot be read ({exc})")
    return problems


# A role folder name in a COMPLETE marker: a plain folder name (the marker must not point outside the checkpoint).
_ROLE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
# The latest file holds one step number; anything longer than this is not one (and is not read further).
_LATEST_MAX_BYTES = 64


def _folder_step(folder: Path) -> int | None:
    m = STEP_DIR.match(folder.name) or WORK_DIR.match(folder.name)
    return int(m.group(1)) if m else None


def read_marker(folder: str | os.PathLike) -> tuple[dict[str, Any] | None, str | None]:
    """(marker, None) for a well-formed COMPLETE marker of a checkpoint folder, else (None, why it is missing or
    malformed), naming the file. A malformed marker means "not complete", never a crash."""
    folder = Path(folder)
    path = folder / COMPLETE
    if not path.is_file():
        if path.exists():
            return None, f"{path} is not a file"
        return None, f"{folder} has no {COMPLETE} marker (its save never finished, or the marker was deleted)"
    try:
        marker = read_json(path)
    except JSON_ERRORS as exc:
        return None, f"{path} is unreadable ({type(exc).__name__}: {str(exc)[:200]})"
    why = None
    named = _folder_step(folder)
    if not isinstance(marker, dict):
        why = "not a JSON object"
    elif not (_is_count(marker.get("step")) and marker["step"] >= 1):
        why = "no step number"
    elif named is not None and marker["step"] != named:
        why = f"step {marker['step']} in the folder of step {named}"
    elif not (
        isinstance(marker.get("roles"), list)
        and marker["roles"]
        and all(isinstance(r, str) and _ROLE_NAME.match(r) for r in marker["roles"])
        and len(set(marker["roles"])) == len(marker["roles"])
    ):
        why = "roles is not a list of role folder names"
    if why is not None:
        return None, f"{path} is malformed ({why})"
    return marker, None


def parse_latest_file(path: str | os.PathLike) -> tuple[int | None, str | None]:
    """(step, None) when the latest file holds a step number (ASCII digits, >= 1), else (None, why) naming the
    file: missing, unreadable, too long, not ASCII, not a number."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(_LATEST_MAX_BYTES + 1)
    except FileNotFoundError:
        return None, f"{path} is missing"
    except OSError as exc:
        return None, f"{path} cannot be read ({exc})"
    if len(data) > _LATEST_MAX_BYTES:
        return None, f"{path} does not hold a step number (more than {_LATEST_MAX_BYTES} bytes)"
    text = data.decode("utf-8", errors="replace").strip()
    if not data.isascii():
        return None, f"{path} does not hold a step number ({text!r} is not ASCII digits)"
    if not re.fullmatch(r"[0-9]{1,18}", text) or int(text) < 1:
        return None, f"{path} does not hold a step number ({text!r})"
    return int(text), None
