"""The `rltrain` command: `rltrain PRESET [--config FILE.yaml] [--dotted.field VALUE ...] [--dry-run]`,
or `rltrain --config FILE.yaml [...]` for a complete config (an imported verl run, a file of your own).

Precedence: flags > file > preset > dataclass defaults. A file without `preset:` run without a PRESET is
taken as complete: the dataclass defaults fill what it does not set, no preset's values slip in. Flags are parsed by tyro from the config
dataclasses (help text is the field docstrings); every field is a flag. The whole config is validated and
the plan compiled before anything starts. This module stays light (no torch, ray or megatron imports) so
`rltrain --help` is quick; the controller is imported only to run.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import Any

from rlconf.cli import EXIT_INVALID, EXIT_OK, run_guarded
from rlconf.config import RLConfig
from rlconf.errors import ConfigError, Issue, error
from rlconf.fields import get_path, iter_leaves, leaf_paths

USAGE = """usage: rltrain PRESET [--config FILE.yaml] [--section.field VALUE ...] [--dry-run]
       rltrain --config FILE.yaml [--section.field VALUE ...] [--dry-run]
                                 a complete config (its own `preset:` line, if any, is honoured)
       rltrain PRESET --help     every flag, with the preset's values as defaults
       rltrain --list            the presets
       rltrain inspect CHECKPOINT [--json]       what a checkpoint holds, complete or not
       rltrain export-hf CHECKPOINT OUT          Hugging Face weights from a checkpoint (LoRA: a PEFT
                                                 adapter folder, or --merge for the merged model)

Runs RL fine-tuning (PPO/GRPO) on megatron-core. Precedence: flags > --config file > preset > defaults.
--dry-run prints the resolved config and the trainer plan and exits.
"""

_OWN_FLAGS = {"--config", "--dry-run", "--help", "-h"}

RUN_OPTIONS = """run options (rltrain's own; every other flag below sets one config field):
  --config FILE.yaml   overlay this YAML/JSON file on the preset (flags overlay the file); without a
                       PRESET the file is the whole config (dataclass defaults under it)
  --dry-run            check everything a run checks before it writes anything (every config rule, the
                       files it reads, the length of the paths it writes, free space for a checkpoint, and
                       the Ray cluster at cluster.ray_address / RAY_ADDRESS: reachable, enough nodes; with
                       no address only that the plan fits one node), print the config and the plan, exit

Precedence: flags > --config file > preset > defaults. Check a file alone with `rlconf validate FILE`."""


def _join_lines(text: str) -> str:
    """A field docstring as one paragraph per blank-line-separated block (tyro keeps the break before any
    line that does not start with a letter, which leaves `--help` ragged); list items keep their line."""
    paragraphs = []
    for block in text.split("\n\n"):
        lines = [line.strip() for line in block.splitlines() if line.strip()]
        out: list[str] = []
        for line in lines:
            if out and not line.startswith(("- ", "* ")):
                out[-1] += " " + line
            else:
                out.append(line)
        paragraphs.append("\n".join(out))
    return "\n\n".join(paragraphs)


_FLAG = re.compile(r"--[A-Za-z_][\w.\-]*")


def _tyro_issue(text: str) -> Issue:
    """tyro's boxed parse error (its first paragraph) as rlplan's error: path, message, fix, rule."""
    raw = text.splitlines()

    # rich draws the box in unicode, or in ASCII / without borders on a stream it cannot tell the encoding of.
    def separator(line: str) -> bool:
        return set(line.strip()) <= set("─-+│|╭╮╰╯ ")

    title, body = "", []
    for line in raw:
        if separator(line):
            if body:
                break  # the first paragraph under the title ended
            continue
        inner = line.strip().strip("│|╭╮╰╯").strip().strip("─").strip()
        if not title:
            title = inner
        else:
            body.append(inner)
    message = " ".join(body) or title or "cannot read the flags"
    flag = _FLAG.search(message)
    if flag is None:
        return error("", message, "run `rltrain PRESET --help` for every flag and its type", "type")
    message = re.sub(r"^Error parsing --[\w.\-]+[^:]*:\s*", "", message)
    return error(flag.group(0)[2:].replace("-", "_"), f"{flag.group(0)}: {message}",
                 f"give {flag.group(0)} a value of its type (`rltrain PRESET --help` lists each flag's type)",
                 "type")  # fmt: skip


_RUN_OPTIONS_HEAD = RUN_OPTIONS.splitlines()[0]


def _tyro_cli(default: RLConfig, args: Sequence[str], prog: str) -> RLConfig:
    import contextlib
    import io

    import tyro
    from tyro import _strings  # the helptext cleaner tyro applies to every field docstring

    err = io.StringIO()
    joined = getattr(_strings, "remove_single_line_breaks", None)
    if joined is not None:
        # Field docstrings are joined; the run options (the description) are laid out by hand and kept.
        _strings.remove_single_line_breaks = lambda text: joined(text) if _RUN_OPTIONS_HEAD in text else (
            _join_lines(text))  # fmt: skip
    try:
        with contextlib.redirect_stderr(err):
            parsed = tyro.cli(
                RLConfig,
                args=list(args),
                default=default,
                prog=prog,
                description=RUN_OPTIONS,
                use_underscores=True,
                config=(tyro.conf.FlagConversionOff,),
            )
        if err.getvalue():  # anything tyro said on a successful parse is passed on
            print(err.getvalue(), end="", file=sys.stderr)
        return parsed
    except SystemExit as exc:
        if exc.code in (0, None):
            raise
        raise ConfigError([_tyro_issue(err.getvalue())], "command line") from None
    finally:
        if joined is not None:
            _strings.remove_single_line_breaks = joined


def _flag_issues(args: Sequence[str]) -> list[Issue]:
    """Unknown --flags, reported as config paths with a did-you-mean, before tyro sees them."""
    from rlconf.load import unknown_path_issue

    known = set(leaf_paths(RLConfig))
    issues = []
    for token in args:
        if not token.startswith("--") or token in _OWN_FLAGS:
            continue
        name = token[2:].split("=", 1)[0].replace("-", "_")
        if name not in known:
            issues.append(unknown_path_issue(name))
    return issues


_BOOL_WORDS = {"true": "True", "yes": "True", "on": "True", "1": "True",
               "false": "False", "no": "False", "off": "False", "0": "False"}  # fmt: skip


def _normalize_bools(args: Sequence[str]) -> list[str]:
    """YAML spellings users type for flags, in the form tyro takes: booleans (`true`, `no`, ...) become
    True/False, and a YAML list (`--profile.ranks [0, 1]`) becomes separate values."""
    bool_flags = {f"--{leaf.path}" for leaf in iter_leaves(RLConfig) if leaf.type is bool}
    list_flags = {
        f"--{leaf.path}" for leaf in iter_leaves(RLConfig) if getattr(leaf.type, "__origin__", None) is tuple
    }
    out: list[str] = []
    for i, token in enumerate(args):
        prev = args[i - 1] if i else ""
        if prev in list_flags and token.startswith("["):
            from rlconf.load import parse_yaml

            items = parse_yaml(token, source=f"flag {prev}")
            out.extend(str(v) for v in items) if isinstance(items, list) else out.append(token)
        else:
            out.append(token)
    for i, token in enumerate(out):
        name, eq, value = token.partition("=")
        if name in bool_flags:
            if eq:
                out[i] = f"{name}={_BOOL_WORDS.get(value.lower(), value)}"
            elif i + 1 < len(out) and not out[i + 1].startswith("--"):
                out[i + 1] = _BOOL_WORDS.get(out[i + 1].lower(), out[i + 1])
    return out


def config_to_flags(config: RLConfig) -> list[str]:
    """Flags that reproduce `config` from the defaults (only fields that differ are written)."""
    default = RLConfig()
    flags: list[str] = []
    for leaf in iter_leaves(RLConfig):
        value = get_path(config, leaf.path)
        if value == get_path(default, leaf.path):
            continue
        flags.append(f"--{leaf.path}")
        flags.extend(_flag_values(value))
    return flags


def _flag_values(value: Any) -> list[str]:
    if value is None:
        return ["None"]
    if isinstance(value, tuple):
        return [v for item in value for v in _flag_values(item)]
    return [repr(value) if isinstance(value, float) else str(value)]


def parse_args(argv: Sequence[str]) -> tuple[RLConfig, bool]:
    """(config, dry_run) from `PRESET [--config FILE] [flags] [--dry-run]` or `--config FILE [flags]
    [--dry-run]` (no preset: the file, with its own `preset:` if it names one); raises ConfigError.

    Reports what `rlconf validate` reports, all at once: the file's structural errors (its bad values are
    left at the preset's so the rest can still be checked), then every rule on the result with the flags
    applied, the filesystem rules included (the run reads and writes those paths).
    """
    from presets import PRESETS
    from rlconf.load import build_config, build_from_sources, config_to_dict
    from rlconf.validate import check_config

    has_preset = bool(argv) and not argv[0].startswith("-")
    preset, rest = (argv[0], list(argv[1:])) if has_preset else (None, list(argv))
    config_file, dry_run, flags = None, False, []
    i = 0
    while i < len(rest):
        token = rest[i]
        if token == "--dry-run":
            dry_run = True
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
    source = config_file if config_file is not None else "command line"
    if issues := _flag_issues(flags):
        raise ConfigError(issues, "command line")
    flags = _normalize_bools(flags)
    base, file_issues, _ = build_from_sources(config_file, preset=preset, presets=PRESETS)
    prog = f"rltrain {preset} [--config FILE.yaml]" if preset else f"rltrain --config {config_file}"
    config = _tyro_cli(base, flags, prog=f"{prog} [--dry-run]")
    # tyro checked each value's type; the same structural walk as files (finite floats, ...) and the
    # cross-field rules run on the result, so flags and files are held to one standard.
    config, structural = build_config(config_to_dict(config), source=source)
    issues = file_issues + structural + check_config(config, filesystem=True)
    if any(i.severity == "error" for i in issues):
        raise ConfigError(issues, source)
    for w in issues:
        print(w.format(), file=sys.stderr)
    return config, dry_run


def _run(argv: Sequence[str]) -> int:
    from rltrain.device import configure_process_env

    if argv and argv[0] in ("inspect", "export-hf"):  # checkpoint tools: `rltrain inspect --help`
        from rltrain.checkpoint.tools import main as checkpoint_tool

        configure_process_env("cpu")  # the tools build models on the CPU

        return checkpoint_tool(argv)
    from presets import PRESETS

    if not argv or argv[0] in ("-h", "--help"):
        text = USAGE + "\npresets:\n" + "\n".join(f"  {p.name:26s} {p.description}" for p in PRESETS.values())
        # A bare `rltrain` is a usage error (a script that forgot its arguments must not look successful).
        print(text, file=sys.stdout if argv else sys.stderr)
        return EXIT_OK if argv else EXIT_INVALID
    if argv[0] == "--list":
        for p in PRESETS.values():
            print(f"{p.name:26s} {p.description}")
        return EXIT_OK
    if argv[0].startswith("-") and argv[0] != "--config" and not argv[0].startswith("--config="):
        raise ConfigError([error("", f"expected a PRESET or --config FILE first, got {argv[0]}",
                                 "run `rltrain --list` for the presets, or `rltrain --config run.yaml`", "usage")])  # fmt: skip
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
