"""The generated reference is current and complete."""

from __future__ import annotations

from pathlib import Path

from presets import PRESETS
from rlconf.config import RLConfig
from rlconf.docs import (
    PAGES_WITH_REGIONS,
    RUN_RECORD,
    config_reference,
    generated_regions,
    presets_reference,
    refresh_regions,
)
from rlconf.fields import leaf_paths

DOCS = Path(__file__).resolve().parent.parent / "docs" / "reference"


def test_committed_reference_is_current():
    """Fails when a field, default, docstring, rule or preset changed without `rlconf docs docs/reference`."""
    assert (DOCS / "config.md").read_text() == config_reference(), "run: rlconf docs docs/reference"
    assert (DOCS / "presets.md").read_text() == presets_reference(PRESETS), "run: rlconf docs docs/reference"


def test_reference_lists_every_field():
    text = config_reference()
    for path in leaf_paths(RLConfig):
        assert f"| `{path}`<br>`--{path}` |" in text, path


def test_generated_regions_are_current():
    """The plan excerpts, batch table and the recorded run's output and numbers in the guides and the README
    are what `rlconf docs` writes from compile_plan and docs/_generated/tiny-grpo-run.json."""
    docs_dir = DOCS.parent
    regions = generated_regions(docs_dir, PRESETS)
    assert (docs_dir / RUN_RECORD).exists(), "run: .venv/bin/python bench/docs_run.py"
    for name in PAGES_WITH_REGIONS:
        text = (docs_dir / name).read_text()
        assert "<!-- generated:" in text, name
        assert refresh_regions(text, regions) == text, f"{name} is stale; run: rlconf docs docs/reference"


def test_refresh_regions_rewrites_only_marked_regions():
    text = "keep\n<!-- generated:a -->\nold\n<!-- /generated -->\nkeep too\n<!-- generated:zz -->\nx\n<!-- /generated -->\n"
    assert refresh_regions(text, {"a": "new\n"}) == text.replace("old\n", "new\n")
