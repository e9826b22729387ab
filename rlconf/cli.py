"""The `rlconf` tool: validate, show, diff, plan and schema for rlplan configs, without touching a GPU.

A command layer: it resolves presets (the `presets` package) and hands them to the loader, the schema and the
docs generator, so that the rest of rlconf never imports presets.

Exit codes: 0 ok, 2 invalid config (the message names the config path and the fix), 1 crash.
Errors never print a Python traceback (set RLPLAN_DEBUG=1 to see one for a crash).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from collections.abc import Callable, Sequence

from rlconf.config import RLConfig
from rlconf.errors import ConfigError, Issue

EXIT_OK, EXIT_CRASH, EXIT_INVALID = 0, 1, 2
PRESET_PREFIX = "preset:"


def _load(
    source: str | None, preset: str | None, overrides: Sequence[str], *, filesystem: bool = False
) -> tuple[RLConfig, tuple[Issue, ...]]:
    """Load a config from a file, `preset:NAME` or --preset (a file overlays --preset); returns it with its
    warnings. `filesystem` adds the checks of the paths a run reads and writes (rlconf.validate)."""
    from rlconf.load import load_checked

    if source is not None and source.startswith(PRESET_PREFIX):
        named = source.removeprefix(PRESET_PREFIX)
        if preset is not None and preset != named:
            raise ConfigError(
                [
                    Issue(
                        "preset",
                        f"both preset:{named} and --preset {preset} are given",
                        "give the preset once",
                        "usage",
                    )
                ],
                "rlconf",
            )
        source, preset = None, named
    if source is None and preset is None:
        raise ConfigError(
            [Issue("", "no config given", "pass a FILE, preset:NAME or --preset NAME", "usage")], "rlconf"
        )
    from presets import PRESETS

    return load_checked(source, preset=preset, overrides=overrides, filesystem=filesystem, presets=PRESETS)


def _write_output(path: str, text: str, option: str) -> None:
    """Write a command's output file; a path that cannot be written is a usage error naming the option."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        raise _unwritable(path, option, exc) from None


def _unwritable(path: str, option: str, exc: OSError) -> ConfigError:
    return ConfigError(
        [
            Issue(
                option,
                f"cannot write {exc.filename or path}: {exc.strerror or exc}",
                "choose a path in a folder that exists and that you can write to",
                "output-path",
            )
        ],
        "rlconf",
    )


def _print_warnings(warnings: Sequence[Issue]) -> None:
    for w in warnings:
        print(w.format(), file=sys.stderr)


def cmd_validate(args: argparse.Namespace) -> int:
    """Every check a run makes before its workers start: the rules (paths included) and the plan."""
    from rlconf.plan import compile_plan

    sources = args.files or [None]
    if args.files == [] and args.preset is None:
        raise ConfigError(
            [Issue("", "no config given", "pass FILE..., preset:NAME or --preset NAME", "usage")], "rlconf"
        )
    status = EXIT_OK
    for source in sources:
        name = source or f"preset:{args.preset}"
        try:
            config, warnings = _load(source, args.preset, args.set, filesystem=True)
            try:
                compile_plan(config)
            except ConfigError as exc:
                raise ConfigError(exc.issues, name) from None
        except ConfigError as exc:
            print(exc.format() if exc.source else f"{name}: {exc.format()}", file=sys.stderr)
            status = EXIT_INVALID
            continue
        suffix = f" ({len(warnings)} warning{'s' if len(warnings) != 1 else ''})" if warnings else ""
        print(f"ok {name}{suffix}")
        _print_warnings(warnings)
    return status


def cmd_show(args: argparse.Namespace) -> int:
    from rlconf.render import render_config

    config, warnings = _load(args.file, args.preset, args.set)
    print(render_config(config, warnings, mark_changes=not args.plain), end="")
    _print_warnings(warnings)
    return EXIT_OK


def cmd_diff(args: argparse.Namespace) -> int:
    from rlconf.load import config_to_dict
    from rlconf.render import diff_dicts

    b_source = args.b
    if b_source is None:
        if args.preset is None:
            raise ConfigError(
                [
                    Issue(
                        "",
                        "diff needs two configs",
                        "pass A B, or A --preset NAME to compare A with it",
                        "usage",
                    )
                ],
                "rlconf",
            )
        b_source = f"{PRESET_PREFIX}{args.preset}"
    a, _ = _load(args.a, args.preset, ())
    b, _ = _load(b_source, args.preset, ())
    print(f"--- {args.a}\n+++ {b_source}")
    if args.plan:
        from rlconf.plan import compile_plan, diff_plans

        lines = format_plan_diff(diff_plans(compile_plan(a), compile_plan(b), collapse_records=True))
    else:
        lines = [change.format() for change in diff_dicts(config_to_dict(a), config_to_dict(b))]
    print("\n".join(lines) if lines else "(no differences)")
    return EXIT_OK


_STEP_KEY = re.compile(r"^(?P<head>.*?\[step=)(?P<step>\d+)(?P<tail>\].*)$")


def format_plan_diff(changes: Sequence[tuple[str, object, object]]) -> list[str]:
    """`~ path: old -> new` lines of a plan diff, with per-step rows collapsed into step ranges.

    A plan has a row per training step (the lr table); two plans that differ in their schedule differ in
    hundreds of rows. Consecutive steps whose rows change the same way (same field, the same sides
    missing, the same value types) become one line `table[step=3..100].lr: a -> b`, where a side that
    varies over the range reads `first..last`.
    """
    groups: dict[tuple[str, str], list[tuple[int, object, object]]] = {}
    order: list[tuple[str, str] | int] = []
    for index, (path, old, new) in enumerate(changes):
        m = _STEP_KEY.match(path)
        if m is None:
            order.append(index)
            continue
        key = (m["head"], m["tail"])
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append((int(m["step"]), old, new))
    lines: list[str] = []
    for item in order:
        if isinstance(item, int):
            path, old, new = changes[item]
            lines.append(f"~ {path}: {_fmt(old)} -> {_fmt(new)}")
            continue
        head, tail = item
        for run in _step_runs(sorted(groups[item], key=lambda row: row[0])):
            first, last = run[0][0], run[-1][0]
            steps = str(first) if first == last else f"{first}..{last}"
            olds, news = [row[1] for row in run], [row[2] for row in run]
            lines.append(f"~ {head}{steps}{tail}: {_fmt_range(olds)} -> {_fmt_range(news)}")
    return lines


def _step_runs(rows: list[tuple[int, object, object]]) -> list[list[tuple[int, object, object]]]:
    """Maximal runs of consecutive steps whose rows share a change pattern."""
    from rlconf.plan import MISSING

    def pattern(row: tuple[int, object, object]) -> tuple[str, str]:
        return type(row[1]).__name__ + repr(row[1] == MISSING), type(row[2]).__name__ + repr(
            row[2] == MISSING
        )

    runs: list[list[tuple[int, object, object]]] = []
    for row in rows:
        if runs and runs[-1][-1][0] + 1 == row[0] and pattern(runs[-1][-1]) == pattern(row):
            runs[-1].append(row)
        else:
            runs.append([row])
    return runs


def _fmt(value: object) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def _fmt_range(values: list[object]) -> str:
    if all(v == values[0] for v in values):
        return _fmt(values[0])
    return f"{_fmt(values[0])}..{_fmt(values[-1])}"


def cmd_plan(args: argparse.Namespace) -> int:
    from rlconf.plan import compile_plan, format_plan, plan_to_dict

    config, warnings = _load(args.file, args.preset, args.set)
    plan = compile_plan(config)
    if args.json:
        print(json.dumps(plan_to_dict(plan), indent=2))
    else:
        print(format_plan(plan), end="")
    _print_warnings(warnings)
    return EXIT_OK


def cmd_schema(args: argparse.Namespace) -> int:
    from presets import PRESETS
    from rlconf.schema import config_schema

    text = json.dumps(config_schema(list(PRESETS)), indent=2) + "\n"
    if args.output:
        _write_output(args.output, text, "--output")
    else:
        print(text, end="")
    return EXIT_OK


def cmd_docs(args: argparse.Namespace) -> int:
    from presets import PRESETS
    from rlconf.docs import write_reference

    try:
        written = write_reference(args.outdir, PRESETS, rlconf_main=main)
    except OSError as exc:
        raise _unwritable(args.outdir, "OUTDIR", exc) from None
    for path in written:
        print(f"wrote {path}")
    return EXIT_OK


def _split_verl_inputs(inputs: Sequence[str]) -> tuple[str | None, list[str]]:
    """The verl config file (the first input that is not an override) and the Hydra overrides."""
    first = inputs[0] if inputs else ""
    if "=" not in first and (first.endswith((".yaml", ".yml", ".json")) or os.path.isfile(first)):
        return first, list(inputs[1:])
    return None, list(inputs)


def cmd_import_verl(args: argparse.Namespace) -> int:
    from rlconf.verl import format_report, to_yaml, translate_sources, translation_to_dict

    file, overrides = _split_verl_inputs(args.inputs)
    tr = translate_sources(file, overrides)
    text = to_yaml(tr)
    if args.output:
        _write_output(args.output, text, "--output")
    report = sys.stdout if args.output or args.json else sys.stderr
    if args.json:
        print(json.dumps({**translation_to_dict(tr), "output": args.output}, indent=2, default=str))
    else:
        print(format_report(tr), end="", file=report)
        if args.output:
            state = "" if tr.valid else " (invalid: fix the errors above, then run `rlconf validate` on it)"
            # The file is complete (no `preset:`, dataclass defaults under it): rltrain runs it as is.
            quoted = shlex.quote(args.output)
            hint = f"\nnext: rlconf plan {quoted}\nrun:  rltrain --config {quoted}" if tr.valid else ""
            print(f"\nwrote {args.output}{state}{hint}", file=report)
        else:
            print(text, end="")
    return EXIT_OK if tr.valid else EXIT_INVALID


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlconf",
        description="Validate, inspect and compare rlplan configs before anything runs.",
        epilog="Exit codes: 0 ok, 2 invalid config, 1 crash.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, fn: Callable[[argparse.Namespace], int], help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(fn=fn)
        return p

    def add_source(p: argparse.ArgumentParser) -> None:
        p.add_argument("file", nargs="?", help="YAML/JSON config file (or preset:NAME)")
        p.add_argument("--preset", help="start from this preset (the file, if any, overlays it)")
        add_set(p)

    def add_set(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="PATH=VALUE",
            help="override a field, e.g. actor.optim.lr=1e-6",
        )

    p = add(
        "validate",
        cmd_validate,
        "check configs as a run would before it starts (fields, rules, paths it reads and writes, the plan); "
        "report every error with its path and fix",
    )
    p.add_argument("files", nargs="*", metavar="FILE", help="YAML/JSON config files (or preset:NAME)")
    p.add_argument("--preset", help="start from this preset (each file, if any, overlays it)")
    add_set(p)
    p = add("show", cmd_show, "print the resolved config as YAML, marking values that differ from defaults")
    add_source(p)
    p.add_argument("--plain", action="store_true", help="no annotations")
    p = add("diff", cmd_diff, "semantic diff of two configs (FILE or preset:NAME) by dotted path")
    p.add_argument("a", metavar="A", help="YAML/JSON config file (or preset:NAME)")
    p.add_argument("b", metavar="B", nargs="?", help="the same forms; default: the --preset itself")
    p.add_argument("--preset", help="start both from this preset (files overlay it)")
    p.add_argument("--plan", action="store_true", help="diff the compiled plans instead of the configs")
    p = add("plan", cmd_plan, "compile and print the trainer plan (layouts, batches, lr table, memory)")
    add_source(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p = add("schema", cmd_schema, "print the JSON Schema of the config (for editor completion)")
    p.add_argument("--output", "-o", help="write to this file instead of stdout")
    p = add(
        "import-verl",
        cmd_import_verl,
        "translate a verl Megatron trainer config and/or Hydra overrides into an rlplan config, report every "
        "key that did not map, and validate the result",
    )
    p.add_argument(
        "inputs",
        nargs="*",
        metavar="VERL.yaml|OVERRIDE",
        help="an optional verl config file (.yaml/.json) first, then Hydra overrides: key=value, +key=value, "
        "++key=value, ~key",
    )
    p.add_argument(
        "--output", "-o", help="write the rlplan config here (default: print it; report to stderr)"
    )
    p.add_argument("--json", action="store_true", help="print the report (and the config) as JSON")
    p = add("docs", cmd_docs, "generate the configuration reference (docs/reference/*.md)")
    p.add_argument("outdir", nargs="?", default="docs/reference")
    return parser


def run_guarded(fn: Callable[[], int]) -> int:
    """Run a command: ConfigError -> message + exit 2; any other exception -> one-line crash report + 1."""
    try:
        return fn()
    except ConfigError as exc:
        print(exc.format(), file=sys.stderr)
        return EXIT_INVALID
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except Exception as exc:  # a crash: report it without a traceback unless debugging
        if os.environ.get("RLPLAN_DEBUG"):
            raise
        print(
            f"internal error: {type(exc).__name__}: {exc}\n(rerun with RLPLAN_DEBUG=1 for a traceback)",
            file=sys.stderr,
        )
        return EXIT_CRASH


def _source_of(args: argparse.Namespace) -> str | None:
    """What an error raised without a source came from: the command's config file (or preset:NAME), else
    its --preset, else None (docs/troubleshooting.md: every error names its source)."""
    file = getattr(args, "file", None) or getattr(args, "a", None)
    if file:
        return str(file)
    preset = getattr(args, "preset", None)
    return f"{PRESET_PREFIX}{preset}" if preset else None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def with_source() -> int:
        try:
            return args.fn(args)
        except ConfigError as exc:
            if exc.source or _source_of(args) is None:
                raise
            raise ConfigError(exc.issues, _source_of(args)) from None

    return run_guarded(with_source)


if __name__ == "__main__":
    sys.exit(main())
