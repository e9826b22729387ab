"""The `rlconf` tool: validate, show, diff, plan and schema for rlplan configs, without touching a GPU.

Exit codes: 0 ok, 2 invalid config (the message names the config path and the fix), 1 crash.
Errors never print a Python traceback (set RLPLAN_DEBUG=1 to see one for a crash).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence

from rlconf.config import RLConfig
from rlconf.errors import ConfigError, Issue

EXIT_OK, EXIT_CRASH, EXIT_INVALID = 0, 1, 2
PRESET_PREFIX = "preset:"


def _load(
    source: str | None, preset: str | None, overrides: Sequence[str]
) -> tuple[RLConfig, tuple[Issue, ...]]:
    """Load a config from a file, `preset:NAME` or --preset; returns it with its warnings."""
    from rlconf.load import load_config
    from rlconf.validate import check_config

    if source is not None and source.startswith(PRESET_PREFIX):
        source, preset = None, source.removeprefix(PRESET_PREFIX)
    if source is None and preset is None:
        raise ConfigError(
            [Issue("", "no config given", "pass a FILE, preset:NAME or --preset NAME", "usage")], "rlconf"
        )
    config = load_config(source, preset=preset, overrides=overrides)
    return config, tuple(i for i in check_config(config) if i.severity == "warning")


def _print_warnings(warnings: Sequence[Issue]) -> None:
    for w in warnings:
        print(w.format(), file=sys.stderr)


def cmd_validate(args: argparse.Namespace) -> int:
    status = EXIT_OK
    for source in args.files:
        try:
            _, warnings = _load(source, None, args.set)
        except ConfigError as exc:
            print(exc.format() if exc.source else f"{source}: {exc.format()}", file=sys.stderr)
            status = EXIT_INVALID
            continue
        suffix = f" ({len(warnings)} warning{'s' if len(warnings) != 1 else ''})" if warnings else ""
        print(f"ok {source}{suffix}")
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

    a, _ = _load(args.a, None, ())
    b, _ = _load(args.b, None, ())
    print(f"--- {args.a}\n+++ {args.b}")
    if args.plan:
        from rlconf.plan import compile_plan, diff_plans

        lines = [
            f"~ {path}: {_fmt(old)} -> {_fmt(new)}"
            for path, old, new in diff_plans(compile_plan(a), compile_plan(b))
        ]
    else:
        lines = [change.format() for change in diff_dicts(config_to_dict(a), config_to_dict(b))]
    print("\n".join(lines) if lines else "(no differences)")
    return EXIT_OK


def _fmt(value: object) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


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
    from rlconf.schema import config_schema

    text = json.dumps(config_schema(), indent=2) + "\n"
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        print(text, end="")
    return EXIT_OK


def cmd_docs(args: argparse.Namespace) -> int:
    from rlconf.docs import write_reference

    for path in write_reference(args.outdir):
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
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    report = sys.stdout if args.output or args.json else sys.stderr
    if args.json:
        print(json.dumps({**translation_to_dict(tr), "output": args.output}, indent=2, default=str))
    else:
        print(format_report(tr), end="", file=report)
        if args.output:
            state = "" if tr.valid else " (invalid: fix the errors above, then run `rlconf validate` on it)"
            hint = f"\nnext: rlconf plan {args.output}" if tr.valid else ""
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

    p = add("validate", cmd_validate, "check config files; report every error with its path and fix")
    p.add_argument("files", nargs="+", metavar="FILE", help="config files (or preset:NAME)")
    add_set(p)
    p = add("show", cmd_show, "print the resolved config as YAML, marking values that differ from defaults")
    add_source(p)
    p.add_argument("--plain", action="store_true", help="no annotations")
    p = add("diff", cmd_diff, "semantic diff of two configs (FILE or preset:NAME) by dotted path")
    p.add_argument("a")
    p.add_argument("b")
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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_guarded(lambda: args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
