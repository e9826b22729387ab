"""A role's save and load (worker side): every rank of a role calls these together; they are collective.

`save_engine` writes one role's state into a folder, `finalize_pending` completes background saves,
`load_engine` restores a role from a folder. A role folder holds

    meta.json            what was saved and under which layout (rank 0)
    dist_ckpt/           megatron dist_checkpointing (torch_dist): "model" (bare GPTModel sharded state
                         dicts; model0, model1, ... with virtual pipeline chunks) and "optimizer"
                         (distributed optimizer in the `fully_reshardable` format, or the plain optimizer
                         in parameter space): both reload under another TP / PP / DP layout
    rng/rank_NNNNN.pt    python, numpy, torch, device (cuda / npu) and megatron tracker RNG states of each rank
                         (tensors and plain data: loaded with torch.load(weights_only=True), see safe_load.py)
    extra.json           the controller's `extra` dict and the lr scheduler state (rank 0)
    huggingface/         safetensors + config.json (+ tokenizer files) when hf_model is saved
    manifest.json        written last, after every file above is verified: the role's completion mark

Megatron is imported inside the functions: importing this module costs torch only.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rltrain.checkpoint import results_queue
from rltrain.checkpoint.engine_state import (
    OPTIM_SHARDING,
    adapters_only,
    check_optimizer_supported,
    ensure_optimizer_state,
    fill_missing_common_step,
    model_sharded_state_dict,
    optimizer_sharded_state_dict,
    restore_step_per_param,
    rng_state,
    set_rng_state,
    uses_distributed_optimizer,
)
from rltrain.checkpoint.faults import fault_point
from rltrain.checkpoint.manifest import (
    COMPLETE,
    DIST_DIR,
    EXTRA,
    FORMAT,
    HF_DIR,
    JSON_ERRORS,
    MANIFEST,
    META,
    RNG_DIR,
    CheckpointError,
    read_json,
    verify_manifest,
    write_atomic,
    write_json,
    write_manifest,
)
from rltrain.checkpoint.safe_load import (
    REFUSED,
    UnsafeCheckpointError,
    guarded_dist_load,
    load_rng_file,
    role_problems,
)

if TYPE_CHECKING:
    from rltrain.megatron.engine import MegatronEngine

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


def _stage_layers(engine: MegatronEngine) -> list[list[int]]:
    """Decoder layers of each [pipeline stage][virtual chunk]: the uneven split options
    (num_layers_in_first/last_pipeline_stage, account_for_*) cut the model differently at the same pp."""
    from rlconf.pipeline_split import PipelineSplit, chunk_layer_counts

    c = engine.config
    return chunk_layer_counts(PipelineSplit(
        c.num_layers, c.pipeline_model_parallel_size, c.virtual_pipeline_model_parallel_size,
        c.num_layers_in_first_pipeline_stage, c.num_layers_in_last_pipeline_stage,
        c.account_for_embedding_in_pipeline_split, c.account_for_loss_in_pipeline_split,
    ))  # fmt: skip


def _layout(engine: MegatronEngine) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    return {
        "stage_layers": _stage_layers(engine),
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


# ------------------------------------------------------------------------------------ HF export
def _hf_source(engine: MegatronEngine) -> tuple[Path | None, Path | None]:
    """(model folder, tokenizer folder) the engine was built from, when they exist: the role's weights folder
    from its plan, and the run's tokenizer (every role reads the policy's)."""
    weights, tok_path = engine.spec.model.weights, engine.spec.settings.tokenizer_path
    model = Path(weights) if weights is not None else None
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
        base = read_json(model_dir / "config.json")
    with device_context(engine.device):
        export_hf_weights(engine.chunks, engine.arch, out_dir, base_config=base, mtp_source=model_dir)
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
        fault_point("before_manifest", step)
        missing = [rel for rel in expected if not (folder / rel).is_file()]
        hf = folder / HF_DIR
        if hf.is_dir() and not any(hf.glob("*.safetensors")):
            missing.append(f"{HF_DIR}/*.safetensors")
        if (hf / "model.safetensors.index.json").is_file():
            index = read_json(hf / "model.safetensors.index.json")
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
    from rltrain.device import device_context

    role = _role_of(folder, role)
    folder = Path(folder)
    contents = tuple(dict.fromkeys(contents))
    hf = _save_checks(engine, contents, role)
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
        _save_extra(engine, folder, extra, role, rank)
    has_dist = "model" in contents or "optimizer" in contents
    if rank == 0:
        write_json(folder / META, _save_meta(engine, contents, role, extra, hf))
    timings["small_files_s"] = time.perf_counter() - t0

    request = None
    if has_dist:
        t1 = time.perf_counter()
        request = _save_dist(engine, folder, contents, async_save)
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
        fault_point("during_async_write", step)
        timings["blocking_s"] = time.perf_counter() - t0
        _LAST_TIMINGS.clear()
        _LAST_TIMINGS.update(timings)
        return False
    timings["manifest_s"] = _finish_role(folder, role, expected, step)
    timings["total_s"] = time.perf_counter() - t0
    _LAST_TIMINGS.clear()
    _LAST_TIMINGS.update(timings)
    return True


def _save_checks(engine: MegatronEngine, contents: tuple[str, ...], role: str) -> bool:
    """Refuse contents this engine cannot save; returns whether the HF export is written (not for a value
    model, with a warning)."""
    unknown = [c for c in contents if c not in ("model", "optimizer", "extra", "hf_model")]
    if unknown:
        raise CheckpointError(f"{role}.checkpoint.save_contents: unknown entries {unknown}")
    if "optimizer" in contents and engine.optimizer is None:
        raise CheckpointError(
            f"{role}.checkpoint.save_contents: optimizer requested but this engine has no optimizer"
        )
    if "optimizer" in contents:
        check_optimizer_supported(engine, role)
    hf = "hf_model" in contents
    if hf and _is_value_model(engine):
        # A value head is no causal LM: transformers could not load it. Say so instead of writing garbage.
        warnings.warn(
            f"{role}: hf_model skipped: a critic (value head) has no Hugging Face causal-LM form; "
            f"drop hf_model from {role}.checkpoint.save_contents",
            stacklevel=3,
        )
        hf = False
    return hf


def _save_extra(
    engine: MegatronEngine, folder: Path, extra: Mapping[str, Any] | None, role: str, rank: int
) -> None:
    """This rank's RNG state, and on rank 0 the controller's extra dict with the lr scheduler's state."""
    sched = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    # Serialised on every rank so that a bad value fails everywhere, before any collective.
    try:
        payload = json.dumps({"extra": dict(extra or {}), "lr_scheduler": sched}, allow_nan=True)
    except TypeError as exc:
        raise CheckpointError(f"{role}: the checkpoint's extra dict is not JSON-serialisable: {exc}") from exc
    (folder / RNG_DIR).mkdir(exist_ok=True)
    rng_file = folder / RNG_DIR / f"rank_{rank:05d}.pt"
    tmp = rng_file.with_name(f".{rng_file.name}.tmp-{uuid.uuid4().hex[:8]}")
    torch.save(rng_state(engine), tmp)
    os.replace(tmp, rng_file)
    if rank == 0:
        write_atomic(folder / EXTRA, payload.encode())


def _save_meta(
    engine: MegatronEngine,
    contents: tuple[str, ...],
    role: str,
    extra: Mapping[str, Any] | None,
    hf: bool,
) -> dict[str, Any]:
    """meta.json of one role's save: what it holds and what it was built from."""
    return {
        "format": FORMAT,
        "role": role,
        "contents": [c for c in contents if c != "hf_model" or hf],
        "layout": _layout(engine),
        "distributed_optimizer": uses_distributed_optimizer(engine) if engine.optimizer else None,
        "optimizer_sharding": (
            (OPTIM_SHARDING if uses_distributed_optimizer(engine) else "param_space")
            if "optimizer" in contents
            else None
        ),
        "params_dtype": engine.spec.settings.transformer.params_dtype,
        "arch": asdict(engine.arch),
        "value_head": _is_value_model(engine),
        "versions": _versions(),
        "extra_keys": sorted((extra or {}).keys()),
        "tokenizer": _tokenizer_meta(engine),
        # LoRA: the adapters (rlconf LoraPlan) and whether the base weights were left out (they reload
        # from model.path; a random-init base is saved with the adapters).
        "lora": asdict(engine.lora) if getattr(engine, "lora", None) is not None else None,
        "lora_adapters_only": adapters_only(engine),
    }


def _save_dist(engine: MegatronEngine, folder: Path, contents: tuple[str, ...], async_save: bool) -> Any:
    """Write (or, async, plan) the megatron dist checkpoint of the model and / or optimizer; returns the
    async request (None when written now)."""
    from megatron.core import dist_checkpointing

    from rltrain.device import device_context

    (folder / DIST_DIR).mkdir(exist_ok=True)
    _barrier()
    with device_context(engine.device), torch.no_grad():
        model_sd = model_sharded_state_dict(engine)
        state: dict[str, Any] = dict(model_sd) if "model" in contents else {}
        if "optimizer" in contents:
            # An optimizer that never stepped (e.g. the actor during critic warmup) has no state yet.
            ensure_optimizer_state(engine)
            state["optimizer"] = optimizer_sharded_state_dict(engine, model_sd, loading=False)
        results_queue.install()  # megatron's write-results queue, without its spawned manager
        return dist_checkpointing.save(state, str(folder / DIST_DIR), async_sharded_save=async_save)


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
        meta = read_json(folder / META)
    except JSON_ERRORS as exc:
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
    verify_s = _verify_for_load(folder)
    meta = read_role_meta(folder)
    _load_checks(engine, meta, contents, role, folder)
    layout = _layout(engine)
    # Checkpoints written before the uneven split options have no "stage_layers": their pp and vpp decide.
    saved_layout = {"stage_layers": layout["stage_layers"], **meta["layout"]}
    if "optimizer" in contents:
        _check_optimizer_loadable(engine, meta, role, folder, saved_layout, layout)
    t0 = time.perf_counter()
    timings: dict[str, float] = {"verify_s": verify_s}
    if "model" in contents:
        _load_dist(engine, folder, "optimizer" in contents)
        timings["dist_load_s"] = time.perf_counter() - t0
    elif "hf_model" in contents:
        _load_hf_model(engine, folder)
    extra: dict[str, Any] = {}
    if "extra" in contents:
        extra = _load_extra(engine, folder, role, saved_layout == layout, saved_layout, layout)
    _barrier()
    timings["total_s"] = time.perf_counter() - t0
    _LAST_TIMINGS.clear()
    _LAST_TIMINGS.update(timings)
    return extra


def _verify_for_load(folder: Path) -> float:
    """Refuse a save that did not finish, is damaged or holds a file the restricted loaders refuse, before
    megatron opens anything; returns the seconds it took."""
    _require_manifest(folder)  # the save finished
    # Every byte against the manifest (rank 0 reads, every rank raises alike): a truncated, zeroed or
    # overwritten file is named here instead of surfacing as an unpickling or shape error deep inside torch, or
    # not at all (zeros inside a tensor shard load silently).
    t_verify = time.perf_counter()
    problems = _bcast_from_rank0(verify_manifest(folder, full=True) if _dist_rank() == 0 else None)
    if problems:
        raise damaged_error(folder, problems)
    # Intact is not trustworthy (a CRC is no signature): every pickle-based file must load with the
    # restricted loaders before megatron opens any of them (which then uses them as well).
    unsafe = _bcast_from_rank0(role_problems(folder) if _dist_rank() == 0 else None)
    if unsafe:
        raise (UnsafeCheckpointError if REFUSED in unsafe[0] else CheckpointError)(unsafe[0])
    return time.perf_counter() - t_verify


def _load_checks(
    engine: MegatronEngine, meta: Mapping[str, Any], contents: tuple[str, ...], role: str, folder: Path
) -> None:
    """Refuse load contents the save does not hold or this engine cannot take, and another architecture."""
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


def _check_optimizer_loadable(
    engine: MegatronEngine,
    meta: Mapping[str, Any],
    role: str,
    folder: Path,
    saved_layout: Mapping[str, Any],
    layout: Mapping[str, Any],
) -> None:
    """The saved optimizer state fits this engine: the same distributed-optimizer setting, and a sharding
    that reshards when the model split changed."""
    split_changed = any(saved_layout[k] != layout[k] for k in (*_MODEL_SPLIT_KEYS, "stage_layers"))
    now_dist = uses_distributed_optimizer(engine)
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


def _load_dist(engine: MegatronEngine, folder: Path, with_optimizer: bool) -> None:
    """The model (and optimizer) state from the dist checkpoint, resharded to this engine's layout."""
    from megatron.core import dist_checkpointing

    from rltrain.device import device_context

    with device_context(engine.device), torch.no_grad():
        model_sd = model_sharded_state_dict(engine)
        state: dict[str, Any] = dict(model_sd)
        if with_optimizer:
            ensure_optimizer_state(engine)
            state["optimizer"] = optimizer_sharded_state_dict(engine, model_sd, loading=True)
        with guarded_dist_load():  # what megatron unpickles goes through safe_load's loaders too
            loaded = dist_checkpointing.load(state, str(folder / DIST_DIR))
        for key, module in zip(model_sd, engine.modules(), strict=True):
            module.load_state_dict(loaded[key], strict=not adapters_only(engine))
        if with_optimizer:
            if not uses_distributed_optimizer(engine):
                fill_missing_common_step(loaded["optimizer"])
            with restore_step_per_param(engine):
                engine.optimizer.load_state_dict(loaded["optimizer"])
        elif engine.optimizer is not None:
            # fp32 main params of 16-bit models are copies: refresh them from the loaded weights.
            engine.optimizer.reload_model_params()


def _load_hf_model(engine: MegatronEngine, folder: Path) -> None:
    """The weights from the checkpoint's huggingface/ folder (fresh optimizer state)."""
    from rltrain.device import device_context
    from rltrain.megatron.hf_weights import load_hf_weights

    with device_context(engine.device):
        load_hf_weights(engine.chunks, folder / HF_DIR, engine.arch, value_head=_is_value_model(engine))
        if engine.optimizer is not None:
            engine.optimizer.reload_model_params()


def _load_extra(
    engine: MegatronEngine,
    folder: Path,
    role: str,
    same_layout: bool,
    saved_layout: Mapping[str, Any],
    layout: Mapping[str, Any],
) -> dict[str, Any]:
    """The controller's extra dict; restores the lr scheduler, and the RNG states under the saved layout."""
    payload = read_json(folder / EXTRA)
    if payload["lr_scheduler"] is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(payload["lr_scheduler"])
    if same_layout:
        set_rng_state(engine, load_rng_file(folder / RNG_DIR / f"rank_{_dist_rank():05d}.pt"))
    elif _dist_rank() == 0:
        warnings.warn(
            f"{role}: RNG states not restored: saved under {_fmt_layout(saved_layout)}, loading under "
            f"{_fmt_layout(layout)} (RNG streams belong to ranks); the run continues with fresh seeds",
            stacklevel=3,
        )
    return payload["extra"]


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
