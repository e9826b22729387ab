"""`rltrain inspect` and `rltrain export-hf`: look into a checkpoint, and turn one into a Hugging Face model.

    rltrain inspect CHECKPOINT [--json]
        CHECKPOINT: checkpoints/global_step_N (or a role folder in it), or a run's checkpoints/ or output
        folder for one line per step. Shows the step, roles, contents, the layout it was saved with
        (TP / PP / VPP / CP / EP / DP), files and sizes, whether it is complete, the manifest verification
        (every size, CRC-32 of every byte) and when it was committed.
    rltrain export-hf CHECKPOINT OUT [--role actor] [--overwrite] [--merge]
        A LoRA run's checkpoint (actor.lora) gives a PEFT adapter folder (adapter_config.json +
        adapter_model.safetensors, on the run's model.path), or with --merge the merged model as below.
        Writes OUT/{model.safetensors, config.json, tokenizer files} loadable by
        `transformers.AutoModelForCausalLM.from_pretrained`, from the dist checkpoint (no hf_model needed in
        save_contents). The model is built on the CPU in this process (TP = PP = 1, a gloo world of one) and
        the checkpoint is loaded resharded from whatever layout it was saved with. The architecture and dtype
        come from the role's meta.json; the base config.json and the tokenizer files from the run's model
        folder named in output_dir/config.yaml (or plan.json) next to checkpoints/, when it still exists; a run
        on the built-in character tokenizer gets it as Hugging Face files (tokenizer.json, ...). OUT must not
        be, hold or lie inside a run folder or checkpoint (with or without --overwrite, which only ever
        replaces an export folder). Files get the modes of a plain write (0666 less the umask).

Errors (no such folder, an incomplete or damaged checkpoint, a malformed marker, manifest or latest file, a
non-empty OUT, an OUT in a run, a file that would run code when loaded: safe_load.py) are one line naming
the file and the fix, exit code 2; `inspect` of an incomplete or damaged checkpoint prints its report and then the
error. Only `export-hf` imports megatron (~10 s); `inspect` reads JSON, hashes files and loads the pickle-based
ones (RNG states, dist checkpoint metadata) with the restricted loaders of safe_load.py (imports torch).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rltrain.checkpoint import (
    COMPLETE,
    DIST_DIR,
    HF_DIR,
    LATEST_FILE,
    MANIFEST,
    META,
    REFUSED,
    STEP_DIR,
    WORK_DIR,
    CheckpointError,
    CheckpointRegistry,
    copy_tokenizer_files,
    damaged_error,
    normalize_modes,
    parse_latest_file,
    read_manifest,
    read_marker,
    verify_manifest,
)
from rltrain.checkpoint.manifest import read_json

EXIT_OK, EXIT_INVALID = 0, 2
_LAYOUT_KEYS = (
    ("TP", "tensor_model_parallel_size"),
    ("PP", "pipeline_model_parallel_size"),
    ("VPP", "virtual_pipeline_model_parallel_size"),
    ("CP", "context_parallel_size"),
    ("EP", "expert_model_parallel_size"),
    ("DP", "data_parallel_size"),
)


# ============================================================================================ locating
@dataclass(frozen=True)
class Located:
    """What a CHECKPOINT argument names: a run's checkpoints folder, or one checkpoint (and maybe a role)."""

    kind: str  # "root" | "step"
    folder: Path  # the checkpoints/ folder, or the global_step_N(.tmp-*) folder
    role: str | None = None


def _nearby_hint(path: Path) -> str:
    """' (complete checkpoints in X: steps [...])' for the closest checkpoints folder, else ''."""
    for root in (path.parent, path, path / "checkpoints", path.parent.parent):
        with contextlib.suppress(OSError):
            steps = CheckpointRegistry(root).complete_steps() if root.is_dir() else []
            if steps:
                return f" (complete checkpoints in {root}: steps {steps})"
    return ""


def _is_step_name(name: str) -> bool:
    return bool(STEP_DIR.match(name) or (WORK_DIR.match(name) and ".tmp-" in name))


def locate(path: str | os.PathLike) -> Located:
    """Classify a CHECKPOINT argument; CheckpointError (naming the path and the fix) when it is none."""
    p = Path(path).absolute()
    if not p.exists():
        raise CheckpointError(
            f"{p} does not exist; give a checkpoints/global_step_N folder (or its actor folder){_nearby_hint(p)}"
        )
    if not p.is_dir():
        raise CheckpointError(f"{p} is a file; give a checkpoints/global_step_N folder{_nearby_hint(p)}")
    if (p / COMPLETE).is_file() or _is_step_name(p.name):
        return Located("step", p)
    if (p / META).is_file() or (p / MANIFEST).is_file() or (p / DIST_DIR).is_dir():
        if not _is_step_name(p.parent.name) and not (p.parent / COMPLETE).is_file():
            raise CheckpointError(
                f"{p} is a role folder outside a global_step_N folder; give the global_step_N folder that holds it"
            )
        return Located("step", p.parent, p.name)
    if (p / LATEST_FILE).is_file() or any(_is_step_name(c.name) for c in p.iterdir() if c.is_dir()):
        return Located("root", p)
    if (p / "checkpoints").is_dir():
        return Located("root", p / "checkpoints")
    raise CheckpointError(
        f"{p} holds no checkpoint (no {COMPLETE}, {META} or global_step_N folders); give a "
        f"checkpoints/global_step_N folder{_nearby_hint(p)}"
    )


# ============================================================================================ inspect
def _read_json(path: Path) -> tuple[Any, str | None]:
    """(content, None) or (None, why it cannot be read)."""
    try:
        return read_json(path), None  # bounded (rltrain.checkpoint.manifest.read_json)
    except FileNotFoundError:
        return None, f"{path} is missing"
    except (OSError, ValueError, RecursionError) as exc:
        return None, f"{path} is unreadable ({type(exc).__name__}: {str(exc)[:200]})"


def _iso(unix: Any) -> str | None:
    if not isinstance(unix, int | float) or isinstance(unix, bool) or not 0 < unix < 1e11:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(unix))


# meta.json fields shown by inspect, with the type each must have to be shown (a damaged meta.json is
# reported by the manifest check; its odd values must not crash the report).
_META_FIELDS: dict[str, type | tuple[type, ...]] = {
    "contents": list,
    "layout": dict,
    "distributed_optimizer": (bool, type(None)),
    "optimizer_sharding": (str, type(None)),
    "params_dtype": str,
    "arch": dict,
    "value_head": bool,
    "versions": dict,
    "extra_keys": list,
}


def _files(folder: Path) -> list[dict[str, Any]]:
    out = []
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = Path(dirpath) / name
            with contextlib.suppress(OSError):
                out.append({"path": path.relative_to(folder).as_posix(), "bytes": path.stat().st_size})
    return sorted(out, key=lambda f: f["path"])


def _role_report(folder: Path) -> dict[str, Any]:
    role: dict[str, Any] = {"path": str(folder), "exists": folder.is_dir()}
    if not folder.is_dir():
        role["problems"] = [f"{folder}: missing"]
        return role
    meta, meta_error = _read_json(folder / META)
    manifest, _ = read_manifest(folder)
    extra, _ = _read_json(folder / "extra.json")
    if isinstance(meta, dict):
        for key, kind in _META_FIELDS.items():
            role[key] = meta.get(key) if isinstance(meta.get(key), kind) else None
    else:
        role["meta_error"] = meta_error or f"{folder / META} is not a JSON object"
    if isinstance(extra, dict) and isinstance(extra.get("extra"), dict):
        role["saved_step"] = extra["extra"].get("step")
    files = _files(folder)
    role["files"] = files
    role["bytes"] = sum(f["bytes"] for f in files)
    if manifest is not None:
        entries = manifest["files"].values()
        role["saved_at"] = _iso(manifest.get("time"))
        role["manifest"] = {
            "files": len(manifest["files"]),
            "crc32": sum(1 for e in entries if "crc32" in e),
            # digests of manifests written by older rlplan versions
            "sha256": sum(1 for e in entries if "sha256" in e),
            "sampled_sha256": sum(1 for e in entries if "sampled_sha256" in e),
        }
    role["problems"] = verify_manifest(folder, full=True)
    if not role["problems"]:
        # Intact files are what was saved, or a forgery with recomputed CRCs: load every pickle-based one
        # with the restricted loaders the resume uses (safe_load.py), so that "ok" means loadable.
        from rltrain.checkpoint.safe_load import role_problems

        role["problems"] = role_problems(folder)
    return role


def inspect_step(folder: Path, only_role: str | None = None) -> dict[str, Any]:
    """The report of one checkpoint folder (JSON-serialisable); `problems` is empty when it is loadable."""
    marker, marker_error = read_marker(folder)
    m = STEP_DIR.match(folder.name) or WORK_DIR.match(folder.name)
    report: dict[str, Any] = {
        "kind": "checkpoint",
        "path": str(folder),
        "step": int(m.group(1)) if m else None,
        "staging": ".tmp-" in folder.name,
    }
    problems: list[str] = []
    if marker is not None:
        report["step"] = marker["step"]
        report["committed"] = marker.get("time") if isinstance(marker.get("time"), str) else None
        roles = list(marker["roles"])
        run = marker.get("run")  # rltrain.run_record: what the resume guard compares with
        report["run_record"] = (
            {"config_sha256": run.get("config_sha256"), "data_files": len(run.get("data") or {})}
            if isinstance(run, dict)
            else None
        )
    else:
        problems.append(marker_error or f"{folder} has no {COMPLETE} marker")
        roles = sorted(c.name for c in folder.iterdir() if c.is_dir()) if folder.is_dir() else []
    if report["staging"]:
        problems.append(f"{folder} is a staging folder: a save that was never published")
    report["complete"] = not problems
    if only_role is not None:
        if only_role not in roles and not (folder / only_role).is_dir():
            raise CheckpointError(
                f"{folder} has no role {only_role} (it holds {', '.join(roles) or 'nothing'})"
            )
        roles = [only_role]
    report["roles"] = {r: _role_report(folder / r) for r in roles}
    for r in report["roles"].values():
        problems += r["problems"]
    named, report["latest_file_problem"] = parse_latest_file(folder.parent / LATEST_FILE)
    report["latest_file_step"] = named
    report["is_latest"] = (
        named is not None and named == report["step"] and STEP_DIR.match(folder.name) is not None
    )
    report["bytes"] = sum(r.get("bytes", 0) for r in report["roles"].values())
    # complete: the save finished and was published (marker); verified: every file matches its manifest.
    report["verified"] = not any(r["problems"] for r in report["roles"].values())
    report["problems"] = problems
    report["ok"] = not problems
    return report


def inspect_root(root: Path) -> dict[str, Any]:
    """One entry per checkpoint folder of a run's checkpoints/ (sizes checked, not re-hashed: fast)."""
    reg = CheckpointRegistry(root)
    steps = []
    for step, folder in sorted(reg.step_folders().items()):
        marker, _ = read_marker(folder)
        reason = reg.check_complete(folder, full=False)
        if reason is None:
            status = "complete"
        elif marker is not None:
            status = "damaged"
        else:
            status = "unmarked" if not (folder / COMPLETE).exists() else "bad marker"
        steps.append({
            "step": step,
            "path": str(folder),
            "status": status,
            "complete": reason is None,
            "problem": reason,
            "committed": marker.get("time") if marker is not None and isinstance(marker.get("time"), str) else None,
            "roles": list(marker["roles"]) if marker is not None else [],
            "bytes": sum(f["bytes"] for f in _files(folder)),
        })  # fmt: skip
    leftovers = sorted(c.name for c in root.iterdir() if WORK_DIR.match(c.name))
    named, latest_problem = parse_latest_file(reg.latest_file)
    problems = []
    # A missing latest file is normal before the first commit; one that exists must hold a step number.
    if named is None and (reg.latest_file.exists() or steps):
        problems.append(f"{latest_problem}; resume_mode auto falls back to the newest intact checkpoint")
    return {
        "kind": "checkpoints",
        "path": str(root),
        "latest_file_step": named,
        "latest_file_problem": latest_problem,
        "checkpoints": steps,
        "leftovers": leftovers,
        "problems": problems,
        "ok": not problems,
    }


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _layout(layout: dict[str, Any] | None) -> str:
    if not layout:
        return "?"
    parts = [f"{short}={layout.get(key, '?')}" for short, key in _LAYOUT_KEYS]
    return " ".join(parts) + f" (world {layout.get('world_size', '?')})"


def _table(rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def format_step(report: dict[str, Any]) -> str:
    """The human-readable form of `inspect_step`."""
    lines = [f"checkpoint  {report['path']}", f"step        {report['step']}"]
    if report["complete"]:
        lines.append(f"status      complete ({COMPLETE} marker, committed {report.get('committed')})")
    elif report["staging"]:
        lines.append(
            "status      INCOMPLETE (a save in progress or cut short; never loaded; the next run removes it)"
        )
    else:
        lines.append(
            f"status      INCOMPLETE (no valid {COMPLETE} marker; never loaded by resume_mode auto; kept)"
        )
    named = report["latest_file_step"]
    lines.append(
        "latest      " + ("yes: " if report["is_latest"] else "no: ")
        + (f"{LATEST_FILE} names step {named}" if named is not None else report["latest_file_problem"])
    )  # fmt: skip
    if report["complete"]:
        run = report.get("run_record")
        lines.append(
            f"run record  config sha256 {str(run['config_sha256'])[:16]}, {run['data_files']} data file(s) (a "
            "resume is compared with it)"
            if run
            else "run record  none (an older rlplan's checkpoint: a resume is compared with config.yaml)"
        )
    n_files = sum(len(r.get("files", [])) for r in report["roles"].values())
    lines.append(f"size        {_size(report['bytes'])} in {n_files} files")
    role_problems = [p for r in report["roles"].values() for p in r["problems"]]
    if role_problems:
        lines.append(
            f"verified    FAILED: {role_problems[0]}"
            + (f" (+{len(role_problems) - 1} more)" if len(role_problems) > 1 else "")
        )
    else:
        counts = [r.get("manifest", {}) for r in report["roles"].values()]
        total = {k: sum(c.get(k, 0) for c in counts) for k in ("files", "crc32", "sha256", "sampled_sha256")}
        how = f"sizes; crc32 of every byte of {total['crc32']}"
        if total["sha256"] or total["sampled_sha256"]:  # a manifest of an older rlplan version
            how += f", sha256 of {total['sha256']}, sampled sha256 of {total['sampled_sha256']}"
        lines.append(f"verified    ok: {total['files']} files match their manifests ({how})")
    lines.append("")
    rows = [["role", "contents", "saved with", "optimizer state", "dtype", "model", "saved at"]]
    for name, r in report["roles"].items():
        arch = r.get("arch") or {}
        model = (
            f"{arch.get('num_layers')} layers, hidden {arch.get('hidden_size')}, vocab {arch.get('vocab_size')}"
            + (", value head" if r.get("value_head") else "")
            if arch
            else "?"
        )
        optim = "-"
        if r.get("optimizer_sharding"):
            kind = "distributed" if r.get("distributed_optimizer") else "plain"
            optim = f"{kind}, {r['optimizer_sharding']}"
        rows.append([
            name,
            ", ".join(str(c) for c in r.get("contents") or []) or "?",
            _layout(r.get("layout")),
            optim,
            str(r.get("params_dtype") or "?"),
            model,
            str(r.get("saved_at") or "?"),
        ])  # fmt: skip
    lines += _table(rows)
    for name, r in report["roles"].items():
        if r.get("meta_error"):
            lines.append(f"{name}: {r['meta_error']}")
        if not r.get("files"):
            continue
        lines += ["", f"{name} files ({_size(r['bytes'])})"]
        lines += _table([[_size(f["bytes"]).rjust(10), f["path"]] for f in r["files"]], indent="  ")
    return "\n".join(lines)


def format_root(report: dict[str, Any]) -> str:
    """The human-readable form of `inspect_root`."""
    named = report["latest_file_step"]
    latest = f"step {named} (*) ({LATEST_FILE})" if named is not None else report["latest_file_problem"]
    lines = [f"checkpoints {report['path']}", f"latest      {latest}", ""]
    if report["checkpoints"]:
        rows = [["step", "status", "committed", "size", "roles"]]
        for c in report["checkpoints"]:
            rows.append([str(c["step"]) + (" *" if c["step"] == named else ""), c["status"],
                         str(c["committed"] or "-"), _size(c["bytes"]), ", ".join(c["roles"]) or "-"])  # fmt: skip
        lines += _table(rows)
        lines += [f"step {c['step']}: {c['problem']}" for c in report["checkpoints"] if c["problem"]]
    else:
        lines.append("no global_step_N folders")
    if report["leftovers"]:
        lines += [
            "",
            "left by interrupted saves (removed when the run restarts): " + ", ".join(report["leftovers"]),
        ]
    return "\n".join(lines)


def _step_error(report: dict[str, Any]) -> CheckpointError:
    """The one-line error for a checkpoint that cannot be loaded: damaged files first, else incomplete."""
    if report["kind"] == "checkpoints":
        return CheckpointError(
            f"{report['problems'][0]}; write the step to resume from into it (e.g. `echo "
            f"{_newest_complete(report)} > {Path(report['path']) / LATEST_FILE}`) or delete it"
        )
    damaged = [p for r in report["roles"].values() for p in r["problems"]]
    if report["complete"] and damaged and REFUSED in damaged[0]:
        return CheckpointError(damaged[0])  # a forgery, not damage: its message says what to do
    if report["complete"] and damaged:
        return damaged_error(report["path"], damaged)
    problems = report["problems"]
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return CheckpointError(
        f"{problems[0]}{more}; it cannot be loaded: use an earlier complete checkpoint (`rltrain inspect "
        f"{Path(report['path']).parent}` lists them; trainer.resume_mode: auto picks the newest intact one)"
    )


def _newest_complete(report: dict[str, Any]) -> str:
    steps = [c["step"] for c in report["checkpoints"] if c["complete"]]
    return str(steps[-1]) if steps else "N"


def run_inspect(path: str, as_json: bool) -> int:
    loc = locate(path)
    report = inspect_root(loc.folder) if loc.kind == "root" else inspect_step(loc.folder, loc.role)
    print(
        json.dumps(report, indent=2)
        if as_json
        else (format_root if loc.kind == "root" else format_step)(report)
    )
    if not report["ok"]:
        print(f"error: {_step_error(report)}", file=sys.stderr)
        return EXIT_INVALID
    return EXIT_OK


# ============================================================================================ export
def _run_model_paths(step_dir: Path) -> tuple[Path | None, Path | None, str]:
    """(model folder, tokenizer folder, where that came from) of the run that wrote the checkpoint."""
    out_dir = step_dir.parent.parent
    model: dict[str, Any] | None = None
    source = ""
    if (out_dir / "config.yaml").is_file():
        import yaml

        from rlconf.errors import ConfigError
        from rlconf.files import MAX_MANIFEST_BYTES, read_text

        with contextlib.suppress(ConfigError, yaml.YAMLError):
            text = read_text(out_dir / "config.yaml", MAX_MANIFEST_BYTES, key="", what="run config")
            data = yaml.safe_load(text)
            model = data.get("model") if isinstance(data, dict) else None
            source = str(out_dir / "config.yaml")
    if model is None and (out_dir / "plan.json").is_file():
        plan, _ = _read_json(out_dir / "plan.json")
        if isinstance(plan, dict) and isinstance(plan.get("config"), dict):  # a plan.json of before 2026-12
            model = plan["config"].get("model")
            source = str(out_dir / "plan.json")
        elif (
            isinstance(plan, dict)
            and isinstance(plan.get("tokenizer"), dict)
            and isinstance(plan.get("models"), list)
        ):
            policy = next(
                (m for m in plan["models"] if isinstance(m, dict) and m.get("name") == "policy"), {}
            )
            model = {"path": policy.get("weights"), "tokenizer_path": plan["tokenizer"].get("path")}
            source = str(out_dir / "plan.json")
    if not isinstance(model, dict):
        return None, None, ""
    path = model.get("path") if isinstance(model.get("path"), str) else None
    tok = model.get("tokenizer_path") if isinstance(model.get("tokenizer_path"), str) else path
    return (Path(path) if path else None), (Path(tok) if tok else None), source


@contextlib.contextmanager
def _cpu_world() -> Any:
    """A gloo world of one at TP = PP = 1 (the caller's, when it already has exactly that)."""
    import torch
    from megatron.core import parallel_state

    from rltrain.megatron.parallel import GroupSizes, destroy_parallel, free_port, init_parallel, release_port

    if torch.distributed.is_initialized():
        layout_ok = (
            torch.distributed.get_world_size() == 1
            and parallel_state.model_parallel_is_initialized()
            and parallel_state.get_tensor_model_parallel_world_size() == 1
            and parallel_state.get_pipeline_model_parallel_world_size() == 1
        )
        if not layout_ok:
            raise CheckpointError("export-hf runs in a process of its own (a torch.distributed world of one)")
        yield
        return
    port = free_port()
    try:
        init_parallel(GroupSizes(), "cpu", rank=0, world_size=1, master_addr="127.0.0.1", master_port=port)
    finally:
        release_port(port)
    try:
        yield
    finally:
        destroy_parallel()


def _require_loadable(step_dir: Path, role: str) -> dict[str, Any]:
    """The role's meta.json once the checkpoint is complete and the role's files match its manifest."""
    marker, why = read_marker(step_dir)
    if marker is None:
        raise CheckpointError(
            f"{why}; export a complete checkpoint instead (`rltrain inspect {step_dir.parent}` lists them)"
        )
    if role not in marker["roles"]:
        raise CheckpointError(
            f"{step_dir} has no role {role} (it holds {', '.join(marker['roles'])}); pass --role with one of those"
        )
    problems = verify_manifest(step_dir / role, full=True)
    if problems:
        raise damaged_error(step_dir / role, problems)
    from rltrain.checkpoint.safe_load import check_role

    check_role(step_dir / role)  # a file that would run code: refused before anything is built
    meta, meta_error = _read_json(step_dir / role / META)
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_error}; export another checkpoint")
    return meta


# Names that make a folder a run folder (rltrain's output_dir) or part of a checkpoint. config.yaml counts for
# OUT and what is inside it (what --overwrite would delete), not for the folders above OUT: a project folder
# with its own config.yaml is no run.
_RUN_FILES = ("metrics.jsonl", "plan.json", LATEST_FILE, COMPLETE, MANIFEST, META)
# More entries than an export folder ever holds: past this, OUT is not scanned further and is refused.
_SCAN_LIMIT = 10_000


def _run_marker(folder: Path, with_config: bool) -> str | None:
    """What makes `folder` a run folder or (part of) a checkpoint, or None."""
    if STEP_DIR.match(folder.name) or WORK_DIR.match(folder.name):
        return f"it is named {folder.name}"
    for name in (*_RUN_FILES, "config.yaml") if with_config else _RUN_FILES:
        if (folder / name).is_file():
            return f"it holds {name}"
    if (folder / DIST_DIR).is_dir():
        return f"it holds {DIST_DIR}/"
    ckpts = folder / "checkpoints"
    with contextlib.suppress(OSError):
        if ckpts.is_dir() and (
            (ckpts / LATEST_FILE).exists() or any(_is_step_name(c.name) for c in ckpts.iterdir())
        ):
            return "it holds checkpoints/"
        step = next((c.name for c in folder.iterdir() if c.is_dir() and _is_step_name(c.name)), None)
        if step is not None:
            return f"it holds {step}/"
    return None


def _check_out_is_no_run(out: Path, step_dir: Path) -> None:
    """Refuse an OUT that is, contains or lies inside a run folder or a checkpoint (--overwrite would delete it,
    or the export would land among the run's files), whatever --overwrite says."""
    real_out, real_step = out.resolve(), step_dir.resolve()
    run_dir = real_step.parent.parent
    fix = (
        f"; export-hf never writes there, with or without --overwrite: choose a new folder outside the run, "
        f"e.g. {run_dir.parent / f'{run_dir.name}-hf-{real_step.name}'}"
    )
    why = _run_marker(real_out, with_config=True) if real_out.is_dir() else None
    if why is not None:
        raise CheckpointError(f"{out} is a run folder or checkpoint ({why}){fix}")
    if real_out.is_relative_to(real_step):
        raise CheckpointError(f"{out} is inside the checkpoint being exported ({step_dir}){fix}")
    for folder in real_out.parents:
        why = _run_marker(folder, with_config=False)
        if why is not None:
            raise CheckpointError(
                f"{out} is inside {folder}, which is a run folder or checkpoint ({why}){fix}"
            )
    if real_step.is_relative_to(real_out):
        raise CheckpointError(f"{out} holds the checkpoint being exported ({step_dir}){fix}")
    if not real_out.is_dir():
        return
    seen = 0
    for dirpath, dirs, files in os.walk(real_out):
        seen += len(dirs) + len(files)
        if seen > _SCAN_LIMIT:
            raise CheckpointError(
                f"{out} holds more than {_SCAN_LIMIT} files and folders: not an export folder{fix}"
            )
        why = _run_marker(Path(dirpath), with_config=True)
        if why is not None:
            raise CheckpointError(f"{out} holds a run folder or checkpoint ({dirpath}: {why}){fix}")


def _prepare_out(out: Path, overwrite: bool) -> Path:
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} is a file; give a folder for the Hugging Face model")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(f"{out} is not empty; choose a new folder or pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished export into place (a crash before this leaves only a hidden .tmp- folder)."""
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def export_hf(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    role: str = "actor",
    overwrite: bool = False,
    merge: bool = False,
) -> dict[str, Any]:
    """Write a Hugging Face model folder from a checkpoint; returns what was written (for the CLI summary).
    A LoRA checkpoint gives a PEFT adapter folder, or with `merge` the model with its adapters merged."""
    loc = locate(checkpoint)
    if loc.kind == "root":
        steps = CheckpointRegistry(loc.folder).complete_steps()
        pick = f"{loc.folder}/global_step_{steps[-1]}" if steps else f"{loc.folder}/global_step_N"
        raise CheckpointError(f"{loc.folder} is a checkpoints folder; name one checkpoint in it, e.g. {pick}")
    role = loc.role or role
    step_dir = loc.folder
    meta = _require_loadable(step_dir, role)
    if meta.get("value_head"):
        raise CheckpointError(
            f"{step_dir / role} is a value model (critic): it has no Hugging Face causal-LM form; export the "
            "actor (--role actor)"
        )
    out = Path(out).absolute()
    _check_out_is_no_run(out, step_dir)
    model_dir, tok_dir, source = _run_model_paths(step_dir)
    notes: list[str] = []
    contents = meta["contents"] if isinstance(meta.get("contents"), list) else []
    if merge and not meta.get("lora"):
        raise CheckpointError(
            f"{step_dir / role} is not a LoRA checkpoint: --merge is for adapters; drop --merge"
        )
    tmp = _prepare_out(out, overwrite)
    try:
        if "model" not in contents:
            if "hf_model" not in contents:
                raise CheckpointError(
                    f"{step_dir / role} holds no model weights (contents: {', '.join(contents)}); export a "
                    f"checkpoint saved with model in {role}.checkpoint.save_contents"
                )
            # Only the HF export was saved: that is already the answer.
            shutil.copytree(step_dir / role / HF_DIR, tmp, dirs_exist_ok=True)
            notes.append(f"copied the checkpoint's {HF_DIR}/ folder (it holds no dist checkpoint)")
        else:
            base = None
            if model_dir is not None and (model_dir / "config.json").is_file():
                base, _ = _read_json(model_dir / "config.json")
            elif model_dir is not None:
                notes.append(f"model.path {model_dir} (from {source}) has no config.json any more: config.json "
                             "is written from the saved architecture")  # fmt: skip
            if meta.get("lora"):
                notes.append(_export_lora(step_dir / role, role, meta, tmp, base, model_dir, merge))
            else:
                _export_dist(step_dir / role, role, meta, tmp, base, model_dir)
        notes += _export_tokenizer(tok_dir, source, meta, tmp)
        normalize_modes(tmp)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = _files(out)
    return {"out": str(out), "role": role, "step_dir": str(step_dir), "files": files, "notes": notes}


def _export_tokenizer(tok_dir: Path | None, source: str, meta: dict[str, Any], out: Path) -> list[str]:
    """Write the tokenizer of the run next to the exported model; returns notes for the summary.

    The run's config (config.yaml / plan.json next to checkpoints/) says which tokenizer it read, else the
    role's meta.json (recorded since the save of the tokenizer kind); a Hugging Face folder's files are copied,
    the built-in character tokenizer is written as Hugging Face files (CharTokenizer.save_pretrained)."""
    saved = meta.get("tokenizer") if isinstance(meta.get("tokenizer"), dict) else None
    if not source and saved is not None:
        if saved.get("kind") == "char":
            tok_dir, source = None, "meta.json"
        elif isinstance(saved.get("path"), str):
            tok_dir, source = Path(saved["path"]), "meta.json"
    if tok_dir is not None and tok_dir.is_dir():
        copied = copy_tokenizer_files(tok_dir, out)
        return [f"tokenizer files from {tok_dir}: {', '.join(copied)}"] if copied else []
    if tok_dir is not None:
        return [f"tokenizer folder {tok_dir} (from {source}) is gone: no tokenizer files copied"]
    if not source:
        return [
            "no config.yaml / plan.json next to checkpoints/ and no tokenizer in meta.json: no tokenizer written"
        ]
    from rltrain.tokenizer import CharTokenizer

    written = CharTokenizer().save_pretrained(out)
    return [f"the built-in character tokenizer, as Hugging Face files: {', '.join(written)}"]


def _export_dist(
    role_dir: Path,
    role: str,
    meta: dict[str, Any],
    out: Path,
    base: dict[str, Any] | None,
    model_dir: Path | None = None,
) -> None:
    """Build the role's model at TP = PP = 1 on the CPU, load its dist checkpoint (resharded), export it
    (with the multi-token prediction layers of `model_dir`, the run's model.path, copied unchanged)."""
    import warnings

    with warnings.catch_warnings():
        # megatron's notes about missing Apex / Transformer Engine: the CPU fallbacks are intended here.
        warnings.simplefilter("ignore")
        import dacite

        from rlconf.arch import ModelArch
        from rlconf.plan.small import export_engine
        from rltrain.checkpoint import load_engine
        from rltrain.device import device_context
        from rltrain.megatron.engine import MegatronEngine
        from rltrain.megatron.hf_weights import export_hf_weights

        try:  # nested sections (rope_scaling) and tuples come back from JSON as dicts and lists
            arch = dacite.from_dict(ModelArch, meta["arch"], config=dacite.Config(cast=[tuple]))
        except (dacite.DaciteError, TypeError, ValueError) as exc:
            raise CheckpointError(
                f"{role_dir / META}: its arch cannot be read ({exc}); export another checkpoint"
            ) from exc
        if arch.num_mtp_layers and (model_dir is None or not model_dir.is_dir()):
            raise CheckpointError(
                f"{role_dir}: the model's {arch.num_mtp_layers} multi-token prediction layer(s) were not trained "
                f"and are exported from its model.path {model_dir}, which is gone: restore that folder to export"
            )
        with _cpu_world():
            # No optimizer: parameters only (a frozen engine has no DDP buffers either).
            engine = MegatronEngine.from_spec(export_engine(arch, meta["params_dtype"]))
            load_engine(engine, role_dir, ("model",), role=role)
            with device_context("cpu"):
                export_hf_weights(engine.chunks, arch, out, base_config=base, mtp_source=model_dir)


def _export_lora(
    role_dir: Path,
    role: str,
    meta: dict[str, Any],
    out: Path,
    base: dict[str, Any] | None,
    model_dir: Path | None,
    merge: bool,
) -> str:
    """A LoRA checkpoint: the base model (model.path, or the saved random-init base) with the saved adapters,
    written as a PEFT adapter folder or, with `merge`, as the merged model. Returns a note for the summary."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import dacite

        from rlconf.arch import ModelArch
        from rlconf.lora import LoraPlan
        from rlconf.plan.small import export_engine
        from rltrain.checkpoint import load_engine
        from rltrain.device import device_context
        from rltrain.megatron.engine import MegatronEngine
        from rltrain.megatron.hf_weights import export_hf_weights
        from rltrain.megatron.lora import merged_weights
        from rltrain.megatron.peft_io import save_peft_adapter

        cast = dacite.Config(cast=[tuple])
        try:
            arch = dacite.from_dict(ModelArch, meta["arch"], config=cast)
            lora = dacite.from_dict(LoraPlan, meta["lora"], config=cast)
        except (dacite.DaciteError, TypeError, ValueError, KeyError) as exc:
            raise CheckpointError(f"{role_dir / META}: its arch / lora cannot be read ({exc})") from exc
        adapters_only = bool(meta.get("lora_adapters_only"))
        if adapters_only and (model_dir is None or not (model_dir / "config.json").is_file()):
            raise CheckpointError(
                f"{role_dir} holds the LoRA adapters only; their base model (model.path {model_dir}) is gone: "
                "restore that folder to export"
            )
        weights = str(model_dir) if adapters_only else None
        with _cpu_world():
            engine = MegatronEngine.from_spec(export_engine(arch, meta["params_dtype"], weights, lora))
            load_engine(engine, role_dir, ("model",), role=role)
            with device_context("cpu"):
                if merge:
                    with merged_weights(engine.chunks, arch):
                        export_hf_weights(engine.chunks, arch, out, base_config=base, mtp_source=model_dir)
                    return f"LoRA rank {lora.rank} merged into the base weights (W + alpha / r B A)"
                save_peft_adapter(engine.chunks, lora, arch, out, str(model_dir) if model_dir else None)
    where = (
        f"on {model_dir}" if model_dir else "(base: a random-init model; export --merge for a whole model)"
    )
    return f"PEFT LoRA adapter (rank {lora.rank}, {len(lora.modules)} linears) {where}"


def run_export(checkpoint: str, out: str, role: str, overwrite: bool, merge: bool = False) -> int:
    t0 = time.perf_counter()
    result = export_hf(checkpoint, out, role=role, overwrite=overwrite, merge=merge)
    total = sum(f["bytes"] for f in result["files"])
    print(f"exported {result['role']} of {result['step_dir']} to {result['out']} "
          f"({len(result['files'])} files, {_size(total)}, {time.perf_counter() - t0:.1f} s)")  # fmt: skip
    for note in result["notes"]:
        print(f"  note: {note}")
    return EXIT_OK


# ============================================================================================ CLI
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rltrain", description="Checkpoint tools of rltrain.")
    sub = parser.add_subparsers(dest="command", required=True)
    ins = sub.add_parser(
        "inspect",
        help="what a checkpoint holds, and whether it is complete and intact",
        description="Show a checkpoint: step, roles, contents, saved layout, files and sizes, completeness, "
        "manifest verification, commit time. Exit 2 when it is incomplete or damaged.",
    )
    ins.add_argument(
        "checkpoint", help="checkpoints/global_step_N (or its role folder), or a checkpoints/ folder"
    )
    ins.add_argument("--json", action="store_true", help="print the report as JSON")
    exp = sub.add_parser(
        "export-hf",
        help="write a Hugging Face model folder from a checkpoint",
        description="Write safetensors + config.json (+ the run's tokenizer files) loadable by "
        "transformers.AutoModelForCausalLM.from_pretrained, from a checkpoint saved with or without hf_model.",
    )
    exp.add_argument("checkpoint", help="checkpoints/global_step_N, or its actor folder")
    exp.add_argument("out", help="output folder (new or empty)")
    exp.add_argument("--role", default="actor", help="role folder to export (default: actor)")
    exp.add_argument("--overwrite", action="store_true", help="replace OUT when it is not empty")
    exp.add_argument(
        "--merge",
        action="store_true",
        help="LoRA checkpoints: write the model with its adapters merged (default: a PEFT adapter folder)",
    )
    return parser


def main(argv: Sequence[str]) -> int:
    """`rltrain inspect ...` / `rltrain export-hf ...`; 0 ok, 2 a checkpoint or argument problem."""
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2), already printed
        return int(exc.code or 0)
    try:
        if args.command == "inspect":
            return run_inspect(args.checkpoint, args.json)
        return run_export(args.checkpoint, args.out, args.role, args.overwrite, args.merge)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except BrokenPipeError:  # `rltrain inspect ... | head`: not an error (run_guarded exits 0)
        raise
    except OSError as exc:  # unreadable files or folders: the message names the file
        print(f"error: {exc}; check the path and its permissions", file=sys.stderr)
        return EXIT_INVALID


__all__ = [
    "Located",
    "export_hf",
    "format_root",
    "format_step",
    "inspect_root",
    "inspect_step",
    "locate",
    "main",
]
