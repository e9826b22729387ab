"""The checkpoints/ folder of a run, seen from the controller: staging, commit, resume, retention, clean-up.

`CheckpointRegistry` owns `checkpoints/`. `begin(step)` hands out staging folders
(`global_step_N.tmp-<id>/ROLE`), `commit(step)` verifies every role's manifest, writes the `COMPLETE` marker,
renames the staging folder to `global_step_N` (one atomic rename) and only then rewrites
`latest_checkpointed_iteration.txt` (temp file + os.replace). A folder without a well-formed marker is never
loaded by resume_mode auto; `cleanup_incomplete` removes only what is provably a half-written save (staging
folders, interrupted deletes), never a global_step_N folder; `apply_retention` deletes old complete
checkpoints only; `resolve_resume` implements trainer.resume_mode.

So a crash at any point leaves the previous checkpoint and the latest file untouched. The checkpoint folder
must be on a filesystem that every rank and the controller see (one node, or a shared filesystem).
This module uses neither torch nor megatron: the controller never pays for `import megatron.core`.

Resume (`trainer.resume_mode: auto`): the checkpoint committed last (COMPLETE marker mtime, step as the
tie-break), i.e. the latest file's step unless a newer commit happened after the latest file was written (a
crash between the rename and the latest-file update). A user who edits the latest file to an older step
makes it newer than every marker, so that edit is honoured. A checkpoint that fails verification is skipped
with a warning naming the file, and the next one down is used; a malformed latest file, marker or manifest
makes resolution fall back to the newest intact checkpoint with a warning naming the file.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlconf.errors import ConfigError, error
from rltrain.checkpoint.faults import fault_point
from rltrain.checkpoint.manifest import (
    COMPLETE,
    FORMAT,
    LATEST_FILE,
    MANIFEST,
    META,
    STEP_DIR,
    WORK_DIR,
    CheckpointError,
    fsync_dir,
    is_scratch,
    parse_latest_file,
    read_json,
    read_marker,
    verify_manifest,
    write_atomic,
    write_json,
)

if TYPE_CHECKING:
    from rlconf.plan import CheckpointPlan, TrainerPlan

logger = logging.getLogger(__name__)


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
        # What the controller records about the run in every COMPLETE marker (rltrain.run_record): the resume
        # guard compares a resume with the record of the checkpoint it resumes from.
        self.run_record: dict[str, Any] | None = None

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
                saved = read_json(tmp / role / META)["contents"]
                # hf_model is legitimately absent for a value model (no causal-LM form; save_engine warns).
                lacking = [c for c in self.contents[role] if c not in saved and c != "hf_model"]
                if lacking:
                    role_problems.append(f"{tmp / role} lacks {', '.join(lacking)} of the planned save")
            problems += role_problems
        if problems:
            raise CheckpointError(
                f"checkpoint of step {step} is incomplete, not committed: " + "; ".join(problems)
            )
        fault_point("before_complete", step)
        marker = {
            "format": FORMAT,
            "step": step,
            "roles": list(self.roles),
            "contents": {r: list(read_json(tmp / r / META)["contents"]) for r in self.roles},
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "unix_time": time.time(),
        }
        if self.run_record is not None:
            marker["run"] = self.run_record
        write_json(tmp / COMPLETE, marker)
        fault_point("before_rename", step)
        final = self.step_dir(step)
        old = None
        if final.exists():
            old = self.root / f"global_step_{step}.old-{uuid.uuid4().hex[:10]}"
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(self.root)
        del self._staging[step]
        fault_point("before_latest", step)
        write_atomic(self.latest_file, f"{step}\n".encode())
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        logger.info("checkpoint of step %d committed: %s", step, final)
        return final

    def abort(self, step: int) -> None:
        """Drop the staged save of `step` (its workers failed or are gone); nothing published changes. A step
        no longer staged (dropped already, by the stopping driver or its release thread) is left alone."""
        tmp = self._staging.pop(step, None)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    def abort_pending(self) -> None:
        """Drop every staged save not committed (`abort` each pending step)."""
        for step in self.pending_steps():
            self.abort(step)

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
                m = STEP_DIR.match(child.name)
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
        if not STEP_DIR.match(folder.name) and STEP_DIR.match(folder.parent.name):
            folder = folder.parent  # a role folder (global_step_N/actor) names its checkpoint
        m = STEP_DIR.match(folder.name)
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
            fault_point("during_retention", step)
            shutil.rmtree(trash, ignore_errors=True)
            deleted.append(step)
        if deleted:
            fsync_dir(self.root)
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
            if child.is_file() and is_scratch(child) and child.name.startswith(f".{LATEST_FILE}.tmp-"):
                child.unlink(missing_ok=True)
                removed.append(child)
                continue
            if child in staged or not child.is_dir():
                continue
            m = WORK_DIR.match(child.name)
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
            fsync_dir(self.root)
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
