"""The docs name only what exists: the tests, `make` targets, linked files, repository paths, `python -m` modules
and `sidecar` commands that README.md and docs/*.md cite."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TEST_FILE = re.compile(r"tests/(test_\w+\.py)")
MAKE_TARGET = re.compile(r"`make ([\w-]+)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`]+)`")
# a path in a code span that starts at one of the repository's top-level directories
TOP_DIRS = "|".join(re.escape(p.name) for p in sorted(REPO.iterdir()) if p.is_dir() and p.name not in {".git", ".venv"})
REPO_PATH = re.compile(rf"(?<![\w./-])((?:{TOP_DIRS})/[\w./-]*\w/?)")
MODULE = re.compile(r"python3? -m ([\w.]+)")
SIDECAR_COMMAND = re.compile(r"(?:^|[\s;&|(])sidecar ([a-z][\w-]*)(?: ([a-z][\w-]*))?")
# what runs write, named as where to find it: not in a fresh checkout (test-artifacts/: a test run's; .prefect/:
# a local Prefect home)
WRITTEN = {"data/sidecar.duckdb", "bench/results/gpu_check.md", "bench/results/NAME.json",
           "bench/results/gpu_check_step_costs.json",
           # the host-overhead benchmark's results, committed once run on a quiet machine (and a GPU)
           "bench/results/host_overhead_gpu.json", "bench/results/host_overhead_cpu.json"}
WRITTEN_UNDER = ("test-artifacts/", ".prefect/")


def defined_tests() -> dict[str, set[str]]:
    """Each test module's test functions, by file name."""
    return {path.name: set(re.findall(r"^\s*(?:async )?def (test_\w+)", path.read_text(), re.M))
            for path in (REPO / "tests").glob("test_*.py")}


def missing_references(doc: Path, tests: dict[str, set[str]], targets: set[str]) -> list[str]:
    """What `doc` names that is not there: test files, test functions, make targets, linked repo files."""
    missing, every_test = [], set().union(*tests.values())
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        where = f"{shown(doc)}:{number}"
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
        for code in CODE_SPAN.findall(line):
            missing += [f"{where}: {path}" for path in REPO_PATH.findall(code)
                        if path not in WRITTEN and not path.startswith(WRITTEN_UNDER) and not (REPO / path).exists()]
            missing += [f"{where}: python -m {module}" for module in MODULE.findall(code)
                        if not is_module(module)]
    return missing


def shown(doc: Path) -> str:
    return str(doc.relative_to(REPO)) if doc.is_relative_to(REPO) else doc.name


def is_module(module: str) -> bool:
    """A module of this repository's tree, or an installed one (``python -m pytest``)."""
    path = REPO / module.replace(".", "/")
    if (REPO / module.split(".")[0]).is_dir():
        return path.with_suffix(".py").exists() or (path / "__main__.py").exists()
    return importlib.util.find_spec(module) is not None


def missing_commands(doc: Path, commands: dict[str, set[str] | None]) -> list[str]:
    """The `sidecar ...` commands in ``doc``'s code spans that the CLI lacks (``commands``: each command's
    subcommands, None for a command without any)."""
    missing = []
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        for code in CODE_SPAN.findall(line):
            for command, sub in SIDECAR_COMMAND.findall(code):
                if command not in commands or (sub and commands[command] is not None and sub not in commands[command]):
                    missing.append(f"{shown(doc)}:{number}: sidecar {command} {sub}".rstrip())
    return missing


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_every_test_target_and_linked_file_a_doc_names_exists(doc: Path) -> None:
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    assert missing_references(doc, defined_tests(), targets) == []


def test_every_sidecar_command_the_docs_name_exists() -> None:
    import typer.main

    from cli.main import app

    group = typer.main.get_command(app)
    commands = {name: set(c.commands) if hasattr(c, "commands") else None for name, c in group.commands.items()}
    assert commands.get("models"), "the CLI's commands and subcommands should be read"
    assert [line for doc in DOCS for line in missing_commands(doc, commands)] == []


def test_the_references_of_a_planted_doc_that_do_not_exist_are_named(tmp_path: Path) -> None:
    doc = tmp_path / "planted.md"
    doc.write_text("Run `python -m bench.no_such_module`, read `sidecar/no_such_file.py`, `tests/test_docs.py`, "
                   "`python -m bench.gpu_check`, `python -m pytest`, `python -m no_such_package`;\n"
                   "`sidecar no-such-command`, `sidecar models fetch`, `sidecar models nope`.\n")
    assert sorted(missing_references(doc, defined_tests(), set())) == [
        "planted.md:1: python -m bench.no_such_module", "planted.md:1: python -m no_such_package",
        "planted.md:1: sidecar/no_such_file.py"]
    assert missing_commands(doc, {"models": {"fetch"}}) == [
        "planted.md:2: sidecar no-such-command", "planted.md:2: sidecar models nope"]


def test_the_readme_stays_within_12_kb() -> None:
    # the README is the front page: what does not fit belongs in docs/
    assert (REPO / "README.md").stat().st_size <= 12 * 1024
