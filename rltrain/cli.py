"""The `rltrain` command: `rltrain PRESET [--config FILE.yaml] [--dotted.field VALUE ...] [--dry-run]`,
or `rltrain --config FILE.yaml [...]` for a complete config (an imported verl run, a file of your own).

Precedence: flags > file > preset > dataclass defaults. A file without `preset:` run without a PRESET is
taken as complete: the dataclass defaults fill what it does not set, no preset's values slip in. Every config
field is a flag (rltrain.flags reads them with the loader's own checks; rltrain.cli_help writes `--help` from
the field docstrings). The whole config is validated and the plan compiled before anything starts. This
module stays light (no torch, ray or megatron imports) so `rltrain --help` is quick; the controller is
imported only to run.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from rlconf.cli import EXIT_INVALID, EXIT_OK, run_guarded
from rlconf.config import RLConfig
from rlconf.errors import ConfigError, Issue, error

USAGE = (
    ("rltrain PRESET [--config FILE.yaml] [--section.field VALUE ...] [--dry-run]", ""),
    ("rltrain --config FILE.yaml [--section.field VALUE ...] [--dry-run]",
     "a complete config (its own `preset:` line, if any, is honoured)"),
    ("rltrain PRESET --help [SECTION | FIELD | all]",
     "every flag with the preset's value; a section or a field in full"),
    ("rltrain --list", "the presets"),
    ("rltrain inspect CHECKPOINT [--json]", "what a checkpoint holds, complete or not"),
    ("rltrain export-hf CHECKPOINT OUT [--merge]",
     "Hugging Face weights from a checkpoint (LoRA: a PEFT adapter folder, or --merge for the merged model)"),
)  # fmt: skip
ABOUT = (
    "Runs RL fine-tuning (PPO/GRPO) on megatron-core. Precedence: flags > --config file > preset > "
    "defaults. --dry-run prints the resolved config and the trainer plan and exits."
)
HELP_FLAGS = ("-h", "--help")


@dataclass(frozen=True)
class Command:
    """An `rltrain PRESET ...` / `rltrain --config FILE ...` command line, split into rltrain's own options
    and the config flags."""

    preset: str | None
    config_file: str | None
    dry_run: bool
    help: bool
    help_topic: str | None
    flags: tuple[str, ...]

    @property
    def prog(self) -> str:
        return f"rltrain {self.preset}" if self.preset else f"rltrain --config {self.config_file}"


def split_command(argv: Sequence[str]) -> Command:
    """rltrain's own options (--config FILE, --dry-run, -h / --help [TOPIC]) apart from the config flags;
    raises ConfigError for a --config without a FILE or a command with neither a PRESET nor --config."""
    has_preset = bool(argv) and not argv[0].startswith("-")
    preset, rest = (argv[0], list(argv[1:])) if has_preset else (None, list(argv))
    config_file, dry_run, help_, topic, flags = None, False, False, None, []
    i = 0
    while i < len(rest):
        token = rest[i]
        if token == "--dry-run":
            dry_run = True
        elif token in HELP_FLAGS or token.startswith("--help="):
            help_ = True
            if "=" in token:
                topic = token.split("=", 1)[1]
            elif i + 1 < len(rest) and not rest[i + 1].startswith("-"):
                topic, i = rest[i + 1], i + 1
        elif token == "--config" or token.startswith("--config="):
            if "=" in token:
                config_file = token.split("=", 1)[1]
            elif i + 1 < len(rest):
                config_file, i = rest[i + 1], i + 1
            else:
                raise ConfigError(
                    [error("", "--config needs a FILE", "write --config path/to/run.yaml", "usage")]
                )
        else:
            flags.append(token)
        i += 1
    if preset is None and config_file is None:
        raise ConfigError([error("", "expected a PRESET or --config FILE first", "run `rltrain --list` for "
                                 "the presets, or `rltrain --config run.yaml`", "usage")])  # fmt: skip
    return Command(preset, config_file, dry_run, help_, topic, tuple(flags))


def parse_args(argv: Sequence[str]) -> tuple[RLConfig, bool]:
    """(config, dry_run) from `PRESET [--config FILE] [flags] [--dry-run]` or `--config FILE [flags]
    [--dry-run]` (no preset: the file, with its own `preset:` if it names one); raises ConfigError.

    A flag that cannot be read (an unknown path, a value its field cannot take) is reported first, with
    the command line as the source, in the words `rlconf validate` uses for the same value in a file. Then
    what `rlconf validate` reports, all at once: the file's structural errors (its bad values are left at
    the preset's so the rest can still be checked) and every rule on the result with the flags applied,
    the filesystem rules included (the run reads and writes those paths).
    """
    from rlconf.validate import check_config

    command = split_command(argv)
    config, file_issues = _config_of(command)
    source = command.config_file if command.config_file is not None else "command line"
    issues = list(file_issues) + list(check_config(config, filesystem=True))
    if any(i.severity == "error" for i in issues):
        raise ConfigError(issues, source)
    for w in issues:
        print(w.format(), file=sys.stderr)
    return config, command.dry_run


def _config_of(command: Command, *, strict: bool = True) -> tuple[RLConfig, tuple[Issue, ...]]:
    """The command's config (preset, then file, then flags) and the file's structural issues. `strict`:
    raise the flags' issues (source: command line); else leave those values at the file's / preset's."""
    from presets import PRESETS
    from rlconf.load import build_from_sources
    from rltrain.flags import apply_flags

    base, file_issues, _ = build_from_sources(command.config_file, preset=command.preset, presets=PRESETS)
    config, flag_issues = apply_flags(base, command.flags)
    if strict and flag_issues:
        raise ConfigError(flag_issues, "command line")
    return config, file_issues


def _print_help(command: Command) -> int:
    from rltrain.cli_help import preset_help

    config, _ = _config_of(command, strict=False)  # help shows what it can; the run reports the rest
    print(preset_help(command.prog, config, command.help_topic), end="")
    return EXIT_OK


def _run(argv: Sequence[str]) -> int:
    from rltrain.device import configure_process_env

    if argv and argv[0] in ("inspect", "export-hf"):  # checkpoint tools: `rltrain inspect --help`
        from rltrain.checkpoint.tools import main as checkpoint_tool

        configure_process_env("cpu")  # the tools build models on the CPU

        return checkpoint_tool(argv)
    from presets import PRESETS

    if not argv or argv[0] in HELP_FLAGS:
        from rltrain.cli_help import general_help

        text = general_help(USAGE, ABOUT, {p.name: p.description for p in PRESETS.values()})
        # A bare `rltrain` is a usage error (a script that forgot its arguments must not look successful).
        print(text, end="", file=sys.stdout if argv else sys.stderr)
        return EXIT_OK if argv else EXIT_INVALID
    if argv[0] == "--list":
        for p in PRESETS.values():
            print(f"{p.name:26s} {p.description}")
        return EXIT_OK
    if argv[0].startswith("-") and argv[0] != "--config" and not argv[0].startswith("--config="):
        raise ConfigError([error("", f"expected a PRESET or --config FILE first, got {argv[0]}",
                                 "run `rltrain --list` for the presets, or `rltrain --config run.yaml`", "usage")])  # fmt: skip
    command = split_command(argv)
    if command.help:
        return _print_help(command)
    config, dry_run = parse_args(argv)

    from rlconf.plan import compile_plan, format_plan

    plan = compile_plan(config)
    if dry_run:
        from rlconf.render import render_config
        from rltrain.preflight import check_start

        checked = check_start(plan)  # what a run checks before writing anything (the cluster, the disk)
        print("# resolved config")
        print(render_config(config), end="")
        print("\n# trainer plan")
        print(format_plan(plan), end="")
        print("\n# checked before a run writes anything")
        print("".join(f"  {line}\n" for line in checked), end="")
        return EXIT_OK
    # Before torch is imported (by the controller): keep an installed torch_npu from loading on cpu / cuda
    # runs (rltrain.device.worker_env); a local Ray cluster hands the setting on to its workers.
    configure_process_env(config.cluster.device)
    from rltrain.quiet import quiet_driver

    if note := quiet_driver(config.cluster.device):  # third-party noise filtered; what it meant, said once
        print(note, file=sys.stderr, flush=True)
    from rlconf.run_config import ConfigDocument
    from rltrain.controller import run_training

    return run_training(plan, ConfigDocument.of(config))


def _source_of(argv: Sequence[str]) -> str:
    """What an error raised without a source came from (docs/troubleshooting.md: the file, preset:NAME or
    command line): the --config file when there is one, else the command line when it sets anything beyond
    the preset (or names no known preset), else the preset."""
    from presets import PRESETS

    for i, token in enumerate(argv):
        if token.startswith("--config="):
            return token.split("=", 1)[1]
        if token == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    if argv and argv[0] in PRESETS and all(t == "--dry-run" for t in argv[1:]):
        return f"preset:{argv[0]}"
    return "command line"


def _with_source(argv: Sequence[str]) -> int:
    try:
        return _run(argv)
    except ConfigError as exc:
        if exc.source:
            raise
        raise ConfigError(exc.issues, _source_of(argv)) from None


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    return run_guarded(lambda: _with_source(args))


if __name__ == "__main__":
    sys.exit(main())
