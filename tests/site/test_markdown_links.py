"""Every relative link in the repository's Markdown files names a file that exists, and every
anchor a heading of the page it points to, so a page moved or a heading renamed cannot leave a
link behind that leads nowhere."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

from tests.harness.procs import REPO_ROOT

# Folders that hold no page of ours: hidden ones (.git, .venv, .ci), what runs write, and
# installed packages.
SKIPPED = {"var", "node_modules", "__pycache__"}
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"`+[^`]*`+")
# [text](target) and ![alt](target), the target up to a space (a title may follow) or ")".
INLINE = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+[^)]*)?\)")
# [label]: target
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def markdown_files(root: Path) -> list[Path]:
    found = []
    for path in sorted(root.rglob("*.md")):
        parts = path.relative_to(root).parts[:-1]
        if not any(p.startswith(".") or p in SKIPPED for p in parts):
            found.append(path)
    return found


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) for each line outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            yield number, line


def links(text: str) -> Iterator[tuple[int, str]]:
    """(line number, target) of every link outside code."""
    for number, raw in prose_lines(text):
        line = CODE_SPAN.sub("", raw)
        for match in INLINE.finditer(line):
            yield number, match.group(1)
        reference = REFERENCE.match(line)
        if reference:
            yield number, reference.group(1)


def anchors(text: str) -> set[str]:
    """Every heading's anchor as GitHub makes it: lower case, punctuation (backticks included)
    dropped, spaces to hyphens; a repeated heading gets ``-1``, ``-2``..."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(text):
        match = HEADING.match(line)
        if not match:
            continue
        base = re.sub(r"[^\w\- ]", "", match.group(2).lower()).replace(" ", "-")
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(root: Path) -> list[str]:
    """``file:line: target (why)`` for each relative link that leads nowhere."""
    broken = []
    for page in markdown_files(root):
        for number, target in links(page.read_text()):
            if SCHEME.match(target) or target.startswith("//"):
                continue  # another site's: not ours to check
            path_part, _, fragment = target.partition("#")
            destination = (page.parent / unquote(path_part)).resolve() if path_part else page
            where = f"{page.relative_to(root)}:{number}: {target}"
            if not destination.exists():
                broken.append(f"{where} (no such file)")
            elif fragment and destination.suffix == ".md":
                if unquote(fragment).lower() not in anchors(destination.read_text()):
                    broken.append(f"{where} (no such heading)")
    return broken


def test_every_relative_link_in_the_repositorys_markdown_leads_to_a_file_and_heading() -> None:
    pages = markdown_files(REPO_ROOT)
    assert REPO_ROOT / "README.md" in pages and REPO_ROOT / "docs" / "operations.md" in pages
    relative = [
        target
        for page in pages
        for _, target in links(page.read_text())
        if not SCHEME.match(target)
    ]
    assert len(relative) > 30  # the README alone links every page of docs/
    assert broken_links(REPO_ROOT) == []


def test_a_link_to_a_missing_file_or_heading_is_reported(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# The guide\n\n## Two `words`: here\n")
    (tmp_path / "README.md").write_text(
        "See [the guide](docs/guide.md), [its part](docs/guide.md#two-words-here),\n"
        "[gone](docs/gone.md), [no part](docs/guide.md#nowhere) and [a site](https://x.example).\n"
        "```\n[in code](docs/also-gone.md)\n```\n"
        "`[in a span](docs/spanned.md)` and [here](#the-readme)\n\n# The README\n"
        "[ref]: docs/missing.md\n"
    )
    assert broken_links(tmp_path) == [
        "README.md:2: docs/gone.md (no such file)",
        "README.md:2: docs/guide.md#nowhere (no such heading)",
        "README.md:9: docs/missing.md (no such file)",
    ]


def test_headings_get_githubs_anchors() -> None:
    text = "# llmgw\n## The console: `/admin/`\n## Leadership\n## Leadership\n```\n# not one\n```\n"
    assert anchors(text) == {"llmgw", "the-console-admin", "leadership", "leadership-1"}
