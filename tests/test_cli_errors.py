"""A user's error ends the ``sidecar`` command with one ``error:`` line, no traceback, and its documented exit code.

The database cases run the real command (``python -m cli``) in a process of its own, as a user or a scheduler runs
it: a ``--db`` that is a directory, a file that is not DuckDB, a path under a regular file, and a location nobody
may write (``/sys``, which refuses new files to root too; the tests run as root, so a chmod-ed directory would
prove nothing). One subprocess imports the CLI once and forks a child per command (``FORKED_COMMANDS``): each
import of torch, transformers and Prefect costs seconds of CPU, and a fork after it none.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from storage import Database, DatabaseLockedError, InputSchemaError, SchemaTooNewError, UnknownRunError

pytestmark = pytest.mark.servers  # the CLI in subprocesses

REPO = Path(__file__).resolve().parents[1]
READ_ONLY_DB = Path("/sys/sidecar-test.duckdb")


def _read_only_location_is_writable() -> bool:
    try:
        READ_ONLY_DB.open("xb").close()
    except OSError:
        return False
    READ_ONLY_DB.unlink()
    return True


def _read_only_location() -> Path:
    if _read_only_location_is_writable():
        pytest.skip(f"{READ_ONLY_DB.parent} is writable here")
    return READ_ONLY_DB


def unusable_db(kind: str, tmp_path: Path) -> tuple[Path, str]:
    """A --db path of the given kind, and what the error line must say about it."""
    if kind == "directory":
        path = tmp_path / "results.duckdb"
        path.mkdir()
        return path, "is a directory"
    if kind == "not-duckdb":
        path = tmp_path / "notes.duckdb"
        path.write_text("these are my notes, not a database\n")
        return path, "not a DuckDB database"
    if kind == "under-a-file":
        (tmp_path / "plain-file").write_text("x")
        return tmp_path / "plain-file" / "sidecar.duckdb", "is a file, not a directory"
    if kind == "read-only":
        return _read_only_location(), "permission denied"
    raise AssertionError(kind)


KINDS = ["directory", "not-duckdb", "under-a-file", "read-only"]


@pytest.mark.parametrize("kind", KINDS)
def test_database_open_errors_name_the_path_and_what_is_wrong(kind: str, tmp_path: Path) -> None:
    from storage import DatabaseOpenError

    path, problem = unusable_db(kind, tmp_path)
    with pytest.raises(DatabaseOpenError) as raised:
        Database(path)
    message = str(raised.value)
    assert str(path) in message and problem.lower() in message.lower(), message
    assert "\n" not in message
    assert raised.value.path == path


def test_exit_codes_of_user_errors() -> None:
    from cli.errors import EXIT_BAD_INPUT, EXIT_BUSY, EXIT_DATABASE_UNUSABLE, exit_code
    from sidecar.errors import InputError, PairError
    from storage import DatabaseOpenError, LockHeldError, RunMismatchError
    from storage.errors import LockHolder
    from study.cost import CostInputError

    assert (EXIT_BAD_INPUT, EXIT_DATABASE_UNUSABLE, EXIT_BUSY) == (2, 3, 4)
    assert exit_code(DatabaseOpenError(Path("x"), "it is a directory")) == 3
    assert exit_code(SchemaTooNewError(Path("x"), 9, 3)) == 3
    assert exit_code(DatabaseLockedError(Path("x"), 1, "python", 10, 5.0, "locked")) == 4
    assert exit_code(LockHeldError(Path("x.lock"), "run 'r'", LockHolder(1, "python"), 0.0)) == 4
    for error in (InputSchemaError("no column"), UnknownRunError("no run"), PairError("unknown pair"),
                  RunMismatchError("another corpus"),
                  InputError("empty"), CostInputError("negative"), FileNotFoundError("missing.parquet")):
        assert exit_code(error) == 2, error
    # a bug is not the user's error: it keeps its traceback and Python's exit code 1
    assert exit_code(KeyError("oops")) is None and exit_code(RuntimeError("oops")) is None


def test_usage_errors_exit_2() -> None:
    from cli.main import app

    result = CliRunner().invoke(app, ["nightly", "--no-such-option"])
    assert result.exit_code == 2, result.output


# -- the real command, in a subprocess -------------------------------------------------------------------------


def write_corpus(path: Path) -> Path:
    pq.write_table(pa.table({"id": ["a", "b"], "article": ["The council met on Tuesday.", "Prices rose again."],
                             "title": ["Council", "Prices"]}), path)
    return path


def sidecar(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env=os.environ | env | {"PYTHONPATH": str(REPO), "COLUMNS": "200"})


# Imports the CLI and what its commands import when they run, then runs each command of argv[1] (JSON: [args, cwd,
# stdout file, stderr file]) as ``python -m cli`` does, in a child forked per command, all at once; prints the
# children's exit codes (JSON).
FORKED_COMMANDS = """
import json, os, runpy, sys
import cli.main, flows.cost_report, flows.judge, flows.nightly, study.judge
children = []
for args, cwd, out, err in json.loads(sys.argv[1]):
    pid = os.fork()
    if pid == 0:
        os.chdir(cwd)
        for fd, name in ((1, out), (2, err)):
            os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.argv = ["cli", *args]
        runpy.run_module("cli", run_name="__main__", alter_sys=True)
        sys.exit(0)
    children.append(pid)
print(json.dumps([os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]))
"""


def sidecars(commands: list[tuple[list[str], Path]], env: dict[str, str],
             logs: Path) -> list[subprocess.CompletedProcess[str]]:
    """Each command's exit code, stdout and stderr, as ``sidecar <args>`` run in its directory gives them."""
    files = [(str(logs / f"{i}.out"), str(logs / f"{i}.err")) for i in range(len(commands))]
    todo = [[args, str(cwd), out, err] for (args, cwd), (out, err) in zip(commands, files, strict=True)]
    parent = subprocess.run([sys.executable, "-c", FORKED_COMMANDS, json.dumps(todo)], capture_output=True,
                            text=True, timeout=600, env=os.environ | env | {"PYTHONPATH": str(REPO), "COLUMNS": "200"})
    assert parent.returncode == 0, parent.stderr
    codes = json.loads(parent.stdout.splitlines()[-1])
    return [subprocess.CompletedProcess(args, code, Path(out).read_text(), Path(err).read_text())
            for (args, _), code, (out, err) in zip(commands, codes, files, strict=True)]


def assert_one_error_line(done: subprocess.CompletedProcess[str], code: int, *fragments: str) -> None:
    output = f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    assert done.returncode == code, output
    assert "Traceback" not in output
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output
    for fragment in fragments:
        assert fragment.lower() in errors[0].lower(), output


def nightly_args(corpus: Path, db: Path) -> list[str]:
    return ["nightly", "--corpus", str(corpus), "--pair", "tiny", "--db", str(db), "--max-new-tokens", "4",
            "--no-judge", "--no-cost-report"]


@dataclass(frozen=True)
class Command:
    """A ``sidecar`` command of a test below, the directory it runs in, and what its one error line must say."""

    args: list[str]
    cwd: Path
    fragments: tuple[str, ...]


def commands(tmp: pytest.TempPathFactory) -> dict[str, Command]:
    """The commands of the tests below, by name."""
    found: dict[str, Command] = {}
    for kind in KINDS:
        if kind == "read-only" and _read_only_location_is_writable():
            continue  # its test skips
        where = tmp.mktemp(f"nightly-{kind}")
        db, problem = unusable_db(kind, where)
        found[f"nightly-{kind}"] = Command(nightly_args(write_corpus(where / "news.parquet"), db), where,
                                           (str(db), problem))
    where = tmp.mktemp("nightly-missing-corpus")
    missing = where / "missing.parquet"
    found["nightly-missing-corpus"] = Command(nightly_args(missing, where / "sidecar.duckdb"), where,
                                              (str(missing), "does not exist"))
    # the database is opened before the endpoint is asked anything: this one does not exist
    where = tmp.mktemp("judge-not-duckdb")
    db, problem = unusable_db("not-duckdb", where)
    found["judge-not-duckdb"] = Command(["judge", "--run-id", "r", "--db", str(db), "--base-url",
                                         "http://127.0.0.1:9/v1", "--model", "m"], where, (str(db), problem))
    where = tmp.mktemp("judge-unknown-run")
    found["judge-unknown-run"] = Command(["judge", "--run-id", "no-such-run", "--db", str(where / "sidecar.duckdb"),
                                          "--base-url", "http://127.0.0.1:9/v1", "--model", "m"], where,
                                         ("'no-such-run' does not exist",))
    where = tmp.mktemp("demo-directory")
    db, problem = unusable_db("directory", where)
    found["demo-directory"] = Command(["demo", "--corpus", str(write_corpus(where / "news.parquet")), "--pair", "tiny",
                                       "--limit", "2", "--db", str(db), "--max-new-tokens", "4"], where,
                                      (str(db), problem))
    return found


Ran = dict[str, tuple[subprocess.CompletedProcess[str], Command]]


@pytest.fixture(scope="module")
def ran(prefect_api, tmp_path_factory: pytest.TempPathFactory) -> Ran:
    """Every command of the tests below, forked after one import of the CLI (8 commands: importing torch,
    transformers and Prefect in each took about 70 s of CPU in all)."""
    todo = commands(tmp_path_factory)
    done = sidecars([(c.args, c.cwd) for c in todo.values()], prefect_api, tmp_path_factory.mktemp("logs"))
    return {name: (result, command) for (name, command), result in zip(todo.items(), done, strict=True)}


def assert_ran_with_one_error_line(ran: Ran, name: str, code: int) -> None:
    if name not in ran:
        pytest.skip(f"{READ_ONLY_DB.parent} is writable here")
    done, command = ran[name]
    assert_one_error_line(done, code, *command.fragments)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_nightly_on_an_unusable_database_exits_3_with_one_line(kind: str, ran: Ran) -> None:
    assert_ran_with_one_error_line(ran, f"nightly-{kind}", 3)


@pytest.mark.slow
def test_nightly_on_a_missing_corpus_exits_2_with_one_line(ran: Ran) -> None:
    assert_ran_with_one_error_line(ran, "nightly-missing-corpus", 2)


@pytest.mark.slow
def test_judge_on_an_unusable_database_exits_3_with_one_line(ran: Ran) -> None:
    assert_ran_with_one_error_line(ran, "judge-not-duckdb", 3)


@pytest.mark.slow
def test_judge_of_an_unknown_run_exits_2_with_one_line(ran: Ran) -> None:
    assert_ran_with_one_error_line(ran, "judge-unknown-run", 2)


@pytest.mark.slow
def test_demo_on_an_unusable_database_exits_3_with_one_line(ran: Ran) -> None:
    assert_ran_with_one_error_line(ran, "demo-directory", 3)


@pytest.mark.parametrize(("corpus", "fragments"), [
    ("absent.jsonl", ["absent.jsonl", "does not exist"]),
    ("news.csv", ["news.csv has no text column 'article'", "id, body"]),
    ("news.xlsx", ["news.xlsx", ".jsonl", "extension"]),
])
def test_a_corpus_that_cannot_be_read_creates_no_database_file(tmp_path: Path, corpus: str,
                                                               fragments: list[str]) -> None:
    from cli.main import app

    (tmp_path / "news.csv").write_text("id,body\na,The council met.\n")
    (tmp_path / "news.xlsx").write_text("")
    db = tmp_path / "out" / "sidecar.duckdb"
    for command in ("nightly", "demo"):
        result = CliRunner().invoke(app, [command, "--corpus", str(tmp_path / corpus), "--pair", "tiny", "--db",
                                          str(db)])
        assert result.exit_code == 2, result.output
        [line] = result.output.strip().splitlines()[-1:]
        assert line.startswith("error: ") and all(f in line for f in fragments), line
        assert not db.parent.exists()


def test_generate_skips_a_text_line_that_is_not_utf8_and_names_it(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A bad line in a text input raised UnicodeDecodeError for the whole file; now it is that line's reject."""
    from cli.generate import read_inputs

    path = tmp_path / "inputs.txt"
    path.write_bytes(b"First article.\n\xff\xfe latin-1 caf\xe9\n\nThird article, caf\xc3\xa9.\n")
    assert read_inputs(str(path), "article", None, None) == [("1", "First article."), ("4", "Third article, café.")]
    assert "skipped line 2: not_utf8" in capsys.readouterr().err
