"""storage.Database: migrations, idempotent writes, the views and hostile strings, on a real DuckDB file."""

from __future__ import annotations

import ast
import contextlib
import json
import re
import statistics
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import get_args, get_type_hints

import duckdb
import pytest

from sidecar.decoding.stats import GenerationStats
from storage import (
    CostRecord,
    Database,
    Document,
    JudgementRecord,
    JudgementScoreRecord,
    JudgeSettingsRecord,
    OutputRecord,
    RejectedDocument,
    RequestStats,
    RunStart,
    SchemaTooNewError,
    SidecarRecord,
    UnknownRunError,
)
from storage.connection import RetryPolicy
from storage.migrate import Migration, known_migrations, migrate
from storage.records import AttemptStatus, CostSource, CostTiming, GameKind, JudgeMode, Phase, RunStatus
from storage.tables import SCHEMAS, DocumentStatus
from storage.writer import TABLE_KEYS
from vocab.modes import MODES

TABLES = {"schema_migrations", "runs", "documents", "outputs", "sidecar_outputs", "request_stats", "judgement_games",
          "judgement_scores", "judge_settings", "judge_tasks", "cost_estimates", "ingested_parts", "shard_attempts"}
VIEWS = {"results", "throughput", "judgements", "judge_documents", "judge_quality", "judge_headline", "judge_verdicts",
         "costs", "run_captures"}


def start(db: Database, run_id: str = "run-1", modes=("sidecar", "standalone"), **overrides) -> bool:
    args = {"params": {"limit": 4}, "pair": "tiny", "device": "cpu", "gpu_type": "cpu", "gamma": 4,
            "batch_size": 2, "code_version": "test", "modes": modes} | overrides
    return db.start_run(run_id, **args)


def output(doc_id: str, mode: str, tags: list[str] | None = None, batch_id: int | None = 0,
           stats: list[RequestStats] | None = None, summary: str = "A summary.") -> OutputRecord:
    return OutputRecord(
        doc_id=doc_id, mode=mode, summary=summary,
        sidecars=[SidecarRecord.of("hashtags", " ".join(tags or []), tags, finish_reason="eos")],
        main_tokens=None if mode == "standalone" else 12, finish_reason="eos", batch_id=batch_id,
        stats=stats if stats is not None else [RequestStats("main", new_tokens=12, drafted=16, accepted=10,
                                                            target_forwards=4, wall_s=2.0)],
    )


def table_names(path: Path) -> tuple[set[str], set[str]]:
    with duckdb.connect(str(path)) as con:
        tables = {r[0] for r in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
        views = {r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}
    return tables, views


@pytest.fixture
def db(tmp_path: Path) -> Database:
    return Database(tmp_path / "sidecar.duckdb")


# -- migrations -----------------------------------------------------------------------------------------


def test_fresh_database_gets_every_migration(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "dir" / "fresh.duckdb"
    db = Database(path)
    assert db.schema_version == len(known_migrations()) >= 1
    tables, views = table_names(path)
    assert tables >= TABLES
    assert views >= VIEWS
    applied = db.query("SELECT version, name FROM schema_migrations ORDER BY version")
    assert [(r["version"], r["name"]) for r in applied] == [(m.version, m.name) for m in known_migrations()]


def test_reopening_keeps_data_and_applies_nothing_twice(db: Database) -> None:
    start(db)
    reopened = Database(db.path)
    assert reopened.schema_version == db.schema_version
    assert reopened.query("SELECT count(*) AS n FROM schema_migrations")[0]["n"] == len(known_migrations())
    assert reopened.get_run("run-1") is not None


def test_newer_schema_is_refused_and_left_untouched(db: Database) -> None:
    with duckdb.connect(str(db.path)) as con:
        con.execute("INSERT INTO schema_migrations (version, name) VALUES (999, 'from_the_future')")
    with pytest.raises(SchemaTooNewError) as caught:
        Database(db.path)
    assert caught.value.db_version == 999
    assert caught.value.code_version == len(known_migrations())
    assert "999" in str(caught.value) and "upgrade sidecar" in str(caught.value)
    with duckdb.connect(str(db.path)) as con:
        assert con.execute("SELECT max(version) FROM schema_migrations").fetchall() == [(999,)]


def test_pending_migrations_apply_in_order_and_a_failing_one_leaves_nothing(db: Database) -> None:
    shipped = known_migrations()
    broken = Migration(len(shipped) + 1, "broken", "CREATE TABLE half_done (x INTEGER); SELECT no_such_column;")
    with pytest.raises(duckdb.Error):
        migrate(db.path, RetryPolicy(), [*shipped, broken])
    tables, _ = table_names(db.path)
    assert "half_done" not in tables
    assert Database(db.path).schema_version == len(shipped)

    extra = Migration(len(shipped) + 1, "extra", "CREATE TABLE extra (x INTEGER);")
    assert migrate(db.path, RetryPolicy(), [*shipped, extra]) == len(shipped) + 1
    assert "extra" in table_names(db.path)[0]
    # the code without the extra migration now meets a newer database
    with pytest.raises(SchemaTooNewError):
        Database(db.path)


# -- the migrated tables match the records ---------------------------------------------------------------


@pytest.mark.parametrize("table", sorted(TABLE_KEYS))
def test_each_written_table_has_the_columns_its_record_derives(db: Database, table: str) -> None:
    """Migrations stay SQL; the Arrow schema the writer derives from the records must name the same
    columns, with the types DuckDB gives them and NOT NULL where the annotation admits no None."""
    derived = SCHEMAS[table]
    assert set(TABLE_KEYS[table]) <= set(derived.names)
    with duckdb.connect(str(db.path)) as con:
        migrated = {name: (dtype, null == "YES", default)
                    for name, dtype, null, _, default, _ in con.execute(f"DESCRIBE {table}").fetchall()}
        con.register("derived", derived.empty_table())
        as_sql = {name: dtype for name, dtype, *_ in con.execute("DESCRIBE derived").fetchall()}
    # only the database's own columns, filled by their default, are not written
    unwritten = {name: default for name, (_, _, default) in migrated.items() if name not in derived.names}
    assert None not in unwritten.values(), f"{table} has columns nothing writes: {unwritten}"
    assert {name: migrated[name][:2] for name in derived.names if name in migrated} == {
        f.name: (as_sql[f.name], f.nullable) for f in derived}


def check_values(path: Path, table: str, column: str) -> tuple[object, ...]:
    """The values of the ``column IN (...)`` CHECK constraint on ``table``, as DuckDB reads them back."""
    with duckdb.connect(str(path)) as con:
        expressions = [row[0] for row in con.execute(
            "SELECT expression FROM duckdb_constraints() WHERE table_name = ? AND constraint_type = 'CHECK' "
            "AND constraint_column_names = [?]", [table, column]).fetchall()]
    [values] = [m[1] for e in expressions if (m := re.fullmatch(rf'\("?{column}"? IN \((.*)\)\)', e))]
    return ast.literal_eval(f"({values},)")


@pytest.mark.parametrize(("table", "column", "allowed"), [
    ("outputs", "mode", MODES),
    ("request_stats", "mode", MODES),
    ("request_stats", "phase", get_args(Phase)),
    ("judgement_games", "game", get_args(get_type_hints(JudgementRecord)["game"])),
    ("judgement_games", "kind", get_args(GameKind)),
    ("judge_settings", "mode", get_args(JudgeMode)),
    ("cost_estimates", "source", get_args(CostSource)),
    ("cost_estimates", "timed_by", get_args(CostTiming)),
    ("documents", "status", get_args(DocumentStatus)),
    ("runs", "status", get_args(RunStatus)),
    ("shard_attempts", "status", get_args(AttemptStatus)),
])
def test_check_constraints_allow_exactly_the_values_of_the_python_literals(db: Database, table: str, column: str,
                                                                          allowed: tuple[object, ...]) -> None:
    assert check_values(db.path, table, column) == allowed


# -- runs ----------------------------------------------------------------------------------------------


def test_start_run_is_idempotent_and_resume_sets_running_again(db: Database) -> None:
    assert start(db, params={"seed": 1, "corpus": Path("data/news.parquet")}) is False
    created = db.get_run("run-1")
    assert created["status"] == "running"
    assert created["params"] == {"seed": 1, "corpus": "data/news.parquet"}
    assert created["modes"] == ["sidecar", "standalone"]
    db.finish_run("run-1", "failed", error="CUDA out of memory")
    failed = db.get_run("run-1")
    assert (failed["status"], failed["error"]) == ("failed", "CUDA out of memory")
    assert failed["finished_at"] is not None

    assert start(db) is True
    resumed = db.get_run("run-1")
    assert (resumed["status"], resumed["error"], resumed["finished_at"]) == ("running", None, None)
    assert resumed["created_at"] == created["created_at"]
    assert db.query("SELECT count(*) AS n FROM runs")[0]["n"] == 1
    db.finish_run("run-1", "completed")
    assert db.get_run("run-1")["status"] == "completed"


def test_code_version_defaults_to_the_checkout(db: Database) -> None:
    db.start_run("run-v", {}, "tiny", "cpu", "cpu", 4, 1)
    version = db.get_run("run-v")["code_version"]
    assert version and version != "unknown"


def test_bad_run_arguments_are_refused(db: Database) -> None:
    with pytest.raises(ValueError, match="modes"):
        start(db, modes=("sidecar", "tagger"))
    with pytest.raises(ValueError, match="completed"):
        db.finish_run("run-1", "running")
    with pytest.raises(UnknownRunError):
        db.finish_run("no-such-run", "completed")
    with pytest.raises(UnknownRunError):
        db.write_batch("no-such-run", [output("d1", "sidecar", ["#a"])])
    assert db.query("SELECT count(*) AS n FROM outputs")[0]["n"] == 0


def begin(db: Database, docs: list[Document], rejects: list[RejectedDocument], run_id: str = "run-1") -> RunStart:
    return db.begin_run(run_id, {"limit": 4}, "tiny", "cpu", "cpu", 4, 2, docs=docs, rejects=rejects,
                        modes=("sidecar", "standalone"), code_version="test")


def test_begin_run_starts_records_and_reads_what_is_done_in_one_go(db: Database) -> None:
    docs = [Document("d1", "text one", 0, "Title one"), Document("d2", "text two", 1)]
    rejects = [RejectedDocument("row:2", "null", 2, detail="id is null")]
    first = begin(db, docs, rejects)
    run = db.get_run("run-1")
    assert first == RunStart(resumed=False, done_doc_ids=set(), nonce=run["nonce"]) and len(first.nonce) == 32
    assert (run["status"], run["modes"], run["params"]) == ("running", ["sidecar", "standalone"], {"limit": 4})
    stored = db.query("SELECT doc_id, status, reject_reason FROM documents ORDER BY row_index")
    assert [(r["doc_id"], r["status"], r["reject_reason"]) for r in stored] == [
        ("d1", "ok", None), ("d2", "ok", None), ("row:2", "rejected", "null")]

    # d1 has every mode, d2 only one: a resume skips d1 alone
    db.write_batch("run-1", [output("d1", "sidecar"), output("d1", "standalone"), output("d2", "sidecar")])
    db.finish_run("run-1", "failed", error="CUDA out of memory")
    # the run keeps its nonce: its shards' parts stay its own
    assert begin(db, docs, rejects) == RunStart(resumed=True, done_doc_ids={"d1"}, nonce=first.nonce)
    resumed = db.get_run("run-1")
    assert (resumed["status"], resumed["error"], resumed["finished_at"]) == ("running", None, None)
    assert db.query("SELECT count(*) AS n FROM documents")[0]["n"] == 3


def test_a_failing_begin_run_leaves_nothing_behind(db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    import storage.database

    docs = [Document("d1", "text one", 0)]
    with pytest.raises(ValueError, match="row_index"):
        begin(db, docs, [RejectedDocument("x", "empty", 0)])
    assert db.get_run("run-1") is None

    # a failure after the run row and the documents are written inside the transaction undoes both
    def fail(*_: object) -> set[str]:
        raise RuntimeError("injected failure while reading the done documents")

    monkeypatch.setattr(storage.database, "_done_doc_ids", fail)
    with pytest.raises(RuntimeError, match="injected"):
        begin(db, docs, [])
    assert db.get_run("run-1") is None
    assert db.query("SELECT count(*) AS n FROM documents")[0]["n"] == 0

    # ... and leaves a resumed run as it was, not running again
    start(db)
    db.finish_run("run-1", "failed", error="earlier failure")
    with pytest.raises(RuntimeError, match="injected"):
        begin(db, docs, [])
    run = db.get_run("run-1")
    assert (run["status"], run["error"]) == ("failed", "earlier failure")
    assert db.query("SELECT count(*) AS n FROM documents")[0]["n"] == 0


def test_write_batch_can_finish_the_run_in_the_same_transaction(db: Database,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import storage.database

    start(db)
    with pytest.raises(ValueError, match="completed"):
        db.write_batch("run-1", [output("d1", "sidecar")], finish="done")
    assert db.query("SELECT count(*) AS n FROM outputs")[0]["n"] == 0
    assert db.get_run("run-1")["status"] == "running"

    db.write_batch("run-1", [output("d1", "sidecar"), output("d1", "standalone")],
                   [RejectedDocument("d2", "oom", 1)], finish="completed")
    run = db.get_run("run-1")
    assert (run["status"], run["error"]) == ("completed", None) and run["finished_at"] is not None
    assert db.done_doc_ids("run-1", ["sidecar", "standalone"]) == {"d1"}
    assert db.query("SELECT doc_id, reject_reason FROM documents") == [{"doc_id": "d2", "reject_reason": "oom"}]

    # one transaction: when finishing fails, the batch is not written either
    def fail(*_: object) -> None:
        raise RuntimeError("injected failure while finishing the run")

    start(db)
    monkeypatch.setattr(storage.database, "_finish_run", fail)
    with pytest.raises(RuntimeError, match="injected"):
        db.write_batch("run-1", [output("d3", "sidecar")], finish="completed")
    assert db.query("SELECT count(*) AS n FROM outputs WHERE doc_id = 'd3'")[0]["n"] == 0
    assert db.get_run("run-1")["status"] == "running"


# -- idempotent writes ----------------------------------------------------------------------------------


def test_rewriting_a_batch_leaves_one_copy_with_the_new_content(db: Database) -> None:
    start(db)
    two_phases = [RequestStats("main", new_tokens=12, drafted=16, accepted=10, target_forwards=4, wall_s=2.0),
                  RequestStats("sidecar", new_tokens=6, wall_s=0.5, kv_bytes=1000)]
    batch = [output("d1", "sidecar", ["#old"], stats=two_phases), output("d1", "standalone", ["#b"]),
             output("d2", "sidecar", ["#c"]), output("d2", "standalone", ["#d"])]
    db.write_batch("run-1", batch)
    db.write_batch("run-1", batch)
    assert db.query("SELECT count(*) AS n FROM outputs")[0]["n"] == 4
    assert db.query("SELECT count(*) AS n FROM request_stats")[0]["n"] == 5

    # the rerun of d1/sidecar brings new tags and only the main phase: the old sidecar phase must go
    db.write_batch("run-1", [output("d1", "sidecar", ["#new"])])
    rows = db.query("SELECT doc_id, mode, CAST(parsed AS VARCHAR[]) AS tags FROM sidecar_outputs ORDER BY doc_id, mode")
    assert [(r["doc_id"], r["mode"], r["tags"]) for r in rows] == [
        ("d1", "sidecar", ["#new"]), ("d1", "standalone", ["#b"]),
        ("d2", "sidecar", ["#c"]), ("d2", "standalone", ["#d"])]
    phases = db.query("SELECT phase FROM request_stats WHERE doc_id = 'd1' AND mode = 'sidecar'")
    assert [r["phase"] for r in phases] == ["main"]
    assert len(db.results("run-1")) == 2


def test_each_task_of_a_request_is_a_row_and_a_rewrite_keeps_only_the_tasks_it_brings(db: Database) -> None:
    start(db)
    headline = SidecarRecord.of("headline", " Council passes budget", "Council passes budget", finish_reason="eos",
                                new_tokens=4, device_s=0.5)
    two = output("d1", "sidecar", ["budget"])
    db.write_batch("run-1", [replace(two, sidecars=[*two.sidecars, headline]), output("d1", "standalone", ["b"])])
    rows = db.query("SELECT mode, task, parsed, new_tokens FROM sidecar_outputs ORDER BY mode, task")
    assert [(r["mode"], r["task"], json.loads(r["parsed"]), r["new_tokens"]) for r in rows] == [
        ("sidecar", "hashtags", ["budget"], None), ("sidecar", "headline", "Council passes budget", 4),
        ("standalone", "hashtags", ["b"], None)]
    # results shows the hashtags task of a run with several
    [result] = db.results("run-1")
    shown = (result["sidecar_name"], result["sidecar_tags"], result["standalone_tags"])
    assert shown == ("hashtags", ["budget"], ["b"])
    db.write_batch("run-1", [output("d1", "sidecar", ["new"])])
    assert db.query("SELECT mode, task FROM sidecar_outputs ORDER BY mode") == [
        {"mode": "sidecar", "task": "hashtags"}, {"mode": "standalone", "task": "hashtags"}]
    with pytest.raises(ValueError, match="two outputs of one sidecar task"):
        db.write_batch("run-1", [replace(two, sidecars=[*two.sidecars, *two.sidecars])])


def test_the_sidecar_phase_of_several_tasks_adds_their_work_and_keeps_the_batch_clock() -> None:
    tags = RequestStats("sidecar", new_tokens=5, draft_forwards=5, prompt_tokens=3, wall_s=1.0, kv_bytes=100,
                        batch_size=4, ended_s=2.0, decode_device_s=0.2, queue_s=0.1, first_token_s=0.3)
    headline = RequestStats("sidecar", new_tokens=7, draft_forwards=7, prompt_tokens=4, wall_s=1.5, kv_bytes=200,
                            batch_size=4, ended_s=2.5, decode_device_s=0.3, queue_s=0.1, first_token_s=0.2)
    assert RequestStats.together([tags]) is tags
    both = RequestStats.together([tags, headline])
    assert (both.new_tokens, both.draft_forwards, both.prompt_tokens, both.kv_bytes) == (12, 12, 7, 300)
    assert (both.wall_s, both.ended_s, both.batch_size, both.first_token_s) == (1.5, 2.5, 4, 0.2)
    assert both.decode_device_s == pytest.approx(0.5) and both.prefill_device_s is None
    with pytest.raises(ValueError, match="one phase"):
        RequestStats.together([tags, RequestStats("main", new_tokens=1)])


def test_duplicate_keys_inside_one_batch_are_refused(db: Database) -> None:
    start(db)
    with pytest.raises(ValueError, match="same"):
        db.write_batch("run-1", [output("d1", "sidecar", ["#a"]), output("d1", "sidecar", ["#b"])])
    with pytest.raises(ValueError, match="phase"):
        db.write_batch("run-1", [output("d1", "sidecar", ["#a"], stats=[RequestStats("main", 1)] * 2)])
    assert db.query("SELECT count(*) AS n FROM outputs")[0]["n"] == 0


def test_documents_judgements_and_costs_are_idempotent(db: Database) -> None:
    start(db)
    docs = [Document("d1", "text one", 0, "Title one"), Document("d2", "text two", 2)]
    rejects = [RejectedDocument("d1", "duplicate_id", 1, detail="an earlier row has id 'd1'", text="again"),
               RejectedDocument("row:3", "null", 3, detail="id is null")]
    games = [JudgementRecord("d1", "judge-x", "v1", 1, "sidecar", "standalone", '{"winner": "A"}', "sidecar"),
             JudgementRecord("d1", "judge-x", "v1", 2, "standalone", "sidecar", '{"winner": "B"}', "sidecar")]
    costs = [CostRecord("NVIDIA T4", "standalone", 8, 120.0, "projected", usd_per_gpu_hour=0.59),
             CostRecord("cpu", "sidecar", 2, 3.5, "measured", pair="tiny", run_id="run-1", usd_per_mtok=9.0)]
    for _ in range(2):
        db.record_documents("run-1", docs, rejects)
        db.write_judgements("run-1", games)
        db.write_costs(costs)
    counts = db.query("SELECT (SELECT count(*) FROM documents) AS docs, (SELECT count(*) FROM judgement_games) AS "
                      "games, (SELECT count(*) FROM cost_estimates) AS costs")[0]
    assert counts == {"docs": 4, "games": 2, "costs": 2}
    stored = db.query("SELECT row_index, doc_id, status, reject_reason, n_chars FROM documents ORDER BY row_index")
    assert [(r["doc_id"], r["status"], r["reject_reason"], r["n_chars"]) for r in stored] == [
        ("d1", "ok", None, 8), ("d1", "rejected", "duplicate_id", 5), ("d2", "ok", None, 8),
        ("row:3", "rejected", "null", None)]
    with pytest.raises(ValueError, match="row_index"):
        db.record_documents("run-1", docs, [RejectedDocument("x", "empty", 0)])


# -- views ---------------------------------------------------------------------------------------------


def test_results_show_a_document_only_once_all_its_modes_are_written(db: Database) -> None:
    start(db, modes=("sidecar", "sidecar_attended", "standalone"))
    db.record_documents("run-1", [Document("d1", "The document.", 0, "The title")],
                        [RejectedDocument("d1", "duplicate_id", 1, title="Wrong title")])
    db.write_batch("run-1", [output("d1", "sidecar", ["#masked"])])
    db.write_batch("run-1", [output("d1", "standalone", ["#alone"])])
    assert db.results() == []
    assert db.done_doc_ids("run-1", ["sidecar", "standalone"]) == {"d1"}
    assert db.done_doc_ids("run-1", ["sidecar", "sidecar_attended"]) == set()

    db.write_batch("run-1", [output("d1", "sidecar_attended", None, summary="A summary.")])
    [row] = db.results("run-1")
    assert row["doc_id"] == "d1" and row["title"] == "The title" and row["n_chars"] == len("The document.")
    assert row["summary"] == "A summary." and row["summary_tokens"] == 12
    assert (row["sidecar_tags"], row["standalone_tags"], row["attended_tags"]) == (["#masked"], ["#alone"], None)
    assert row["run_status"] == "running" and row["pair"] == "tiny"
    assert db.results("other-run") == []


def test_throughput_keeps_batch_wall_time_and_shared_counters_but_no_wall_clock_rate(db: Database) -> None:
    start(db, gpu_type="NVIDIA H200", batch_size=2)

    def stats(tokens: int, drafted: int, accepted: int, forwards: int, wall: float) -> list[RequestStats]:
        return [RequestStats("main", new_tokens=tokens, drafted=drafted, accepted=accepted,
                             target_forwards=forwards, wall_s=wall, batch_size=2)]

    # batch 0: two rows finishing at 1.0 s and 2.0 s; batch 1: one row taking 2.0 s
    db.write_batch("run-1", [output("d1", "sidecar", ["#a"], 0, stats(10, 12, 9, 4, 1.0)),
                             output("d2", "sidecar", ["#a"], 0, stats(20, 24, 18, 6, 2.0)),
                             output("d3", "sidecar", ["#a"], 1, stats(30, 36, 27, 10, 2.0))])
    [row] = db.query("SELECT * FROM throughput WHERE mode = 'sidecar' AND phase = 'main'")
    assert (row["gpu_type"], row["requests"], row["batches"], row["batch_size"]) == ("NVIDIA H200", 3, 2, 2)
    assert row["new_tokens"] == 60
    assert row["wall_s"] == pytest.approx(4.0)
    # written without a device-time ledger (an older engine): no rate at all, never 60 tokens / 4.0 s
    assert (row["tokens_per_s"], row["device_s"], row["ledger_requests"]) == (None, None, 0)
    assert row["acceptance_rate"] == pytest.approx(54 / 72)
    assert row["tokens_per_target_forward"] == pytest.approx(3.0)


def test_a_streamed_batch_takes_until_its_last_row_ended_not_its_longest_row(db: Database) -> None:
    start(db, batch_size=2)

    def stats(tokens: int, wall: float, ended: float) -> list[RequestStats]:
        return [RequestStats("main", new_tokens=tokens, wall_s=wall, ended_s=ended, batch_size=2)]

    # one stream of two slots: d1 and d2 start together, d3 takes d1's slot at 1.0 s and ends at 3.0 s, so the
    # stream ran 3.0 s although no row of it took longer than 2.5 s
    db.write_batch("run-1", [output("d1", "sidecar", ["#a"], 7, stats(10, 1.0, 1.0)),
                             output("d2", "sidecar", ["#a"], 7, stats(25, 2.5, 2.5)),
                             output("d3", "sidecar", ["#a"], 7, stats(20, 2.0, 3.0))])
    [row] = db.query("SELECT * FROM throughput WHERE mode = 'sidecar' AND phase = 'main'")
    assert (row["requests"], row["batches"]) == (3, 1)
    assert row["wall_s"] == pytest.approx(3.0)  # latency: the stream's clock
    assert row["tokens_per_s"] is None  # and no rate from it


def ledger(tokens: int, prefill_s: float, decode_s: float, **extra: float) -> dict[str, float]:
    """The ledger's and the latency's fields of the engine's stats record (``GenerationStats``)."""
    return {"prefill_tokens": 40, "prefill_forwards": 1, "prefill_device_seconds": prefill_s,
            "decode_tokens": tokens, "decode_forwards": tokens, "decode_device_seconds": decode_s,
            "queue_seconds": 0.5, "first_token_seconds": 1.0} | extra


def test_throughput_rates_divide_by_attributed_device_seconds_not_the_streams_clock(db: Database) -> None:
    start(db, batch_size=2)
    # One stream: d1's and d2's main rows, then their sidecar rows beside the main rows of later requests. On
    # the stream's clock the sidecar phase ends at 9 s and 10 s; the ledger charged the sidecar rows 0.3 s and
    # 0.5 s of device time (prefill, decode and the instruction line), the main rows 2 s each.
    def sidecar(doc: str, tags: int, device: tuple[float, float, float], ended: float) -> OutputRecord:
        main = RequestStats.main_phase(GenerationStats(new_tokens=20, wall_seconds=4.0, batch_size=2,
                                                       **ledger(20, 0.5, 1.5)))
        tagging = RequestStats.sidecar_phase(GenerationStats(
            new_tokens=tags, draft_forwards=tags, decode_seconds=2.0, wall_seconds=2.0, batch_size=2,
            **ledger(tags, device[0], device[1], prefill_tokens=4, instruction_tokens=25,
                     instruction_device_seconds=device[2])))
        return output(doc, "sidecar", ["#a"], 3, stats=[replace(main, ended_s=ended - 3),
                                                        replace(tagging, ended_s=ended)])

    db.write_batch("run-1", [sidecar("d1", 10, (0.05, 0.2, 0.05), 9.0), sidecar("d2", 20, (0.05, 0.4, 0.05), 10.0)])
    rows = {r["phase"]: r for r in db.query("SELECT * FROM throughput WHERE mode = 'sidecar'")}
    tagging = rows["sidecar"]
    assert tagging["wall_s"] == pytest.approx(10.0)  # the stream's clock, kept as latency
    assert tagging["device_s"] == pytest.approx(0.8)
    assert tagging["tokens_per_s"] == pytest.approx(30 / 0.8)  # not 30 / 10.0
    assert (tagging["prefill_device_s"], tagging["decode_device_s"], tagging["instruction_device_s"]) == \
        pytest.approx((0.1, 0.6, 0.1))
    assert (tagging["prefill_tokens"], tagging["decode_tokens"], tagging["instruction_tokens"]) == (8, 30, 50)
    assert (tagging["ledger_requests"], tagging["ledger_new_tokens"]) == (2, 30)
    assert (tagging["mean_queue_s"], tagging["mean_first_token_s"]) == pytest.approx((0.5, 1.0))
    main = rows["main"]
    assert main["tokens_per_s"] == pytest.approx(40 / 4.0)
    assert main["instruction_device_s"] == 0  # the instruction line is the sidecar's, not the main row's

    # a later request written by an engine without the ledger joins no rate: its tokens and seconds stay out
    db.write_batch("run-1", [output("d3", "sidecar", ["#a"], 4, stats=[
        RequestStats("sidecar", new_tokens=100, draft_forwards=100, decode_s=0.1, wall_s=0.1, batch_size=2)])])
    [tagging] = db.query("SELECT * FROM throughput WHERE mode = 'sidecar' AND phase = 'sidecar'")
    assert (tagging["requests"], tagging["ledger_requests"], tagging["new_tokens"]) == (3, 2, 130)
    assert tagging["tokens_per_s"] == pytest.approx(30 / 0.8)


def test_throughput_has_each_batchs_decode_time_and_longest_row(db: Database) -> None:
    start(db, batch_size=2)

    def stats(tokens: int, prompt: int, prefill: float, decode: float) -> list[RequestStats]:
        return [RequestStats("sidecar", new_tokens=tokens, prompt_tokens=prompt, prefill_s=prefill, decode_s=decode,
                             wall_s=prefill + decode, batch_size=2)]

    # batch 0: rows of 10 and 20 tokens sharing a 0.2 s prefill, the longer decoding 2.0 s; batch 1: one row
    db.write_batch("run-1", [output("d1", "standalone", ["#a"], 0, stats(10, 100, 0.2, 1.0)),
                             output("d2", "standalone", ["#a"], 0, stats(20, 200, 0.2, 2.0)),
                             output("d3", "standalone", ["#a"], 1, stats(30, 300, 0.5, 3.0))])
    [row] = db.query("SELECT * FROM throughput WHERE mode = 'standalone'")
    assert row["longest_row_tokens"] == 20 + 30
    assert row["decode_s"] == pytest.approx(2.0 + 3.0)
    assert row["prefill_s"] == pytest.approx(0.2 + 0.5)
    assert row["prompt_tokens"] == pytest.approx(200.0)
    assert row["wall_s"] == pytest.approx(2.2 + 3.5)


def test_request_acceptance_is_per_request_of_the_main_phase(db: Database) -> None:
    start(db, gpu_type="NVIDIA H200")
    start(db, run_id="run-2")

    def main(drafted: int, accepted: int) -> list[RequestStats]:
        return [RequestStats("main", new_tokens=12, drafted=drafted, accepted=accepted, target_forwards=4),
                RequestStats("sidecar", new_tokens=6, drafted=0)]

    db.write_batch("run-1", [output("d1", "sidecar", stats=main(8, 6)), output("d2", "sidecar", stats=main(4, 1)),
                             output("d3", "sidecar", stats=main(0, 0))])  # gamma 0 throughout: no rate
    db.write_batch("run-2", [output("d1", "sidecar", stats=main(10, 10))])
    rows = db.request_acceptance("run-1")
    assert [(r["doc_id"], r["acceptance_rate"]) for r in rows] == [("d1", 0.75), ("d2", 0.25)]
    assert {(r["gpu_type"], r["pair"], r["mode"]) for r in rows} == {("NVIDIA H200", "tiny", "sidecar")}
    assert [(r["run_id"], r["doc_id"]) for r in db.request_acceptance()] == [
        ("run-1", "d1"), ("run-1", "d2"), ("run-2", "d1")]
    assert db.request_acceptance("no-such-run") == []


def test_judgement_verdicts_need_two_agreeing_games(db: Database) -> None:
    start(db)

    def game(doc: str, number: int, winner: str | None, error: str | None = None) -> JudgementRecord:
        first, second = ("sidecar", "standalone") if number == 1 else ("standalone", "sidecar")
        # a failed call has no answer; an answer that could not be parsed keeps its raw text
        return JudgementRecord(doc, "judge-x", "v1", number, first, second, None if error else "raw", winner, error)

    db.write_judgements("run-1", [
        game("agree", 1, "standalone"), game("agree", 2, "standalone"),
        game("disagree", 1, "sidecar"), game("disagree", 2, "standalone"),
        game("half", 1, "sidecar"),
        game("failed", 1, "tie"), game("failed", 2, None, error="HTTP 500"),
    ])
    verdicts = {r["doc_id"]: r for r in db.query("SELECT * FROM judgements")}
    assert verdicts["agree"]["verdict"] == "standalone" and verdicts["agree"]["consistent"] is True
    assert verdicts["disagree"]["verdict"] == "tie" and verdicts["disagree"]["consistent"] is False
    assert verdicts["half"]["verdict"] is None
    assert verdicts["failed"]["verdict"] is None and verdicts["failed"]["errors"] == 1
    assert verdicts["agree"]["mode_a"] == "sidecar"
    assert db.judged_doc_ids("run-1", "judge-x", "v1") == {"agree", "disagree"}
    assert db.judged_doc_ids("run-1", "judge-x", "v2") == set()
    # text-mode games have no preference, and a run without control games is never reliable
    # the text mode's differences: -0.5 (both games for the standalone) and 0 (they disagree)
    assert db.judge_tally("run-1") == [{"task": "hashtags", "judge_model": "judge-x", "prompt_version": "v1",
                                        "method": "pairwise",
                                        "documents": 4, "wins": 0, "losses": 1, "ties": 1, "undecided": 2,
                                        "consistent": 1, "mean_preference": None, "mean_difference": -0.25,
                                        "preferences": [], "reliable": False}]
    assert db.judge_tally("run-2") == []


def probability_game(doc: str, kind: str, number: int, p_subject_first: float, foil: str | None = None
                     ) -> JudgementRecord:
    """A probability-mode game whose subject side is shown first in game 1; ``p_subject_first`` is the
    probability the judge gives the set shown first."""
    subject, other = {"main": ("sidecar", "standalone"), "control": ("own", "other"), "hard": ("own", "mixed"),
                      "null": ("original", "reversed")}[kind]
    first, second = (subject, other) if number == 1 else (other, subject)
    winner = first if p_subject_first > 0.5 else second if p_subject_first < 0.5 else "tie"
    return JudgementRecord(doc, "judge-p", "p1", number, first, second, "A", winner, kind=kind,
                           p_a=p_subject_first, p_b=1 - p_subject_first, foil_doc_id=foil)


def pair(doc: str, kind: str, first_game: float, second_game: float, foil: str | None = None) -> list[JudgementRecord]:
    return [probability_game(doc, kind, 1, first_game, foil), probability_game(doc, kind, 2, second_game, foil)]


# own: the control games' P(first shown); 0.7 for the own tags, exactly even, or 0.52: on the right side but
# inside the run's margin of 0.05, which is no better than even (003 counted it right)
@pytest.mark.parametrize(("own", "reliable"), [((0.8, 0.4), True), ((0.6, 0.6), False), ((0.53, 0.49), False)])
def test_probability_games_give_debiased_preferences_a_calibrated_margin_and_control_quality(
        db: Database, own: tuple[float, float], reliable: bool) -> None:
    start(db)
    # P(first shown) per game; the subject is first in game 1 and second in game 2, so its preference is
    # the mean of game 1's p and 1 - game 2's p
    games = [
        *pair("d1", "main", 0.9, 0.3),    # preference (0.9 + 0.7) / 2 = 0.8: the sidecar's
        *pair("d2", "main", 0.6, 0.58),   # 0.51: within the margin, a tie
        *pair("d3", "main", 0.5, 0.9),    # 0.3: standalone's
        *pair("d1", "control", *own, foil="d2"), *pair("d2", "control", *own, foil="d3"),
        *pair("d1", "null", 0.7, 0.6),    # 0.55: the judge's noise is 0.05
        *pair("d2", "null", 0.5, 0.52),   # 0.49
    ]
    # a threshold of 0.5: the null rung's d1 (0.05 from even) lies outside the floor of 0.02, d2 inside
    db.write_judgements("run-1", games, JudgeSettingsRecord("judge-p", "p1", "probability", 0.5, 0.02))

    [quality] = db.judge_quality("run-1")
    assert quality["margin"] == pytest.approx(0.05)
    assert (quality["control_games"], quality["control_documents"], quality["null_documents"]) == (4, 2, 2)
    assert (quality["null_tied"], quality["null_ties"]) == (1, 0.5)
    assert quality["control_accuracy"] == (1.0 if reliable else 0.0)
    assert quality["reliable"] is reliable
    first_shown = [g.p_a for g in games]
    assert quality["position_bias"] == pytest.approx(sum(first_shown) / len(first_shown))
    verdicts = {r["doc_id"]: r for r in db.query("SELECT * FROM judgements WHERE run_id = 'run-1'")}
    assert set(verdicts) == {"d1", "d2", "d3"}  # controls and null games are not documents' verdicts
    assert {d: (r["verdict"], round(r["preference"], 6)) for d, r in verdicts.items()} == {
        "d1": ("sidecar", 0.8), "d2": ("tie", 0.51), "d3": ("standalone", 0.3)}
    assert all(r["reliable"] is reliable for r in verdicts.values())
    [tally] = db.judge_tally("run-1")
    assert (tally["wins"], tally["ties"], tally["losses"], tally["reliable"]) == (1, 1, 1, reliable)
    assert tally["mean_preference"] == pytest.approx((0.8 + 0.51 + 0.3) / 3)
    assert tally["preferences"] == pytest.approx([0.8, 0.51, 0.3])
    assert db.judged_doc_ids("run-1", "judge-p", "p1") == {"d1", "d2", "d3"}


@pytest.mark.parametrize(("null_second_game", "verdict"), [(0.5, "sidecar"), (0.3, "UNRELIABLE")])
def test_the_ladders_rungs_and_a_verdict_only_from_a_trusted_method(db: Database, null_second_game: float,
                                                                   verdict: str) -> None:
    """Easy controls all clear the margin; the hard rung is reported; a null rung that does not tie (d2's
    preference 0.6, which also widens the margin to 0.1) leaves the run without a verdict."""
    start(db)
    games = [*pair("d1", "main", 0.9, 0.3), *pair("d2", "main", 0.8, 0.3), *pair("d3", "main", 0.85, 0.3),
             *pair("d1", "control", 0.9, 0.1, foil="d2"), *pair("d2", "control", 0.8, 0.2, foil="d3"),
             *pair("d1", "hard", 0.7, 0.3, foil="d2"), *pair("d2", "hard", 0.5, 0.5, foil="d3"),
             *pair("d1", "null", 0.5, 0.5), *pair("d2", "null", 0.5, null_second_game)]
    db.write_judgements("run-1", games, JudgeSettingsRecord("judge-p", "p1", "probability", 0.9, 0.02))

    [quality] = db.judge_quality("run-1")
    assert (quality["control_cleared"], quality["control_documents"]) == (2, 2)
    assert (quality["hard_cleared"], quality["hard_documents"], quality["hard_accuracy"]) == (1, 2, 0.5)
    assert quality["null_ties"] == (1.0 if verdict != "UNRELIABLE" else 0.5)
    assert quality["separation"] == pytest.approx(0.35) and quality["auc"] == 1.0
    differences = [0.3, 0.25, 0.275]  # (0.9 + 0.7) / 2 - 0.5 and so on
    se = statistics.stdev(differences) / len(differences) ** 0.5
    assert quality["mean_difference"] == pytest.approx(0.275)
    assert quality["difference_low"] == pytest.approx(0.275 - 1.96 * se)
    assert quality["detectable"] == pytest.approx(2.8 * se)
    assert (quality["reliable"], quality["verdict"]) == (verdict != "UNRELIABLE", verdict)
    assert db.query("SELECT * FROM judge_headline") == [
        {"run_id": "run-1", "task": "hashtags", "trusted": ["pairwise judge-p p1"] if verdict != "UNRELIABLE" else [],
         "verdict": verdict}]


def scores(doc: str, kind: str, subject_pmi: float, other_pmi: float, model: str = "judge-p",
           foil: str | None = None) -> list[JudgementScoreRecord]:
    """A likelihood-scored pair of tag sets whose PMIs are ``subject_pmi`` and ``other_pmi`` (given_own less a
    given_baseline of -3)."""
    sides = {"main": ("sidecar", "standalone"), "control": ("own", "other"), "hard": ("own", "mixed"),
             "null": ("original", "reversed")}[kind]
    return [JudgementScoreRecord(doc, model, "tags-l2", kind, side, ["t"], "base", given_own=-3 + pmi,
                                 given_baseline=-3.0, tokens=4, foil_doc_id=foil)
            for side, pmi in zip(sides, (subject_pmi, other_pmi), strict=True)]


def test_likelihood_scores_keep_their_method_and_are_read_by_the_same_ladder(db: Database) -> None:
    start(db)
    likelihood = [*scores("d1", "main", 2.0, 1.0), *scores("d2", "main", 1.5, 1.0), *scores("d3", "main", 1.2, 0.9),
                  *scores("d1", "control", 2.0, -1.0, foil="d2"), *scores("d2", "control", 1.5, -0.5, foil="d3"),
                  *scores("d1", "hard", 2.0, 1.95, foil="d2"), *scores("d1", "null", 2.0, 1.96)]
    db.write_judgements("run-1", [], JudgeSettingsRecord("judge-p", "tags-l2", "likelihood", 0.9, 0.1), likelihood)
    # a second scorer whose endpoint had no prompt log probabilities: settings with the reason, no scores
    db.write_judgements("run-1", [], JudgeSettingsRecord("judge-p/draft", "tags-l2", "likelihood", 0.9, 0.1,
                                                         note="HTTP 404 on /completions"))

    documents = db.query("SELECT doc_id, kind, method, difference, own_score, foil_score FROM judge_documents "
                         "WHERE kind = 'control' ORDER BY doc_id")
    assert [(d["method"], round(d["difference"], 6), d["own_score"], d["foil_score"]) for d in documents] == [
        ("likelihood", 3.0, pytest.approx(2.0), pytest.approx(-1.0)),
        ("likelihood", 2.0, pytest.approx(1.5), pytest.approx(-0.5))]
    scored, unavailable = db.judge_quality("run-1")  # judge-p, then judge-p/draft
    assert (scored["method"], scored["mode"], scored["margin"], scored["floor"]) == ("likelihood", "likelihood",
                                                                                    pytest.approx(0.1), 0.1)
    assert (scored["control_cleared"], scored["hard_cleared"], scored["null_tied"]) == (2, 0, 1)
    assert scored["auc"] == 1.0 and scored["reliable"] is True and scored["verdict"] == "sidecar"
    assert (unavailable["method"], unavailable["reliable"], unavailable["verdict"], unavailable["note"]) == (
        "likelihood", False, "UNRELIABLE", "HTTP 404 on /completions")
    verdicts = db.query("SELECT doc_id, method, verdict, difference FROM judgements ORDER BY doc_id")
    assert [(v["method"], v["verdict"]) for v in verdicts] == [("likelihood", "sidecar")] * 3
    assert db.scored_doc_ids("run-1", "judge-p", "tags-l2") == {"d1", "d2", "d3"}
    assert db.query("SELECT trusted, verdict FROM judge_headline") == [
        {"trusted": ["likelihood judge-p tags-l2"], "verdict": "sidecar"}]


@pytest.mark.parametrize("value", [float("-inf"), float("nan"), -1e308, 0.5], ids=["-inf", "nan", "-1e308", "0.5"])
def test_a_score_or_probability_that_is_not_finite_or_out_of_range_is_refused_before_it_is_stored(
        value: float) -> None:
    with pytest.raises(ValueError, match="given_baseline of 'd1' main sidecar"):
        JudgementScoreRecord("d1", "judge-p", "tags-l2", "main", "sidecar", ["t"], "base", given_own=-1.0,
                             given_baseline=value)
    with pytest.raises(ValueError, match="p_b of 'd1' game 2"):
        replace(probability_game("d1", "main", 2, 0.5), p_b=value if value != 0.5 else 1.5)


def test_the_views_read_a_stored_score_that_is_not_finite_as_missing_never_as_nan(db: Database) -> None:
    """-Infinity given both summaries made a PMI of NaN: the null rung's root mean square and the margin became
    NaN, and the documents compared with it came out standalone-preferred."""
    start(db)
    likelihood = [*scores("d1", "main", 2.0, 1.0), *scores("d2", "main", 1.5, 1.0), *scores("d3", "main", 1.2, 0.9),
                  *scores("d1", "control", 2.0, -1.0, foil="d2"), *scores("d2", "control", 1.5, -0.5, foil="d3"),
                  *scores("d1", "null", 2.0, 1.96)]
    db.write_judgements("run-1", [], JudgeSettingsRecord("judge-p", "tags-l2", "likelihood", 0.9, 0.1), likelihood)
    # rows another client wrote, or this code before it checked: CHECK (given_own <= 1e-6) lets -Infinity in
    with duckdb.connect(str(db.path)) as con:
        for doc, kind, side in [("d4", "main", "sidecar"), ("d4", "main", "standalone"), ("d2", "null", "original"),
                                ("d2", "null", "reversed")]:
            con.execute("INSERT INTO judgement_scores (run_id, doc_id, judge_model, prompt_version, kind, side, tags, "
                        "baseline_doc_id, given_own, given_baseline, tokens) VALUES ('run-1', ?, 'judge-p', "
                        "'tags-l2', ?, ?, ['t'], 'base', '-inf'::DOUBLE, '-inf'::DOUBLE, 4)", [doc, kind, side])

    [quality] = db.judge_quality("run-1")
    assert quality["margin"] == pytest.approx(0.1) and quality["null_documents"] == 1  # d2 is missing
    assert (quality["reliable"], quality["verdict"]) == (True, "sidecar")
    verdicts = {v["doc_id"]: (v["verdict"], v["difference"]) for v in db.query("SELECT * FROM judgements")}
    assert verdicts == {"d1": ("sidecar", pytest.approx(1.0)), "d2": ("sidecar", pytest.approx(0.5)),
                        "d3": ("sidecar", pytest.approx(0.3)), "d4": (None, None)}
    assert db.scored_doc_ids("run-1", "judge-p", "tags-l2") == {"d1", "d3"}  # d2 (its null rung) and d4 again


def test_a_likelihood_margin_is_twice_the_null_differences_root_mean_square_and_bands_the_null_rung(
        db: Database) -> None:
    start(db)
    # null differences within half a nat (reordering moves a likelihood), and one far outside them: 3.0
    likelihood = [*scores("d1", "main", 2.0, 1.0), *scores("d2", "main", 1.5, 1.0), *scores("d3", "main", 1.2, 0.9),
                  *scores("d1", "control", 2.9, -1.0, foil="d2"), *scores("d2", "control", 2.8, -0.5, foil="d3"),
                  *scores("d1", "null", 1.0, 0.5), *scores("d2", "null", 1.0, 1.3), *scores("d3", "null", 1.0, 0.6),
                  *scores("d4", "null", 1.0, 1.2), *scores("d5", "null", 3.0, 0.0)]
    db.write_judgements("run-1", [], JudgeSettingsRecord("judge-p", "tags-l2", "likelihood", 0.9, 0.1), likelihood)
    [quality] = db.judge_quality("run-1")
    margin = 2 * ((0.5**2 + 0.3**2 + 0.4**2 + 0.2**2 + 3.0**2) / 5) ** 0.5  # as likelihood_run.likelihood_margin
    assert quality["margin"] == pytest.approx(margin) and quality["floor"] == pytest.approx(margin)
    assert (quality["null_documents"], quality["null_tied"]) == (5, 4)  # 3.0 lies outside 2 x 1.38
    assert quality["reliable"] is False and quality["verdict"] == "UNRELIABLE"


def test_the_margin_never_falls_below_the_runs_floor(db: Database) -> None:
    start(db)
    db.write_judgements("run-1", [*pair("d1", "main", 0.54, 0.5), *pair("d1", "null", 0.5, 0.5)],
                        JudgeSettingsRecord("judge-p", "p1", "probability", 0.75, 0.05))
    [quality] = db.judge_quality("run-1")
    assert quality["margin"] == pytest.approx(0.05)
    assert quality["control_accuracy"] is None and quality["reliable"] is False
    assert db.query("SELECT verdict FROM judgements") == [{"verdict": "tie"}]  # 0.52 is within 0.05


@contextlib.contextmanager
def old_database(path: Path, version: int) -> Iterator[duckdb.DuckDBPyConnection]:
    """A database file at schema ``version`` holding one completed run ``r``, open for the rows code of that
    version would have written."""
    migrate(path, RetryPolicy(), known_migrations()[:version])
    with duckdb.connect(str(path)) as con:
        con.execute("INSERT INTO runs (run_id, status, params, modes, pair) VALUES "
                    "('r', 'completed', '{}', ['sidecar', 'standalone'], 'tiny')")
        yield con


def test_migration_003_keeps_stored_games_as_main_games(tmp_path: Path) -> None:
    path = tmp_path / "old.duckdb"
    with old_database(path, 2) as con:
        con.execute("INSERT INTO judgement_games (run_id, doc_id, judge_model, prompt_version, game, mode_a, mode_b, "
                    "raw_answer, winner) VALUES ('r', 'd', 'j', 'tags-v1', 1, 'sidecar', 'standalone', 'x', 'sidecar'),"
                    " ('r', 'd', 'j', 'tags-v1', 2, 'standalone', 'sidecar', 'y', 'sidecar')")
    db = Database(path)
    assert db.query("SELECT kind, game, p_a FROM judgement_games ORDER BY game") == [
        {"kind": "main", "game": 1, "p_a": None}, {"kind": "main", "game": 2, "p_a": None}]
    assert db.query("SELECT verdict, preference, reliable FROM judgements") == [
        {"verdict": "sidecar", "preference": None, "reliable": False}]


def test_migration_010_keeps_stored_games_and_settings_and_rereads_them_by_the_honest_rules(tmp_path: Path) -> None:
    """A schema-9 run whose one control favoured the own tags by 0.01, inside its margin of 0.02: schema 9
    called it reliable, 010 keeps every row and calls it UNRELIABLE."""
    path = tmp_path / "old.duckdb"
    with old_database(path, 9) as con:
        con.execute("INSERT INTO judgement_games (run_id, doc_id, judge_model, prompt_version, kind, game, mode_a, "
                    "mode_b, raw_answer, winner, p_a, p_b, foil_doc_id) VALUES "
                    "('r', 'd', 'j', 'tags-p1', 'main', 1, 'sidecar', 'standalone', 'A', 'sidecar', 0.6, 0.4, NULL), "
                    "('r', 'd', 'j', 'tags-p1', 'main', 2, 'standalone', 'sidecar', 'A', 'standalone', 0.6, 0.4, "
                    "NULL), "
                    "('r', 'd', 'j', 'tags-p1', 'control', 1, 'own', 'other', 'A', 'own', 0.61, 0.39, 'e'), "
                    "('r', 'd', 'j', 'tags-p1', 'control', 2, 'other', 'own', 'A', 'other', 0.59, 0.41, 'e')")
        con.execute("INSERT INTO judge_settings (run_id, judge_model, prompt_version, mode, threshold, margin_floor) "
                    "VALUES ('r', 'j', 'tags-p1', 'probability', 0.75, 0.02)")
        assert con.execute("SELECT reliable FROM judge_quality").fetchall() == [(True,)]
    db = Database(path)
    assert db.query("SELECT count(*) AS n FROM judgement_games") == [{"n": 4}]
    assert db.query("SELECT mode, threshold, margin_floor, note FROM judge_settings") == [
        {"mode": "probability", "threshold": 0.75, "margin_floor": 0.02, "note": None}]
    [quality] = db.judge_quality("r")
    assert (quality["method"], quality["control_cleared"], quality["reliable"], quality["verdict"]) == (
        "pairwise", 0, False, "UNRELIABLE")
    assert quality["separation"] == pytest.approx(0.01)


def test_migration_013_gives_stored_judgements_the_task_they_judged_and_reads_them_per_task(tmp_path: Path) -> None:
    """Schema 12 judged one task per run, the one ``results`` shows: ``hashtags`` where the run has it, else its
    first task by name. 013 files every game, score and setting under that task, and reads them per task."""
    path = tmp_path / "old.duckdb"
    with old_database(path, 12) as con:
        con.execute("INSERT INTO runs (run_id, status, params, modes, pair) VALUES "
                    "('t', 'completed', '{}', ['sidecar', 'standalone'], 'tiny')")
        con.execute("INSERT INTO sidecar_outputs (run_id, doc_id, mode, task, text) VALUES "
                    "('r', 'd', 'sidecar', 'headline', 'x'), ('r', 'd', 'sidecar', 'hashtags', '#x'), "
                    "('t', 'd', 'sidecar', 'topic', 'x'), ('t', 'd', 'sidecar', 'summary_kind', 'x')")
        for run in ("r", "t"):
            con.execute("INSERT INTO judgement_games (run_id, doc_id, judge_model, prompt_version, kind, game, mode_a, "
                        "mode_b, raw_answer, winner) VALUES "
                        f"('{run}', 'd', 'j', 'tags-v1', 'main', 1, 'sidecar', 'standalone', 'x', 'sidecar'), "
                        f"('{run}', 'd', 'j', 'tags-v1', 'main', 2, 'standalone', 'sidecar', 'y', 'sidecar')")
            con.execute("INSERT INTO judge_settings (run_id, judge_model, prompt_version, mode, threshold) "
                        f"VALUES ('{run}', 'j', 'tags-v1', 'text', 0.9)")
        con.execute("INSERT INTO judgement_scores (run_id, doc_id, judge_model, prompt_version, kind, side, tags, "
                    "baseline_doc_id, given_own, given_baseline, tokens) VALUES "
                    "('r', 'd', 'j', 'tags-l1', 'main', 'sidecar', ['x'], 'e', -1.0, -2.0, 3)")
    db = Database(path)
    assert db.query("SELECT DISTINCT run_id, task FROM judgement_games ORDER BY ALL") == [
        {"run_id": "r", "task": "hashtags"}, {"run_id": "t", "task": "summary_kind"}]
    assert db.query("SELECT run_id, task FROM judge_settings ORDER BY ALL") == [
        {"run_id": "r", "task": "hashtags"}, {"run_id": "t", "task": "summary_kind"}]
    assert db.query("SELECT run_id, task FROM judgement_scores") == [{"run_id": "r", "task": "hashtags"}]
    assert db.judged_doc_ids("r", "j", "tags-v1") == {"d"}
    assert db.judged_doc_ids("t", "j", "tags-v1", task="summary_kind") == {"d"}
    # no control game was played: unreliable, saying so, and never "not judged"
    assert {task: (v["status"], v["reason"]) for task, v in db.judge_verdicts("t").items()} == {
        "summary_kind": ("unreliable", "pairwise j tags-v1: no control answered")}


def counters(forwards: int, recompiles: int = 0, graph_breaks: int = 0, shapes: int = 3, skips: int = 0) -> dict:
    return {"compiles": 2, "recompiles": recompiles, "graph_breaks": graph_breaks, "forwards": forwards,
            "graph_calls": forwards, "chained_forwards": 0, "distinct_shapes": shapes, "compile_seconds": 1.5,
            "graph_bytes": 0, "cudagraph_skips": skips}


def test_a_run_records_its_capture_mode_and_a_resume_adds_only_its_own_counters(db: Database) -> None:
    start(db, capture="compile (SIDECAR_CAPTURE=compile)", dtype="fp32 (SIDECAR_DTYPE=fp32)")
    db.record_capture("run-1", {"target": counters(10), "draft": counters(30, shapes=5)})
    # the resume loads the pair again: its counters start from 0, and it records them once, at its end
    assert start(db, capture="eager (auto: CPU, eager)") is True
    db.record_capture("run-1", {"target": counters(4, shapes=2), "draft": counters(8, recompiles=1)})
    run = db.get_run("run-1")
    assert run["capture"] == "compile (SIDECAR_CAPTURE=compile)", "the first start's, as its dtype"
    assert json.loads(run["capture_counters"]) == {
        "target": {**counters(14), "compiles": 4, "compile_seconds": 3.0},
        "draft": {**counters(38, recompiles=1, shapes=5), "compiles": 4, "compile_seconds": 3.0}}
    summed = db.capture("run-1")
    assert (summed["capture"], summed["recorded"], summed["forwards"], summed["compiles"], summed["recompiles"],
            summed["graph_breaks"], summed["distinct_shapes"], summed["faults"]) == (
        "compile (SIDECAR_CAPTURE=compile)", 1, 52, 8, 1, 0, 5, 1)


def test_graphs_left_uncaptured_add_up_over_starts_and_are_faults_and_older_counters_have_none(
        db: Database, tmp_path: Path) -> None:
    start(db, capture="cudagraph (auto: CUDA)")
    db.record_capture("run-1", {"target": counters(10, skips=2), "draft": counters(30)})
    db.record_capture("run-1", {"target": counters(4, skips=1), "draft": counters(8, recompiles=1)})
    summed = db.capture("run-1")
    assert (summed["cudagraph_skips"], summed["recompiles"], summed["faults"]) == (3, 1, 4)
    path = tmp_path / "old.duckdb"
    with old_database(path, 15) as con:  # counters a run recorded before migration 016: no such counter
        old = {k: v for k, v in counters(5).items() if k != "cudagraph_skips"}
        con.execute("UPDATE runs SET capture = 'eager', capture_counters = ?", [json.dumps({"target": old})])
    older = Database(path).capture("r")
    assert (older["forwards"], older["cudagraph_skips"], older["faults"]) == (5, None, 0)


def test_a_runs_step_counters_add_up_over_its_starts_and_give_syncs_and_host_time_per_step(db: Database) -> None:
    start(db, capture="eager (auto)")
    steps = {"steps": 10, "syncs": 12, "step_seconds": 2.0, "read_seconds": 0.5}
    db.record_capture("run-1", {"target": counters(10), "steps": steps})
    db.record_capture("run-1", {"target": counters(4), "steps": {**steps, "steps": 30, "syncs": 32}})
    assert json.loads(db.get_run("run-1")["capture_counters"])["steps"] == {
        "steps": 40, "syncs": 44, "step_seconds": 4.0, "read_seconds": 1.0}
    summed = db.capture("run-1")
    # "steps" is no model: the forwards are the target's alone
    assert (summed["forwards"], summed["steps"], summed["syncs"]) == (14, 40, 44)
    assert summed["syncs_per_step"] == pytest.approx(1.1)
    assert summed["host_ms_per_step"] == pytest.approx((4.0 - 1.0) * 1000 / 40)
    with pytest.raises(ValueError, match=r"capture counter steps\.syncs must be a number >= 0, got -1"):
        db.record_capture("run-1", {"steps": {**steps, "syncs": -1}})


def test_capture_counters_that_are_no_counts_are_refused_unwritten(db: Database) -> None:
    start(db, capture="eager (auto)")
    with pytest.raises(ValueError, match=r"capture counter draft\.forwards must be a number >= 0, got -1"):
        db.record_capture("run-1", {"target": counters(3), "draft": counters(-1)})
    with pytest.raises(ValueError, match=r"capture counter target\.compiles must be a number >= 0, got None"):
        db.record_capture("run-1", {"target": {"forwards": 3}})
    assert db.get_run("run-1")["capture_counters"] is None
    with pytest.raises(UnknownRunError):
        db.record_capture("no-such-run", {})


def test_a_sharded_runs_capture_is_its_attempts_and_hf_mode_keeps_no_counters(db: Database) -> None:
    start(db, "sharded", device=None, gpu_type=None)
    start(db, "hf-run", capture="hf (SIDECAR_CAPTURE=hf)")
    db.record_capture("hf-run", {})
    for launch, shard, capture, recompiles in (("l0", 0, "eager (auto)", 0), ("l1", 1, "compile (c)", 2)):
        db.record_attempt("sharded", launch, shard, 1, docs=2)
        with duckdb.connect(str(db.path)) as con:
            con.execute("UPDATE shard_attempts SET capture = ?, capture_counters = ? WHERE launch_id = ?",
                        [capture, json.dumps({"target": counters(5, recompiles=recompiles)}), launch])
    sharded = db.capture("sharded")
    assert (sharded["capture"], sharded["recorded"], sharded["forwards"], sharded["recompiles"], sharded["faults"]) \
        == ("compile (c); eager (auto)", 2, 10, 2, 2)
    hf = db.capture("hf-run")
    assert (hf["capture"], hf["recorded"], hf["forwards"], hf["faults"]) == ("hf (SIDECAR_CAPTURE=hf)", 1, None, 0)
    assert db.capture("no-such-run") is None


def test_migration_014_leaves_older_runs_without_a_capture_mode(tmp_path: Path) -> None:
    path = tmp_path / "old.duckdb"
    with old_database(path, 13) as con:
        con.execute("INSERT INTO shard_attempts (run_id, launch_id, shard, attempt, docs, status) VALUES "
                    "('r', 'l0', 0, 1, 2, 'completed')")
    db = Database(path)
    run = db.get_run("r")
    assert (run["capture"], run["capture_counters"]) == (None, None)
    assert db.shard_attempts("r")[0]["capture"] is None
    assert db.capture("r") == {"run_id": "r", "capture": None, "recorded": 0, "compiles": None, "recompiles": None,
                               "graph_breaks": None, "forwards": None, "graph_calls": None,
                               "chained_forwards": None, "distinct_shapes": None,
                               "compile_seconds": None, "graph_bytes": None, "cudagraph_skips": None, "faults": 0,
                               "steps": None,
                               "syncs": None, "syncs_per_step": None, "host_ms_per_step": None}


def test_migration_007_leaves_older_rows_without_a_ledger_and_wall_clock_cost_lines_without_a_rate(
        tmp_path: Path) -> None:
    path = tmp_path / "old.duckdb"
    with old_database(path, 6) as con:
        con.execute("INSERT INTO request_stats (run_id, doc_id, mode, phase, batch_id, drafted, accepted, "
                    "target_forwards, draft_forwards, new_tokens, wall_s, ended_s) VALUES "
                    "('r', 'd', 'sidecar', 'sidecar', 0, 0, 0, 0, 12, 12, 1.0, 60.0)")
        con.execute("INSERT INTO cost_estimates (gpu_type, pair, mode, batch_size, tokens_per_s, usd_per_gpu_hour, "
                    "source, run_id) VALUES ('NVIDIA H200', 'tiny', 'sidecar', 4, 0.2, 3.5, 'measured', 'r'), "
                    "('H200', 'tiny', 'sidecar', 4, 900.0, 3.5, 'projected', NULL)")
    db = Database(path)
    [stats] = db.query("SELECT prefill_device_s, decode_device_s, instruction_device_s, queue_s FROM request_stats")
    assert set(stats.values()) == {None}
    [row] = db.query("SELECT new_tokens, wall_s, tokens_per_s FROM throughput")
    assert row == {"new_tokens": 12, "wall_s": 60.0, "tokens_per_s": None}
    costs = {r["source"]: r for r in db.query("SELECT * FROM costs")}
    # the measured line divided by the stream's wall clock: kept, but no rate and no price any more
    assert (costs["measured"]["tokens_per_s"], costs["measured"]["usd_per_mtok"], costs["measured"]["timed_by"]) \
        == (None, None, None)
    assert costs["projected"]["tokens_per_s"] == 900.0
    assert costs["projected"]["usd_per_mtok"] == pytest.approx(3.5 / (900 * 3600) * 1e6)


def test_migration_011_moves_each_stored_sidecar_output_to_its_task_row_and_keeps_results(tmp_path: Path) -> None:
    """A schema-10 file, written as that code wrote it: one sidecar output per outputs row. After 011 the
    summary stays in outputs, the sidecar output is its task's row with its tokens and ledger seconds, and
    the results view reads the same as before."""
    path = tmp_path / "old.duckdb"
    with old_database(path, 10) as con:
        con.execute("INSERT INTO runs (run_id, status, params, modes, pair) VALUES "
                    "('t', 'completed', '{}', ['sidecar'], 'tiny')")
        con.execute("INSERT INTO documents (run_id, row_index, doc_id, title, text, n_chars, status) VALUES "
                    "('r', 0, 'd1', 'Budget', 'The council approved a budget.', 30, 'ok'), "
                    "('t', 0, 'd1', 'Budget', 'The council approved a budget.', 30, 'ok')")
        con.execute("INSERT INTO outputs (run_id, doc_id, mode, summary, main_tokens, sidecar_name, sidecar_text, "
                    "tags, parse_error, finish_reason, sidecar_finish_reason, batch_id) VALUES "
                    "('r', 'd1', 'sidecar', 'A budget.', 3, 'hashtags', '#budget #council', ['budget', 'council'], "
                    "NULL, 'eos', 'eos', 0), "
                    "('r', 'd1', 'standalone', 'A budget.', NULL, 'hashtags', 'nothing', NULL, 'no hashtags found', "
                    "NULL, 'length', 1), "
                    "('t', 'd1', 'sidecar', 'A budget.', 3, 'headline', ' Council passes budget\n', NULL, NULL, "
                    "'eos', 'eos', 0)")
        con.execute("INSERT INTO request_stats (run_id, doc_id, mode, phase, drafted, accepted, target_forwards, "
                    "draft_forwards, new_tokens, prefill_device_s, decode_device_s, instruction_device_s) VALUES "
                    "('r', 'd1', 'sidecar', 'main', 4, 2, 2, 4, 3, 0.5, 0.5, NULL), "
                    "('r', 'd1', 'sidecar', 'sidecar', 0, 0, 0, 5, 5, 0.1, 0.2, 0.05), "
                    "('r', 'd1', 'standalone', 'sidecar', 0, 0, 0, 7, 7, NULL, NULL, NULL)")
        results_before = con.execute("SELECT * FROM results ORDER BY run_id").fetchall()
    db = Database(path)
    assert db.schema_version == len(known_migrations())
    assert {r["column_name"] for r in db.query("DESCRIBE outputs")} == {
        "run_id", "doc_id", "mode", "summary", "main_tokens", "finish_reason", "batch_id", "written_at"}
    rows = db.query("SELECT run_id, mode, task, text, CAST(parsed AS VARCHAR) AS parsed, parse_error, finish_reason, "
                    "new_tokens, round(device_s, 6) AS device_s FROM sidecar_outputs ORDER BY run_id, mode")
    assert [tuple(r.values()) for r in rows] == [
        ("r", "sidecar", "hashtags", "#budget #council", '["budget","council"]', None, "eos", 5, 0.35),
        ("r", "standalone", "hashtags", "nothing", None, "no hashtags found", "length", 7, None),
        # a text task's value is its text, trimmed
        ("t", "sidecar", "headline", " Council passes budget\n", '"Council passes budget"', None, "eos", None,
         None)]
    with duckdb.connect(str(path), read_only=True) as con:
        assert con.execute("SELECT * FROM results ORDER BY run_id").fetchall() == results_before
    assert db.results("r")[0]["sidecar_tags"] == ["budget", "council"]


def test_a_winner_outside_the_compared_modes_is_refused(db: Database) -> None:
    start(db)
    with pytest.raises(duckdb.ConstraintException):
        db.write_judgements("run-1", [JudgementRecord("d1", "j", "v1", 1, "sidecar", "standalone", "A", "A")])


def test_costs_derive_price_per_million_tokens_from_hourly_rent(db: Database) -> None:
    db.write_costs([CostRecord("NVIDIA T4", "standalone", 8, 100.0, "projected", usd_per_gpu_hour=0.59,
                               timed_by="roofline"),
                    CostRecord("NVIDIA H200", "sidecar", 32, 900.0, "measured", usd_per_mtok=1.25,
                               timed_by="device_ledger")])
    rows = {r["gpu_type"]: r for r in db.query("SELECT * FROM costs")}
    assert rows["NVIDIA T4"]["usd_per_mtok"] == pytest.approx(0.59 / (100.0 * 3600) * 1e6)
    assert rows["NVIDIA H200"]["usd_per_mtok"] == 1.25
    assert (rows["NVIDIA H200"]["source"], rows["NVIDIA H200"]["tokens_per_s"]) == ("measured", 900.0)


def test_query_binds_parameters_and_cannot_change_the_database(db: Database) -> None:
    start(db)
    assert db.query("SELECT run_id FROM runs WHERE run_id = $id", {"id": "run-1"}) == [{"run_id": "run-1"}]
    db.query("DELETE FROM runs")
    assert db.get_run("run-1") is not None


# -- hostile strings -----------------------------------------------------------------------------------

HOSTILE = [
    "'; DROP TABLE runs; --",
    'double "quotes" and \'single\' quotes',
    "unicode: Zürich 東京 🙂 \u200b right-to-left \u202e",
    "NUL\x00inside",
    "backslash \\ and percent % and question ? and $1",
]


@pytest.mark.parametrize("hostile", HOSTILE)
def test_hostile_strings_round_trip_unchanged(db: Database, hostile: str) -> None:
    run_id = f"run {hostile}"
    doc_id = f"doc {hostile}"
    params = {"note": hostile, hostile: [hostile]}
    start(db, run_id=run_id, params=params, pair=hostile)
    db.record_documents(run_id, [Document(doc_id, hostile, 0, title=hostile)], [])
    tags = [f"#{hostile}", "#plain"]
    db.write_batch(run_id, [output(doc_id, "sidecar", tags, summary=hostile),
                            output(doc_id, "standalone", tags, summary=hostile)])
    run = db.get_run(run_id)
    assert (run["params"], run["pair"]) == (params, hostile)
    [row] = db.results(run_id)
    assert (row["doc_id"], row["title"], row["summary"]) == (doc_id, hostile, hostile)
    assert row["sidecar_tags"] == tags and row["standalone_tags"] == tags
    assert db.done_doc_ids(run_id, ["sidecar", "standalone"]) == {doc_id}
    db.finish_run(run_id, "failed", error=hostile)
    assert db.get_run(run_id)["error"] == hostile
    tables, _ = table_names(db.path)
    assert tables >= TABLES


# -- documentation ---------------------------------------------------------------------------------------


def test_every_sql_example_in_the_readme_runs(db: Database) -> None:
    readme = (Path(__file__).resolve().parent.parent / "storage" / "README.md").read_text(encoding="utf-8")
    examples = re.findall(r"```sql\n(.*?)```", readme, flags=re.DOTALL)
    assert len(examples) >= 6
    start(db, modes=("sidecar", "sidecar_attended", "standalone"))
    db.record_documents("run-1", [Document("d1", "text", 0)], [RejectedDocument("row:1", "null", 1)])
    both_phases = [RequestStats("main", 12, drafted=16, accepted=10, target_forwards=4, wall_s=2.0),
                   RequestStats.sidecar_phase(GenerationStats(
                       new_tokens=6, draft_forwards=6, decode_seconds=0.4, wall_seconds=0.4, kv_bytes=3_700_000,
                       **ledger(6, 0.01, 0.1, instruction_device_seconds=0.005)))]
    db.write_batch("run-1", [output("d1", "sidecar", ["#a"], stats=both_phases),
                             output("d1", "standalone", ["#b"], stats=both_phases[1:]),
                             output("d1", "sidecar_attended", ["#a", "#town"])])
    db.write_judgements("run-1", [
        JudgementRecord("d1", "j", "v1", 1, "sidecar", "standalone", "A", "sidecar"),
        JudgementRecord("d1", "j", "v1", 2, "standalone", "sidecar", "B", "sidecar"),
        # a judge that passed its control: the examples that read reliable judges have a row
        JudgementRecord("d1", "j", "v1", 1, "own", "other", "A", "own", kind="control", foil_doc_id="d2"),
        JudgementRecord("d1", "j", "v1", 2, "other", "own", "B", "own", kind="control", foil_doc_id="d2"),
        # and whose null rung tied: each game chose the set shown first
        JudgementRecord("d1", "j", "v1", 1, "original", "reversed", "A", "original", kind="null"),
        JudgementRecord("d1", "j", "v1", 2, "reversed", "original", "A", "reversed", kind="null"),
    ], JudgeSettingsRecord("j", "v1", "text", threshold=0.75))
    db.write_costs([CostRecord("NVIDIA T4", "standalone", 32, 100.0, "projected", usd_per_gpu_hour=0.59)])
    for sql in examples:
        assert db.query(sql), f"example returned no rows on a populated database:\n{sql}"
    # the tagging cost example reads the ledger: (10 + 100 + 5) ms over 6 tag tokens, in both modes here
    [cost_example] = [e for e in examples if "device_ms_per_tag_token" in e]
    assert {r["device_ms_per_tag_token"] for r in db.query(cost_example)} == {round(115 / 6, 3)}


def test_request_stats_read_the_engine_stats_record() -> None:
    main = RequestStats.main_phase(GenerationStats(
        prompt_tokens=400, new_tokens=64, drafted=80, accepted=58, target_forwards=20, draft_forwards=80,
        prefill_seconds=0.2, decode_seconds=3.0, wall_seconds=3.2, kv_bytes=9, batch_size=4))
    # the engine always keeps the ledger: a row it never charged carries zeros, not None
    ledger_zeros = dict.fromkeys(("prefill_tokens", "prefill_forwards", "decode_tokens", "decode_forwards"), 0) \
        | dict.fromkeys(("prefill_device_s", "decode_device_s", "queue_s", "first_token_s"), 0.0)
    assert main == RequestStats("main", new_tokens=64, drafted=80, accepted=58, target_forwards=20,
                                draft_forwards=80, prompt_tokens=400, prefill_s=0.2, decode_s=3.0, wall_s=3.2,
                                batch_size=4, **ledger_zeros)  # no kv_bytes and no instruction line: a sidecar's
    tagging = RequestStats.sidecar_phase(GenerationStats(
        new_tokens=12, prompt_tokens=700, draft_forwards=13, prefill_seconds=0.05, decode_seconds=0.5,
        wall_seconds=0.55, kv_bytes=3_700_000, batch_size=8, **ledger(12, 0.02, 0.3, prefill_tokens=30,
                                                                       instruction_tokens=25,
                                                                       instruction_device_seconds=0.01)))
    # its prompt is what it was fed (the ledger's prefill tokens), not the context it attends to
    assert tagging == RequestStats("sidecar", new_tokens=12, draft_forwards=13, prompt_tokens=30, prefill_s=0.05,
                                   decode_s=0.5, wall_s=0.55, kv_bytes=3_700_000, batch_size=8, prefill_tokens=30,
                                   prefill_forwards=1, prefill_device_s=0.02, decode_tokens=12, decode_forwards=12,
                                   decode_device_s=0.3, queue_s=0.5, first_token_s=1.0, instruction_tokens=25,
                                   instruction_device_s=0.01)
