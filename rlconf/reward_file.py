"""`reward.function` given as a file, verl's way (`path/to/reward.py:compute_score`), checked without
running it.

verl names a reward by `custom_reward_function.path` and `.name`; rlplan spells the pair as one value,
`path/to/file.py:function`. What `rlconf validate` checks here never executes the file: the function
name is an identifier, the path is a regular Python file of bounded size that parses (`ast`), and the
function is defined at its top level (a `def`, an assignment or an import under that name). The run
imports it at start, like a `package.module:function` reward (rltrain.rewards).
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterator

from rlconf.errors import Issue, error

PATH = "reward.function"
RULE = "reward-function-file"
# Far above any real reward file (verl's largest scorers are tens of KiB); a bigger file is not a reward.
MAX_BYTES = 4 << 20
FILE_SPEC = re.compile(r"^(?P<path>.+\.py):(?P<name>[^:]*)$")
_IDENTIFIER = re.compile(r"^[A-Za-z_]\w*$")


def split_file_spec(spec: str) -> tuple[str, str] | None:
    """(path, function name) when `spec` names a Python file (`....py:name`), else None."""
    m = FILE_SPEC.match(spec.strip())
    return (m["path"], m["name"]) if m else None


def _top_level_names(tree: ast.Module) -> list[str]:
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names += [(a.asname or a.name).split(".")[0] for a in node.names]
    return names


def file_spec_issues(spec: str, *, filesystem: bool) -> Iterator[Issue]:
    """Problems of a `path.py:function` reward: its form (rule reward-function) without `filesystem`, its
    file with it (relative paths are relative to the directory the run starts in)."""
    parts = split_file_spec(spec)
    if parts is None:
        return
    path, name = parts
    if not _IDENTIFIER.match(name):
        if not filesystem:
            yield error(PATH, f"{name!r} in {spec!r} is not a Python function name",
                        f"write {path}:compute_score (the file, a ':', then the function's name)",
                        "reward-function")  # fmt: skip
        return
    if not filesystem:
        return
    full = os.path.expanduser(path)
    where = f"(relative to {os.getcwd()})" if not os.path.isabs(full) else ""
    if not os.path.exists(full):
        yield error(PATH, f"reward file {path!r} does not exist {where}".rstrip(),
                    "fix the path to your reward file (verl's custom_reward_function.path)", RULE)  # fmt: skip
        return
    if not os.path.isfile(full):
        yield error(PATH, f"reward file {path!r} is not a regular file", "point it at a .py file", RULE)
        return
    size = os.path.getsize(full)
    if size > MAX_BYTES:
        yield error(PATH, f"reward file {path!r} is {size:,} bytes, more than a reward file holds "
                    f"({MAX_BYTES:,})", "point it at the Python file that defines the function", RULE)  # fmt: skip
        return
    try:
        with open(full, "rb") as f:
            source = f.read(MAX_BYTES + 1)
        tree = ast.parse(source, filename=full)
    except SyntaxError as exc:
        yield error(PATH, f"reward file {path!r} does not parse: {exc.msg} (line {exc.lineno})",
                    f"fix the syntax error (try `python -m py_compile {path}`)", RULE)  # fmt: skip
        return
    except (OSError, ValueError) as exc:  # unreadable, or NUL bytes
        yield error(PATH, f"cannot read reward file {path!r}: {exc}", "check the file", RULE)
        return
    names = _top_level_names(tree)
    if name not in names:
        import difflib

        close = difflib.get_close_matches(name, names, n=1)
        hint = f"did you mean `{close[0]}`? " if close else ""
        defined = ", ".join(n for n in names if not n.startswith("_")) or "(none)"
        yield error(PATH, f"{path!r} defines no top-level {name!r}",
                    f"{hint}names defined there: {defined}", RULE)  # fmt: skip
