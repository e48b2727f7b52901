"""The documentation holds together: every relative link in the top-level and `docs/` pages
points at a file that exists (and, with `#anchor`, at a heading of that file, by GitHub's
anchor rules), and the README stays a front door: short, with the console's screenshot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.paths import REPO

PAGES = sorted([*REPO.glob("*.md"), *(REPO / "docs").glob("*.md")])
README_MAX_LINES = 80
SCREENSHOT = "screenshots/live-160x48.svg"

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = ("http://", "https://", "mailto:")


def prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks (a link or heading there is code)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: links reduced to their text, markup dropped,
    lowercased, every character but letters, digits, `_`, `-` and spaces removed, spaces
    turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor the page's headings produce; repeated headings get `-1`, `-2`, ..."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(page.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    """Every link and image target in the page's prose (inline code spans left out)."""
    found = []
    for line in prose_lines(page.read_text(encoding="utf-8")):
        found += LINK.findall(INLINE_CODE.sub("", line))
    return found


def broken_links(page: Path) -> list[str]:
    """The page's relative links whose file, or whose heading anchor, does not exist."""
    broken = []
    for target in links(page):
        if target.startswith(EXTERNAL):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no file {dest})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading with anchor #{anchor} in {dest.name})")
    return broken


def test_the_pages_are_found() -> None:
    names = {p.relative_to(REPO).as_posix() for p in PAGES}
    assert {"README.md", "CONTRIBUTING.md", "docs/architecture.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_the_readme_is_a_front_door() -> None:
    readme = REPO / "README.md"
    text = readme.read_text(encoding="utf-8")
    assert len(text.splitlines()) < README_MAX_LINES
    assert SCREENSHOT in links(readme)
    assert "make test" in text  # CI's .ci/run runs "the README's test command"


def test_the_readme_links_every_docs_page() -> None:
    targets = {t.partition("#")[0] for t in links(REPO / "README.md")}
    pages = {p.relative_to(REPO).as_posix() for p in PAGES if p.name != "README.md"}
    assert pages - targets == set()


def test_slugs_follow_githubs_rules() -> None:
    assert slug("`kvdeck` / `kvdeck console`") == "kvdeck--kvdeck-console"
    assert slug("The llama.cpp executor: `--executor llama_cpp`") == \
        "the-llamacpp-executor---executor-llama_cpp"
    assert slug("Layout: slots") == "layout-slots"


def test_a_broken_link_is_caught(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Title\n\n## Two words\n", encoding="utf-8")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#two-words) [gone](missing.md) [bad](a.md#three)\n"
                    "`[in code](nowhere.md)`\n\n```\n[fenced](nowhere.md)\n```\n",
                    encoding="utf-8")
    assert [b.split()[0] for b in broken_links(page)] == ["missing.md", "a.md#three"]
