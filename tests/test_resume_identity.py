"""A run id reused for another corpus or other settings is refused, and the refusal writes nothing.

A resume is proven, not assumed: every stored input row comes again with the same id, title and text, and
the decisive settings (pair, gamma, modes and the caller's identity) are the ones the run was started
with; where it runs (device, GPU type) may change. On a real DuckDB file, with Parquet corpora written in
tmp_path.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from storage import Database, Document, OutputRecord, RejectedDocument, RunMismatchError, RunStart, SidecarRecord
from storage.parquet import read_documents

TABLES = ("runs", "documents", "outputs", "sidecar_outputs", "request_stats", "judgement_games", "judge_settings",
          "cost_estimates")
IDENTITY = {"max_new_tokens": 12, "sidecar_tasks": [{"name": "hashtags", "instruction": "Then tags."}]}


def corpus(path: Path, ids: list[str], texts: list[str] | None = None) -> Path:
    texts = texts if texts is not None else [f"The text of {doc_id}." for doc_id in ids]
    pq.write_table(pa.table({"id": ids, "article": texts}), path)
    return path


def begin(db: Database, path: Path, run_id: str = "run-1", limit: int | None = None, **overrides: Any) -> RunStart:
    docs, rejects = read_documents(path, limit=limit)
    args: dict[str, Any] = {"params": {"corpus": str(path), "limit": limit}, "pair": "tiny", "device": "cpu",
                            "gpu_type": "cpu", "gamma": 4, "batch_size": 2, "modes": ("sidecar", "standalone"),
                            "identity": IDENTITY, "code_version": "test"} | overrides
    return db.begin_run(run_id, docs=docs, rejects=rejects, **args)


def outputs(doc_id: str) -> list[OutputRecord]:
    return [OutputRecord(doc_id=doc_id, mode=mode, summary=f"Summary of {doc_id}.",
                         sidecars=[SidecarRecord.of("hashtags", "#tag", ["#tag"])])
            for mode in ("sidecar", "standalone")]


def snapshot(db: Database) -> tuple[str, dict[str, list[tuple[Any, ...]]]]:
    """The file's bytes (as a digest) and every row of every table, in a stable order."""
    rows = {}
    for table in TABLES:
        names = [r["column_name"] for r in db.query(
            "SELECT column_name FROM duckdb_columns() WHERE table_name = ? ORDER BY column_index", [table])]
        ordered = ", ".join(str(i + 1) for i in range(len(names)))
        rows[table] = [tuple(r.values()) for r in db.query(f"SELECT * FROM {table} ORDER BY {ordered}")]
    return hashlib.sha256(db.path.read_bytes()).hexdigest(), rows


@pytest.fixture
def finished(tmp_path: Path) -> tuple[Database, Path]:
    """A completed run of three documents."""
    db = Database(tmp_path / "sidecar.duckdb")
    first = corpus(tmp_path / "first.parquet", ["a", "b", "c"])
    begin(db, first)
    db.write_batch("run-1", [r for doc_id in ("a", "b", "c") for r in outputs(doc_id)], finish="completed")
    return db, first


def refused(db: Database, match: str, path: Path, **overrides: Any) -> RunMismatchError:
    before = snapshot(db)
    with pytest.raises(RunMismatchError, match=match) as caught:
        begin(db, path, **overrides)
    assert snapshot(db) == before, "a refused resume must leave the database exactly as it was"
    assert "\n" not in str(caught.value), "one line"
    return caught.value


def test_another_corpus_under_the_same_run_id_is_refused(finished, tmp_path: Path) -> None:
    db, _ = finished
    other = corpus(tmp_path / "other.parquet", ["x", "y", "z"])
    error = refused(db, "row 0", other)
    assert "'a'" in str(error) and "'x'" in str(error)
    assert db.get_run("run-1")["status"] == "completed"
    assert [r["doc_id"] for r in db.results("run-1")] == ["a", "b", "c"]


def test_same_ids_with_other_text_are_refused(finished, tmp_path: Path) -> None:
    db, _ = finished
    edited = corpus(tmp_path / "edited.parquet", ["a", "b", "c"],
                    ["The text of a.", "An edited text of b.", "The text of c."])
    error = refused(db, "row 1", edited)
    assert "'b'" in str(error) and "content" in str(error)


def test_a_resume_that_leaves_stored_rows_out_is_refused(finished) -> None:
    db, first = finished
    refused(db, "2 stored input rows", first, limit=1)


@pytest.mark.parametrize(("override", "named"), [
    ({"pair": "qwen-coder-small"}, "pair"),
    ({"gamma": 2}, "gamma"),
    ({"modes": ("sidecar",)}, "modes"),
    ({"identity": IDENTITY | {"max_new_tokens": 64}}, "max_new_tokens"),
    ({"identity": IDENTITY | {"sidecar_tasks": [{"name": "hashtags", "instruction": "Then other tags."}]}},
     "sidecar_tasks differ in hashtags.instruction"),
    ({"identity": IDENTITY | {"sidecar_tasks": [{"name": "hashtags", "instruction": "Then tags."},
                                                {"name": "headline", "instruction": "Then a headline."}]}},
     re.escape("sidecar_tasks hashtags (this start: hashtags, headline)")),
])
def test_other_decisive_settings_are_refused(finished, override: dict[str, Any], named: str) -> None:
    db, first = finished
    error = refused(db, named, first, **override)
    assert "another run id" in str(error)


def test_the_same_run_resumes_and_may_grow_or_change_what_is_not_decisive(finished, tmp_path: Path) -> None:
    db, _ = finished
    # batch size, device, the corpus's path and the recorded params do not decide the outputs
    copied = corpus(tmp_path / "copy.parquet", ["a", "b", "c"])
    start = begin(db, copied, batch_size=8, device="cpu:1", params={"note": "retry"}, modes=("standalone", "sidecar"))
    assert (start.resumed, start.done_doc_ids) == (True, {"a", "b", "c"})
    # more rows of the same corpus extend the run; the stored ones are checked, the new ones added
    grown = corpus(tmp_path / "grown.parquet", ["a", "b", "c", "d"])
    assert begin(db, grown).done_doc_ids == {"a", "b", "c"}
    assert [r["doc_id"] for r in db.query("SELECT doc_id FROM documents ORDER BY row_index")] == ["a", "b", "c", "d"]


def test_another_device_or_gpu_type_resumes_because_each_request_records_where_it_ran(finished) -> None:
    db, first = finished
    # in-process on another GPU, then as shards (whose parent records no device): the same run each time
    assert begin(db, first, device="cuda:0", gpu_type="NVIDIA H200").resumed
    assert begin(db, first, device=None, gpu_type=None).done_doc_ids == {"a", "b", "c"}
    run = db.get_run("run-1")
    assert (run["device"], run["gpu_type"]) == ("cpu", "cpu"), "the run's row keeps its first start's"


def test_a_document_that_ran_out_of_memory_is_retried_on_resume(tmp_path: Path) -> None:
    db = Database(tmp_path / "sidecar.duckdb")
    path = corpus(tmp_path / "news.parquet", ["a", "b"])
    begin(db, path)
    [_, b] = read_documents(path)[0]
    oom = RejectedDocument(b.doc_id, "oom", b.row_index, detail="CUDA out of memory", text=b.text)
    db.write_batch("run-1", outputs("a"), rejects=[oom], finish="completed")
    assert begin(db, path).done_doc_ids == {"a"}
    assert [r["status"] for r in db.query("SELECT status FROM documents ORDER BY row_index")] == ["ok", "ok"]


def test_a_run_started_without_an_identity_cannot_be_resumed_with_one(tmp_path: Path) -> None:
    db = Database(tmp_path / "sidecar.duckdb")
    path = corpus(tmp_path / "news.parquet", ["a"])
    begin(db, path, identity=None)
    refused(db, "max_new_tokens not recorded", path)


def test_record_documents_refuses_to_replace_a_row_with_another_document(tmp_path: Path) -> None:
    db = Database(tmp_path / "sidecar.duckdb")
    begin(db, corpus(tmp_path / "news.parquet", ["a", "b"]))
    before = snapshot(db)
    with pytest.raises(RunMismatchError, match="row 0"):
        db.record_documents("run-1", [Document("x", "Another text.", 0)], [])
    # a new row may not reuse the id of a stored usable document either
    with pytest.raises(ValueError, match="'b'"):
        db.record_documents("run-1", [Document("b", "The text of b.", 5)], [])
    assert snapshot(db) == before


def test_the_cli_prints_a_refused_resume_as_one_line_with_exit_code_2(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    import flows.nightly
    from cli.main import app

    def nightly(**params):
        raise RunMismatchError("run 'run-1' exists with other documents: row 0 is 'a' there, 'x' here")

    monkeypatch.setattr(flows.nightly, "nightly", nightly)
    # the command checks the corpus's columns before the flow starts: a real one
    news = corpus(tmp_path / "news.parquet", ["x"])
    result = CliRunner().invoke(app, ["nightly", "--corpus", str(news), "--pair", "tiny", "--run-id", "run-1"])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        "error: run 'run-1' exists with other documents: row 0 is 'a' there, 'x' here"]
