"""The generated reference is current and complete."""

from __future__ import annotations

from pathlib import Path

from rlconf.config import RLConfig
from rlconf.docs import config_reference, presets_reference
from rlconf.fields import leaf_paths

DOCS = Path(__file__).resolve().parent.parent / "docs" / "reference"


def test_committed_reference_is_current():
    """Fails when a field, default, docstring, rule or preset changed without `rlconf docs docs/reference`."""
    assert (DOCS / "config.md").read_text() == config_reference(), "run: rlconf docs docs/reference"
    assert (DOCS / "presets.md").read_text() == presets_reference(), "run: rlconf docs docs/reference"


def test_reference_lists_every_field():
    text = config_reference()
    for path in leaf_paths(RLConfig):
        assert f"| `{path}`<br>`--{path}` |" in text, path
