"""The generated reference and every generated region of the guides are current: `rlconf docs` run now
would write exactly the committed pages (config and presets reference, plan excerpts, the recorded runs'
output, and the program output of rlconf.docs_outputs.EXCERPTS, run again here)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from presets import PRESETS
from rlconf.cli import main as rlconf_main
from rlconf.config import RLConfig
from rlconf.docs import (
    CENSUS_RECORD,
    CENSUS_REGIONS,
    MIGRATION_PAGE,
    PLAN_REGIONS,
    RUN_RECORD,
    RUN_REGIONS,
    VERL_RECORD,
    VERL_REGIONS,
    census_regions,
    config_reference,
    generated_regions,
    pages_with_regions,
    plan_regions,
    presets_reference,
    refresh_regions,
    region_names,
    run_regions,
    verl_regions,
)
from rlconf.docs_outputs import EXCERPTS, Excerpt, excerpt_text, kept_lines
from rlconf.fields import leaf_paths

DOCS = Path(__file__).resolve().parent.parent / "docs" / "reference"
_MARKER = re.compile(r"^\s*<!-- generated:(\S+) -->\s*$", re.M)


def test_committed_reference_is_current():
    """Fails when a field, default, docstring, rule or preset changed without `rlconf docs docs/reference`."""
    assert (DOCS / "config.md").read_text() == config_reference(), "run: rlconf docs docs/reference"
    assert (DOCS / "presets.md").read_text() == presets_reference(PRESETS), "run: rlconf docs docs/reference"


def test_reference_lists_every_field():
    text = config_reference()
    for path in leaf_paths(RLConfig):
        assert f"| `{path}`<br>`--{path}` |" in text, path


@pytest.fixture(scope="module")
def regions() -> dict[str, str]:
    return generated_regions(DOCS.parent, PRESETS, rlconf_main)


@pytest.mark.slow
def test_generated_regions_are_current(regions):
    """The plan excerpts, batch table, the recorded runs' output and numbers, and every program output quoted
    in the guides and the README are what `rlconf docs` writes today (it reruns the commands)."""
    docs_dir = DOCS.parent
    assert (docs_dir / RUN_RECORD).exists(), "run: .venv/bin/python bench/docs_run.py"
    assert set(regions) == region_names()
    stale = [page.name for page in pages_with_regions(docs_dir)
             if refresh_regions(page.read_text(), regions) != page.read_text()]  # fmt: skip
    assert stale == [], f"{stale} are stale; run: rlconf docs docs/reference"


@pytest.mark.slow
def test_every_region_is_quoted_and_every_quote_is_a_region():
    """A page may only name regions `rlconf docs` writes (an unknown name would never be filled), each
    region is quoted somewhere, and a region's name is well-formed (the writer skips a malformed one)."""
    docs_dir = DOCS.parent
    pages = [*pages_with_regions(docs_dir), docs_dir / MIGRATION_PAGE]
    named = {(page.name, name) for page in pages for name in _MARKER.findall(page.read_text())}
    assert {name for _, name in named if name not in region_names()} == set()
    assert {name for name in region_names() if re.fullmatch(r"[\w-]+", name) is None} == set()
    assert region_names() - {name for _, name in named} == set()


def test_region_names_are_the_writers_names():
    docs_dir = DOCS.parent
    assert {*plan_regions(PRESETS["tiny-grpo"]), "gpu-presets"} == set(PLAN_REGIONS)
    assert set(run_regions(json.loads((docs_dir / RUN_RECORD).read_text()))) == set(RUN_REGIONS)
    assert set(verl_regions(json.loads((docs_dir / VERL_RECORD).read_text()))) == set(VERL_REGIONS)
    assert set(census_regions(json.loads((docs_dir / CENSUS_RECORD).read_text()))) == set(CENSUS_REGIONS)
    assert len({e.name for e in EXCERPTS}) == len(EXCERPTS)


def test_refresh_regions_rewrites_only_marked_regions():
    text = "keep\n<!-- generated:a -->\nold\n<!-- /generated -->\nkeep too\n<!-- generated:zz -->\nx\n<!-- /generated -->\n"
    assert refresh_regions(text, {"a": "new\n"}) == text.replace("old\n", "new\n")


def test_kept_lines_mark_what_was_left_out():
    out = ["x.yaml: invalid config: 2 errors", "error [a] p: m", "    fix: f", "error [b] q: n", "    fix: g",
           "warning [a] r: o", "    fix: h", "", "tail"]  # fmt: skip
    assert kept_lines(out, ("rule:a",)) == ([*out[1:3], "...", *out[5:7]], {"rule:a"})
    assert kept_lines(out, ("from:error [b]",)) == (out[3:7], {"from:error [b]"})
    assert kept_lines(out, ("from:x.yaml:2", "line:tail")) == (
        [*out[:2], "...", "tail"],
        {"from:x.yaml:2", "line:tail"},
    )
    assert kept_lines(out, ("rule:c",)) == ([], set())


def test_an_excerpt_fails_when_its_command_changed_behaviour():
    """An excerpt whose command no longer exits as documented, or whose selection finds nothing, stops
    `rlconf docs` (and the test above) instead of writing a wrong page."""
    ok = Excerpt("x", ("rlconf validate --preset tiny-grpo",))
    assert (
        excerpt_text(ok, rlconf_main)
        == "```text\n$ rlconf validate --preset tiny-grpo\nok preset:tiny-grpo\n```\n"
    )
    with pytest.raises(RuntimeError, match="exited 0, the docs say 2"):
        excerpt_text(Excerpt("x", ok.commands, exit=2), rlconf_main)
    with pytest.raises(RuntimeError, match="selected nothing"):
        excerpt_text(Excerpt("x", ok.commands, ("rule:type",)), rlconf_main)
