"""docs/scenarios.md names the tests that cover each scenario: every one it names exists, and
every scenario code a test module cites is one the document defines."""

from __future__ import annotations

import re

from tests.harness.procs import REPO_ROOT

DOC = REPO_ROOT / "docs" / "scenarios.md"
TESTS = REPO_ROOT / "tests"


def named_tests() -> list[tuple[str, str]]:
    """(path under tests/, function) for every ``path::name`` and each ``::name`` after it."""
    found = []
    for cell in re.findall(r"^\|[^|]+\|[^|]+\|(.+)\|$", DOC.read_text(), flags=re.M):
        path = ""
        for ref in re.findall(r"`([^`]+)`", cell):
            if "::" not in ref:
                continue
            head, name = ref.split("::", 1)
            path = head or path
            found.append((path, name))
    return found


def test_every_test_the_document_names_exists() -> None:
    named = named_tests()
    assert len(named) > 60
    missing = [
        f"{path}::{name}"
        for path, name in named
        if not (TESTS / path).exists()
        or not re.search(rf"^(async )?def {name}\(", (TESTS / path).read_text(), flags=re.M)
    ]
    assert missing == []


def test_every_code_a_test_cites_is_defined_in_the_document() -> None:
    defined = set(re.findall(r"^\| ([LCNGUAS]\d+) \|", DOC.read_text(), flags=re.M))
    cited: set[str] = set()
    for module in TESTS.rglob("test_*.py"):
        cited.update(
            re.findall(r"\[([LCNGUAS]\d{1,2})\]|\b([LCNGUAS]\d{1,2})\b:", module.read_text())
        )
    codes = {code for pair in cited for code in pair if code}
    assert codes and codes <= defined, sorted(codes - defined)


def test_every_scenario_code_is_defined_once() -> None:
    codes = re.findall(r"^\| ([LCNGUAS]\d+) \|", DOC.read_text(), flags=re.M)
    assert len(codes) > 60
    assert sorted(c for c in set(codes) if codes.count(c) > 1) == []
