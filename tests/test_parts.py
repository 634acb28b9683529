"""Part files (storage.parts) and their ingest (Database.ingest_parts): complete or invisible, ingested once."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.fs as pafs
import pytest
from shard_parts import both_modes, record

from storage import (
    Database,
    Document,
    IngestResult,
    OutputRecord,
    PartRunMismatchError,
    PartStore,
    RanOn,
    RejectedDocument,
    ShardInfo,
    SidecarRecord,
    UnknownAttemptError,
    UnknownRunError,
)
from storage import parts as parts_module
from storage.connection import RetryPolicy
from storage.migrate import known_migrations, migrate
from storage.parts import STATS_TYPE, Manifest, PartCapture, text_sha256

# the fields migration 007 added to request_stats, and so to the stats of a part
LEDGER_FIELDS = {"prefill_tokens", "prefill_forwards", "prefill_device_s", "decode_tokens", "decode_forwards",
                 "decode_device_s", "instruction_tokens", "instruction_device_s", "queue_s", "first_token_s"}

RUN = "run-1"
DOCS = [Document(f"d{i}", f"Text of document {i}.", i, title=f"Title {i}") for i in range(4)]
HASHES = {d.doc_id: text_sha256(d.text) for d in DOCS}


def begin(db: Database, run_id: str = RUN, gpu_type: str | None = None, device: str | None = None,
          docs: list[Document] = DOCS) -> str:
    """Start the run; returns its nonce."""
    # a sharded run's own row names no device: the parent holds none
    return db.begin_run(run_id, {"workers": 2}, "tiny", device, gpu_type, 4, 2, docs, [], code_version="test").nonce


# the nonce of the run RUN of the test's database (each test has one database)
NONCE: dict[str, str] = {}


def shard(launch_id: str, shard_index: int = 0, attempt: int = 1, gpu_type: str | None = "NVIDIA H100",
          run_id: str = RUN, host: str = "gpu-a", nonce: str | None = None) -> ShardInfo:
    return ShardInfo(run_id, launch_id, shard_index, attempt, host, "cuda:0", gpu_type,
                     nonce or NONCE.get(run_id, "no-run-begun"))


def attempt_writer(store: PartStore, launch_id: str, *args, docs: list[Document] = DOCS,
                   **kwargs) -> parts_module.PartWriter:
    """An attempt's writer (:func:`shard`'s arguments) whose manifest held ``docs``."""
    return store.writer(shard(launch_id, *args, **kwargs), docs)


def oom(doc: Document) -> RejectedDocument:
    return RejectedDocument(doc.doc_id, "oom", doc.row_index, detail="CUDA out of memory", title=doc.title,
                            text=doc.text)


def counts(db: Database) -> tuple[int, int, int]:
    [row] = db.query("SELECT (SELECT count(*) FROM outputs) AS o, (SELECT count(*) FROM request_stats) AS s, "
                     "(SELECT count(*) FROM ingested_parts) AS p")
    return row["o"], row["s"], row["p"]


@pytest.fixture
def db(tmp_path: Path) -> Database:
    db = Database(tmp_path / "sidecar.duckdb")
    NONCE.clear()
    NONCE[RUN] = begin(db)
    return db


@pytest.fixture
def store(db: Database) -> PartStore:
    return PartStore.beside(db.path)


# -- writing parts ------------------------------------------------------------------------------------


def test_the_default_location_is_beside_the_database(db: Database, store: PartStore) -> None:
    assert Path(store.uri) == db.runs_dir / "parts"
    assert store.is_local


def test_parts_are_numbered_in_order_and_an_empty_write_writes_nothing(store: PartStore) -> None:
    writer = attempt_writer(store, "s0000-a01-aaaa")
    assert writer.write([], []) is None
    first = writer.write(both_modes("d0"), [])
    second = writer.write([], [oom(DOCS[1])])
    assert [Path(p).name for p in (first, second)] == ["part-000001.parquet", "part-000002.parquet"]
    # a writer for a launch that has parts numbers on, never over a part the parent may have ingested
    third = attempt_writer(store, "s0000-a01-aaaa").write(both_modes("d2"), [])
    assert Path(third).name == "part-000003.parquet"
    assert store.parts(RUN) == [first, second, third]
    assert store.parts("another run") == []


def test_a_killed_write_leaves_no_visible_part(db: Database, store: PartStore,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(fs, source, target):
        raise OSError("killed between write and rename")

    monkeypatch.setattr(parts_module, "_publish", crash)
    writer = attempt_writer(store, "s0000-a01-aaaa")
    with pytest.raises(OSError, match="killed"):
        writer.write(both_modes("d0"), [oom(DOCS[1])])
    assert store.parts(RUN) == []
    # a SIGKILL leaves its temporary file behind, half written: never listed, never ingested
    launch_dir = Path(store.launch_dir(RUN, "s0000-a01-aaaa"))
    (launch_dir / ".part-000001.parquet.tmp-0123abcd").write_bytes(b"PAR1 half a part")
    assert store.parts(RUN) == []
    assert db.ingest_parts(RUN, store) == IngestResult(parts=0, skipped=0, outputs=0, rejects=0)
    assert counts(db) == (0, 0, 0)
    assert db.query("SELECT status FROM documents WHERE doc_id = 'd1'") == [{"status": "ok"}]
    # the next write of the launch is its first visible part
    monkeypatch.undo()
    assert Path(attempt_writer(store, "s0000-a01-aaaa").write(both_modes("d0"), [])).name == "part-000001.parquet"
    # once the attempt is over, its parent deletes what the killed writer left, and only that
    store.write_manifest(RUN, "s0000-a01-aaaa", Manifest(NONCE[RUN], DOCS[:1]))
    assert store.remove_temporary(RUN, "s0000-a01-aaaa") == 1
    assert sorted(p.name for p in launch_dir.iterdir()) == ["manifest.parquet", "part-000001.parquet"]
    assert store.remove_temporary(RUN, "s0000-a01-aaaa") == 0
    assert store.remove_temporary(RUN, "s0009-a01-ffff") == 0, "an attempt that never wrote"


def test_a_manifest_round_trips_and_is_not_a_part(store: PartStore) -> None:
    path = store.write_manifest(RUN, "s0001-a01-bbbb", Manifest("f00d", DOCS[:3]))
    assert Path(path).name == "manifest.parquet" and Path(path).exists()
    assert store.read_manifest(RUN, "s0001-a01-bbbb") == Manifest("f00d", DOCS[:3])
    assert store.parts(RUN) == []
    assert not [p for p in Path(path).parent.iterdir() if ".tmp-" in p.name]


def test_an_attempts_device_state_is_replaced_as_it_changes_and_is_not_a_part(store: PartStore) -> None:
    assert store.read_device_state(RUN, "s0001-a01-bbbb") is None
    store.write_device_state(RUN, "s0001-a01-bbbb", "waiting")
    assert store.read_device_state(RUN, "s0001-a01-bbbb") == "waiting"
    store.write_device_state(RUN, "s0001-a01-bbbb", "held")
    assert store.read_device_state(RUN, "s0001-a01-bbbb") == "held"
    assert store.parts(RUN) == []
    directory = Path(store.launch_dir(RUN, "s0001-a01-bbbb"))
    assert [p.name for p in directory.iterdir()] == ["device-state"]
    (directory / "device-state").write_text("asleep")
    with pytest.raises(ValueError, match="says its device is 'asleep'"):
        store.read_device_state(RUN, "s0001-a01-bbbb")


@pytest.mark.parametrize("launch_id", ["", "../escape", "a/b", ".hidden"])
def test_a_launch_id_must_be_one_plain_directory_name(store: PartStore, launch_id: str) -> None:
    with pytest.raises(ValueError, match="launch id"):
        shard(launch_id)
    with pytest.raises(ValueError, match="launch id"):
        store.write_manifest(RUN, launch_id, Manifest(NONCE[RUN], DOCS))


# -- ingest ----------------------------------------------------------------------------------------------


def test_ingest_twice_stores_each_document_and_mode_once_and_skips_every_part(db: Database,
                                                                               store: PartStore) -> None:
    writer = attempt_writer(store, "s0000-a01-aaaa")
    writer.write(both_modes("d0") + both_modes("d1"), [])
    writer.write(both_modes("d2"), [])
    assert db.ingest_parts(RUN, store) == IngestResult(parts=2, skipped=0, outputs=6, rejects=0)
    # sidecar rows carry two phases, standalone rows one
    assert counts(db) == (6, 9, 2)
    assert db.ingest_parts(RUN, store) == IngestResult(parts=0, skipped=2, outputs=0, rejects=0)
    assert counts(db) == (6, 9, 2)
    assert [r["doc_id"] for r in db.results(RUN)] == ["d0", "d1", "d2"]
    assert db.done_doc_ids(RUN, ["sidecar", "standalone"]) == {"d0", "d1", "d2"}
    stored = db.query("SELECT DISTINCT launch_id, host, device, gpu_type FROM request_stats")
    assert stored == [{"launch_id": "s0000-a01-aaaa", "host": "gpu-a", "device": "cuda:0", "gpu_type": "NVIDIA H100"}]
    [stats] = db.query("SELECT * FROM request_stats WHERE doc_id = 'd0' AND mode = 'sidecar' AND phase = 'sidecar'")
    assert (stats["new_tokens"], stats["kv_bytes"], stats["wall_s"]) == (5, 3_000_000, 0.5)
    assert db.query("SELECT part, launch_id, rows FROM ingested_parts ORDER BY part") == [
        {"part": "s0000-a01-aaaa/part-000001.parquet", "launch_id": "s0000-a01-aaaa", "rows": 4},
        {"part": "s0000-a01-aaaa/part-000002.parquet", "launch_id": "s0000-a01-aaaa", "rows": 2}]

    # a part that arrives later is the only one read
    writer.write(both_modes("d3"), [])
    assert db.ingest_parts(RUN, store) == IngestResult(parts=1, skipped=2, outputs=2, rejects=0)
    assert counts(db) == (8, 12, 3)


def test_an_ingested_part_is_not_read_again(db: Database, store: PartStore) -> None:
    path = attempt_writer(store, "s0000-a01-aaaa").write(both_modes("d0"), [])
    db.ingest_parts(RUN, store)
    Path(path).write_bytes(b"not parquet any more")
    assert db.ingest_parts(RUN, store) == IngestResult(parts=0, skipped=1, outputs=0, rejects=0)


@pytest.mark.parametrize("chunk_parts", [1, 64])
def test_a_document_finished_by_two_attempts_is_stored_once(db: Database, store: PartStore,
                                                            chunk_parts: int) -> None:
    attempt_writer(store, "s0000-a01-aaaa").write(both_modes("d0", summary="first attempt"), [])
    attempt_writer(store, "s0000-a02-bbbb", attempt=2).write(
        both_modes("d0", summary="second attempt") + both_modes("d1"), [])
    result = db.ingest_parts(RUN, store, chunk_parts=chunk_parts)
    assert (result.parts, result.skipped) == (2, 0)
    assert db.query("SELECT doc_id, mode, count(*) AS n FROM outputs GROUP BY ALL HAVING n > 1") == []
    assert db.query("SELECT doc_id, mode, phase, count(*) AS n FROM request_stats GROUP BY ALL HAVING n > 1") == []
    assert counts(db) == (4, 6, 2)
    # the part last by path wins, in one chunk as across chunks
    assert {r["summary"] for r in db.query("SELECT summary FROM outputs WHERE doc_id = 'd0'")} == {"second attempt"}
    assert {r["launch_id"] for r in db.query("SELECT launch_id FROM request_stats WHERE doc_id = 'd0'")} == {
        "s0000-a02-bbbb"}


def test_a_rewritten_request_loses_the_stats_of_phases_it_no_longer_brings(db: Database, store: PartStore) -> None:
    attempt_writer(store, "s0000-a01-aaaa").write([record("d0", "sidecar")], [])
    db.ingest_parts(RUN, store)
    assert counts(db)[1] == 2
    fewer = record("d0", "sidecar")
    fewer = OutputRecord(**{**fewer.__dict__, "stats": fewer.stats[:1]})
    attempt_writer(store, "s0000-a02-bbbb", attempt=2).write([fewer], [])
    db.ingest_parts(RUN, store)
    assert db.query("SELECT phase FROM request_stats") == [{"phase": "main"}]


def test_parts_carry_every_task_and_a_rewritten_request_loses_the_tasks_it_no_longer_brings(
        db: Database, store: PartStore) -> None:
    headline = SidecarRecord.of("headline", " Council passes budget", "Council passes budget", finish_reason="eos",
                                new_tokens=4, device_s=0.25)
    two = record("d0", "sidecar")
    two = OutputRecord(**{**two.__dict__, "sidecars": [*two.sidecars, headline]})
    attempt_writer(store, "s0000-a01-aaaa").write([two], [])
    db.ingest_parts(RUN, store)
    rows = db.query("SELECT task, text, parsed, new_tokens, device_s FROM sidecar_outputs ORDER BY task")
    assert [(r["task"], r["text"], json.loads(r["parsed"]), r["new_tokens"], r["device_s"]) for r in rows] == [
        ("hashtags", "#a #b", ["#a", "#b"], None, None),
        ("headline", " Council passes budget", "Council passes budget", 4, 0.25)]
    assert db.query("SELECT count(*) AS n FROM outputs") == [{"n": 1}], "the summary once"
    attempt_writer(store, "s0000-a02-bbbb", attempt=2).write([record("d0", "sidecar")], [])
    db.ingest_parts(RUN, store)
    assert db.query("SELECT task FROM sidecar_outputs") == [{"task": "hashtags"}]


@pytest.mark.parametrize("location", ["local", "mock"])
def test_a_part_written_before_parts_carried_each_tasks_output_is_refused(db: Database, tmp_path: Path,
                                                                          location: str) -> None:
    """Such a part's sidecar outputs would be lost: its documents run again instead."""
    store = PartStore(tmp_path / "results" if location == "local" else "mock:///results")
    info = shard("s0000-a01-aaaa")
    table = parts_module.part_table(info, both_modes("d0"), [], HASHES).drop_columns(["sidecars"])
    path = f"{store.launch_dir(RUN, info.launch_id)}/part-000001.parquet"
    old = parts_module.write_atomically(store.filesystem, path, table)
    assert db.ingest_parts(RUN, store).refused == (old,)
    assert counts(db) == (0, 0, 0)


def test_rejects_land_in_documents_as_write_batch_puts_them(db: Database, store: PartStore, tmp_path: Path) -> None:
    attempt_writer(store, "s0000-a01-aaaa").write(both_modes("d0"), [oom(DOCS[1]), oom(DOCS[2])])
    assert db.ingest_parts(RUN, store) == IngestResult(parts=1, skipped=0, outputs=2, rejects=2)
    direct = Database(tmp_path / "direct.duckdb")
    begin(direct)
    direct.write_batch(RUN, both_modes("d0"), [oom(DOCS[1]), oom(DOCS[2])])
    sql = "SELECT * FROM documents ORDER BY row_index"
    assert db.query(sql) == direct.query(sql)
    assert [(r["doc_id"], r["status"], r["reject_reason"], r["reject_detail"]) for r in db.query(sql)] == [
        ("d0", "ok", None, None), ("d1", "rejected", "oom", "CUDA out of memory"),
        ("d2", "rejected", "oom", "CUDA out of memory"), ("d3", "ok", None, None)]


def test_a_reject_that_names_another_document_is_refused(db: Database, store: PartStore) -> None:
    other = RejectedDocument("intruder", "oom", DOCS[1].row_index, detail="x", title="T", text="other text")
    attempt_writer(store, "s0000-a01-aaaa").write(both_modes("d0"), [other])
    with pytest.raises(Exception, match="stored other input rows"):
        db.ingest_parts(RUN, store)
    assert counts(db) == (0, 0, 0)


def test_a_part_for_another_run_is_refused_and_nothing_is_written(db: Database, store: PartStore) -> None:
    NONCE["run-2"] = begin(db, "run-2")
    attempt_writer(store, "s0000-a01-aaaa").write(both_modes("d0"), [])
    stray = attempt_writer(store, "s0000-a01-cccc", run_id="run-2").write(both_modes("d1"), [])
    # a part copied under run-1's directory
    target = Path(store.launch_dir(RUN, "s0009-a01-cccc")) / "part-000001.parquet"
    target.parent.mkdir(parents=True)
    target.write_bytes(Path(stray).read_bytes())
    with pytest.raises(PartRunMismatchError, match="run-2") as caught:
        db.ingest_parts(RUN, store, chunk_parts=1)
    assert str(target) in str(caught.value) and "nothing was ingested" in str(caught.value)
    assert counts(db) == (0, 0, 0)


def refused_line(caplog: pytest.LogCaptureFixture) -> str:
    [line] = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    return line


def test_a_part_of_another_start_of_the_run_id_is_refused_in_one_line_and_stores_nothing(
        db: Database, store: PartStore, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # the same run id started afresh in another database over the same results location: its parts are not
    # this run's, whatever ids they name
    other = Database(tmp_path / "other.duckdb")
    stray = attempt_writer(store, "s0000-a01-aaaa", nonce=begin(other)).write(both_modes("d0", summary="not ours"), [])
    ours = attempt_writer(store, "s0001-a01-bbbb").write(both_modes("d1"), [])
    with caplog.at_level("WARNING"):
        result = db.ingest_parts(RUN, store)
    assert (result.parts, result.outputs, result.refused) == (1, 2, (stray,))
    assert "another start of this run id" in refused_line(caplog) and stray in refused_line(caplog)
    assert db.done_doc_ids(RUN, ["sidecar", "standalone"]) == {"d1"} and counts(db) == (2, 3, 1)
    assert Path(ours).exists()


def test_a_part_of_another_text_or_of_no_document_of_the_run_is_refused(db: Database, store: PartStore,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    changed = [Document("d0", "The text as it was before the corpus changed.", 0, title="Title 0")]
    edited = attempt_writer(store, "s0000-a01-aaaa", docs=changed).write(both_modes("d0"), [])
    stranger = [Document("d9", "Not in the run.", 9)]
    unknown = attempt_writer(store, "s0001-a01-bbbb", docs=stranger).write(both_modes("d9"), [])
    with caplog.at_level("WARNING"):
        result = db.ingest_parts(RUN, store)
    assert (result.parts, sorted(result.refused)) == (0, sorted([edited, unknown]))
    assert "does not have with that text" in refused_line(caplog)
    assert counts(db) == (0, 0, 0)
    # a refused part is not recorded: the run's own parts still go in, and it is refused again, unread
    attempt_writer(store, "s0002-a01-cccc").write(both_modes("d0"), [])
    assert db.ingest_parts(RUN, store).parts == 1 and counts(db) == (2, 3, 1)


@pytest.mark.parametrize("location", ["local", "mock"])
def test_a_part_written_before_parts_carried_a_nonce_is_refused(db: Database, tmp_path: Path, location: str) -> None:
    store = PartStore(tmp_path / "results" if location == "local" else "mock:///results")
    info = shard("s0000-a01-aaaa")
    table = parts_module.part_table(info, both_modes("d0"), [], HASHES).drop_columns(["run_nonce", "text_sha256"])
    path = f"{store.launch_dir(RUN, info.launch_id)}/part-000001.parquet"
    old = parts_module.write_atomically(store.filesystem, path, table)
    assert db.ingest_parts(RUN, store).refused == (old,)
    assert counts(db) == (0, 0, 0)


def test_ingest_needs_the_run(db: Database, store: PartStore) -> None:
    with pytest.raises(UnknownRunError, match="no-such-run"):
        db.ingest_parts("no-such-run", store)


def test_a_location_duckdb_would_read_as_a_glob_is_read_through_pyarrow(db: Database, tmp_path: Path) -> None:
    store = PartStore(tmp_path / "results [nightly]")
    assert not store.is_local
    attempt_writer(store, "s0000-a01-aaaa").write(both_modes("d0"), [oom(DOCS[1])])
    assert db.ingest_parts(RUN, store) == IngestResult(parts=1, skipped=0, outputs=2, rejects=1)


@pytest.mark.parametrize("location", ["file", "mock"])
def test_a_pyarrow_uri_location_works(db: Database, tmp_path: Path, location: str) -> None:
    # file:// is read by DuckDB by path; mock:// (pyarrow's in-memory file system) is read through pyarrow
    store = PartStore((tmp_path / "results").as_uri() if location == "file" else "mock:///results")
    assert store.is_local == (location == "file")
    store.write_manifest(RUN, "s0000-a01-aaaa", Manifest(NONCE[RUN], DOCS[:2]))
    assert store.read_manifest(RUN, "s0000-a01-aaaa") == Manifest(NONCE[RUN], DOCS[:2])
    writer = attempt_writer(store, "s0000-a01-aaaa")
    writer.write(both_modes("d0"), [oom(DOCS[1])])
    writer.write(both_modes("d2"), [])
    assert len(store.parts(RUN)) == 2
    assert db.ingest_parts(RUN, store) == IngestResult(parts=2, skipped=0, outputs=4, rejects=1)
    assert db.ingest_parts(RUN, store) == IngestResult(parts=0, skipped=2, outputs=0, rejects=0)
    assert counts(db) == (4, 6, 2)
    if location == "file":
        assert (tmp_path / "results").is_dir()
    else:
        assert store.filesystem.get_file_info(store.parts(RUN)[0]).type == pafs.FileType.File


def without_the_ledger(table: pa.Table) -> pa.Table:
    """A part as a shard running code from before migration 007 wrote it: its stats lack the ledger fields."""
    fields = [f for f in STATS_TYPE.value_type if f.name not in LEDGER_FIELDS]
    old_schema = table.schema.set(table.schema.get_field_index("stats"),
                                  pa.field("stats", pa.list_(pa.struct(fields))))
    rows = table.to_pylist()
    for row in rows:
        row["stats"] = [{k: v for k, v in stats.items() if k not in LEDGER_FIELDS} for stats in row["stats"] or []]
    return pa.Table.from_pylist(rows, schema=old_schema)


@pytest.mark.parametrize("location", ["local", "mock"])
def test_parts_carry_the_ledger_and_a_part_from_before_it_ingests_beside_them_without_one(
        db: Database, tmp_path: Path, location: str) -> None:
    store = PartStore(tmp_path / "results" if location == "local" else "mock:///results")
    # the older attempt's part sorts first: its narrower stats must not narrow the newer part's
    old = shard("s0000-a01-aaaa")
    table = without_the_ledger(parts_module.part_table(old, both_modes("d0", device_s=1.0), [], HASHES))
    parts_module.write_atomically(store.filesystem, f"{store.launch_dir(RUN, old.launch_id)}/part-000001.parquet",
                                  table)
    attempt_writer(store, "s0001-a01-bbbb", 1).write(both_modes("d1", device_s=1.0), [])
    assert db.ingest_parts(RUN, store) == IngestResult(parts=2, skipped=0, outputs=4, rejects=0)
    ledgers = {(r["doc_id"], r["mode"], r["phase"]): r for r in db.query(
        "SELECT doc_id, mode, phase, prefill_tokens, prefill_device_s, decode_device_s, instruction_tokens, "
        "instruction_device_s, first_token_s FROM request_stats")}
    assert ledgers[("d1", "sidecar", "main")] | {"doc_id": None} == {
        "doc_id": None, "mode": "sidecar", "phase": "main", "prefill_tokens": 50, "prefill_device_s": 0.2,
        "decode_device_s": 0.8, "instruction_tokens": None, "instruction_device_s": None, "first_token_s": 0.1}
    tagging = ledgers[("d1", "sidecar", "sidecar")]
    assert (tagging["instruction_tokens"], tagging["instruction_device_s"]) == (25, 0.01)
    assert all(v is None for key, row in ledgers.items() if key[0] == "d0"
               for name, v in row.items() if name not in ("doc_id", "mode", "phase"))
    [main] = db.query("SELECT requests, ledger_requests, tokens_per_s FROM throughput "
                      "WHERE mode = 'sidecar' AND phase = 'main'")
    assert main == {"requests": 2, "ledger_requests": 1, "tokens_per_s": 10.0}


# -- attempts and throughput -------------------------------------------------------------------------------


def test_an_attempt_is_recorded_at_launch_gets_its_host_from_its_parts_and_ends(db: Database,
                                                                                store: PartStore) -> None:
    db.record_attempt(RUN, "s0000-a01-aaaa", shard=0, attempt=1, docs=2, flow_run_id=None)
    db.record_attempt(RUN, "s0000-a01-aaaa", shard=0, attempt=1, docs=2, flow_run_id="flow-1")
    [row] = db.shard_attempts(RUN)
    assert (row["status"], row["docs"], row["flow_run_id"], row["host"]) == ("running", 2, "flow-1", None)
    attempt_writer(store, "s0000-a01-aaaa", host="gpu-a").write(both_modes("d0"), [])
    # a part ingested before its attempt was recorded (a parent rerun) names its host all the same
    attempt_writer(store, "s0001-a01-bbbb", 1, host="gpu-b", gpu_type="NVIDIA A10G").write(both_modes("d1"), [])
    db.ingest_parts(RUN, store)
    db.record_attempt(RUN, "s0001-a01-bbbb", shard=1, attempt=1, docs=1)
    db.finish_attempt(RUN, "s0000-a01-aaaa", "completed")
    db.finish_attempt(RUN, "s0001-a01-bbbb", "crashed", error="worker lost")
    rows = db.shard_attempts(RUN)
    assert [(r["shard"], r["status"], r["host"], r["device"], r["gpu_type"], r["error"]) for r in rows] == [
        (0, "completed", "gpu-a", "cuda:0", "NVIDIA H100", None),
        (1, "crashed", "gpu-b", "cuda:0", "NVIDIA A10G", "worker lost")]
    assert all(r["finished_at"] is not None for r in rows)
    with pytest.raises(UnknownAttemptError):
        db.finish_attempt(RUN, "s0002-a01-cccc", "failed")
    with pytest.raises(ValueError, match="ends as"):
        db.finish_attempt(RUN, "s0000-a01-aaaa", "running")
    with pytest.raises(UnknownRunError):
        db.record_attempt("no-such-run", "s0000-a01-aaaa", shard=0, attempt=1, docs=1)


def forwards(n: int, recompiles: int = 0) -> dict:
    return {"target": {"compiles": 1, "recompiles": recompiles, "graph_breaks": 0, "forwards": n,
                       "graph_calls": n, "chained_forwards": 0, "distinct_shapes": 2, "compile_seconds": 0.5,
                       "graph_bytes": 0, "cudagraph_skips": 0}}


@pytest.mark.parametrize("location", ["local", "mock"])
def test_an_attempt_keeps_the_capture_of_its_latest_part_and_a_part_from_before_014_has_none(
        db: Database, tmp_path: Path, location: str) -> None:
    store = PartStore(tmp_path / "results" if location == "local" else "mock:///results")
    # an attempt's counters grow as it decodes: each part carries them as they are when it is written
    said = iter([PartCapture("eager (auto: CPU)", forwards(5)), PartCapture("eager (auto: CPU)", forwards(12))])
    db.record_attempt(RUN, "s0000-a01-aaaa", shard=0, attempt=1, docs=2)
    first = store.writer(shard("s0000-a01-aaaa"), DOCS, capture=lambda: next(said))
    first.write(both_modes("d0"), [])
    db.ingest_parts(RUN, store)
    first.write(both_modes("d1"), [])
    # a part written before migration 014 (no capture columns), and a compiled attempt's, ingested before its
    # attempt is recorded (a parent rerun)
    old = shard("s0001-a01-bbbb", 1)
    table = parts_module.part_table(old, both_modes("d2"), [], HASHES)
    table = table.drop_columns(["capture", "capture_counters"])
    parts_module.write_atomically(store.filesystem, f"{store.launch_dir(RUN, old.launch_id)}/part-000001.parquet",
                                  table)
    store.writer(shard("s0002-a01-cccc", 2), DOCS,
                 capture=lambda: PartCapture("compile (c)", forwards(7, recompiles=1))).write(both_modes("d3"), [])
    assert db.ingest_parts(RUN, store).parts == 3
    db.record_attempt(RUN, "s0001-a01-bbbb", shard=1, attempt=1, docs=1)
    db.record_attempt(RUN, "s0002-a01-cccc", shard=2, attempt=1, docs=1)
    rows = db.shard_attempts(RUN)
    assert [(r["capture"], r["capture_counters"] and json.loads(r["capture_counters"])["target"]["forwards"])
            for r in rows] == [("eager (auto: CPU)", 12), (None, None), ("compile (c)", 7)]
    summed = db.capture(RUN)
    assert (summed["capture"], summed["recorded"], summed["forwards"], summed["recompiles"], summed["faults"]) == (
        "compile (c); eager (auto: CPU)", 2, 19, 1, 1)


def test_part_capture_counters_that_are_no_counts_are_refused_before_a_part_is_written(store: PartStore) -> None:
    writer = store.writer(shard("s0000-a01-aaaa"), DOCS, capture=lambda: PartCapture("eager (e)", forwards(-3)))
    with pytest.raises(ValueError, match=r"capture counter target\.forwards must be a number >= 0, got -3"):
        writer.write(both_modes("d0"), [])
    assert store.parts(RUN) == []


def test_throughput_has_one_row_per_gpu_type_of_a_run(db: Database, store: PartStore) -> None:
    # both attempts number their batches from 0: a batch is one attempt's, never merged across shards
    attempt_writer(store, "s0000-a01-aaaa", 0, gpu_type="NVIDIA H100").write(
        [record("d0", "sidecar", tokens=40, wall_s=1.0, device_s=0.5),
         record("d1", "sidecar", tokens=20, wall_s=0.5, device_s=0.25)], [])
    attempt_writer(store, "s0001-a01-bbbb", 1, gpu_type="NVIDIA A10G", host="gpu-b").write(
        [record("d2", "sidecar", tokens=30, wall_s=3.0, device_s=2.0)], [])
    db.ingest_parts(RUN, store)
    rows = db.query("SELECT gpu_type, device, requests, batches, new_tokens, wall_s, device_s, tokens_per_s "
                    "FROM throughput WHERE run_id = ? AND phase = 'main' ORDER BY gpu_type", [RUN])
    # tokens per attributed device second; the batch's wall clock stays beside it as latency
    assert rows == [
        {"gpu_type": "NVIDIA A10G", "device": "cuda:0", "requests": 1, "batches": 1, "new_tokens": 30,
         "wall_s": 3.0, "device_s": 2.0, "tokens_per_s": 15.0},
        {"gpu_type": "NVIDIA H100", "device": "cuda:0", "requests": 2, "batches": 1, "new_tokens": 60,
         "wall_s": 1.0, "device_s": 0.75, "tokens_per_s": 80.0}]
    assert len(db.throughput(RUN)) == 4  # two GPU types x two phases
    # the per-request distribution of the cost report too: the run's own row names no GPU
    assert {(m["doc_id"], m["gpu_type"]) for m in db.request_acceptance(RUN)} == {
        ("d0", "NVIDIA H100"), ("d1", "NVIDIA H100"), ("d2", "NVIDIA A10G")}


def test_a_run_written_by_itself_reports_its_own_device_and_gpu_type(tmp_path: Path) -> None:
    db = Database(tmp_path / "own.duckdb")
    begin(db, gpu_type="NVIDIA H200", device="cuda:0")
    db.write_batch(RUN, both_modes("d0"))
    rows = db.query("SELECT DISTINCT gpu_type, device FROM throughput")
    assert rows == [{"gpu_type": "NVIDIA H200", "device": "cuda:0"}]
    assert db.query("SELECT DISTINCT launch_id, host FROM request_stats") == [{"launch_id": None, "host": None}]


def test_a_run_resumed_elsewhere_reports_each_request_where_it_ran(tmp_path: Path) -> None:
    db = Database(tmp_path / "moved.duckdb")
    NONCE[RUN] = begin(db, gpu_type="NVIDIA H200", device="cuda:0")
    db.write_batch(RUN, both_modes("d0"), ran_on=RanOn("host-a", "cuda:0", "NVIDIA H200"))
    # resumed in-process on another GPU type: not refused, and the run's row keeps its first start's
    begin(db, gpu_type="NVIDIA A10G", device="cuda:1")
    db.write_batch(RUN, both_modes("d1"), ran_on=RanOn("host-b", "cuda:1", "NVIDIA A10G"))
    # ... then as shards, and the last documents deferred past a locked file (committed by the next open)
    store = PartStore.beside(db.path)
    attempt_writer(store, "s0000-a01-aaaa", gpu_type="NVIDIA H100").write(both_modes("d2"), [])
    db.ingest_parts(RUN, store)
    db.defer_batch(RUN, both_modes("d3"), finish="completed", ran_on=RanOn("host-c", "cpu", "CPU Xeon"))
    db = Database(db.path)
    assert (db.get_run(RUN)["gpu_type"], db.get_run(RUN)["device"]) == ("NVIDIA H200", "cuda:0")
    where = db.query("SELECT DISTINCT doc_id, launch_id, host, device, gpu_type FROM request_stats ORDER BY doc_id")
    assert [tuple(w.values()) for w in where] == [
        ("d0", None, "host-a", "cuda:0", "NVIDIA H200"), ("d1", None, "host-b", "cuda:1", "NVIDIA A10G"),
        ("d2", "s0000-a01-aaaa", "gpu-a", "cuda:0", "NVIDIA H100"), ("d3", None, "host-c", "cpu", "CPU Xeon")]
    rows = db.query("SELECT gpu_type, device, requests FROM throughput WHERE phase = 'main' AND mode = 'sidecar' "
                    "ORDER BY gpu_type")
    assert [tuple(r.values()) for r in rows] == [("CPU Xeon", "cpu", 1), ("NVIDIA A10G", "cuda:1", 1),
                                                 ("NVIDIA H100", "cuda:0", 1), ("NVIDIA H200", "cuda:0", 1)]
    with pytest.raises(ValueError, match="host"):
        RanOn("", "cpu", None)


def test_a_run_created_before_migration_008_gets_a_nonce_at_its_next_start(tmp_path: Path) -> None:
    path = tmp_path / "old.duckdb"
    migrate(path, RetryPolicy(), known_migrations()[:7])
    with duckdb.connect(str(path)) as con:
        con.execute("INSERT INTO runs (run_id, status, params, modes, pair, gamma, batch_size) VALUES "
                    "('run-1', 'failed', '{}', ['sidecar', 'standalone'], 'tiny', 4, 2)")
    db = Database(path)
    assert db.get_run(RUN)["nonce"] is None
    nonce = begin(db)
    assert nonce and db.get_run(RUN)["nonce"] == nonce and begin(db) == nonce


def test_migration_006_applies_on_a_database_made_by_005(tmp_path: Path) -> None:
    path = tmp_path / "old.duckdb"
    migrate(path, RetryPolicy(), known_migrations()[:5])
    with duckdb.connect(str(path)) as con:
        con.execute("INSERT INTO runs (run_id, status, params, modes, pair, device, gpu_type, batch_size) VALUES "
                    "('r', 'completed', '{}', ['sidecar'], 'tiny', 'cuda:0', 'NVIDIA T4', 2)")
        con.execute("INSERT INTO request_stats (run_id, doc_id, mode, phase, batch_id, drafted, accepted, "
                    "target_forwards, draft_forwards, new_tokens, wall_s, ended_s) VALUES "
                    "('r', 'd0', 'sidecar', 'main', 0, 8, 6, 3, 8, 9, 2.0, NULL), "
                    "('r', 'd1', 'sidecar', 'main', 0, 8, 6, 3, 8, 9, 1.0, NULL)")
    assert migrate(path, RetryPolicy(), known_migrations()[:6]) == 6
    with duckdb.connect(str(path)) as con:
        [row] = con.execute("SELECT gpu_type, device, requests, batches, wall_s, tokens_per_s FROM throughput "
                            "WHERE run_id = 'r'").fetchall()
    assert row == ("NVIDIA T4", "cuda:0", 2, 1, 2.0, 9.0)  # 007 takes the wall-clock rate away (test_storage)
    db = Database(path)
    assert db.query("SELECT launch_id, host, device, gpu_type FROM request_stats LIMIT 1") == [
        {"launch_id": None, "host": None, "device": None, "gpu_type": None}]
    assert db.query("SELECT count(*) AS n FROM ingested_parts") == [{"n": 0}]
    assert db.shard_attempts("r") == []
