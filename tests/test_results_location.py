"""An unusable ``--results-uri`` (a scheme nobody knows, a path under a regular file) is refused before the run
starts: one ``error:`` line, exit 2, and nothing written, not even the database."""

from __future__ import annotations

from pathlib import Path
from subprocess import CompletedProcess

import pytest
from test_cli_errors import assert_one_error_line, nightly_args, sidecars, write_corpus

from storage.errors import ResultsLocationError
from storage.parts import PartStore

KINDS = ["unknown-scheme", "under-a-file"]
# by kind: the command's outcome, its --db path and what its error line must say
Refused = dict[str, tuple[CompletedProcess[str], Path, str]]


def unusable(kind: str, tmp_path: Path) -> tuple[str, str]:
    """A results URI of the given kind, and what the error line must say about it."""
    if kind == "unknown-scheme":
        return "nosuchscheme://x", "nosuchscheme://x"
    (tmp_path / "plain-file").write_text("x")
    return str(tmp_path / "plain-file" / "parts"), "plain-file"


@pytest.mark.parametrize("kind", KINDS)
def test_an_unusable_results_location_is_refused_when_opened(kind: str, tmp_path: Path) -> None:
    uri, fragment = unusable(kind, tmp_path)
    with pytest.raises(ResultsLocationError, match=fragment):
        PartStore.opened(uri)
    assert PartStore.opened(str(tmp_path / "new" / "parts")).is_local


@pytest.fixture(scope="module")
def refused(prefect_api, tmp_path_factory: pytest.TempPathFactory) -> Refused:
    """`sidecar nightly` with each kind of unusable ``--results-uri``: the real command, run as ``python -m cli``
    is, in a child forked per command after one import of the CLI (``test_cli_errors.sidecars``), on the module's
    Prefect API: an embedded API per command, and the imports of each, cost more than the refusals themselves."""
    todo = {}
    for kind in KINDS:
        where = tmp_path_factory.mktemp(kind)
        uri, fragment = unusable(kind, where)
        db = where / "sidecar.duckdb"
        args = [*nightly_args(write_corpus(where / "news.parquet"), db), "--workers", "2", "--results-uri", uri]
        todo[kind] = (args, where, db, fragment)
    done = sidecars([(args, where) for args, where, _, _ in todo.values()], prefect_api,
                    tmp_path_factory.mktemp("logs"))
    return {kind: (result, db, fragment) for (kind, (_, _, db, fragment)), result in zip(todo.items(), done,
                                                                                          strict=True)}


@pytest.mark.servers
@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_nightly_with_an_unusable_results_uri_exits_2_with_one_line_and_writes_nothing(kind: str,
                                                                                       refused: Refused) -> None:
    done, db, fragment = refused[kind]
    assert_one_error_line(done, 2, fragment, "results location")
    assert not db.exists()  # no database, so no run row either
