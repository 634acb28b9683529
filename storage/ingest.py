"""Ingest of part files (``storage.parts``) into the results database, chunk by chunk, in SQL.

DuckDB reads local parts itself (``DuckDBPyConnection.read_parquet``); parts on another file system are
read by pyarrow and handed over as Arrow. Either way no Python code touches a row. Each chunk of parts is
one transaction that writes their rows and records them in ``ingested_parts``, so a part is ingested
entirely or not at all, and once: the parent skips a recorded part without reading it.

A part is ingested only when it belongs to this start of the run and to its documents: every row carries the
run's nonce (``runs.nonce``, which the attempt's manifest gave it), and every output the SHA-256 of the text
its document has in ``documents``. Parts of another start under the same run id (a database deleted but not
its parts, another database sharing the results location) or of other texts are refused before any row is
written: they are left out, not recorded, and named in one warning line (``Database.ingest_parts``).

Rows replace stored rows by key (``storage.writer``): outputs, their tasks' outputs (``sidecar_outputs``) and
their request stats by (run, document, mode), rejects the ``documents`` row of their input row, as
``Database.write_batch`` writes them. A key met in several parts of one chunk (two attempts that both finished
a document) keeps the row of the part last by path, so each (run, document, mode) is stored once whatever was
retried.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import duckdb
import pyarrow as pa

from storage.errors import PartRunMismatchError
from storage.parts import PartStore
from storage.resume import check_same_documents, check_unique_ids
from storage.tables import SCHEMAS, SHARD_COLUMNS
from storage.writer import delete_keys, insert_rows

# what the census reads of each part: who wrote it, whether it holds rejects, and what binds it to the run
_CENSUS_COLUMNS = ["run_id", "launch_id", "host", "device", "gpu_type", "kind", "doc_id", "run_nonce", "text_sha256",
                   "sidecars", "capture", "capture_counters"]
# columns parts written by an older sidecar lack; they read as NULL, and such parts are refused (an output
# without ``sidecars`` was written before migration 011 kept its tasks' outputs apart)
_BINDING_COLUMNS = ("run_nonce", "text_sha256", "sidecars")
# columns parts written before migration 014 lack, which bind nothing: such parts say nothing of their capture
_CAPTURE_COLUMNS = ("capture", "capture_counters")
_CENSUS_SCHEMA = pa.schema([(name, pa.int64() if name == "rows" else pa.string())
                            for name in ("run_id", "part", "launch_id", "rows", "host", "device", "gpu_type",
                                         *_CAPTURE_COLUMNS)])
# per launch id, the capture mode and counters of its latest ingested part that has them (for $run_id)
LATEST_CAPTURE = ("SELECT launch_id, arg_max(capture, part) AS capture, arg_max(capture_counters, part) AS "
                  "capture_counters FROM ingested_parts WHERE run_id = $run_id AND capture IS NOT NULL")
SOURCE = "ingest_source"
_CENSUS = "ingest_census"
_KEYS = "ingest_keys"
_KEPT = "ingest_kept"
_OUTPUT_ROWS = "ingest_output_rows"
_STATS_ROWS = "ingest_stats_rows"
_SIDECAR_ROWS = "ingest_sidecar_rows"
_REJECTS = "ingest_rejects"


def register_parts(con: duckdb.DuckDBPyConnection, store: PartStore, paths: Sequence[str],
                   columns: Sequence[str] | None = None) -> None:
    """Make ``paths`` the relation :data:`SOURCE` on ``con``, with a ``filename`` column: DuckDB reads
    local parts by path (a lazy relation: each statement reads only the columns and rows it needs); other
    file systems' parts are read by pyarrow (``columns`` only) and registered as Arrow. Parts written before a
    field was added to a record (an attempt of the run before an upgrade) lack its column: it reads as NULL,
    by name, whichever part comes first (pyarrow does so when it reads a part with :data:`PART_SCHEMA`)."""
    if store.is_local:
        parts = con.read_parquet(list(paths), filename=True, union_by_name=True)
        missing = [name for name in (*_BINDING_COLUMNS, *_CAPTURE_COLUMNS) if name not in parts.columns]
        if missing:
            parts = parts.project(", ".join(["*", *(f"NULL::VARCHAR AS {name}" for name in missing)]))
        con.register(SOURCE, parts)
        return
    tables = []
    for path in paths:
        table = store.read_part(path, columns)
        tables.append(table.append_column("filename", pa.array([path] * table.num_rows, pa.string())))
    con.register(SOURCE, pa.concat_tables(tables))


@dataclass(frozen=True)
class PartCensus:
    """Who wrote one part and how many rows it holds: its ``ingested_parts`` row."""

    path: str
    part: str
    launch_id: str
    rows: int
    rejects: int
    host: str | None
    device: str | None
    gpu_type: str | None
    capture: str | None = None
    capture_counters: str | None = None  # JSON text


@dataclass(frozen=True)
class RefusedPart:
    """A part that is not of this start of the run, or not of its documents: why, in a few words."""

    path: str
    reason: str


def census(con: duckdb.DuckDBPyConnection, run_id: str, store: PartStore,
           paths: Sequence[str]) -> tuple[list[PartCensus], list[RefusedPart]]:
    """Read who wrote each of ``paths`` (a few small columns) and whether it belongs to the run: the parts to
    ingest, and those refused (another start's nonce, none, or an output of a document the run does not have
    with that text). A part holding rows of another run than ``run_id`` raises :class:`PartRunMismatchError`
    before anything is written."""
    [(nonce,)] = con.execute("SELECT nonce FROM runs WHERE run_id = ?", [run_id]).fetchall()
    register_parts(con, store, paths, _CENSUS_COLUMNS)
    # the join hashes only the stored texts of the documents the parts name
    found = con.execute(
        f"SELECT p.filename, min(p.run_id), max(p.run_id), any_value(p.launch_id), count(*), "
        f"count(*) FILTER (WHERE p.kind = 'reject'), any_value(p.host), any_value(p.device), any_value(p.gpu_type), "
        f"any_value(p.capture), any_value(p.capture_counters), "
        f"count(*) FILTER (WHERE p.run_nonce IS DISTINCT FROM $nonce OR (p.kind = 'output' AND p.sidecars IS NULL)), "
        f"min(p.doc_id) FILTER (WHERE p.kind = 'output' AND (d.text IS NULL OR sha256(d.text) IS DISTINCT FROM "
        f"p.text_sha256)) "
        f"FROM {SOURCE} AS p LEFT JOIN documents AS d ON d.run_id = $run_id AND d.doc_id = p.doc_id "
        f"AND d.status = 'ok' GROUP BY p.filename", {"nonce": nonce, "run_id": run_id}).fetchall()
    by_path: dict[str, PartCensus] = {}
    refused: dict[str, RefusedPart] = {}
    for path, first_run, last_run, launch_id, rows, rejects, host, device, gpu_type, capture, counters, foreign, \
            unknown in found:
        other = first_run if first_run != run_id else last_run
        if other != run_id:
            raise PartRunMismatchError(
                f"part {path} under {store.uri} holds rows of run {other!r}, not of run {run_id!r}; "
                f"nothing was ingested. Parts of a run live under its own directory: was a file copied there?")
        if foreign:
            refused[path] = RefusedPart(path, "written for another start of this run id (another or a deleted "
                                              "database sharing the results location), or by an older sidecar "
                                              "(without the run's nonce or its tasks' outputs)")
        elif unknown is not None:
            refused[path] = RefusedPart(path, f"holds outputs of document {unknown!r} that this run does not have "
                                              f"with that text")
        else:
            by_path[path] = PartCensus(path, store.part_name(run_id, path), launch_id, rows, rejects, host, device,
                                       gpu_type, capture, counters)
    # a part with no rows has nothing to check; it is recorded all the same, so it is not looked at again
    accepted = [by_path.get(path) or PartCensus(path, name, name.split("/")[0], 0, 0, None, None, None)
                for path, name in ((p, store.part_name(run_id, p)) for p in paths) if path not in refused]
    return accepted, list(refused.values())


@dataclass(frozen=True)
class ChunkCounts:
    outputs: int
    rejects: int
    parts: int = 0


def ingest_chunk(con: duckdb.DuckDBPyConnection, run_id: str, store: PartStore,
                 parts: Sequence[PartCensus]) -> ChunkCounts:
    """Write the rows of ``parts`` and their ``ingested_parts`` rows, inside the caller's transaction."""
    register_parts(con, store, [p.path for p in parts])
    # the chunk's (document, mode) keys, each with the part last by path that holds it: only keys held by
    # several parts (a document two attempts finished) need their other copies dropped
    con.execute(f"CREATE OR REPLACE TEMP TABLE {_KEYS} AS SELECT run_id, doc_id, mode, max(filename) AS filename, "
                f"count(*) AS copies FROM {SOURCE} WHERE kind = 'output' GROUP BY run_id, doc_id, mode")
    [(outputs, repeated)] = con.execute(f"SELECT count(*), count(*) FILTER (WHERE copies > 1) FROM {_KEYS}").fetchall()
    dropped = (f"AND NOT EXISTS (SELECT 1 FROM {_KEYS} AS k WHERE k.copies > 1 AND k.doc_id = p.doc_id "
               f"AND k.mode = p.mode AND k.filename <> p.filename)") if repeated else ""
    con.execute(f"CREATE OR REPLACE TEMP VIEW {_KEPT} AS SELECT p.* FROM {SOURCE} AS p WHERE p.kind = 'output' "
                f"{dropped}")
    con.execute(f"CREATE OR REPLACE TEMP VIEW {_OUTPUT_ROWS} AS SELECT {', '.join(SCHEMAS['outputs'].names)} "
                f"FROM {_KEPT}")
    request_keys = ", ".join(["run_id", "doc_id", "mode", "batch_id", *(c.name for c in SHARD_COLUMNS)])
    con.execute(f"CREATE OR REPLACE TEMP VIEW {_STATS_ROWS} AS SELECT {request_keys}, "
                f"unnest(stats, recursive := true) FROM {_KEPT}")
    con.execute(f"CREATE OR REPLACE TEMP VIEW {_SIDECAR_ROWS} AS SELECT run_id, doc_id, mode, "
                f"unnest(sidecars, recursive := true) FROM {_KEPT}")
    if outputs:
        delete_keys(con, "outputs", _KEYS)
        insert_rows(con, "outputs", _OUTPUT_ROWS)
        # so are the outputs of every task of a rewritten request
        delete_keys(con, "sidecar_outputs", _KEYS)
        insert_rows(con, "sidecar_outputs", _SIDECAR_ROWS)
        # the stats of every rewritten request go, also of those that now bring fewer phases
        delete_keys(con, "request_stats", _KEYS)
        insert_rows(con, "request_stats", _STATS_ROWS)
    # rejects are rare (a document that ran out of memory alone): most chunks have none to look for
    rejects = _write_rejects(con, run_id) if any(p.rejects for p in parts) else 0
    con.register(_CENSUS, pa.Table.from_pylist(
        [{"run_id": run_id, "part": p.part, "launch_id": p.launch_id, "rows": p.rows, "host": p.host,
          "device": p.device, "gpu_type": p.gpu_type, "capture": p.capture, "capture_counters": p.capture_counters}
         for p in parts], schema=_CENSUS_SCHEMA))
    con.execute(f"INSERT INTO ingested_parts BY NAME SELECT * FROM {_CENSUS}")
    con.execute(
        f"UPDATE shard_attempts AS a SET host = c.host, device = c.device, gpu_type = c.gpu_type "
        f"FROM (SELECT DISTINCT launch_id, host, device, gpu_type FROM {_CENSUS} WHERE host IS NOT NULL) AS c "
        f"WHERE a.run_id = $run_id AND a.launch_id = c.launch_id", {"run_id": run_id})
    # an attempt's counters are cumulative: it keeps those of its latest part ingested (by name, in the order
    # it wrote them), whichever chunk brought it
    con.execute(
        f"UPDATE shard_attempts AS a SET capture = c.capture, capture_counters = c.capture_counters "
        f"FROM ({LATEST_CAPTURE} AND launch_id IN (SELECT launch_id FROM {_CENSUS}) GROUP BY launch_id) AS c "
        f"WHERE a.run_id = $run_id AND a.launch_id = c.launch_id", {"run_id": run_id})
    for view in (_STATS_ROWS, _SIDECAR_ROWS, _OUTPUT_ROWS, _KEPT):
        con.execute(f"DROP VIEW {view}")
    for table in (_KEYS, _REJECTS):
        con.execute(f"DROP TABLE IF EXISTS {table}")
    return ChunkCounts(outputs, rejects, len(parts))


def _write_rejects(con: duckdb.DuckDBPyConnection, run_id: str) -> int:
    """Store the chunk's rejects as ``documents`` rows, with the same checks as a run's own writes: a row
    may only be replaced by the same document, and no two usable rows may share an id."""
    con.execute(
        f"CREATE OR REPLACE TEMP TABLE {_REJECTS} AS "
        f"SELECT run_id, row_index, doc_id, title, text, length(text) AS n_chars, 'rejected' AS status, "
        f"reason AS reject_reason, nullif(detail, '') AS reject_detail "
        f"FROM {SOURCE} WHERE kind = 'reject' "
        f"QUALIFY row_number() OVER (PARTITION BY row_index ORDER BY filename DESC) = 1")
    [(rejects,)] = con.execute(f"SELECT count(*) FROM {_REJECTS}").fetchall()
    if rejects:
        check_same_documents(con, run_id, con.table(_REJECTS), whole_input=False)
        delete_keys(con, "documents", _REJECTS)
        insert_rows(con, "documents", _REJECTS)
        check_unique_ids(con, run_id)
    return rejects
