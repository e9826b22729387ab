"""The docs site builds offline without warnings, and the pages link to each other correctly.

`test_mkdocs_build_strict` runs `mkdocs build --strict` (broken links, missing anchors and pages left out
of the nav are errors, see `validation:` in mkdocs.yml). It needs the `docs` extra and is skipped without
it. The other tests need only PyYAML, so CI without the extra still catches a page missing from the nav
or a relative link to a file or heading that does not exist.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MKDOCS_YML = ROOT / "mkdocs.yml"

# [text](target) outside code; images too. Targets with a scheme (http:, mailto:) are external.
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ID = re.compile(r"<a\s+id=\"([^\"]+)\"")


def _nav_files(nav: object) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [f for item in nav for f in _nav_files(item)]
    if isinstance(nav, dict):
        return [f for value in nav.values() for f in _nav_files(value)]
    return []


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def _prose_lines(text: str) -> list[str]:
    """Lines outside fenced code blocks, with inline code removed (links inside code are not links)."""
    out, in_fence = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            out.append(line)
    return out


def _slug(heading: str) -> str:
    """Python-Markdown's default toc slug of a heading's text (what mkdocs uses for anchors)."""
    spans: list[str] = []

    def keep(m: re.Match[str]) -> str:  # code spans keep their text verbatim (underscores included)
        spans.append(m.group(1))
        return f"\0{len(spans) - 1}\0"

    text = re.sub(r"`([^`]*)`", keep, heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links keep their text
    text = re.sub(r"\*{1,2}([^*]+)\*{1,2}", r"\1", text)  # emphasis (underscores inside words are text)
    text = re.sub(r"(?<!\w)_{1,2}([^_]+)_{1,2}(?!\w)", r"\1", text)
    text = re.sub(r"\0(\d+)\0", lambda m: spans[int(m.group(1))], text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for line in _prose_lines(page.read_text(encoding="utf-8")):
        if m := _HEADING.match(line):
            slug = _slug(m.group(2))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}_{n}")
        anchors.update(_HTML_ID.findall(line))
    return anchors


def test_every_page_is_in_the_nav():
    config = yaml.safe_load(MKDOCS_YML.read_text(encoding="utf-8"))
    in_nav = set(_nav_files(config["nav"]))
    on_disk = {p.relative_to(DOCS).as_posix() for p in _pages()}
    assert on_disk - in_nav == set(), "pages missing from mkdocs.yml nav"
    assert in_nav - on_disk == set(), "nav entries without a page"


def test_relative_links_resolve():
    problems = []
    anchors = {p: _anchors(p) for p in _pages()}
    for page in _pages():
        for line in _prose_lines(page.read_text(encoding="utf-8")):
            for target in _LINK.findall(re.sub(r"`[^`]*`", "", line)):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                    continue  # external
                path, _, anchor = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                rel = page.relative_to(DOCS)
                if not dest.exists():
                    problems.append(f"{rel}: {target}: no such file")
                elif anchor and dest.suffix == ".md" and anchor not in anchors[dest]:
                    problems.append(f"{rel}: {target}: no heading or id `{anchor}`")
    assert not problems, "\n".join(problems)


def test_theme_needs_no_network():
    """Nothing in the theme or plugins fetches at build or view time (fonts, social cards, privacy)."""
    config = yaml.safe_load(MKDOCS_YML.read_text(encoding="utf-8"))
    assert config["theme"]["name"] == "material"
    assert config["theme"].get("font") is False, "set theme.font: false (no Google Fonts)"
    plugins = [p if isinstance(p, str) else next(iter(p)) for p in config.get("plugins", [])]
    assert not {"social", "privacy", "optimize"} & set(plugins), plugins


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install -e '.[docs]'")
    pytest.importorskip("material", reason="mkdocs-material is not installed: pip install -e '.[docs]'")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(MKDOCS_YML),
         "--site-dir", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for page in _pages():
        rel = page.relative_to(DOCS).with_suffix("")
        built = site / ("index.html" if rel.name == "index" else rel / "index.html")
        assert built.is_file(), f"{page.name} was not built"


def test_every_mkdocs_command_the_docs_give_keeps_materials_banner_off():
    """mkdocs-material prints a boxed banner about MkDocs 2.0 on every build or serve unless
    NO_MKDOCS_2_WARNING=1: each command the README, the pages and mkdocs.yml give sets it on its line, or a
    few lines above in the same block (`export`)."""
    sources = [ROOT / "README.md", MKDOCS_YML, *sorted(DOCS.glob("*.md"))]
    missed = []
    for path in sources:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            command = re.search(r"mkdocs (build|serve)", line) and "skip-test" not in line
            if command and not any(
                "NO_MKDOCS_2_WARNING=1" in above for above in lines[max(0, i - 4) : i + 1]
            ):
                missed.append(f"{path.name}:{i + 1}: {line.strip()}")
    assert missed == []
