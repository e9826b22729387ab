"""The run folder's filesystem as a cause of failure: free space before each save, and the errors a write can
meet there (no space, a read-only filesystem, a name too long) told as one line naming `trainer.output_dir`.

A rerun cannot fix these, so they are ConfigErrors (exit 2, rule `output-dir-storage`) with what to change,
never a worker failure's "rerun the same command to resume". torch's own writers lose the errno (a full disk
during `torch.save` reads "enforce fail at inline_container.cc: unexpected pos"), so a failed write is also
diagnosed from the filesystem itself afterwards: read-only (statvfs), or less room left than the save needs.
No torch, no megatron: the controller and the workers both use it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from rlconf.errors import ConfigError, error

RULE = "output-dir-storage"
MIB = 1 << 20
GIB = 1 << 30

# errno -> what it means for the run, in words
_STORAGE_ERRNOS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the filesystem is read-only",
    errno.ENAMETOOLONG: "a file name or path is too long",
}
_STRERROR = {os.strerror(code): code for code in _STORAGE_ERRNOS}


def existing_ancestor(path: str | os.PathLike) -> Path:
    """`path` or its nearest existing parent (the folder whose filesystem a new path would live on)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged writer can still use on the filesystem of `path` (or its nearest parent)."""
    return shutil.disk_usage(existing_ancestor(path)).free


def _read_only(path: str | os.PathLike) -> bool:
    try:
        return bool(os.statvfs(existing_ancestor(path)).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, its causes and contexts, and the per-rank failures of torch's CheckpointException."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):
            todo += [x for x in failures.values() if isinstance(x, BaseException)]


def storage_errno(exc: BaseException, path: str | os.PathLike, need_bytes: int = 0) -> int | None:
    """The storage errno behind a failed write to `path`, or None when the failure is not the filesystem's.

    From the exception chain (an OSError's errno, or its strerror in a wrapped message), else from the
    filesystem now: read-only, or fewer free bytes than `need_bytes` (at least 1 MiB) after the failure."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in _STORAGE_ERRNOS:
            return e.errno
        text = str(e)
        for message, code in _STRERROR.items():
            if message in text:
                return code
    if _read_only(path):
        return errno.EROFS
    try:
        if free_bytes(path) < max(need_bytes, MIB):
            return errno.ENOSPC
    except OSError:
        pass
    return None


def _fmt(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.1f} MiB"


def storage_error(
    code: int, what: str, path: str | os.PathLike, need_bytes: int = 0, after: str = ""
) -> ConfigError:
    """The one-line error of a write to `path` that failed with storage errno `code`. `what`: what failed,
    with where (e.g. "the checkpoint of step 4 could not be written to DIR"); `after`: what the folder still
    holds (e.g. the checkpoints before it are intact)."""
    name = errno.errorcode.get(code, str(code))
    detail = _STORAGE_ERRNOS.get(code, os.strerror(code))
    if code in (errno.ENOSPC, errno.EDQUOT):
        with contextlib.suppress(OSError):
            detail += f": {_fmt(free_bytes(path))} free"
            if need_bytes:
                detail += f", a checkpoint needs about {_fmt(need_bytes)} (the plan's estimate)"
        fix = ("free space on that filesystem (or keep fewer checkpoints: trainer.max_ckpt_to_keep), or give "
               "another --trainer.output_dir")  # fmt: skip
    elif code == errno.EROFS:
        fix = "make the filesystem writable (remount it read-write), or give another --trainer.output_dir"
    else:
        fix = "give a shorter --trainer.output_dir (`rlconf validate` checks the longest path a run writes)"
    tail = f"; {after}" if after else ""
    return ConfigError(
        [error("trainer.output_dir", f"{what}: {detail} ({name}){tail}",
               fix + "; once that is done, the same command resumes from the last complete checkpoint", RULE)]
    )  # fmt: skip


@contextlib.contextmanager
def storage_errors(
    what: str, path: str | os.PathLike, need_bytes: int = 0, after: str = ""
) -> Iterator[None]:
    """Turn a failed write under `path` whose cause is the filesystem into `storage_error` (other failures
    pass unchanged)."""
    try:
        yield
    except ConfigError:
        raise
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        code = storage_errno(exc, path, need_bytes)
        if code is None:
            raise
        raise storage_error(code, what, path, need_bytes, after) from None


def check_free_space(path: str | os.PathLike, need_bytes: int, what: str, after: str = "") -> None:
    """ConfigError (exit 2) when the filesystem of `path` has fewer than `need_bytes` free for `what`."""
    if need_bytes <= 0:
        return
    try:
        free = free_bytes(path)
    except OSError:
        return  # the write itself will say what is wrong
    if free < need_bytes:
        raise storage_error(errno.ENOSPC, what, existing_ancestor(path), need_bytes, after)
