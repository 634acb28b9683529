"""An unusable ``--results-uri`` (a scheme nobody knows, a path under a regular file) is refused before the run
starts: one ``error:`` line, exit 2, and nothing written, not even the database."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli_errors import assert_one_error_line, nightly_args, sidecar, write_corpus

from storage.errors import ResultsLocationError
from storage.parts import PartStore


def unusable(kind: str, tmp_path: Path) -> tuple[str, str]:
    """A results URI of the given kind, and what the error line must say about it."""
    if kind == "unknown-scheme":
        return "nosuchscheme://x", "nosuchscheme://x"
    (tmp_path / "plain-file").write_text("x")
    return str(tmp_path / "plain-file" / "parts"), "plain-file"


@pytest.mark.parametrize("kind", ["unknown-scheme", "under-a-file"])
def test_an_unusable_results_location_is_refused_when_opened(kind: str, tmp_path: Path) -> None:
    uri, fragment = unusable(kind, tmp_path)
    with pytest.raises(ResultsLocationError, match=fragment):
        PartStore.opened(uri)
    assert PartStore.opened(str(tmp_path / "new" / "parts")).is_local


@pytest.mark.servers
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["unknown-scheme", "under-a-file"])
def test_nightly_with_an_unusable_results_uri_exits_2_with_one_line_and_writes_nothing(kind: str,
                                                                                       tmp_path: Path) -> None:
    # the real command in a subprocess, on its own embedded API, as a user runs it
    uri, fragment = unusable(kind, tmp_path)
    db = tmp_path / "sidecar.duckdb"
    args = [*nightly_args(write_corpus(tmp_path / "news.parquet"), db), "--workers", "2", "--results-uri", uri]
    done = sidecar(args, {}, tmp_path)
    assert_one_error_line(done, 2, fragment, "results location")
    assert not db.exists()  # no database, so no run row either
