"""The docs name only what exists: the tests, `make` targets and linked files that README.md and docs/*.md cite."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TEST_FILE = re.compile(r"tests/(test_\w+\.py)")
MAKE_TARGET = re.compile(r"`make ([\w-]+)")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def defined_tests() -> dict[str, set[str]]:
    """Each test module's test functions, by file name."""
    return {path.name: set(re.findall(r"^\s*(?:async )?def (test_\w+)", path.read_text(), re.M))
            for path in (REPO / "tests").glob("test_*.py")}


def missing_references(doc: Path, tests: dict[str, set[str]], targets: set[str]) -> list[str]:
    """What `doc` names that is not there: test files, test functions, make targets, linked repo files."""
    missing, every_test = [], set().union(*tests.values())
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        where = f"{doc.relative_to(REPO)}:{number}"
        missing += [f"{where}: tests/{name}" for name in TEST_FILE.findall(line) if name not in tests]
        last_file = None  # `::test_y` names a test of the file named last before it on the line
        for match in re.finditer(rf"{TEST_FILE.pattern}(?:::(test_\w+))?|::(test_\w+)|`(test_\w+)", line):
            file, named, continued, bare = match.groups()
            if file:
                last_file = file
            name, in_file = named or continued, file or last_file
            if name and in_file in tests and name not in tests[in_file]:
                missing.append(f"{where}: tests/{in_file}::{name}")
            if bare and bare not in every_test and bare + ".py" not in tests:
                missing.append(f"{where}: {bare}")
        missing += [f"{where}: make {t}" for t in MAKE_TARGET.findall(line) if t not in targets]
        for link in LINK.findall(line):
            path = link.split("#")[0]
            if path and not re.match(r"[a-z]+:", path) and not (doc.parent / path).exists():
                missing.append(f"{where}: link {link}")
    return missing


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_every_test_target_and_linked_file_a_doc_names_exists(doc: Path) -> None:
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    assert missing_references(doc, defined_tests(), targets) == []


def test_the_readme_stays_within_12_kb() -> None:
    # the README is the front page: what does not fit belongs in docs/
    assert (REPO / "README.md").stat().st_size <= 12 * 1024
