"""`rltrain --help` and `rltrain PRESET --help [TOPIC]`: the flags, laid out for the terminal by rlplan.

The help is written from the config dataclasses (rlconf.fields: the same field docstrings that
`rlconf schema` and `rlconf docs` publish), not by an argument-parser library, so it can be short enough to
read: every flag takes one or two lines (flag, type or choices, the value this command would run with, the
first sentence of its docstring), grouped by section, and `--help TOPIC` narrows it to a section, a field or
every field with its whole docstring. Lines are wrapped to the terminal (COLUMNS, else the terminal's width,
else 80); only a single token longer than the line (a long path) can stick out. No torch, Ray or megatron.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import shutil
import textwrap
from collections.abc import Iterable, Mapping
from typing import Any

from rlconf.config import RLConfig
from rlconf.errors import ConfigError, error
from rlconf.fields import (
    Leaf,
    field_default,
    field_docs,
    field_types,
    get_path,
    is_dataclass_type,
    literal_values,
    strip_optional,
    tuple_item_types,
)
from rltrain.flags import flag_text

MIN_WIDTH, MAX_WIDTH = 40, 120
"""Below 40 columns nothing reads well; above 120 a paragraph is hard to follow, so lines stop there."""
DOC_INDENT = "      "
HEADER_INDENT = "        "
"""A field's flag line wraps deeper than its text, so the two never read as one."""
ALL = "all"


def terminal_width() -> int:
    """COLUMNS, else the width of the terminal on stdout, else 80; clamped to [MIN_WIDTH, MAX_WIDTH]."""
    return max(MIN_WIDTH, min(MAX_WIDTH, shutil.get_terminal_size((80, 24)).columns))


def wrap(text: str, width: int, indent: str = "", subsequent: str | None = None) -> list[str]:
    """`text` re-flowed to `width` (its line breaks are not kept); words are never split."""
    return textwrap.wrap(
        " ".join(text.split()),
        width=width,
        initial_indent=indent,
        subsequent_indent=indent if subsequent is None else subsequent,
        break_long_words=False,
        break_on_hyphens=False,
    ) or [indent.rstrip()]


def _wrap_atoms(atoms: Iterable[tuple[str, bool]], width: int, indent: str, subsequent: str) -> list[str]:
    """Greedy wrap of atoms joined by spaces; an atom marked splittable may break after its commas."""
    pieces: list[tuple[str, str]] = []  # (separator before, text)
    for atom, splittable in atoms:
        parts = re.split(r"(?<=,)", atom) if splittable else [atom]
        pieces += [(" " if i == 0 else "", part) for i, part in enumerate(parts) if part]
    lines = [indent]
    for sep, text in pieces:
        line = lines[-1]
        fresh = line in (indent, subsequent)
        if not fresh and len(line) + len(sep) + len(text) > width:
            lines.append(subsequent + text)
        else:
            lines[-1] = line + ("" if fresh else sep) + text
    return lines


def flag_type(tp: Any) -> str:
    """A field's type as a flag takes it: INT, FLOAT, STR, BOOL, {a,b} for choices, `X...` for a list of
    any length, `X X` for a fixed one; `|None` when the field may be null."""
    inner, optional = strip_optional(tp)
    if (choices := literal_values(inner)) is not None:
        name = "{" + ",".join(str(c) for c in choices) + "}"
    elif (items := tuple_item_types(inner)) is not None:
        item, variadic = items
        name = f"{flag_type(item)}..." if variadic else " ".join(flag_type(t) for t in item)
    else:
        name = {bool: "BOOL", int: "INT", float: "FLOAT", str: "STR"}.get(inner, str(inner))
    return f"{name}|None" if optional else name


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`(])")


def summary(doc: str, room: int) -> str:
    """The first sentence of a docstring (the whole docstring when it fits), cut with `...` to `room`: at
    its last `; ` when that keeps half of the room, else at a word."""
    text = " ".join(doc.split())
    if len(text) > room:
        text = _SENTENCE_END.split(text, maxsplit=1)[0]
    if len(text) > room:
        head = text[: room - 3]
        clause = head.rfind("; ")
        head = head[:clause] if clause >= room // 2 else head.rsplit(" ", 1)[0]
        text = head.rstrip(",;:") + "..."
    return text


def _field_lines(leaf: Leaf, value: Any, width: int, full: bool) -> list[str]:
    """A field's entry: `--path TYPE = VALUE` (wrapped), then its docstring: whole, or one line of it."""
    first, *rest = flag_text(value).split(" ")  # a value with spaces (quoted) may wrap between its words
    atoms = [(f"--{leaf.path}", False), (flag_type(leaf.type), True), (f"= {first}", False)]
    atoms += [(word, False) for word in rest]
    lines = _wrap_atoms(atoms, width, "  ", HEADER_INDENT)
    if not leaf.doc:
        return lines
    if full:
        return lines + wrap(leaf.doc, width, DOC_INDENT)
    return [*lines, DOC_INDENT + summary(leaf.doc, width - len(DOC_INDENT))]


@dataclasses.dataclass(frozen=True)
class Section:
    """A config section (a nested dataclass) with the fields declared directly in it."""

    path: str
    cls: type
    leaves: tuple[Leaf, ...]

    @property
    def doc(self) -> str:
        return " ".join((self.cls.__doc__ or "").split())


def sections(root: type = RLConfig, prefix: str = "") -> list[Section]:
    """Every section under `root`, depth first in declaration order (the order of `rlconf docs`)."""
    docs = field_docs(root)
    own: list[Leaf] = []
    nested: list[Section] = []
    for f in dataclasses.fields(root):
        tp = field_types(root)[f.name]
        if is_dataclass_type(tp):
            nested += sections(tp, f"{prefix}{f.name}.")
        else:
            own.append(Leaf(prefix + f.name, tp, field_default(f), docs.get(f.name, ""), root))
    head = [Section(prefix.rstrip("."), root, tuple(own))] if prefix else []
    return head + nested


def _section_lines(section: Section, config: RLConfig, width: int, full: bool) -> list[str]:
    room = width - len(section.path) - 2
    doc = section.doc if full else summary(section.doc, room)
    title = f"{section.path}: {doc}" if doc else section.path
    lines = ["", *wrap(title, width, "", "  ")]
    for leaf in section.leaves:
        lines += _field_lines(leaf, get_path(config, leaf.path), width, full)
    return lines


def columns(rows: Iterable[tuple[str, str]], width: int, indent: str = "  ") -> list[str]:
    """Two columns: each name, then its text wrapped beside it; when the names take over half the line,
    each text goes under its name instead."""
    rows = list(rows)
    column = len(indent) + max(len(name) for name, _ in rows) + 2
    stacked = column > width // 2
    lines: list[str] = []
    for name, text in rows:
        if stacked:
            lines += [indent + name, *(wrap(text, width, indent + "    ") if text else [])]
            continue
        body = wrap(text, width, " " * column)
        lines += [(indent + name).ljust(column) + body[0][column:], *body[1:]]
    return lines


def run_options(width: int) -> list[str]:
    """rltrain's own options, a column of names and their wrapped descriptions."""
    options = (
        ("--config FILE.yaml", "overlay this YAML/JSON file on the preset (flags overlay the file); "
         "without a PRESET the file is the whole config (dataclass defaults under it)"),
        ("--dry-run", "check everything a run checks before it writes anything (every config rule, the "
         "files it reads, the length of the paths it writes, free space for a checkpoint, and the Ray "
         "cluster at cluster.ray_address / RAY_ADDRESS: reachable, enough nodes; with no address only "
         "that the plan fits one node), print the config and the plan, exit"),
        ("-h, --help [TOPIC]", "this help; TOPIC narrows it (below)"),
    )  # fmt: skip
    head = wrap("run options (rltrain's own; every other flag sets one config field):", width)
    return [*head, *columns(options, width)]


def _intro(prog: str, width: int) -> list[str]:
    lines = wrap(f"usage: {prog} [--config FILE.yaml] [--section.field VALUE ...] [--dry-run]", width,
                 "", "         ")  # fmt: skip
    lines += wrap(f"{prog} --help [SECTION | FIELD | all]", width, "       ", "         ")
    lines.append("")
    lines += wrap(
        "Every config field is a flag: `--section.field VALUE`. Each is listed with its type, the value "
        "this command runs with (after `=`: the preset, with --config FILE and the other flags applied) "
        "and the first line of its description. For the whole description:",
        width,
    )
    examples = (
        ("--help actor.optim", "one section (and the sections under it)"),
        ("--help actor.optim.lr", "one field (`--help lr`: every field named lr)"),
        ("--help all", "every field"),
    )
    lines += columns(examples, width)
    return [
        *lines,
        "",
        *run_options(width),
        "",
        *wrap(
            "Precedence: flags > --config file > preset > defaults. Check a file alone with "
            "`rlconf validate FILE`.",
            width,
        ),
    ]


def topic_sections(topic: str | None, all_sections: list[Section]) -> tuple[list[Section], bool]:
    """The sections a help topic shows (fields narrowed for a field topic) and whether in full.
    Raises ConfigError (exit 2) for a topic that names nothing, with the closest names."""
    if topic is None:
        return all_sections, False
    if topic == ALL:
        return all_sections, True
    chosen = [s for s in all_sections if s.path == topic or s.path.startswith(topic + ".")]
    if chosen:
        return chosen, True
    picked = [
        dataclasses.replace(s, leaves=tuple(leaf for leaf in s.leaves if _names(leaf.path, topic)))
        for s in all_sections
    ]
    picked = [s for s in picked if s.leaves]
    if picked:
        return picked, True
    names = [ALL] + [s.path for s in all_sections] + [leaf.path for s in all_sections for leaf in s.leaves]
    close = difflib.get_close_matches(topic, names, n=3, cutoff=0.6)
    hint = f"did you mean {', '.join(f'`{c}`' for c in close)}? " if close else ""
    tops = ", ".join(s.path for s in all_sections if "." not in s.path)
    raise ConfigError(
        [
            error(
                topic,
                f"no section or field named `{topic}` (--help {topic})",
                f"{hint}give a section ({tops}), a field (actor.optim.lr, or its last name: lr) or `all`",
                "usage",
            )
        ],
        "command line",
    )


def _names(path: str, topic: str) -> bool:
    return path == topic or path.endswith("." + topic)


def preset_help(prog: str, config: RLConfig, topic: str | None = None, width: int | None = None) -> str:
    """The help of `PROG --help [TOPIC]` with `config`'s values (see the module docstring)."""
    width = terminal_width() if width is None else max(MIN_WIDTH, min(MAX_WIDTH, width))
    chosen, full = topic_sections(topic, sections())
    lines = _intro(prog, width) if topic is None else [*wrap(f"{prog} --help {topic}", width)]
    for section in chosen:
        lines += _section_lines(section, config, width, full)
    return "\n".join(line.rstrip() for line in lines) + "\n"


def general_help(usage: Iterable[tuple[str, str]], about: str, presets: Mapping[str, str],
                 width: int | None = None) -> str:  # fmt: skip
    """`rltrain --help`: the command forms (each with what it does), a paragraph, the presets."""
    width = terminal_width() if width is None else max(MIN_WIDTH, min(MAX_WIDTH, width))
    lines: list[str] = []
    for i, (form, text) in enumerate(usage):
        lines += (
            wrap(f"usage: {form}", width, "", "         ") if i == 0 else wrap(form, width, " " * 7, " " * 9)
        )
        lines += wrap(text, width, "         ") if text else []
    lines += ["", *wrap(about, width), "", "presets:", *columns(presets.items(), width)]
    return "\n".join(lines) + "\n"
