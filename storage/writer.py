"""Arrow in, one transaction out: replace the keys being written, insert the rows, commit.

Rows are handed to DuckDB as registered Arrow tables, never formatted into SQL. The only identifiers in
the statements below are the table and key names of :data:`TABLE_KEYS`, fixed in this module, and the
names of relations the caller registered (Arrow tables, or the temporary tables of a Parquet ingest).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa

from storage.connection import RetryPolicy, in_transaction

# The columns that identify a row of each writable table: incoming rows replace stored rows with the
# same key, which makes every write idempotent.
TABLE_KEYS: dict[str, tuple[str, ...]] = {
    "documents": ("run_id", "row_index"),
    "outputs": ("run_id", "doc_id", "mode"),
    # keyed without task, as request_stats without phase: rewriting a request replaces all its tasks' outputs
    "sidecar_outputs": ("run_id", "doc_id", "mode"),
    # keyed without phase: rewriting a request replaces all its phases
    "request_stats": ("run_id", "doc_id", "mode"),
    "judgement_games": ("run_id", "task", "doc_id", "judge_model", "prompt_version", "kind", "game"),
    "judgement_scores": ("run_id", "task", "doc_id", "judge_model", "prompt_version", "kind", "side"),
    "judge_settings": ("run_id", "task", "judge_model", "prompt_version"),
    "judge_tasks": ("run_id", "task"),
    "cost_estimates": ("gpu_type", "pair", "mode", "batch_size", "source", "run_id"),
}


@dataclass(frozen=True)
class TableWrite:
    """Rows for one table, replacing the stored rows whose keys appear in ``replace``.

    ``replace`` defaults to ``rows`` itself; pass other key rows to also clear keys that get no new
    rows (a request rewritten without stats loses its old stats). Both must carry the key columns.
    """

    table: str
    rows: pa.Table | pa.RecordBatch
    replace: pa.Table | pa.RecordBatch | None = None

    def __post_init__(self) -> None:
        if self.table not in TABLE_KEYS:
            raise ValueError(f"unknown table {self.table!r}; writable tables: {', '.join(TABLE_KEYS)}")
        for label, table in (("rows", self.rows), ("replace", self.replace)):
            missing = [] if table is None else [c for c in TABLE_KEYS[self.table] if c not in table.schema.names]
            if missing:
                raise ValueError(f"{label} for {self.table} lack key columns {missing}")


def delete_keys(con: duckdb.DuckDBPyConnection, table: str, replaced: str) -> None:
    """Delete the rows of ``table`` whose keys (:data:`TABLE_KEYS`) appear in the relation ``replaced``: a
    name the connection knows (a registered Arrow table, a temporary table or view)."""
    # IS NOT DISTINCT FROM so that a NULL key part (cost_estimates.run_id) matches NULL
    key_match = " AND ".join(f"k.{c} IS NOT DISTINCT FROM t.{c}" for c in TABLE_KEYS[table])
    con.execute(f"DELETE FROM {table} AS t WHERE EXISTS (SELECT 1 FROM {replaced} AS k WHERE {key_match})")


def insert_rows(con: duckdb.DuckDBPyConnection, table: str, incoming: str) -> None:
    """Insert the relation ``incoming`` into ``table`` by column name."""
    con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM {incoming}")


def _replace_rows(con: duckdb.DuckDBPyConnection, write: TableWrite) -> None:
    incoming = f"incoming_{write.table}"
    replaced = f"replaced_{write.table}"
    replace = write.rows if write.replace is None else write.replace
    # registered for this connection only, which is closed right after the transaction
    con.register(incoming, write.rows)
    con.register(replaced, replace)
    if replace.num_rows:
        delete_keys(con, write.table, replaced)
    if write.rows.num_rows:
        insert_rows(con, write.table, incoming)


def apply_writes(con: duckdb.DuckDBPyConnection, writes: Sequence[TableWrite]) -> None:
    """Apply ``writes`` on ``con`` inside the caller's transaction, so that they can share it with other
    statements (a run's start, its finish); the caller commits or rolls back."""
    for write in writes:
        _replace_rows(con, write)


def write_tables(path: Path, writes: Sequence[TableWrite], retry: RetryPolicy,
                 check: Callable[[duckdb.DuckDBPyConnection], None] | None = None) -> None:
    """Write all ``writes`` in one transaction on a short-lived connection.

    ``check`` runs first inside the same transaction (e.g. "the run exists") and aborts everything by
    raising. A failure anywhere leaves the database as it was.
    """

    def work(con: duckdb.DuckDBPyConnection) -> None:
        if check is not None:
            check(con)
        apply_writes(con, writes)

    in_transaction(path, retry, work)
