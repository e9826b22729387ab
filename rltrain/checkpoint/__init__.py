"""Distributed checkpoints of the megatron roles: atomic, optionally asynchronous, reshardable, resumable.

One module per responsibility:

    manifest.py   the folder format: names, digests (manifest.json), atomic writes, COMPLETE markers, the
                  latest file (no torch)
    engine_io.py  worker side: a role's collective save_engine / finalize_pending / load_engine
    registry.py   controller side: CheckpointRegistry (staging, commit, resume, retention, clean-up), Resume
    safe_load.py  the restricted loaders of every pickle-based file (nothing in a checkpoint runs code)
    tools.py      `rltrain inspect` and `rltrain export-hf` (imported by the CLI only, not here)
    faults.py     test-only fault points (a no-op unless RLPLAN_CHECKPOINT_FAULT is set)

This package re-exports the names the trainer, the tools and the tests use.
"""

from rltrain.checkpoint.engine_io import (
    OPTIM_SHARDING,
    copy_tokenizer_files,
    damaged_error,
    finalize_pending,
    has_pending,
    last_timings,
    load_engine,
    normalize_modes,
    read_role_meta,
    save_engine,
)
from rltrain.checkpoint.faults import FAULT_ENV, FAULT_POINTS
from rltrain.checkpoint.manifest import (
    COMPLETE,
    DIST_DIR,
    EXTRA,
    FORMAT,
    HF_DIR,
    LATEST_FILE,
    MANIFEST,
    META,
    RNG_DIR,
    STEP_DIR,
    WORK_DIR,
    CheckpointError,
    build_manifest,
    parse_latest_file,
    read_manifest,
    read_marker,
    verify_manifest,
    write_manifest,
)
from rltrain.checkpoint.registry import CheckpointRegistry, Resume, role_contents
from rltrain.checkpoint.safe_load import REFUSED, UnsafeCheckpointError, role_problems

__all__ = [
    "COMPLETE",
    "DIST_DIR",
    "EXTRA",
    "FAULT_ENV",
    "FAULT_POINTS",
    "FORMAT",
    "HF_DIR",
    "LATEST_FILE",
    "MANIFEST",
    "META",
    "OPTIM_SHARDING",
    "REFUSED",
    "RNG_DIR",
    "STEP_DIR",
    "WORK_DIR",
    "CheckpointError",
    "CheckpointRegistry",
    "Resume",
    "UnsafeCheckpointError",
    "build_manifest",
    "copy_tokenizer_files",
    "damaged_error",
    "finalize_pending",
    "has_pending",
    "last_timings",
    "load_engine",
    "normalize_modes",
    "parse_latest_file",
    "read_manifest",
    "read_marker",
    "read_role_meta",
    "role_contents",
    "role_problems",
    "save_engine",
    "verify_manifest",
    "write_manifest",
]
