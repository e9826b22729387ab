"""Rules of the run as a whole: seed ranges, the plan's limits, the resume checkpoint, the output folder and the profiler.

Each rule registers itself in rlconf.rules with `@rule(name, fields...)` when this module is imported
(rlconf.validate imports every check module, in the order the docs list the rules).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

from rlconf.checks.limits import MAX_DEVICES, MAX_INT, MAX_TOTAL_STEPS
from rlconf.checks.values import leaves
from rlconf.config import (
    ROLES,
    RLConfig,
)
from rlconf.errors import Issue, error, warning
from rlconf.fields import (
    get_path,
)
from rlconf.plan.roles import (
    present_passes,
    total_devices,
)
from rlconf.rules import rule
from rlconf.run_paths import in_run_folder

SEED_FIELDS = ("trainer.seed", "data.seed", "actor.megatron.seed", "ref.megatron.seed", "critic.megatron.seed",
               "reward.reward_model.megatron.seed")  # fmt: skip
SEED_LIMIT = 2**62
"""Seeds are in [0, SEED_LIMIT): numpy's SeedSequence takes no negative seed, torch.manual_seed no seed of
2**64 or more, and workers add offsets to a seed (megatron: 2718 + rank; rlconf.seeding: rank, step)."""


@rule("seed-range", *SEED_FIELDS)
def seed_range(c: RLConfig) -> Iterator[Issue]:
    """Seeds are whole numbers in [0, 2**62), the range every random generator of the run accepts."""
    for path in SEED_FIELDS:
        value = get_path(c, path)
        if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value < SEED_LIMIT:
            yield error(path, f"seed {value} is outside [0, 2**62)", "use a non-negative seed below 2**62, "
                        "e.g. 1", "seed-range")  # fmt: skip


@rule("plan-limits", "trainer.total_steps", "cluster.nnodes", "cluster.gpus_per_node")
def plan_limits(c: RLConfig) -> Iterator[Issue]:
    """Numbers stay within what the plan can lay out: at most 100,000 steps and 131,072 devices, and no
    integer beyond 2**40 (the plan's step, rank and lr tables are built from them)."""
    if c.trainer.total_steps > MAX_TOTAL_STEPS:
        yield error("trainer.total_steps", f"{c.trainer.total_steps} steps is more than a plan supports "
                    f"({MAX_TOTAL_STEPS:,})", f"use at most {MAX_TOTAL_STEPS:,} steps per run (a longer "
                    "run resumes from its checkpoint with a larger total_steps)", "plan-limits")  # fmt: skip
    if total_devices(c) > MAX_DEVICES:
        yield error("cluster.nnodes", f"{c.cluster.nnodes} x {c.cluster.gpus_per_node} devices is more than a "
                    f"plan supports ({MAX_DEVICES:,})", "check cluster.nnodes and cluster.gpus_per_node",
                    "plan-limits")  # fmt: skip
    for leaf in leaves():
        if leaf.path in SEED_FIELDS or leaf.path == "trainer.total_steps":
            continue  # reported above and by seed-range
        value = get_path(c, leaf.path)
        values = value if isinstance(value, tuple) else (value,)
        for i, v in enumerate(values):
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_INT:
                where = f"{leaf.path}[{i}]" if isinstance(value, tuple) else leaf.path
                yield error(where, f"{v} is too large to plan", f"use a value of at most 2**40 "
                            f"({MAX_INT:,})", "plan-limits")  # fmt: skip


CHECKPOINT_COMPLETE_MARKER = "COMPLETE"
"""The file a complete checkpoint folder holds (rltrain.checkpoint.COMPLETE)."""
_STEP_FOLDER = re.compile(r"^global_step_\d+$")


def _complete_steps(root: str) -> list[int]:
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(
        int(n.rsplit("_", 1)[1])
        for n in names
        if _STEP_FOLDER.match(n) and os.path.isfile(os.path.join(root, n, CHECKPOINT_COMPLETE_MARKER))
    )


@rule("resume-path", "trainer.resume_mode", "trainer.resume_from_path", filesystem=True)
def resume_path(c: RLConfig) -> Iterator[Issue]:
    """With resume_mode resume_path, resume_from_path is a complete checkpoints/global_step_N folder (or a
    role folder in one). The run re-checks every file's digest at start; this catches a wrong path first."""
    t = c.trainer
    if t.resume_mode != "resume_path" or not t.resume_from_path:
        return  # the trainer rule reports a missing path
    folder = os.path.abspath(t.resume_from_path)
    if not _STEP_FOLDER.match(os.path.basename(folder)) and _STEP_FOLDER.match(
        os.path.basename(os.path.dirname(folder))
    ):
        folder = os.path.dirname(folder)  # a role folder (global_step_N/actor) names its checkpoint
    fix = "point it at a checkpoints/global_step_N folder of an earlier run, or use resume_mode: auto"
    # The user may have named the run folder, the checkpoints folder or a sibling step: show what is there.
    for root in (os.path.dirname(folder), folder, os.path.join(folder, "checkpoints")):
        if steps := _complete_steps(root):
            fix += f" (complete checkpoints in {root}: steps {steps})"
            break
    if not os.path.exists(folder):
        problem = f"{t.resume_from_path} does not exist"
    elif not os.path.isdir(folder):
        problem = f"{t.resume_from_path} is a file, not a checkpoint folder"
    elif not _STEP_FOLDER.match(os.path.basename(folder)):
        problem = f"{t.resume_from_path} is not a global_step_N folder"
    elif not os.path.isfile(os.path.join(folder, CHECKPOINT_COMPLETE_MARKER)):
        problem = f"{folder} has no {CHECKPOINT_COMPLETE_MARKER} marker (the save did not finish)"
    else:
        return
    yield error("trainer.resume_from_path", f"cannot resume: {problem}", fix, "resume-path")


def _unwritable_reason(path: str) -> str | None:
    """Why a folder cannot be used (or created) for output, or None when it can."""
    target = os.path.abspath(path)
    if os.path.exists(target):
        if not os.path.isdir(target):
            return f"{path} is not a folder"
        if not os.access(target, os.W_OK | os.X_OK):
            return f"{path} is not writable"
        return None
    parent = os.path.dirname(target)
    while not os.path.exists(parent):  # the nearest existing folder decides whether it can be created
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is a file, so {path} cannot be created"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{path} cannot be created: {parent} is not writable"
    return None


@rule(
    "output-dir", "trainer.output_dir", "profile.save_path", "logging.rollout_data_dir",
    "logging.validation_data_dir", filesystem=True,
)  # fmt: skip
def output_dir(c: RLConfig) -> Iterator[Issue]:
    """trainer.output_dir (and an absolute profile.save_path, the generation folders where they resolve) is
    a writable folder or can be created."""
    if (reason := _unwritable_reason(c.trainer.output_dir)) is not None:
        yield error("trainer.output_dir", f"the run cannot write its outputs: {reason}",
                    "choose a folder you can write to (it is created if missing)", "output-dir")  # fmt: skip
    p = c.profile
    if p.tool != "none" and os.path.isabs(p.save_path) and (reason := _unwritable_reason(p.save_path)):
        yield error("profile.save_path", f"the profiler cannot write: {reason}",
                    "choose a folder you can write to, or a path relative to trainer.output_dir",
                    "output-dir")  # fmt: skip
    for name in ("rollout_data_dir", "validation_data_dir"):
        folder = getattr(c.logging, name)
        if folder and (reason := _unwritable_reason(in_run_folder(c.trainer.output_dir, folder))):
            yield error(f"logging.{name}", f"the run cannot write its generations: {reason}",
                        "choose a folder you can write to, or a path relative to trainer.output_dir",
                        "output-dir")  # fmt: skip


@rule("profile", "profile.*", "cluster.device")
def profile(c: RLConfig) -> Iterator[Issue]:
    """Profile ranks are within the world, steps within the run, roles present, tool options fit the tool."""
    p = c.profile
    world = total_devices(c)
    for i, r in enumerate(p.ranks):
        if not 0 <= r < max(world, 1) and not p.all_ranks:
            yield error(f"profile.ranks[{i}]", f"rank {r} is outside the world of {world} devices",
                        f"use ranks in 0..{world - 1}, or all_ranks: true", "profile")  # fmt: skip
    for i, s in enumerate(p.steps):
        if not 1 <= s <= c.trainer.total_steps:
            yield error(f"profile.steps[{i}]", f"step {s} is outside the run's steps 1..{c.trainer.total_steps}",
                        "steps count from 1", "profile")  # fmt: skip
    present = present_passes(c)
    for i, role in enumerate(p.roles):
        if role not in present:
            yield warning(f"profile.roles[{i}]", f"role {role} does not run in this config, nothing to profile",
                          f"roles of this run: {', '.join(r for r in ROLES if r in present)}", "profile")  # fmt: skip
    if p.tool == "none":
        return
    if not p.steps:
        yield warning("profile.steps", f"tool is {p.tool} but no steps are listed: nothing is profiled",
                      "list steps, e.g. [2, 3]", "profile")  # fmt: skip
    needs = {"nsys": "cuda", "npu": "npu"}
    if p.tool in needs and c.cluster.device != needs[p.tool]:
        yield error("profile.tool", f"{p.tool} profiles {needs[p.tool]} devices, but cluster.device = {c.cluster.device}",
                    "use profile.tool: torch, or the matching device", "profile")  # fmt: skip
    if p.tool == "torch":
        wrong = {"cuda": "cuda", "npu": "npu"}
        for i, act in enumerate(p.torch.activities):
            if (
                act in wrong
                and c.cluster.device != wrong[act]
                and not (act == "cuda" and c.cluster.device == "cpu")
            ):
                yield error(f"profile.torch.activities[{i}]",
                            f"activity {act} needs cluster.device = {wrong[act]}", "remove it", "profile")  # fmt: skip
    from rlconf.config import NpuProfileOptions, NsysProfileOptions, TorchProfileOptions

    for name, default in (
        ("torch", TorchProfileOptions()),
        ("npu", NpuProfileOptions()),
        ("nsys", NsysProfileOptions()),
    ):
        if name != p.tool and getattr(p, name) != default:
            yield warning(f"profile.{name}", f"options for {name} are set but profile.tool = {p.tool}; they are ignored",
                          f"remove profile.{name} or set profile.tool: {name}", "profile")  # fmt: skip
