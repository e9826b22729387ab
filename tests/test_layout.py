"""The package layout's promises: rlconf works without the presets package (the command layer hands presets
to the loader, the schema and the docs) and its modules import each other without a cycle."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlconf.errors import ConfigError
from rlconf.load import load_config

ROOT = Path(__file__).resolve().parents[1]
RLCONF = ROOT / "rlconf"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


RLCONF_MODULES = sorted(_module_name(p) for p in RLCONF.rglob("*.py"))


# What used to import presets behind the caller's back, called with a catalogue the caller built itself.
BLOCKED_SCRIPT = """\
import dataclasses, importlib, sys, tempfile
sys.modules["presets"] = None  # any `import presets` raises ImportError
for name in NAMES:
    importlib.import_module(name)
from rlconf.config import RLConfig
from rlconf.docs import generated_regions, presets_reference
from rlconf.load import load_config
from rlconf.schema import config_schema

@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    description: str
    build: object

catalogue = {"tiny-grpo": Preset("tiny-grpo", "the defaults", RLConfig)}
assert load_config(None, preset="tiny-grpo", presets=catalogue) == RLConfig()
assert config_schema(list(catalogue))["properties"]["preset"]["enum"] == ["tiny-grpo"]
assert "## `tiny-grpo`" in presets_reference(catalogue)
assert "batch-table" in generated_regions(tempfile.mkdtemp(), catalogue)
print("ok")
"""


def test_every_rlconf_module_imports_and_works_with_presets_blocked():
    """A fresh interpreter where `import presets` fails imports every rlconf module (the CLI included: it
    imports presets only inside the commands that resolve one), and the loader, the schema and the docs
    generator work from a catalogue handed to them."""
    script = BLOCKED_SCRIPT.replace("NAMES", repr(RLCONF_MODULES))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


def _imports(path: Path) -> list[tuple[str, int]]:
    """(module, line) of every absolute import in a file, those inside functions included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, node.lineno))
            out += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names]
    return out


def test_only_the_command_layer_imports_presets():
    """rlconf's core never imports presets, not even inside a function; rlconf/cli.py (the command layer)
    resolves them."""
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted(RLCONF.rglob("*.py"))
        if path != RLCONF / "cli.py"
        for name, line in _imports(path)
        if name == "presets" or name.startswith("presets.")
    ]
    assert found == []


def test_the_blocking_subprocess_does_fail_on_an_import_of_presets():
    """The check above has teeth: the same blocking makes `import presets` an ImportError."""
    script = "import sys\nsys.modules['presets'] = None\nimport presets\n"
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode != 0 and "import of presets halted" in result.stderr, result.stderr


def test_a_preset_name_without_the_catalogue_is_a_config_error(tmp_path):
    """A library caller that names a preset but does not hand the loader the catalogue gets a ConfigError at
    `preset` saying how to pass it, not an import of the presets package behind its back."""
    f = tmp_path / "run.yaml"
    f.write_text("preset: tiny-grpo\n")
    for call in (lambda: load_config(f), lambda: load_config(None, preset="tiny-grpo")):
        with pytest.raises(ConfigError) as exc:
            call()
        assert exc.value.path == "preset" and "presets=presets.PRESETS" in exc.value.errors[0].fix


def _rlconf_graph() -> dict[str, set[str]]:
    """{module: rlconf modules it imports}, deferred (in-function) imports included: a cycle through a
    deferred import is still a cycle of responsibilities."""
    modules = set(RLCONF_MODULES)
    graph: dict[str, set[str]] = {}
    for path in RLCONF.rglob("*.py"):
        name = _module_name(path)
        graph[name] = {m for m, _ in _imports(path) if m in modules and m != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (as a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_rlconf_modules_import_each_other_without_a_cycle():
    """docs imports the verl importer, never the reverse; no other module pair loops either."""
    graph = _rlconf_graph()
    assert "rlconf.verl" in graph["rlconf.docs"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
