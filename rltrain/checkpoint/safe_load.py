"""Reading the pickle-based files of a checkpoint without ever running code from them.

A checkpoint's CRC manifest detects damage, not forgery: whoever can write a run folder can also recompute
it. So nothing rlplan loads from a checkpoint is unpickled with the full pickle machinery (a `__reduce__`
payload would run in the trainer, outside any sandbox). Every pickle-based file goes through one of two
restricted loaders:

    rng/rank_NNNNN.pt, dist_ckpt/common.pt, dist_ckpt/**/*.pt, the byte items inside dist_ckpt/*.distcp
        `torch.load(weights_only=True)`: tensors, storages, dtypes and plain Python containers only. Older
        RNG files (numpy's state as an ndarray) also need numpy's array rebuild functions
        (`_numpy_globals`), allowed for them alone; new ones hold a tensor instead.
    dist_ckpt/.metadata
        `_MetadataUnpickler`: only the classes torch.distributed.checkpoint writes there
        (`DCP_METADATA_GLOBALS`, listed from real megatron checkpoints), and every file its storage entries
        name must lie inside dist_ckpt/ (rlconf.safe_paths.resolve_inside).

`role_problems` runs both over a role folder (what `rltrain inspect`, `rltrain export-hf` and a resume check
before anything is loaded); `guarded_dist_load` makes megatron's own load of the same files go through them
too (torch's FileSystemReader unpickles `.metadata` with `pickle.load`, its planner loads byte items with
`torch.load(weights_only=False)`): a file swapped between the check and the load is refused as well. A
refusal is `UnsafeCheckpointError`, naming the file and the global it would have called.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rlconf.safe_paths import PathEscapeError, model_folder_escapes, resolve_inside
from rltrain.checkpoint.manifest import DIST_DIR, HF_DIR, CheckpointError

# RNG files written before RNG states were stored as tensors hold numpy's state as an ndarray, which needs
# numpy's array rebuild (`_numpy_globals`): it only builds an array of the given dtype and shape. numpy 2
# spells the module numpy._core, numpy 1 numpy.core; a file names the one it was written with.
_RECONSTRUCT_NAMES = ("numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct")
# What torch.distributed.checkpoint (megatron's torch_dist format) pickles into .metadata, listed by saving
# real checkpoints (tests/test_safe_load.py lists them again and fails on any name not here). Dataclasses
# and enums whose construction only stores values; torch dtypes are checked to be dtypes after the lookup.
DCP_METADATA_GLOBALS = frozenset(
    [("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "BytesStorageMetadata", "ChunkStorageMetadata", "MetadataIndex", "StorageMeta",
        "TensorProperties", "TensorStorageMetadata", "_MEM_FORMAT_ENCODING")]
    + [("torch.distributed.checkpoint.planner", n) for n in (
        "SavePlan", "TensorWriteData", "WriteItem", "WriteItemType")]
    + [("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
       ("torch.serialization", "_get_layout")]
)  # fmt: skip
METADATA_FILE = ".metadata"
_FIX = (
    "the file was changed after rlplan saved it (the manifest's CRCs detect damage, not forgery), so this "
    "checkpoint must not be loaded: load another one, or start over (docs/security.md)"
)


# The rule a resume from a refused checkpoint stops with (exit 2).
UNSAFE_RULE = "checkpoint-unsafe"
# Every refusal's message holds this (after the file's name).
REFUSED = ": refused: "


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file that would run code (or read files outside the checkpoint) if it were loaded."""


def _refused(name: str, why: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(f"{name}{REFUSED}{why}; {_FIX}")


def _weights_only_reason(exc: BaseException) -> str:
    """The line of torch's weights_only error that names what was refused (its message is a page long: the
    advice to load with weights_only=False, which rlplan never does, is left out)."""
    lines = [ln.strip() for ln in str(exc).splitlines()]
    boiler = ("Weights only load failed", "Check the documentation", "(1)", "(2)", "\x1b")
    text = next((ln for ln in lines if ln and not ln.startswith(boiler)), type(exc).__name__)
    text = text.removeprefix("WeightsUnpickler error: ").split(". Please use")[0]
    return f"loading it would need more than tensors and plain data ({text[:300].rstrip('. ')})"


# ------------------------------------------------------------------------------------ torch.save files
def load_torch_file(source: str | os.PathLike | io.BytesIO, name: str, legacy_numpy: bool = False) -> Any:
    """`torch.load(source, weights_only=True)` on the CPU; UnsafeCheckpointError naming `name` when the file
    holds anything else. `legacy_numpy` also allows numpy arrays (RNG files of older rlplan versions)."""
    import torch

    # The forced torch.load of `guarded_dist_load` may be in place: call torch's own.
    load = _ORIGINAL_TORCH_LOAD or torch.load
    extra = _numpy_globals() if legacy_numpy else []
    try:
        with torch.serialization.safe_globals(extra):
            return load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _refused(name, _weights_only_reason(exc)) from None
    except (RuntimeError, ValueError, EOFError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(
            f"{name}: unreadable ({type(exc).__name__}: {str(exc)[:200]}); load another checkpoint"
        ) from None


def _numpy_globals() -> list[Any]:
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct  # numpy 2 (importing numpy.core warns there)
    except ImportError:  # numpy 1
        from numpy.core.multiarray import _reconstruct
    # (object, name) pairs: the name as the file spells it, whichever numpy wrote it.
    return [*((_reconstruct, n) for n in _RECONSTRUCT_NAMES), np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_rng_file(path: str | os.PathLike) -> dict[str, Any]:
    """An RNG state file (rng/rank_NNNNN.pt) of this or an older rlplan version, loaded without unpickling
    anything but tensors, plain data and (older files) numpy arrays."""
    state = load_torch_file(path, str(path), legacy_numpy=True)
    if not isinstance(state, dict):
        raise _refused(str(path), f"it holds a {type(state).__name__}, not the RNG states rlplan writes")
    return state


# ------------------------------------------------------------------------------------ DCP .metadata
class _MetadataUnpickler(pickle.Unpickler):
    """pickle restricted to DCP_METADATA_GLOBALS (and torch dtypes): any other global, a persistent id or an
    extension code is refused before anything is called."""

    def __init__(self, file: Any, name: str) -> None:
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str) -> Any:
        import importlib

        import torch

        if (module, name) in DCP_METADATA_GLOBALS:
            return getattr(importlib.import_module(module), name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _refused(
            self.name, f"loading it would call {module}.{name}, which is no part of the metadata torch writes"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise _refused(self.name, "it holds a persistent id, which the metadata torch writes never does")


def read_dcp_metadata(path: str | os.PathLike) -> Any:
    """The torch.distributed.checkpoint Metadata in `path` (a dist_ckpt/.metadata file), read by the restricted
    unpickler; every file its storage entries name must lie in the folder of `path`."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(path)
    name = str(path)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, name).load()
    except UnsafeCheckpointError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError,
            IndexError, RecursionError, MemoryError) as exc:  # fmt: skip
        raise CheckpointError(
            f"{name}: unreadable ({type(exc).__name__}: {str(exc)[:200]}); load another checkpoint"
        ) from None
    if not isinstance(metadata, Metadata):
        raise _refused(name, f"it holds a {type(metadata).__name__}, not a checkpoint Metadata")
    for index, info in (metadata.storage_data or {}).items():
        try:
            resolve_inside(path.parent, getattr(info, "relative_path", None), f"its entry for {index.fqn!r}")
        except PathEscapeError as exc:
            raise _refused(name, str(exc)) from None
    return metadata


def _byte_items(dist_dir: Path, metadata: Any) -> Iterator[tuple[str, io.BytesIO]]:
    """(name, bytes) of every non-tensor item (megatron's sharded objects) stored in the .distcp files."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    byte_keys = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn not in byte_keys:
            continue
        rel = info.relative_path
        name = f"{dist_dir / rel} bytes {info.offset}-{info.offset + info.length} ({index.fqn})"
        if info.transform_descriptors:
            raise _refused(name, f"it is stored through transforms {info.transform_descriptors}, which rlplan "
                                 "never writes")  # fmt: skip
        with open(resolve_inside(dist_dir, rel, "its metadata"), "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if len(data) != info.length:
            raise CheckpointError(f"{name}: the file ends early; load another checkpoint")
        yield name, io.BytesIO(data)


# ------------------------------------------------------------------------------------ a role folder
def check_role(folder: str | os.PathLike) -> None:
    """Load every pickle-based file of a role folder with the restricted loaders (and check the names its
    huggingface/ folder holds); raises the first UnsafeCheckpointError / CheckpointError. Nothing is kept:
    this says whether loading the folder would be safe."""
    root = Path(folder)
    dist = root / DIST_DIR
    for path in sorted(root.rglob("*.pt")):
        try:
            resolve_inside(root, path.relative_to(root).as_posix(), "the checkpoint file")
        except PathEscapeError as exc:
            raise _refused(str(path), str(exc)) from None
        if path.is_file():
            load_torch_file(path, str(path), legacy_numpy=path.parent.name == "rng")
    if (dist / METADATA_FILE).is_file():
        metadata = read_dcp_metadata(dist / METADATA_FILE)
        for name, data in _byte_items(dist, metadata):
            load_torch_file(data, name)
    escapes = model_folder_escapes(root / HF_DIR)
    if escapes:
        raise _refused(str(root / HF_DIR), str(escapes[0]))


def role_problems(folder: str | os.PathLike) -> list[str]:
    """[] when every pickle-based file of the role folder loads with the restricted loaders, else the one
    problem found (a refusal, or a file that cannot be read), naming the file."""
    try:
        check_role(folder)
    except CheckpointError as exc:
        return [str(exc)]
    except OSError as exc:
        return [f"{exc.filename or folder}: cannot be read ({exc.strerror or exc})"]
    return []


def check_resume(folder: str | os.PathLike, roles: Sequence[str], resume_mode: str) -> None:
    """Before a run loads the checkpoint it resumes from (the controller, before any worker reads it): every
    role's pickle-based files must load with the restricted loaders; ConfigError rule `checkpoint-unsafe`
    (exit 2) naming the setting that chose the checkpoint otherwise. A forged checkpoint is not skipped for
    an older one the way a damaged one is: someone wrote into this run folder, and the user must know."""
    from rlconf.errors import ConfigError, error

    step = Path(folder)
    setting = "trainer.resume_from_path" if resume_mode == "resume_path" else "trainer.resume_mode"
    for role in roles:
        problems = role_problems(step / role)
        if problems:
            raise ConfigError(
                [
                    error(
                        setting,
                        f"the checkpoint to resume from cannot be loaded: {problems[0].removesuffix('; ' + _FIX)}",
                        f"do not load {step}: it was changed after rlplan saved it (the manifest's CRCs detect "
                        "damage, not forgery; docs/security.md). Move it out of the run folder and resume from "
                        "an earlier checkpoint (trainer.resume_mode: resume_path, trainer.resume_from_path), or "
                        "start over (--trainer.resume_mode disable)",
                        UNSAFE_RULE,
                    )
                ]
            )


# ------------------------------------------------------------------------------------ megatron's own load
_ORIGINAL_TORCH_LOAD: Any = None
_GUARD = threading.Lock()


@contextlib.contextmanager
def guarded_dist_load() -> Iterator[None]:
    """Within: torch.distributed.checkpoint's FileSystemReader reads `.metadata` with `read_dcp_metadata`, and
    every `torch.load` (the DCP planner's byte items, megatron's common.pt and sharded objects) is
    weights_only=True whatever its caller asked. Process-wide while it lasts (megatron calls these deep
    inside `dist_checkpointing.load`, with no hook to pass a reader or planner in); restored on exit.

    A refusal inside raises UnsafeCheckpointError out of the block, whatever torch made of it on the way
    (it turns a failed metadata read into an AssertionError holding only the text, and wraps read errors in
    CheckpointException, a BaseException)."""
    global _ORIGINAL_TORCH_LOAD
    import torch
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    refusals: list[UnsafeCheckpointError] = []

    def noted(exc: UnsafeCheckpointError) -> UnsafeCheckpointError:
        refusals.append(exc)
        return exc

    with _GUARD:
        original_read = FileSystemReader.read_metadata
        _ORIGINAL_TORCH_LOAD = original_load = torch.load

        def read_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
            # torch's own read_metadata, with the restricted unpickler in place of pickle.load.
            try:
                metadata = read_dcp_metadata(self._get_metadata_path(kwargs.get("rank")))
            except UnsafeCheckpointError as exc:
                raise noted(exc) from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def forced_load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
            kwargs.pop("weights_only", None)
            kwargs.pop("pickle_module", None)
            name = str(f) if isinstance(f, str | os.PathLike) else "an object stored in the dist checkpoint"
            try:
                return original_load(f, map_location, weights_only=True, **kwargs)
            except pickle.UnpicklingError as exc:
                raise noted(_refused(name, _weights_only_reason(exc))) from None

        FileSystemReader.read_metadata = read_metadata  # type: ignore[method-assign]
        torch.load = forced_load
        try:
            yield
        except BaseException:
            if refusals:
                raise refusals[0] from None
            raise
        finally:
            FileSystemReader.read_metadata = original_read  # type: ignore[method-assign]
            torch.load = original_load
            _ORIGINAL_TORCH_LOAD = None


__all__ = [
    "DCP_METADATA_GLOBALS",
    "REFUSED",
    "UNSAFE_RULE",
    "UnsafeCheckpointError",
    "check_resume",
    "check_role",
    "guarded_dist_load",
    "load_rng_file",
    "load_torch_file",
    "read_dcp_metadata",
    "role_problems",
]
