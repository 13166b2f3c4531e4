"""README and docs, link by link: every relative link resolves from a fresh clone.

A link to a file must name a file of the repository; a link to `#anchor` (on the same
page or another) must name a heading there, with GitHub's slug rule (lower case,
punctuation dropped, spaces to hyphens). External links are not fetched (no network).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {slug(m) for m in re.findall(r"^#+\s+(.*)$", text, flags=re.M)}


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return [a or b for a, b in LINK.findall(text)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    bad = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not fetched here
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not bad, f"{page.name}: " + "; ".join(bad)


def test_the_link_checker_sees_links_and_headings():
    assert "docs/spec.md" in links(ROOT / "README.md")
    assert "how-long-a-light-user-waits" in anchors(ROOT / "docs" / "demo.md")


def test_every_engine_knob_is_in_the_http_api_flag_table():
    """docs/http_api.md's table of flags covers every EngineConfig field (a knob added
    to the dataclass becomes a flag at once; its documentation must follow)."""
    import dataclasses

    from minserve import EngineConfig

    text = (ROOT / "docs" / "http_api.md").read_text(encoding="utf-8").replace("--[no-]", "--")
    missing = [f.name for f in dataclasses.fields(EngineConfig)
               if "--" + f.name.replace("_", "-") not in text]
    assert not missing, f"docs/http_api.md lists no flag for {missing}"
