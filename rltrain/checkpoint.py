"""Distributed checkpoints of the megatron roles: atomic, optionally asynchronous, reshardable, resumable.

Two halves, one per process kind:

* Worker side (every rank of a role calls these together; they are collective over the role's world):
  `save_engine` writes one role's state into a folder, `finalize_pending` completes background saves,
  `load_engine` restores a role from a folder. A role folder holds

      meta.json            what was saved and under which layout (rank 0)
      dist_ckpt/           megatron dist_checkpointing (torch_dist): "model" (bare GPTModel sharded state
                           dicts; model0, model1, ... with virtual pipeline chunks) and "optimizer"
                           (distributed optimizer in the `fully_reshardable` format, or the plain optimizer
                           in parameter space): both reload under another TP / PP / DP layout
      rng/rank_NNNNN.pt    python, numpy, torch, device (cuda / npu) and megatron tracker RNG states of each rank
      extra.json           the controller's `extra` dict and the lr scheduler state (rank 0)
      huggingface/         safetensors + config.json (+ tokenizer files) when hf_model is saved
      manifest.json        written last, after every file above is verified: the role's completion mark

* Controller side: `CheckpointRegistry` owns `checkpoints/`. `begin(step)` hands out staging folders
  (`global_step_N.tmp-<id>/ROLE`), `commit(step)` verifies every role's manifest, writes the
  `COMPLETE` marker, renames the staging folder to `global_step_N` (one atomic rename) and only then
  rewrites `latest_checkpointed_iteration.txt` (temp file + os.replace). A folder without a well-formed marker
  is never loaded by resume_mode auto; `cleanup_incomplete` removes only what is provably a half-written save
  (staging folders, interrupted deletes), never a global_step_N folder; `apply_retention` deletes old complete
  checkpoints only; `resolve_resume` implements trainer.resume_mode.

So a crash at any point leaves the previous checkpoint and the latest file untouched. The checkpoint folder
must be on a filesystem that every rank and the controller see (one node, or a shared filesystem).
Megatron is imported lazily: the controller uses the registry without paying for `import megatron.core`.

Manifests: every file's size and a CRC-32 of every byte, one per 64 MiB block, hashed by a pool of threads
(docs/checkpoints.md has the cost against the save). Commit, resume, `load_engine`, `rltrain inspect` and
`export-hf` verify against it; a mismatch names the file and the damaged byte range. Manifests of older
versions (sha256 of small files, sampled digests of large ones) are still verified as they were written.

Malformed input never crashes: a latest file that holds no step number (too long, non-ASCII digits, ...),
a COMPLETE marker or manifest that is not well formed each make the checkpoint "not complete", and
resolution falls back to the newest intact checkpoint with a warning naming the file.

Resume (`trainer.resume_mode: auto`): the checkpoint committed last (COMPLETE marker mtime, step as the
tie-break), i.e. the latest file's step unless a newer commit happened after the latest file was written (a
crash between the rename and the latest-file update). A user who edits the latest file to an older step
makes it newer than every marker, so that edit is honoured. A checkpoint that fails verification is skipped
with a warning naming the file, and the next one down is used.

Fault injection (tests only; production never sets it): `RLPLAN_CHECKPOINT_FAULT=POINT[@STEP]` makes the
process that reaches POINT (for the checkpoint of STEP, or of any step) SIGKILL the whole job and then itself,
as `kill -9` of the job would: every process of its session (the trainer, Ray's daemons and workers, a
background checkpoint writer) when the job leads its session (start it with `start_new_session=True`), else
only the processes that carry the variable.
Points, in the order a save passes them:

    during_async_write  worker: the background writer of an async save has just been started
    before_manifest     worker: every file of the role is written, its manifest is not
    before_complete     controller: every manifest is verified, the COMPLETE marker is not written
    before_rename       controller: COMPLETE is written in the staging folder, not yet renamed to global_step_N
    before_latest       controller: global_step_N is in place, the latest file still names the previous step
    during_retention    controller: the old checkpoint of STEP is renamed to global_step_N.del-* for deletion
                        and not yet deleted
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
import uuid
import warnings
import zlib
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlconf.errors import ConfigError, error
from rltrain import device as devices

if TYPE_CHECKING:
    from rlconf.plan import CheckpointPlan, TrainerPlan
    from rltrain.megatron.engine import MegatronEngine

logger = logging.getLogger(__name__)

FORMAT = "rlplan-megatron-checkpoint/1"
LATEST_FILE = "latest_checkpointed_iteration.txt"
COMPLETE = "COMPLETE"
MANIFEST = "manifest.json"
META = "meta.json"
EXTRA = "extra.json"
DIST_DIR = "dist_ckpt"
RNG_DIR = "rng"
HF_DIR = "huggingface"
# The distributed optimizer's format that reloads under any TP / PP / DP layout (model-space tensors).
OPTIM_SHARDING = "fully_reshardable"
# Manifest digests: a CRC-32 (zlib) of every byte of every file, one per block of _DIGEST_BLOCK bytes. Measured
# here at 2.7 GB/s per thread (sha256 1.3, blake2b 0.5; xxhash is not installed); zlib releases the GIL, so
# blocks hash in parallel threads. Per-block values also say where a file is damaged. A CRC detects damage
# (zeroed pages, flipped bits, truncation), not forgery: the manifest is no signature.
_DIGEST = "crc32"
_DIGEST_BLOCK = 64 << 20
_READ_BYTES = 4 << 20
_HASH_THREADS = max(1, min(8, os.cpu_count() or 1))
FAULT_ENV = "RLPLAN_CHECKPOINT_FAULT"
FAULT_POINTS = (
    "during_async_write",
    "before_manifest",
    "before_complete",
    "before_rename",
    "before_latest",
    "during_retention",
)
# ASCII digits only (re's \d also takes e.g. Arabic-Indic digits, which int() would then accept).
_STEP_DIR = re.compile(r"^global_step_([0-9]+)$")
# Leftovers of a save (tmp), of replacing a step that already existed (old) and of retention (del).
_WORK_DIR = re.compile(r"^global_step_([0-9]+)\.(tmp|old|del)-([0-9a-z]+)$")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded as asked; the message names the config path to change."""


# ============================================================================================ small files
def _fsync_dir(path: Path) -> None:
    # A rename is durable only once its directory entry is on disk.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    """Write `path` so that readers see the old content or the new one, never a torn file."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _write_json(path: Path, obj: Any) -> None:
    _write_atomic(path, (json.dumps(obj, indent=2, sort_keys=True, allow_nan=True) + "\n").encode())


def _read_json(path: Path) -> Any:
    with open(path) as f:
        return json.load(f)


# What reading a JSON file that someone damaged can raise: OSError, ValueError (bad JSON, bad UTF-8, a number
# past int's 4300-digit limit) and RecursionError (deeply nested brackets).
_JSON_ERRORS = (OSError, ValueError, RecursionError)


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


def _fault(point: str, step: int | None = None) -> None:
    """Test-only fault injection (see the module docstring): a no-op unless RLPLAN_CHECKPOINT_FAULT names
    `point`. An unknown point name is an error, so a typo cannot make a crash test pass without crashing."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    name, _, at = spec.partition("@")
    if name not in FAULT_POINTS or (at and not at.isdigit()):
        raise CheckpointError(
            f"{FAULT_ENV}={spec}: expected POINT[@STEP] with POINT one of {', '.join(FAULT_POINTS)}"
        )
    if name != point or (at and step != int(at)):
        return
    logger.warning("%s=%s: killing this job at %s (step %s)", FAULT_ENV, spec, point, step)
    _kill_session()


def _kill_session() -> None:
    """SIGKILL the job, then this process: every process of this session when the job leads its session
    (the leader carries FAULT_ENV: Ray's agents, started without it, go too), else only those with FAULT_ENV
    (never the shell of a user who typed the variable in front of a command)."""
    import signal

    import psutil

    me, sid = os.getpid(), os.getsid(0)
    try:
        whole_session = FAULT_ENV in psutil.Process(sid).environ()
    except (psutil.Error, OSError):
        whole_session = False
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if (
                proc.pid != me
                and os.getsid(proc.pid) == sid
                and (whole_session or FAULT_ENV in proc.environ())
            ):
                os.kill(proc.pid, signal.SIGKILL)
    os.kill(me, signal.SIGKILL)


def _walk_files(root: Path) -> Iterator[Path]:
    for dirpath, _, files in os.walk(root):
        for name in files:
            yield Path(dirpath) / name


def _is_scratch(path: Path) -> bool:
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
        if rel != MANIFEST and not _is_scratch(path):
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
        _fsync_dir(Path(dirpath))


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
    _write_json(root / MANIFEST, manifest)
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
        manifest = _read_json(mpath)
    except _JSON_ERRORS as exc:
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
        if not _is_scratch(path) and path.relative_to(root).as_posix() not in listed:
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


# ============================================================================================ worker side
def _dist_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _dist_world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _barrier() -> None:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def _bcast_from_rank0(obj: Any) -> Any:
    """Rank 0's value of `obj` on every rank (so that every rank raises the same error)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _role_of(folder: str | os.PathLike, role: str | None) -> str:
    return role if role is not None else Path(folder).name


def _layout() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {
        "world_size": _dist_world(),
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": ps.get_virtual_pipeline_model_parallel_world_size() or 1,
        "context_parallel_size": ps.get_context_parallel_world_size(),
        "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
        "data_parallel_size": ps.get_data_parallel_world_size(),
    }


# Layout entries that decide how model tensors are cut; a DP-only change keeps every rank's model shard.
_MODEL_SPLIT_KEYS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "expert_model_parallel_size",
)


def _sub_optimizers(engine: MegatronEngine) -> list[Any]:
    from megatron.core.optimizer import ChainedOptimizer

    opt = engine.optimizer
    if opt is None:
        return []
    return list(opt.chained_optimizers) if isinstance(opt, ChainedOptimizer) else [opt]


def _uses_distributed_optimizer(engine: MegatronEngine) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in _sub_optimizers(engine))


def _optim_metadata() -> dict[str, Any]:
    # fully_reshardable stores optimizer state in model space (one tensor per parameter, like the model's
    # own sharded tensors), so TP / PP / DP changes reshard it exactly as they reshard the weights.
    # mem_efficient gathers the DP shards over gloo into DP rank 0 only; the default all-gathers them into
    # every DP rank's host memory (DP copies of the state on one host) although only DP rank 0 writes them
    # (the model's replica ids decide). Same files, same speed (measured on H200 at DP=1), less memory.
    # avoid_prefix keeps keys independent of how many chained optimizers a layout has.
    return {
        "distrib_optim_sharding_type": OPTIM_SHARDING,
        "distrib_optim_fully_reshardable_mem_efficient": True,
        "chained_optim_avoid_prefix": True,
    }


def _model_sharded_state_dict(engine: MegatronEngine) -> dict[str, Any]:
    """megatron's convention: "model" for one chunk, "model0", "model1", ... for virtual pipeline chunks."""
    modules = engine.modules()
    if len(modules) == 1:
        return {"model": modules[0].sharded_state_dict()}
    return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(modules)}


def _ensure_optimizer_state(engine: MegatronEngine) -> None:
    """Give every parameter of a never-stepped torch Adam/AdamW its state (step 0, zero moments).

    The distributed optimizer's `state_dict()` reads the common `step` from the per-parameter state and
    asserts that one exists; torch creates that state lazily at the first step, so a fresh engine (the
    resume case, or an actor saved before its first update) has none. Zeros at step 0 are exactly what
    torch's first step would create, so this changes no update; a load overwrites them.
    """
    for sub in _sub_optimizers(engine):
        inner = sub.optimizer
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if "step" not in state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _check_optimizer_supported(engine: MegatronEngine, role: str) -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for sub in _sub_optimizers(engine):
        if isinstance(sub, DistributedOptimizer) and isinstance(sub.optimizer, torch.optim.SGD):
            # megatron-core 0.16.1 gathers exactly (param, exp_avg, exp_avg_sq) for the distributed
            # optimizer: SGD's momentum_buffer has no place there (KeyError deep inside the save).
            raise CheckpointError(
                f"{role}: megatron-core cannot checkpoint the state of {type(sub.optimizer).__name__} under "
                f"the distributed optimizer; set {role}.megatron.use_distributed_optimizer: false or drop "
                f"optimizer from {role}.checkpoint.save_contents"
            )


def _optimizer_sharded_state_dict(engine: MegatronEngine, model_sd: dict[str, Any], loading: bool) -> Any:
    # The optimizer finds its parameters' sharded keys in the model's sharded state dict (every chunk; it
    # walks nested dicts, so the model / model0, model1 nesting does not matter).
    return engine.optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=_optim_metadata())


@contextlib.contextmanager
def _restore_step_per_param(engine: MegatronEngine) -> Iterator[None]:
    """Work around two defects of megatron-core 0.16.1 when it loads torch Adam/AdamW state:

    * `fully_reshardable` load copies every per-parameter state tensor from the checkpoint, but the
      checkpoint (by design) has no per-parameter `step` (it is kept once, in param_groups):
      `KeyError: 'step'` in `_set_main_param_and_optimizer_states`. Here a missing `step` is taken from the
      state the load has just restored from param_groups, i.e. it is left as is.
    * the distributed optimizer's `load_state_dict` gives every parameter the *same* step tensor object;
      torch AdamW increments each parameter's step in place, so one shared tensor advances once per
      parameter per step and bias correction goes wrong after a resume. Each parameter gets its own copy.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    patched = []
    for sub in _sub_optimizers(engine):
        if not isinstance(sub, DistributedOptimizer):
            continue
        original = sub._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, _sub=sub, _original=original):
            if "step" not in tensors:
                current = _sub._get_main_param_and_optimizer_states(model_param)
                if "step" in current:
                    tensors = {**tensors, "step": current["step"]}
            return _original(model_param, tensors)

        # An instance attribute shadows the method for this load only (removed in `finally`).
        sub._set_main_param_and_optimizer_states = set_states
        patched.append(sub)
    try:
        yield
    finally:
        for sub in patched:
            del sub._set_main_param_and_optimizer_states
        for sub in _sub_optimizers(engine):
            seen: set[int] = set()
            for state in sub.optimizer.state.values():
                step = state.get("step") if isinstance(state, dict) else None
                if isinstance(step, torch.Tensor):
                    if id(step) in seen:
                        state["step"] = step.clone()
                    seen.add(id(state["step"]))


def _fill_missing_common_step(obj: Any) -> None:
    """Put back the step of a never-stepped plain (non-distributed) optimizer before megatron loads it.

    megatron-core 0.16.1 saves the Adam step shared by all parameters only when it is truthy (`if step:` in
    the mixed-precision and fp32 optimizers' `sharded_state_dict`), so a save before the first update (step
    0, from `_ensure_optimizer_state`) has per-parameter state without any step, and torch's
    `load_state_dict` fails with `KeyError: 'step'`. Step 0 is exactly what was saved.
    """
    if isinstance(obj, dict):
        state = obj.get("state")
        if isinstance(state, dict) and "param_groups" in obj:
            per_param = [v for k, v in state.items() if k != "common_step" and isinstance(v, dict)]
            if "common_step" not in state and any("step" not in v for v in per_param):
                state["common_step"] = torch.tensor(0.0, dtype=torch.float32)
            return
        for value in obj.values():
            _fill_missing_common_step(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            _fill_missing_common_step(value)


# ------------------------------------------------------------------------------------ RNG
def _rng_state(engine: MegatronEngine) -> dict[str, Any]:
    import numpy as np
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    tracker = {}
    for name, state in get_cuda_rng_tracker().get_states().items():
        tracker[name] = state.get_state() if isinstance(state, torch.Generator) else state.clone()
    out: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tracker,
    }
    # The accelerator's generator of the current device, under the device's name ("cuda", "npu").
    if devices.is_accelerator(engine.device) and devices.is_available(engine.device):
        out[engine.device] = devices.get_rng_state(engine.device)
    # The actor's sampler seeds each generate() call from a call counter: part of its random stream.
    if hasattr(engine, "_sample_calls"):
        out["sample_calls"] = int(engine._sample_calls)
    return out


def _set_rng_state(engine: MegatronEngine, state: dict[str, Any]) -> None:
    import numpy as np
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if (
        engine.device in state
        and devices.is_accelerator(engine.device)
        and devices.is_available(engine.device)
    ):
        devices.set_rng_state(engine.device, state[engine.device])
    tracker = get_cuda_rng_tracker()
    current = tracker.get_states()
    restored = {}
    for name, saved in state["tracker"].items():
        if isinstance(current.get(name), torch.Generator):
            current[name].set_state(saved)
            restored[name] = current[name]
        else:
            restored[name] = saved.clone()
    tracker.set_states(restored)
    if "sample_calls" in state and hasattr(engine, "_sample_calls"):
        engine._sample_calls = int(state["sample_calls"])


# ------------------------------------------------------------------------------------ HF export
def _hf_source(engine: MegatronEngine) -> tuple[Path | None, Path | None]:
    """(model folder, tokenizer folder) the engine was built from, when they exist."""
    cfg = engine.model_cfg
    model = Path(cfg.path) if cfg.path is not None else None
    tok_path = cfg.tokenizer_path if cfg.tokenizer_path is not None else cfg.path
    return model, Path(tok_path) if tok_path is not None else None


def _tokenizer_meta(engine: MegatronEngine) -> dict[str, Any]:
    """Which tokenizer the role's model reads (so an export knows it without the run's config.yaml)."""
    _, tok_dir = _hf_source(engine)
    if tok_dir is None:
        from rltrain.tokenizer import CharTokenizer

        return {"kind": "char", "vocab_size": CharTokenizer().vocab_size}
    return {"kind": "hf", "path": str(tok_dir)}


def _is_value_model(engine: MegatronEngine) -> bool:
    from rltrain.megatron.critic import MegatronCritic

    return isinstance(engine, MegatronCritic)


def _export_hf(engine: MegatronEngine, out_dir: Path) -> None:
    from rltrain.device import device_context
    from rltrain.megatron.hf_weights import export_hf_weights

    model_dir, tok_dir = _hf_source(engine)
    base = None
    if model_dir is not None and (model_dir / "config.json").is_file():
        base = _read_json(model_dir / "config.json")
    with device_context(engine.device):
        export_hf_weights(engine.chunks, engine.arch, out_dir, base_config=base)
    if _dist_rank() == 0:
        if tok_dir is not None and tok_dir.is_dir():
            copy_tokenizer_files(tok_dir, out_dir)
        elif tok_dir is None:
            from rltrain.tokenizer import CharTokenizer

            CharTokenizer().save_pretrained(out_dir)
        normalize_modes(out_dir)
    _barrier()


def copy_tokenizer_files(src: Path, out: Path) -> list[str]:
    """Copy the tokenizer files of a Hugging Face folder that `out` does not have yet; returns their names."""
    copied = [n for n in _TOKENIZER_FILES if (src / n).is_file() and not (out / n).exists()]
    for name in copied:
        shutil.copy2(src / name, out / name)
    return copied


def _umask() -> int:
    # /proc tells it without changing it; os.umask (set, then restore) is the portable fallback.
    with contextlib.suppress(OSError, ValueError, StopIteration), open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def normalize_modes(root: str | os.PathLike) -> None:
    """Give every file and folder under `root` the modes a plain write would (0666 / 0777 less the umask):
    safetensors writes through a private temp file (0600), which other users of an export could not read."""
    mask = _umask()
    for dirpath, _, files in os.walk(root):
        os.chmod(dirpath, 0o777 & ~mask)
        for name in files:
            os.chmod(Path(dirpath) / name, 0o666 & ~mask)


# ------------------------------------------------------------------------------------ save
@dataclass
class _Pending:
    """A role save whose dist checkpoint is still being written in the background."""

    call_idx: int
    folder: Path
    role: str
    expected: list[str]
    device: str
    step: int | None = None
    started: float = field(default_factory=time.perf_counter)


class _AsyncSaves:
    """This process's background saves (megatron's AsyncCallsQueue: a forked writer per save)."""

    def __init__(self) -> None:
        self.queue: Any = None
        self.pending: dict[int, _Pending] = {}

    def get_queue(self) -> Any:
        if self.queue is None:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self.queue = AsyncCallsQueue(persistent=False)
        return self.queue


_ASYNC = _AsyncSaves()
_LAST_TIMINGS: dict[str, float] = {}


def last_timings() -> dict[str, float]:
    """Seconds spent in the parts of this process's latest save / load (for metrics and benchmarks)."""
    return dict(_LAST_TIMINGS)


def _expected_files(contents: Sequence[str], world: int, has_dist: bool, hf: bool) -> list[str]:
    files = [META]
    if has_dist:
        files += [f"{DIST_DIR}/metadata.json", f"{DIST_DIR}/.metadata", f"{DIST_DIR}/common.pt"]
    if "extra" in contents:
        files.append(EXTRA)
        files += [f"{RNG_DIR}/rank_{r:05d}.pt" for r in range(world)]
    if hf:
        files.append(f"{HF_DIR}/config.json")
    return files


def _finish_role(folder: Path, role: str, expected: Sequence[str], step: int | None = None) -> float:
    """Collective: once every rank's files are written, rank 0 verifies them and writes the manifest.
    Returns the seconds rank 0 spent on the manifest (fsync and digests; 0 on other ranks)."""
    _barrier()
    problem = None
    manifest_s = 0.0
    if _dist_rank() == 0:
        _fault("before_manifest", step)
        missing = [rel for rel in expected if not (folder / rel).is_file()]
        hf = folder / HF_DIR
        if hf.is_dir() and not any(hf.glob("*.safetensors")):
            missing.append(f"{HF_DIR}/*.safetensors")
        if (hf / "model.safetensors.index.json").is_file():
            index = _read_json(hf / "model.safetensors.index.json")
            missing += [
                f"{HF_DIR}/{f}" for f in sorted(set(index["weight_map"].values())) if not (hf / f).is_file()
            ]
        if (folder / DIST_DIR).is_dir() and not any((folder / DIST_DIR).glob("*.distcp")):
            missing.append(f"{DIST_DIR}/*.distcp")
        if missing:
            problem = f"{role} checkpoint in {folder} is missing {', '.join(missing)}"
        else:
            t0 = time.perf_counter()
            write_manifest(folder, role)
            manifest_s = time.perf_counter() - t0
    problem = _bcast_from_rank0(problem)
    if problem is not None:
        raise CheckpointError(problem)
    return manifest_s


def save_engine(
    engine: MegatronEngine,
    folder: str | os.PathLike,
    contents: Sequence[str],
    extra: Mapping[str, Any] | None = None,
    async_save: bool = False,
    role: str | None = None,
) -> bool:
    """Save one role's state into `folder` (collective: every rank of the role calls it).

    contents: subset of model, optimizer, extra, hf_model (see the module docstring for the files).
    extra: JSON-serialisable controller state (step, dataloader position, KL controller, ...), written by
    rank 0 and returned by `load_engine`. With async_save the dist checkpoint is written by a background
    process and this returns False at once: call `finalize_pending()` on every rank later (next step, and
    blocking before exit); the role is complete once its manifest exists. Returns True when complete now.
    A save in flight from an earlier call is finished first (one background save at a time).
    """
    from megatron.core import dist_checkpointing

    from rltrain.device import device_context

    role = _role_of(folder, role)
    folder = Path(folder)
    contents = tuple(dict.fromkeys(contents))
    unknown = [c for c in contents if c not in ("model", "optimizer", "extra", "hf_model")]
    if unknown:
        raise CheckpointError(f"{role}.checkpoint.save_contents: unknown entries {unknown}")
    if "optimizer" in contents and engine.optimizer is None:
        raise CheckpointError(
            f"{role}.checkpoint.save_contents: optimizer requested but this engine has no optimizer"
        )
    if "optimizer" in contents:
        _check_optimizer_supported(engine, role)
    hf = "hf_model" in contents
    if hf and _is_value_model(engine):
        # A value head is no causal LM: transformers could not load it. Say so instead of writing garbage.
        warnings.warn(
            f"{role}: hf_model skipped: a critic (value head) has no Hugging Face causal-LM form; "
            f"drop hf_model from {role}.checkpoint.save_contents",
            stacklevel=2,
        )
        hf = False
    finalize_pending(blocking=True)
    step = (extra or {}).get("step")
    step = step if isinstance(step, int) else None  # only names the save for fault injection
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    rank, world = _dist_rank(), _dist_world()
    folder.mkdir(parents=True, exist_ok=True)
    _barrier()

    # Small per-rank and rank-0 files first: they describe the state at this moment.
    if "extra" in contents:
        sched = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
        # Serialised on every rank so that a bad value fails everywhere, before any collective.
        try:
            payload = json.dumps({"extra": dict(extra or {}), "lr_scheduler": sched}, allow_nan=True)
        except TypeError as exc:
            raise CheckpointError(
                f"{role}: the checkpoint's extra dict is not JSON-serialisable: {exc}"
            ) from exc
        (folder / RNG_DIR).mkdir(exist_ok=True)
        rng_file = folder / RNG_DIR / f"rank_{rank:05d}.pt"
        tmp = rng_file.with_name(f".{rng_file.name}.tmp-{uuid.uuid4().hex[:8]}")
        torch.save(_rng_state(engine), tmp)
        os.replace(tmp, rng_file)
        if rank == 0:
            _write_atomic(folder / EXTRA, payload.encode())
    has_dist = "model" in contents or "optimizer" in contents
    if rank == 0:
        meta = {
            "format": FORMAT,
            "role": role,
            "contents": [c for c in contents if c != "hf_model" or hf],
            "layout": _layout(),
            "distributed_optimizer": _uses_distributed_optimizer(engine) if engine.optimizer else None,
            "optimizer_sharding": (
                (OPTIM_SHARDING if _uses_distributed_optimizer(engine) else "param_space")
                if "optimizer" in contents
                else None
            ),
            "params_dtype": engine.model_cfg.params_dtype,
            "arch": asdict(engine.arch),
            "value_head": _is_value_model(engine),
            "versions": _versions(),
            "extra_keys": sorted((extra or {}).keys()),
            "tokenizer": _tokenizer_meta(engine),
        }
        _write_json(folder / META, meta)
    timings["small_files_s"] = time.perf_counter() - t0

    request = None
    if has_dist:
        t1 = time.perf_counter()
        (folder / DIST_DIR).mkdir(exist_ok=True)
        _barrier()
        with device_context(engine.device), torch.no_grad():
            model_sd = _model_sharded_state_dict(engine)
            state: dict[str, Any] = dict(model_sd) if "model" in contents else {}
            if "optimizer" in contents:
                # An optimizer that never stepped (e.g. the actor during critic warmup) has no state yet.
                _ensure_optimizer_state(engine)
                state["optimizer"] = _optimizer_sharded_state_dict(engine, model_sd, loading=False)
            request = dist_checkpointing.save(state, str(folder / DIST_DIR), async_sharded_save=async_save)
        timings["dist_save_s" if not async_save else "dist_plan_s"] = time.perf_counter() - t1
    if hf:
        t2 = time.perf_counter()
        _export_hf(engine, folder / HF_DIR)
        timings["hf_export_s"] = time.perf_counter() - t2

    expected = _expected_files(contents, world, has_dist, hf)
    if request is not None:
        queue = _ASYNC.get_queue()
        with device_context(engine.device):
            idx = queue.schedule_async_request(request)
        _ASYNC.pending[idx] = _Pending(idx, folder, role, expected, engine.device, step)
        _fault("during_async_write", step)
        timings["blocking_s"] = time.perf_counter() - t0
        _LAST_TIMINGS.clear()
        _LAST_TIMINGS.update(timings)
        return False
    timings["manifest_s"] = _finish_role(folder, role, expected, step)
    timings["total_s"] = time.perf_counter() - t0
    _LAST_TIMINGS.clear()
    _LAST_TIMINGS.update(timings)
    return True


def has_pending() -> bool:
    """Whether this process has a background save that `finalize_pending` has not completed."""
    return bool(_ASYNC.pending)


def finalize_pending(blocking: bool = False) -> list[str]:
    """Complete the background saves that have finished on every rank (all of them when `blocking`).

    Collective over the role's ranks (megatron agrees on completion with an all-reduce), so every rank must
    call it at the same point: at the start of each training step and, blocking, before the process exits.
    Returns the role folders that became complete (their manifest is written). A failed background write
    raises CheckpointError on every rank; that folder stays incomplete and is never committed.
    """
    if not _ASYNC.pending:
        return []
    from torch.distributed.checkpoint.api import CheckpointException

    from rltrain.device import device_context

    device = next(iter(_ASYNC.pending.values())).device
    try:
        with device_context(device):
            done = _ASYNC.get_queue().maybe_finalize_async_calls(blocking=blocking)
    # torch's CheckpointException (a failed write on some rank) derives from BaseException.
    except (Exception, CheckpointException) as exc:
        failed = [str(p.folder) for p in _ASYNC.pending.values()]
        _ASYNC.pending.clear()
        raise CheckpointError(f"background checkpoint write failed for {failed}: {exc}") from exc
    out = []
    for idx in done:
        entry = _ASYNC.pending.pop(idx)
        _LAST_TIMINGS["async_manifest_s"] = _finish_role(entry.folder, entry.role, entry.expected, entry.step)
        _LAST_TIMINGS["async_total_s"] = time.perf_counter() - entry.started
        out.append(str(entry.folder))
    return out


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"torch": torch.__version__}
    with contextlib.suppress(PackageNotFoundError):
        out["megatron-core"] = version("megatron-core")
    return out


# ------------------------------------------------------------------------------------ load
def damaged_error(folder: str | os.PathLike, problems: Sequence[str]) -> CheckpointError:
    """The error for a checkpoint whose files do not match its manifest: the first file named, and the fix."""
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return CheckpointError(
        f"{problems[0]}{more}: the checkpoint in {folder} is damaged and cannot be loaded; resume from another "
        "one (trainer.resume_mode: auto skips damaged checkpoints; or set trainer.resume_from_path to an "
        "intact checkpoints/global_step_N)"
    )


def _require_manifest(folder: Path) -> None:
    if not (folder / MANIFEST).is_file():
        raise CheckpointError(
            f"{folder} is not a complete checkpoint (no {MANIFEST}); pick a global_step_N folder with a "
            f"{COMPLETE} marker"
        )


def read_role_meta(folder: str | os.PathLike) -> dict[str, Any]:
    """meta.json of a role folder; CheckpointError when the role's save never completed or it is unreadable."""
    folder = Path(folder)
    _require_manifest(folder)
    try:
        meta = _read_json(folder / META)
    except _JSON_ERRORS as exc:
        meta, why = None, f"{type(exc).__name__}: {str(exc)[:200]}"
    else:
        why = "not a JSON object"
    if not isinstance(meta, dict):
        raise CheckpointError(f"{folder / META} is unreadable ({why}); use another checkpoint")
    return meta


def load_engine(
    engine: MegatronEngine,
    folder: str | os.PathLike,
    contents: Sequence[str],
    role: str | None = None,
) -> dict[str, Any]:
    """Restore one role from `folder` (collective). Returns the `extra` dict given to `save_engine` ({} when
    extra is not loaded).

    contents: subset of what was saved. model and optimizer reload under any TP / PP / VPP / DP layout (the
    optimizer needs the same use_distributed_optimizer setting as at save time, and model with it). extra
    restores the lr scheduler, and the RNG states when the layout is unchanged (they belong to ranks; a
    warning says when they are not). hf_model without model initialises the weights from the checkpoint's
    huggingface/ folder (fresh optimizer state).
    """
    role = _role_of(folder, role)
    folder = Path(folder)
    contents = tuple(dict.fromkeys(contents))
    _require_manifest(folder)  # the save finished
    # Every byte against the manifest (rank 0 reads, every rank raises alike): a truncated, zeroed or
    # overwritten file is named here instead of surfacing as an unpickling or shape error deep inside torch, or
    # not at all (zeros inside a tensor shard load silently).
    t_verify = time.perf_counter()
    problems = _bcast_from_rank0(verify_manifest(folder, full=True) if _dist_rank() == 0 else None)
    if problems:
        raise damaged_error(folder, problems)
    verify_s = time.perf_counter() - t_verify
    from megatron.core import dist_checkpointing

    from rltrain.device import device_context

    meta = read_role_meta(folder)
    saved = set(meta["contents"])
    missing = [c for c in contents if c not in saved]
    if missing:
        raise CheckpointError(
            f"{role}.checkpoint.load_contents asks for {', '.join(missing)} but {folder} holds only "
            f"{', '.join(meta['contents'])}; drop {', '.join(missing)} from {role}.checkpoint.load_contents"
        )
    if "optimizer" in contents and "model" not in contents:
        raise CheckpointError(
            f"{role}.checkpoint.load_contents: optimizer without model would pair restored optimizer state "
            f"with fresh weights; add model to {role}.checkpoint.load_contents"
        )
    if "optimizer" in contents and engine.optimizer is None:
        raise CheckpointError(
            f"{role}.checkpoint.load_contents: optimizer requested but this engine has none"
        )
    _check_arch(meta, engine, role, folder)
    layout = _layout()
    saved_layout = meta["layout"]
    split_changed = any(saved_layout[k] != layout[k] for k in _MODEL_SPLIT_KEYS)
    if "optimizer" in contents:
        now_dist = _uses_distributed_optimizer(engine)
        if meta["distributed_optimizer"] != now_dist:
            raise CheckpointError(
                f"{folder}: optimizer state was saved with use_distributed_optimizer="
                f"{meta['distributed_optimizer']} and this run uses {now_dist}; set "
                f"{role}.megatron.use_distributed_optimizer back, or drop optimizer from "
                f"{role}.checkpoint.load_contents (the weights still load)"
            )
        if split_changed and meta["optimizer_sharding"] not in (OPTIM_SHARDING, "param_space"):
            raise CheckpointError(
                f"{folder}: its optimizer state ({meta['optimizer_sharding']}) cannot be resharded from "
                f"{_fmt_layout(saved_layout)} to {_fmt_layout(layout)}; drop optimizer from "
                f"{role}.checkpoint.load_contents (the weights still load) or use the saved layout"
            )
    t0 = time.perf_counter()
    timings: dict[str, float] = {"verify_s": verify_s}
    if "model" in contents:
        with device_context(engine.device), torch.no_grad():
            model_sd = _model_sharded_state_dict(engine)
            state: dict[str, Any] = dict(model_sd)
            if "optimizer" in contents:
                _ensure_optimizer_state(engine)
                state["optimizer"] = _optimizer_sharded_state_dict(engine, model_sd, loading=True)
            loaded = dist_checkpointing.load(state, str(folder / DIST_DIR))
            for key, module in zip(model_sd, engine.modules(), strict=True):
                module.load_state_dict(loaded[key], strict=True)
            if "optimizer" in contents:
                if not _uses_distributed_optimizer(engine):
                    _fill_missing_common_step(loaded["optimizer"])
                with _restore_step_per_param(engine):
                    engine.optimizer.load_state_dict(loaded["optimizer"])
            elif engine.optimizer is not None:
                # fp32 main params of 16-bit models are copies: refresh them from the loaded weights.
                engine.optimizer.reload_model_params()
        timings["dist_load_s"] = time.perf_counter() - t0
    elif "hf_model" in contents:
        from rltrain.megatron.hf_weights import load_hf_weights

        with device_context(engine.device):
            load_hf_weights(engine.chunks, folder / HF_DIR, value_head=_is_value_model(engine))
            if engine.optimizer is not None:
                engine.optimizer.reload_model_params()
    extra: dict[str, Any] = {}
    if "extra" in contents:
        payload = _read_json(folder / EXTRA)
        extra = payload["extra"]
        if payload["lr_scheduler"] is not None and engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(payload["lr_scheduler"])
        if saved_layout == layout:
            rng = torch.load(folder / RNG_DIR / f"rank_{_dist_rank():05d}.pt", weights_only=False)
            _set_rng_state(engine, rng)
        elif _dist_rank() == 0:
            warnings.warn(
                f"{role}: RNG states not restored: saved under {_fmt_layout(saved_layout)}, loading under "
                f"{_fmt_layout(layout)} (RNG streams belong to ranks); the run continues with fresh seeds",
                stacklevel=2,
            )
    _barrier()
    timings["total_s"] = time.perf_counter() - t0
    _LAST_TIMINGS.clear()
    _LAST_TIMINGS.update(timings)
    return extra


def _fmt_layout(layout: Mapping[str, int]) -> str:
    return (
        f"TP={layout['tensor_model_parallel_size']} PP={layout['pipeline_model_parallel_size']} "
        f"VPP={layout['virtual_pipeline_model_parallel_size']} DP={layout['data_parallel_size']}"
    )


def _check_arch(meta: Mapping[str, Any], engine: MegatronEngine, role: str, folder: Path) -> None:
    saved = meta["arch"]
    now = json.loads(json.dumps(asdict(engine.arch)))  # as meta.json holds it: tuples are lists there
    diff = [f"{k}: {saved[k]} -> {now[k]}" for k in now if k in saved and saved[k] != now[k]]
    if diff or bool(meta["value_head"]) != _is_value_model(engine):
        what = ", ".join(diff) if diff else "value head"
        raise CheckpointError(
            f"{folder}: saved for another model ({what}); point the run at the matching model "
            f"(model.path / model.arch) or at another checkpoint (trainer.resume_mode, "
            f"trainer.resume_from_path)"
        )


# ============================================================================================ controller side
# A role folder name in a COMPLETE marker: a plain folder name (the marker must not point outside the checkpoint).
_ROLE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
# The latest file holds one step number; anything longer than this is not one (and is not read further).
_LATEST_MAX_BYTES = 64


def _folder_step(folder: Path) -> int | None:
    m = _STEP_DIR.match(folder.name) or _WORK_DIR.match(folder.name)
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
        marker = _read_json(path)
    except _JSON_ERRORS as exc:
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


@dataclass(frozen=True)
class Resume:
    """Where a run resumes: the checkpoint's step and its global_step_N folder."""

    step: int
    folder: Path

    def role_folder(self, role: str) -> Path:
        return self.folder / role

    def __iter__(self) -> Iterator[Any]:  # (step, folder) = resume
        return iter((self.step, self.folder))


class CheckpointRegistry:
    """The checkpoints/ folder of a run, seen from the controller: staging, commit, resume, retention.

    Use: `cleanup_incomplete()` and `resolve_resume(plan)` at start-up; per save `begin(step)` -> staging
    role folders for the workers, then `commit(step)` once every role's save is complete (`ready(step)`),
    then `apply_retention(max_ckpt_to_keep)`.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        roles: Sequence[str] = ("actor",),
        contents: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        # Absolute: the staging paths go to worker processes whose working directory may differ.
        self.root = Path(root).absolute()
        self.roles = tuple(roles)
        # Planned save_contents per role (checked at commit); empty: not checked.
        self.contents = {r: tuple(contents[r]) for r in self.roles} if contents is not None else {}
        self._staging: dict[int, Path] = {}

    @classmethod
    def from_plan(cls, plan: TrainerPlan | CheckpointPlan) -> CheckpointRegistry:
        ck = _checkpoint_plan(plan)
        return cls(ck.root, [r.role for r in ck.roles], {r.role: r.save_contents for r in ck.roles})

    # ------------------------------------------------------------------------------------ paths
    @property
    def latest_file(self) -> Path:
        return self.root / LATEST_FILE

    def step_dir(self, step: int) -> Path:
        return self.root / f"global_step_{step}"

    # ------------------------------------------------------------------------------------ saving
    def begin(self, step: int) -> dict[str, str]:
        """Create the staging folder of `step`; returns {role: folder} to pass to the workers' save."""
        if step < 1:
            raise ValueError(f"steps count from 1, got {step}")
        if step in self._staging:
            raise CheckpointError(f"a save of step {step} is already in progress")
        tmp = self.root / f"global_step_{step}.tmp-{uuid.uuid4().hex[:10]}"
        for role in self.roles:
            (tmp / role).mkdir(parents=True, exist_ok=False)
        self._staging[step] = tmp
        return {role: str(tmp / role) for role in self.roles}

    def pending_steps(self) -> list[int]:
        """Steps begun and not yet committed or aborted."""
        return sorted(self._staging)

    def ready(self, step: int) -> bool:
        """Whether every role of the staged `step` has finished writing (its manifest exists)."""
        tmp = self._staging[step]
        return all((tmp / role / MANIFEST).is_file() for role in self.roles)

    def commit(self, step: int) -> Path:
        """Verify the staged save of `step`, mark it complete and publish it; returns global_step_N.

        Order (each step durable before the next): verify every role's files against its manifest ->
        write COMPLETE into the staging folder -> rename it to global_step_N (atomic) -> rewrite the latest
        file (temp + os.replace). An existing global_step_N (a step saved again after resuming from an
        earlier one) is moved aside first and deleted only once the new one is in place.
        """
        tmp = self._staging[step]
        problems = []
        for role in self.roles:
            role_problems = verify_manifest(tmp / role)
            if not role_problems and role in self.contents:
                saved = _read_json(tmp / role / META)["contents"]
                # hf_model is legitimately absent for a value model (no causal-LM form; save_engine warns).
                lacking = [c for c in self.contents[role] if c not in saved and c != "hf_model"]
                if lacking:
                    role_problems.append(f"{tmp / role} lacks {', '.join(lacking)} of the planned save")
            problems += role_problems
        if problems:
            raise CheckpointError(
                f"checkpoint of step {step} is incomplete, not committed: " + "; ".join(problems)
            )
        _fault("before_complete", step)
        marker = {
            "format": FORMAT,
            "step": step,
            "roles": list(self.roles),
            "contents": {r: list(_read_json(tmp / r / META)["contents"]) for r in self.roles},
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "unix_time": time.time(),
        }
        _write_json(tmp / COMPLETE, marker)
        _fault("before_rename", step)
        final = self.step_dir(step)
        old = None
        if final.exists():
            old = self.root / f"global_step_{step}.old-{uuid.uuid4().hex[:10]}"
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        del self._staging[step]
        _fault("before_latest", step)
        _write_atomic(self.latest_file, f"{step}\n".encode())
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        logger.info("checkpoint of step %d committed: %s", step, final)
        return final

    def abort(self, step: int) -> None:
        """Drop the staged save of `step` (its workers failed); nothing published changes."""
        tmp = self._staging.pop(step)
        shutil.rmtree(tmp, ignore_errors=True)

    # ------------------------------------------------------------------------------------ reading
    def check_complete(self, folder: str | os.PathLike, full: bool = False) -> str | None:
        """None when `folder` is a complete checkpoint, else the reason it is not.

        Complete: a well-formed COMPLETE marker naming its roles, and every role's files present with the
        sizes of its manifest (`full` also re-computes every digest). A folder without the marker whose role
        folders still match their manifests is named as such: it is kept, never loaded by resume_mode auto.
        """
        folder = Path(folder)
        if not folder.is_dir():
            return f"{folder} does not exist"
        marker, why = read_marker(folder)
        if marker is None:
            if not (folder / COMPLETE).exists() and self._intact_roles(folder, full=False):
                return (
                    f"{folder} has no {COMPLETE} marker, though its files match their manifests; it is kept "
                    f"and not loaded: to resume from it, set trainer.resume_mode: resume_path and "
                    f"trainer.resume_from_path: {folder}"
                )
            return why
        problems = []
        for role in marker["roles"]:
            problems += verify_manifest(folder / role, full=full)
        return "; ".join(problems) if problems else None

    def _intact_roles(self, folder: Path, full: bool) -> list[str]:
        """Role folders of `folder` (those holding a manifest) when every one matches it, else []."""
        try:
            roles = sorted(c.name for c in folder.iterdir() if (c / MANIFEST).is_file())
        except OSError:
            return []
        if not roles or any(verify_manifest(folder / r, full=full) for r in roles):
            return []
        return roles

    def _resume_problem(self, folder: Path) -> str | None:
        """Why `folder` cannot resume this run: incomplete (checked in full), or without one of its roles."""
        reason = self.check_complete(folder, full=True)
        if reason is None:
            marker, _ = read_marker(folder)
            have = marker["roles"] if marker is not None else []
            lacking = [r for r in self.roles if r not in have]
            if lacking:
                reason = f"{folder} has no {', '.join(lacking)} (it holds {', '.join(have)})"
        return reason

    def is_complete(self, folder: str | os.PathLike) -> bool:
        return self.check_complete(folder) is None

    def step_folders(self) -> dict[int, Path]:
        """{step: folder} of every global_step_N folder (complete or not)."""
        out = {}
        if self.root.is_dir():
            for child in self.root.iterdir():
                m = _STEP_DIR.match(child.name)
                if m and child.is_dir():
                    out[int(m.group(1))] = child
        return out

    def complete_steps(self) -> list[int]:
        """Steps with a complete checkpoint, ascending."""
        return sorted(s for s, f in self.step_folders().items() if self.is_complete(f))

    def read_latest_file(self) -> int | None:
        """The step named by the latest file; None when it is missing or does not hold a step number."""
        return parse_latest_file(self.latest_file)[0]

    def commit_time(self, step: int) -> float:
        """When `step` was committed: the mtime of its COMPLETE marker (0.0 without one).

        File times, not the marker's own clock reading: the latest file's mtime is compared with it, and on a
        shared filesystem both come from the same (server) clock."""
        try:
            return (self.step_dir(step) / COMPLETE).stat().st_mtime
        except OSError:
            return 0.0

    def latest_complete(self) -> int | None:
        """The step to resume from, or None (nothing complete; a warning when incomplete folders exist).

        Candidates, checked in full (every digest re-computed) in this order until one is intact: checkpoints committed after the latest file was last written (a crash between publishing
        global_step_N and updating the latest file), newest first; the latest file's step; the other
        complete checkpoints, newest commit first. Anything but the latest file's step is taken with a
        warning that says why; a missing or malformed latest file, marker or manifest only takes a
        checkpoint out of the candidates. Newer global_step_N folders without a marker are named in a warning.
        """
        named, latest_problem = parse_latest_file(self.latest_file)
        marked = sorted(
            (s for s, f in self.step_folders().items() if (f / COMPLETE).is_file()),
            key=lambda s: (self.commit_time(s), s),
            reverse=True,
        )
        newer: list[int] = []
        if named is not None and named in marked:
            written = self.latest_file.stat().st_mtime
            newer = [s for s in marked if s != named and self.commit_time(s) > written]
            order = [*newer, named, *(s for s in marked if s != named and s not in newer)]
        else:
            order = marked
        chosen, skipped = None, {}
        for step in order:
            problem = self._resume_problem(self.step_dir(step))
            if problem is None:
                chosen = step
                break
            skipped[step] = problem
        if named is None:
            why = latest_problem
        elif named in skipped:
            why = skipped[named]
        elif named not in marked:
            why = self._resume_problem(self.step_dir(named)) or f"{self.step_dir(named)} is not complete"
        else:
            why = None
        unmarked = [
            f"{self.step_dir(s)} has no {COMPLETE} marker: kept, not loaded"
            for s, f in sorted(self.step_folders().items())
            if s != named and (chosen is None or s > chosen) and not (f / COMPLETE).exists()
        ]
        if unmarked:
            warnings.warn("; ".join(unmarked), stacklevel=2)
        if chosen is None:
            if self.step_folders():
                warnings.warn(
                    f"checkpoints in {self.root} exist but none is complete ({why or '; '.join(skipped.values())}); "
                    "starting at step 1",
                    stacklevel=2,
                )
            return None
        if chosen in newer:
            warnings.warn(
                f"{self.latest_file} names step {named}, but step {chosen} was committed after that file was "
                f"written (the run stopped between publishing step {chosen} and updating the latest file); "
                f"resuming from step {chosen}",
                stacklevel=2,
            )
        elif chosen == named:
            if skipped:
                warnings.warn(
                    f"checkpoints committed after the latest file are not usable ({'; '.join(skipped.values())}); "
                    f"resuming from step {named}, which the latest file names",
                    stacklevel=2,
                )
        else:
            damaged = [r for s, r in skipped.items() if s != named]
            also = f"; also not usable: {'; '.join(damaged)}" if damaged else ""
            warnings.warn(
                f"latest checkpoint not usable ({why}{also}); resuming from the newest complete one, "
                f"step {chosen}",
                stacklevel=2,
            )
        return chosen

    def resolve_resume(self, plan: TrainerPlan | CheckpointPlan) -> Resume | None:
        """Where trainer.resume_mode says to resume: Resume(step, folder), or None to start at step 1.

        auto: the latest complete checkpoint under this run's checkpoints/ (see `latest_complete`).
        disable: None (existing checkpoints stay and are replaced as their steps are saved again).
        resume_path: trainer.resume_from_path must be a complete global_step_N folder (or a role folder
        inside one); anything else raises ConfigError naming trainer.resume_from_path.
        """
        ck = _checkpoint_plan(plan)
        if ck.resume_mode == "disable":
            if self.complete_steps():
                warnings.warn(
                    f"trainer.resume_mode is disable: ignoring the checkpoints in {self.root}; saves of the "
                    "same steps will replace them",
                    stacklevel=2,
                )
            return None
        if ck.resume_mode == "auto":
            step = self.latest_complete()
            return Resume(step, self.step_dir(step)) if step is not None else None
        if ck.resume_mode != "resume_path":
            raise ValueError(f"unknown resume_mode {ck.resume_mode!r}")
        return self.resolve_path(ck.resume_from)

    def resolve_path(self, path: str | os.PathLike | None) -> Resume:
        """A complete checkpoint folder given by the user (trainer.resume_from_path)."""
        if path is None:
            raise ConfigError(
                [
                    error(
                        "trainer.resume_from_path",
                        "resume_mode is resume_path but no resume_from_path is given",
                        "set it to a checkpoints/global_step_N folder, or use resume_mode: auto",
                        "resume-path",
                    )
                ]
            )
        folder = Path(path).absolute()
        if not _STEP_DIR.match(folder.name) and _STEP_DIR.match(folder.parent.name):
            folder = folder.parent  # a role folder (global_step_N/actor) names its checkpoint
        m = _STEP_DIR.match(folder.name)
        if m and folder.is_dir() and not (folder / COMPLETE).exists():
            # The marker was lost but the user names the folder: its files, verified in full, decide.
            roles = self._intact_roles(folder, full=True)
            if roles and all(r in roles for r in self.roles):
                warnings.warn(
                    f"{folder} has no {COMPLETE} marker; every file of {', '.join(roles)} matches its manifest: "
                    "resuming from it as trainer.resume_from_path asks",
                    stacklevel=2,
                )
                return Resume(int(m.group(1)), folder)
        reason = self._resume_problem(folder)
        if reason is None and not m:
            reason = f"{folder} is not named global_step_N"
        if reason is not None:
            hint = ""
            # The user may have named the run folder, the checkpoints folder or a sibling step: show what is
            # there to pick from.
            for root in (folder.parent, folder, folder / "checkpoints"):
                nearby = CheckpointRegistry(root).complete_steps() if root.is_dir() else []
                if nearby:
                    hint = f" (complete checkpoints in {root}: steps {nearby})"
                    break
            raise ConfigError(
                [
                    error(
                        "trainer.resume_from_path",
                        f"{path} is not a complete checkpoint: {reason}",
                        f"point it at a checkpoints/global_step_N folder with a {COMPLETE} marker{hint}, "
                        "or use resume_mode: auto",
                        "resume-path",
                    )
                ]
            )
        marker, _ = read_marker(folder)
        assert marker is not None  # _resume_problem checked it
        return Resume(marker["step"], folder)

    # ------------------------------------------------------------------------------------ clean-up
    def apply_retention(self, keep: int | None) -> list[int]:
        """Delete complete checkpoints beyond the newest `keep` (None keeps all); returns deleted steps.

        Never deleted: the newest complete checkpoint, the one the latest file names, staged saves and
        anything incomplete (that is `cleanup_incomplete`'s job at start-up). A checkpoint is first renamed
        out of the global_step_N namespace, so a half-deleted folder can never be mistaken for one.
        """
        if keep is None:
            return []
        if keep < 1:
            raise ValueError(f"trainer.max_ckpt_to_keep must be >= 1, got {keep}")
        complete = self.complete_steps()
        protected = set(complete[-keep:]) | set(self._staging)
        named = self.read_latest_file()
        if named is not None:
            protected.add(named)
        deleted = []
        for step in complete:
            if step in protected:
                continue
            trash = self.root / f"global_step_{step}.del-{uuid.uuid4().hex[:10]}"
            os.replace(self.step_dir(step), trash)
            _fault("during_retention", step)
            shutil.rmtree(trash, ignore_errors=True)
            deleted.append(step)
        if deleted:
            _fsync_dir(self.root)
        return deleted

    def cleanup_incomplete(self) -> list[Path]:
        """Remove what provably is a half-written save or a half-done delete (call at start-up, holding the run
        folder's lock, before resolving the resume). Returns what was removed.

        * global_step_N.tmp-* (a save that never committed) and .del-* (a retention delete cut short);
        * global_step_N.old-* (moved aside by a re-save of step N): put back when global_step_N is gone,
          removed when the new global_step_N is in place (a commit renames only marked folders);
        * a latest-file rewrite that never reached its rename (.latest_checkpointed_iteration.txt.tmp-*).
        global_step_N folders are never removed here, whatever their state: one without a COMPLETE marker
        (a marker deleted by hand, or lost) is kept, and resume_mode auto skips it with a warning.
        Saves staged by this registry are kept.
        """
        removed: list[Path] = []
        if not self.root.is_dir():
            return removed
        staged = set(self._staging.values())
        for child in sorted(self.root.iterdir()):
            if child.is_file() and _is_scratch(child) and child.name.startswith(f".{LATEST_FILE}.tmp-"):
                child.unlink(missing_ok=True)
                removed.append(child)
                continue
            if child in staged or not child.is_dir():
                continue
            m = _WORK_DIR.match(child.name)
            if m:
                step, kind = int(m.group(1)), m.group(2)
                if kind == "old" and not self.step_dir(step).exists():
                    os.replace(child, self.step_dir(step))
                    logger.warning("restored %s from %s", self.step_dir(step), child.name)
                    continue
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child)
                continue
        if removed:
            _fsync_dir(self.root)
            logger.warning("removed leftovers of interrupted saves: %s", [p.name for p in removed])
        return removed


def _checkpoint_plan(plan: TrainerPlan | CheckpointPlan) -> CheckpointPlan:
    return plan.checkpoint if hasattr(plan, "checkpoint") else plan  # type: ignore[return-value]


def role_contents(
    plan: TrainerPlan | CheckpointPlan, role: str
) -> tuple[tuple[str, ...], tuple[str, ...], bool]:
    """(save_contents, load_contents, async_save) of `role` in the plan."""
    for rc in _checkpoint_plan(plan).roles:
        if rc.role == role:
            return tuple(rc.save_contents), tuple(rc.load_contents), bool(rc.async_save)
    raise KeyError(f"the plan has no checkpoint entry for role {role!r}")


__all__ = [
    "FAULT_ENV",
    "FAULT_POINTS",
    "CheckpointError",
    "CheckpointRegistry",
    "Resume",
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
    "save_engine",
    "verify_manifest",
    "write_manifest",
]
