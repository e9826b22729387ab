"""The profile and logging sections of the configuration (re-exported by rlconf.config, where RLConfig holds
them), with the names of the profiled roles and tools."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rlconf.profile_vocab import (
    NpuProfileOptions,
    NsysProfileOptions,
    ProfileTool,
    Role,
    TorchProfileOptions,
)


@dataclass(frozen=True)
class ProfileConfig:
    """Per-role profiling."""

    tool: ProfileTool = "none"
    """none, torch, nsys (CUDA) or npu (Ascend)."""
    discrete: bool = True
    """true: one profile per role call (save_path/step_N/ROLE); false: one per step (save_path/step_N/e2e)."""
    steps: tuple[int, ...] = ()
    """Steps to profile (steps count from 1)."""
    ranks: tuple[int, ...] = (0,)
    """Ranks to profile, counted within each role's world (rank r of the actor, of the critic, ...)."""
    all_ranks: bool = False
    """Profile every rank (ranks is ignored)."""
    roles: tuple[Role, ...] = ()
    """Roles to profile; empty means all."""
    save_path: str = "profile"
    """Output folder; a relative path is under trainer.output_dir."""
    torch: TorchProfileOptions = field(default_factory=TorchProfileOptions)
    """Options used when tool = torch."""
    npu: NpuProfileOptions = field(default_factory=NpuProfileOptions)
    """Options used when tool = npu."""
    nsys: NsysProfileOptions = field(default_factory=NsysProfileOptions)
    """Options used when tool = nsys."""


@dataclass(frozen=True)
class LoggingConfig:
    """Metrics and logs."""

    backends: tuple[Literal["console", "jsonl", "tensorboard", "wandb"], ...] = ("console", "jsonl")
    """Where metrics go (jsonl writes trainer.output_dir/metrics.jsonl)."""
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level of the controller and workers."""
    plot_reward: bool = True
    """Write reward_curve.png to trainer.output_dir at the end of the run."""
    val_generations: int = 0
    """Validation responses to record at each validation (prompt, response, ground truth, score): the same
    rows every time (a choice fixed by trainer.seed), so a reader follows them through training; appended to
    trainer.output_dir/val_generations.jsonl, and a table in wandb / text in tensorboard where those
    backends log. 0: none (verl's trainer.log_val_generations)."""
    rollout_data_dir: str | None = None
    """Folder for every training step's generations, STEP.jsonl, one line per response (input, output, gts,
    score, step, data_source: verl's trainer.rollout_data_dir format); a relative path is under
    trainer.output_dir; null: none written."""
    validation_data_dir: str | None = None
    """Folder for every validation's generations, STEP.jsonl (step 0: before training), as
    rollout_data_dir; null: none written (verl's trainer.validation_data_dir)."""
