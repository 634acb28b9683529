"""The results database: one DuckDB file shared by the flows, the judge, the cost report and the server.

Every method runs one short transaction (``storage.connection``), so several processes can use one file
in turn; each write is one transaction, so readers see a batch entirely or not at all.

Next to the file, in ``<file>.runs/``, live the lock a process holds while it runs a run (one process per
run id at a time) and the writes a run could not commit while another process held the file
(``storage.deferred``); opening the database commits those of runs nobody is running.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, get_args

import duckdb

from storage import deferred, ingest
from storage.capture_counters import checked_counters, merged
from storage.connection import RetryPolicy, in_transaction
from storage.errors import DatabaseOpenError, LockHeldError, LockHolder, UnknownAttemptError, UnknownRunError
from storage.locks import exclusive
from storage.migrate import migrate
from storage.parts import IngestResult, PartStore, check_launch_id
from storage.records import (
    AttemptStatus,
    CostRecord,
    Document,
    JudgementRecord,
    JudgementScoreRecord,
    JudgeSettingsRecord,
    JudgeTaskRecord,
    OutputRecord,
    RanOn,
    RejectedDocument,
    check_outputs,
)
from storage.resume import RUN_COLUMNS, canonical_identity, check_same_documents, check_same_run, check_unique_ids
from storage.run_keys import run_key
from storage.tables import SHARD_COLUMNS, DocumentRow, arrow_table, row
from storage.writer import TABLE_KEYS, TableWrite, apply_writes, write_tables
from vocab.modes import MODES

DEFAULT_DB_PATH = Path("data/sidecar.duckdb")
# One run's rows of the ``results`` view, as `sidecar demo` shows them.
RESULTS_TABLE_SQL = (
    "SELECT doc_id, title, summary, sidecar_tags, standalone_tags, attended_tags\n"
    "FROM results\n"
    "WHERE run_id = ?\n"
    "ORDER BY doc_id"
)
DB_PATH_ENV = "SIDECAR_DB"
# parts per ingest transaction: a part is a shard's commit (seconds of work), so this bounds memory
INGEST_CHUNK_PARTS = 256
logger = logging.getLogger(__name__)

def default_db_path() -> Path:
    """``$SIDECAR_DB`` if set, else ``data/sidecar.duckdb`` under the working directory."""
    return Path(os.environ.get(DB_PATH_ENV, DEFAULT_DB_PATH))


@functools.cache
def current_code_version() -> str:
    """The git commit of this checkout (``+dirty`` with uncommitted changes), else the package version.

    Asked once per process (two ``git`` calls, ~20 ms a run otherwise): the code a process runs is the
    code it imported, whatever happens to the checkout afterwards.
    """
    repo = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        try:
            return f"sidecar {metadata.version('sidecar')}"
        except metadata.PackageNotFoundError:
            return "unknown"
    return f"{sha}+dirty" if dirty else sha


@dataclass(frozen=True)
class RunStart:
    """What :meth:`Database.begin_run` found: whether the run existed, and its documents that have every
    mode written (what the run can skip)."""

    resumed: bool
    done_doc_ids: set[str]
    # what the run's manifests and parts carry, so that only parts launched by a start of this very run (of
    # this database) are ingested: a run id alone is not unique across databases sharing a results location
    nonce: str


@dataclass(frozen=True)
class _RunRow:
    """A ``runs`` row to create, checked and encoded before any connection opens."""

    run_id: str
    params_json: str
    modes: list[str]
    code_version: str
    pair: str
    device: str | None
    gpu_type: str | None
    gamma: int | None
    batch_size: int | None
    identity_json: str | None
    dtype: str | None
    capture: str | None

    @classmethod
    def checked(cls, run_id: str, params: dict[str, Any], pair: str, device: str | None, gpu_type: str | None,
                gamma: int | None, batch_size: int | None, code_version: str | None,
                modes: Sequence[str], identity: Mapping[str, Any] | None, dtype: str | None,
                capture: str | None) -> _RunRow:
        unknown = sorted(set(modes) - set(MODES))
        if not modes or unknown:
            raise ValueError(f"modes must be a non-empty subset of {MODES}, got {list(modes)}")
        return cls(run_id, json.dumps(params, sort_keys=True, default=str), list(dict.fromkeys(modes)),
                   code_version if code_version is not None else current_code_version(), pair, device,
                   gpu_type, gamma, batch_size, canonical_identity(identity), dtype, capture or None)

    @property
    def columns(self) -> dict[str, Any]:
        """The values of the ``runs`` columns a resume must repeat (``storage.resume``)."""
        return {name: getattr(self, name) for name in RUN_COLUMNS}


def _start_run(con: duckdb.DuckDBPyConnection, run: _RunRow) -> tuple[bool, str]:
    """Create or restart the run; returns whether it existed, and its nonce (given now to a run without one:
    a new run, or one created before migration 008)."""
    exists = check_same_run(con, run.run_id, run.columns, run.identity_json)
    nonce = uuid.uuid4().hex
    if exists:
        [(nonce,)] = con.execute("UPDATE runs SET status = 'running', finished_at = NULL, error = NULL, "
                                 "nonce = coalesce(nonce, ?) WHERE run_id = ? RETURNING nonce",
                                 [nonce, run.run_id]).fetchall()
    else:
        con.execute(
            "INSERT INTO runs (run_id, status, params, modes, code_version, pair, device, gpu_type, "
            "gamma, batch_size, identity, nonce, dtype, capture) "
            "VALUES (?, 'running', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [run.run_id, run.params_json, run.modes, run.code_version, run.pair, run.device, run.gpu_type,
             run.gamma, run.batch_size, run.identity_json, nonce, run.dtype, run.capture],
        )
    return exists, nonce


def _check_finish_status(status: str) -> None:
    if status not in ("completed", "failed"):
        raise ValueError(f"a run finishes as 'completed' or 'failed', not {status!r}")


def _finish_deferred_run(con: duckdb.DuckDBPyConnection, run_id: str, status: str, error: str | None) -> None:
    # a run resumed since the write was deferred is not finished by it
    con.execute("UPDATE runs SET status = ?, error = ?, finished_at = current_timestamp "
                "WHERE run_id = ? AND status = 'running'", [status, error, run_id])


def _finish_run(con: duckdb.DuckDBPyConnection, run_id: str, status: str, error: str | None) -> None:
    updated = con.execute(
        "UPDATE runs SET status = ?, error = ?, finished_at = current_timestamp "
        "WHERE run_id = ? RETURNING run_id", [status, error, run_id]).fetchall()
    if not updated:
        raise UnknownRunError(f"run {run_id!r} does not exist")


def _wanted_modes(modes: Sequence[str]) -> list[str]:
    wanted = list(dict.fromkeys(modes))
    if not wanted:
        raise ValueError("done_doc_ids needs at least one mode")
    return wanted


def _done_doc_ids(con: duckdb.DuckDBPyConnection, run_id: str, wanted: list[str]) -> set[str]:
    rows = con.execute(
        "SELECT doc_id FROM outputs WHERE run_id = ? AND list_contains(?, mode) "
        "GROUP BY doc_id HAVING count(DISTINCT mode) = ?",
        [run_id, wanted, len(wanted)],
    ).fetchall()
    return {row[0] for row in rows}


def _require_run(run_id: str):
    def check(con: duckdb.DuckDBPyConnection) -> None:
        if not con.execute("SELECT 1 FROM runs WHERE run_id = ?", [run_id]).fetchall():
            raise UnknownRunError(f"run {run_id!r} does not exist; call start_run first")

    return check


def _documents_write(run_id: str, docs: Sequence[Document], rejects: Sequence[RejectedDocument]) -> TableWrite:
    rows = [row("documents", DocumentRow.usable(d), run_id=run_id) for d in docs]
    rows += [row("documents", DocumentRow.rejected(r), run_id=run_id) for r in rejects]
    row_indexes = [r["row_index"] for r in rows]
    if len(set(row_indexes)) != len(row_indexes):
        raise ValueError("two documents or rejects for one input row (row_index)")
    first_row: dict[str, int] = {}
    for doc in docs:
        # a usable document's id keys its outputs
        if not doc.doc_id.strip():
            raise ValueError(f"row {doc.row_index}: a usable document needs a non-blank id, got {doc.doc_id!r}")
        if doc.doc_id in first_row:
            raise ValueError(f"two usable documents with the id {doc.doc_id!r}, on rows {first_row[doc.doc_id]} "
                             f"and {doc.row_index}; a document id must be unique in its run")
        first_row[doc.doc_id] = doc.row_index
    return TableWrite("documents", arrow_table("documents", rows))


def _write_documents(con: duckdb.DuckDBPyConnection, run_id: str, write: TableWrite, whole_input: bool) -> None:
    """Write a run's ``documents`` rows unless they would replace a stored row by another document (or, with
    ``whole_input``, leave stored rows out) or give two usable rows one id (``storage.resume``)."""
    check_same_documents(con, run_id, write.rows, whole_input)
    apply_writes(con, [write])
    check_unique_ids(con, run_id)


def _ran_on_columns(ran_on: RanOn | None) -> dict[str, Any]:
    """The :data:`SHARD_COLUMNS` of a run's own ``request_stats`` rows: no launch id (no shard attempt wrote
    them), and where they ran; NULL throughout without ``ran_on``."""
    columns: dict[str, Any] = dict.fromkeys(column.name for column in SHARD_COLUMNS)
    if ran_on is not None:
        columns |= {"host": ran_on.host, "device": ran_on.device, "gpu_type": ran_on.gpu_type}
    return columns


def _batch_writes(run_id: str, rows: Sequence[OutputRecord], rejects: Sequence[RejectedDocument],
                  ran_on: RanOn | None) -> list[TableWrite]:
    check_outputs(rows, "write_batch")
    where = _ran_on_columns(ran_on)
    outputs: list[dict[str, Any]] = []
    sidecars: list[dict[str, Any]] = []
    stats: list[dict[str, Any]] = []
    for record in rows:
        outputs.append(row("outputs", record, run_id=run_id))
        sidecars += [row("sidecar_outputs", s, run_id=run_id, doc_id=record.doc_id, mode=record.mode)
                     for s in record.sidecars]
        stats += [row("request_stats", s, run_id=run_id, doc_id=record.doc_id, mode=record.mode,
                      batch_id=record.batch_id, **where) for s in record.stats]
    outputs_table = arrow_table("outputs", outputs)
    keys = outputs_table.select(["run_id", "doc_id", "mode"])
    writes = [
        TableWrite("outputs", outputs_table),
        # clear the outputs of every task of a rewritten request, also of tasks it no longer brings
        TableWrite("sidecar_outputs", arrow_table("sidecar_outputs", sidecars), replace=keys),
        # clear the stats of every rewritten request, also of those that now bring fewer phases
        TableWrite("request_stats", arrow_table("request_stats", stats),
                   replace=keys),
    ]
    if rejects:
        writes.append(_documents_write(run_id, [], rejects))
    return writes


def _apply_run_writes(con: duckdb.DuckDBPyConnection, run_id: str, writes: Sequence[TableWrite]) -> None:
    """Apply a run's writes; its ``documents`` rows go through the same-run checks of :func:`_write_documents`."""
    apply_writes(con, [w for w in writes if w.table != "documents"])
    for write in writes:
        if write.table == "documents":
            _write_documents(con, run_id, write, whole_input=False)


def _rows_as_dicts(cursor: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    names = [column[0] for column in cursor.description or []]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


class Database:
    """Handle on one results database file; creates and migrates it on construction.

    A path that cannot hold a database (a directory, a file that is not DuckDB, a location that cannot be
    written) raises :class:`DatabaseOpenError` here.

    The handle holds no connection, only the path: it is cheap, picklable and safe to share between
    threads and processes.
    """

    def __init__(self, path: str | Path | None = None, retry: RetryPolicy | None = None) -> None:
        self.path = Path(path) if path is not None else default_db_path()
        self.retry = retry or RetryPolicy()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.schema_version = migrate(self.path, self.retry)
        except (OSError, duckdb.IOException) as exc:
            # what the file system or DuckDB refused; a lock held elsewhere is DatabaseLockedError instead
            raise DatabaseOpenError.explaining(self.path, exc) from exc
        self._commit_deferred()

    # -- one process per run, and what a run could not commit --------------------------------------------

    @property
    def runs_dir(self) -> Path:
        """``<file>.runs`` beside the database file: run locks and deferred writes."""
        return self.path.parent / f"{self.path.name}.runs"

    def run_lock_path(self, run_id: str) -> Path:
        return self.runs_dir / f"{run_key(run_id)}.lock"

    @contextlib.contextmanager
    def running(self, run_id: str, wait_s: float | None = 0.0,
                on_wait: Callable[[LockHolder, float], None] | None = None) -> Iterator[None]:
        """Hold run ``run_id`` of this database for the body: another process holding it makes this one
        wait up to ``wait_s`` seconds (None: as long as it takes; 0: refuse at once) and then raise
        :class:`LockHeldError`, naming its PID and host. The lock goes with the process, however it ends.

        Writes an earlier process of the run had to defer are committed first.
        """
        with exclusive(self.run_lock_path(run_id), f"run {run_id!r} of {self.path}", wait_s, on_wait):
            for path in deferred.pending(self.runs_dir, run_key(run_id)):
                self._commit(deferred.load(path))
            yield

    def defer_batch(self, run_id: str, rows: Sequence[OutputRecord], rejects: Sequence[RejectedDocument] = (),
                    finish: str | None = None, error: str | None = None, ran_on: RanOn | None = None) -> Path:
        """What :meth:`write_batch` would write, kept beside the file instead, for when another process holds
        it: the next open of the database (or of the run, :meth:`running`) commits it, unless the run is
        being run then. Returns the folder it is kept in."""
        if finish is not None:
            _check_finish_status(finish)
        kept = deferred.save(self.runs_dir, run_key(run_id), run_id, _batch_writes(run_id, rows, rejects, ran_on),
                             finish, error)
        logger.warning("run %s: %d outputs%s kept in %s for the next open of %s to commit", run_id, len(rows),
                       f" and its finish ({finish})" if finish else "", kept, self.path)
        return kept

    def _commit_deferred(self) -> None:
        """Commit the deferred writes of every run no process is running now."""
        for path in deferred.pending(self.runs_dir):
            write = deferred.load(path)
            try:
                with exclusive(self.run_lock_path(write.run_id), f"run {write.run_id!r}", wait_s=0):
                    self._commit(write)
            except LockHeldError:
                continue  # its run is running again: that process commits it

    def _commit(self, write: deferred.DeferredWrite) -> None:
        def work(con: duckdb.DuckDBPyConnection) -> None:
            if not con.execute("SELECT 1 FROM runs WHERE run_id = ?", [write.run_id]).fetchall():
                return  # nothing to attach the writes to
            _apply_run_writes(con, write.run_id, write.writes)
            if write.status is not None:
                _finish_deferred_run(con, write.run_id, write.status, write.error)

        in_transaction(self.path, self.retry, work)
        deferred.remove(write)
        logger.info("run %s: committed the writes deferred in %s", write.run_id, write.path)

    # -- runs ---------------------------------------------------------------------------------------

    def start_run(self, run_id: str, params: dict[str, Any], pair: str, device: str | None,
                  gpu_type: str | None, gamma: int | None, batch_size: int | None,
                  code_version: str | None = None, modes: Sequence[str] = ("sidecar", "standalone"),
                  identity: Mapping[str, Any] | None = None, dtype: str | None = None,
                  capture: str | None = None) -> bool:
        """Create run ``run_id`` with status ``running``; returns True when it already existed.

        Starting an existing run (a resume) only sets it running again and clears its finish time and
        error; its parameters and outputs stay. A resume must repeat the run's ``pair``, ``gamma``, the set
        of ``modes`` and ``identity`` (what else the caller says decides the outputs); otherwise it raises
        :class:`RunMismatchError` and changes nothing (``storage.resume``). It may run on another device or
        GPU type: ``device`` and ``gpu_type`` stay as the first start recorded them (None for a sharded run's
        parent), and each request-stats row names where it ran (``write_batch``'s ``ran_on``, a part's
        ``ShardInfo``). ``modes`` are the modes each document gets: the ``results`` view shows a document
        once all of them are written. Values in ``params`` and ``identity`` that JSON cannot hold (paths,
        enums) are stored as their ``str()``. ``dtype`` is the pair's dtype and why (``ModelPair.dtype_report``),
        and ``capture`` its capture mode and why (``ModelPair.capture_report``), both kept like ``device``.
        """
        run = _RunRow.checked(run_id, params, pair, device, gpu_type, gamma, batch_size, code_version, modes,
                              identity, dtype, capture)
        return in_transaction(self.path, self.retry, lambda con: _start_run(con, run)[0])

    def begin_run(self, run_id: str, params: dict[str, Any], pair: str, device: str | None,
                  gpu_type: str | None, gamma: int | None, batch_size: int | None, docs: Sequence[Document],
                  rejects: Sequence[RejectedDocument], modes: Sequence[str] = ("sidecar", "standalone"),
                  code_version: str | None = None, identity: Mapping[str, Any] | None = None,
                  dtype: str | None = None, capture: str | None = None) -> RunStart:
        """:meth:`start_run`, :meth:`record_documents` and :meth:`done_doc_ids` (for ``modes``) in one
        transaction.

        ``docs`` and ``rejects`` are the whole input: a resume must bring every input row the run stored,
        each with the same id, title and text (more rows may follow), or it raises
        :class:`RunMismatchError` and nothing is written. Each transaction attaches, commits and
        checkpoints the file, so a flow starting a run this way pays for one instead of three; and a
        failure leaves nothing half done: no run without its documents.
        """
        run = _RunRow.checked(run_id, params, pair, device, gpu_type, gamma, batch_size, code_version, modes,
                              identity, dtype, capture)
        documents = _documents_write(run_id, docs, rejects)

        def work(con: duckdb.DuckDBPyConnection) -> RunStart:
            resumed, nonce = _start_run(con, run)
            _write_documents(con, run_id, documents, whole_input=True)
            return RunStart(resumed, _done_doc_ids(con, run_id, run.modes), nonce)

        return in_transaction(self.path, self.retry, work)

    def finish_run(self, run_id: str, status: str, error: str | None = None) -> None:
        """Mark a run ``completed`` or ``failed`` (with ``error``) and stamp its finish time."""
        _check_finish_status(status)
        in_transaction(self.path, self.retry, lambda con: _finish_run(con, run_id, status, error))

    def record_capture(self, run_id: str, counters: Mapping[str, Mapping[str, float]]) -> None:
        """Add the capture counters of one process's decoding of the run (``{model: {counter: n}}``,
        ``capture_stats(pair)["counters"]``) to ``runs.capture_counters``: once per process, when its decoding
        ends, so that a resume adds its own forwards to its earlier starts' and none counts twice
        (``storage.capture_counters``). A counter that is missing or negative raises ``ValueError``."""
        added = checked_counters(counters)

        def work(con: duckdb.DuckDBPyConnection) -> None:
            stored = con.execute("SELECT capture_counters FROM runs WHERE run_id = ?", [run_id]).fetchall()
            if not stored:
                raise UnknownRunError(f"run {run_id!r} does not exist")
            con.execute("UPDATE runs SET capture_counters = ? WHERE run_id = ?",
                        [merged(stored[0][0], added), run_id])

        in_transaction(self.path, self.retry, work)

    def capture(self, run_id: str) -> dict[str, Any] | None:
        """The run's ``run_captures`` row: its capture mode(s) and counters summed over its models, starts and
        shard attempts, ``faults`` (recompiles + graph breaks + uncaptured graphs); None for an unknown run."""
        rows = self.query("SELECT * FROM run_captures WHERE run_id = ?", [run_id])
        return rows[0] if rows else None

    def get_run(self, run_id: str) -> dict[str, Any] | None:
        """The run's row with ``params`` decoded, or None."""
        rows = self.query("SELECT * FROM runs WHERE run_id = ?", [run_id])
        if not rows:
            return None
        run = rows[0]
        run["params"] = json.loads(run["params"])
        return run

    # -- documents and outputs -------------------------------------------------------------------------

    def record_documents(self, run_id: str, docs: Sequence[Document],
                         rejects: Sequence[RejectedDocument]) -> None:
        """Store the run's input rows, usable and rejected; rows already stored for the same input row
        (``row_index``) are replaced, so recording again on resume adds nothing twice. A row may only be
        replaced by the same document (id, title and text), else :class:`RunMismatchError`; two usable
        rows with one id are a ``ValueError``. Either way nothing is written."""
        documents = _documents_write(run_id, docs, rejects)
        check = _require_run(run_id)

        def work(con: duckdb.DuckDBPyConnection) -> None:
            check(con)
            _write_documents(con, run_id, documents, whole_input=False)

        in_transaction(self.path, self.retry, work)

    def rejected_documents(self, run_id: str) -> list[RejectedDocument]:
        """The run's stored rejects (none for an unknown run), by input row."""
        rows = self.query("SELECT doc_id, reject_reason, row_index, reject_detail, title, text FROM documents "
                          "WHERE run_id = ? AND status = 'rejected' ORDER BY row_index", [run_id])
        return [RejectedDocument(r["doc_id"], r["reject_reason"], r["row_index"], detail=r["reject_detail"] or "",
                                 title=r["title"], text=r["text"]) for r in rows]

    def done_doc_ids(self, run_id: str, modes: list[str]) -> set[str]:
        """Documents of the run that have every one of ``modes`` written (what a resume can skip)."""
        wanted = _wanted_modes(modes)
        return in_transaction(self.path, self.retry, lambda con: _done_doc_ids(con, run_id, wanted),
                              commit=False)

    def write_batch(self, run_id: str, rows: Sequence[OutputRecord], rejects: Sequence[RejectedDocument] = (),
                    finish: str | None = None, error: str | None = None, ran_on: RanOn | None = None) -> None:
        """Write the outputs and request stats of a batch, and ``rejects`` (its documents that failed),
        in one transaction; with ``finish`` (``completed`` or ``failed``, with ``error``) that transaction
        also finishes the run as :meth:`finish_run` does, so a run's last batch costs no second one.

        ``ran_on`` (host, device, GPU type) is stored on every request-stats row, which the ``throughput``
        view reports under it; rows written without it are reported under the run's own ``device`` and
        ``gpu_type`` (those its first start recorded).

        Rows replace whatever is stored under the same (run_id, doc_id, mode), stats included, so
        writing a batch again after a crash leaves exactly one copy.
        """
        if finish is not None:
            _check_finish_status(finish)
        writes = _batch_writes(run_id, rows, rejects, ran_on)
        check = _require_run(run_id)

        def work(con: duckdb.DuckDBPyConnection) -> None:
            check(con)
            _apply_run_writes(con, run_id, writes)
            if finish is not None:
                _finish_run(con, run_id, finish, error)

        in_transaction(self.path, self.retry, work)

    # -- shards: part files and attempts ---------------------------------------------------------------

    def ingest_parts(self, run_id: str, store: PartStore, chunk_parts: int = INGEST_CHUNK_PARTS,
                     paths: list[str] | None = None) -> IngestResult:
        """Ingest the run's visible part files under ``store`` that are not ingested yet (of ``paths`` only, a
        listing the caller already made with ``store.parts(run_id)``, when given).

        Each chunk of up to ``chunk_parts`` parts is one transaction that writes their rows (DuckDB reads the
        Parquet itself) and records each part in ``ingested_parts``, so memory stays flat however large the
        run, and calling this again, after a crash or as new parts arrive, skips every recorded part unread.
        Outputs and their stats replace stored rows by (run, document, mode), rejects the ``documents`` row
        of their input row (as :meth:`write_batch` does), so a document finished by two attempts is stored
        once per mode. The run must exist (:class:`UnknownRunError`); a part holding rows of another run
        raises :class:`PartRunMismatchError` and nothing is written. A part of another start of the run id
        (another nonce, or none) or with an output of a document the run does not have with that text is
        refused: not read further, not recorded, logged in one warning line and returned in ``refused``. An
        attempt recorded by :meth:`record_attempt` gets the host, device and GPU type its parts name.
        """
        if chunk_parts < 1:
            raise ValueError(f"chunk_parts must be at least 1, got {chunk_parts}")
        check = _require_run(run_id)

        def recorded(con: duckdb.DuckDBPyConnection) -> set[str]:
            check(con)
            return {part for (part,) in con.execute(
                "SELECT part FROM ingested_parts WHERE run_id = ?", [run_id]).fetchall()}

        ingested = in_transaction(self.path, self.retry, recorded, commit=False)
        paths = store.parts(run_id) if paths is None else paths
        new = [path for path in paths if store.part_name(run_id, path) not in ingested]
        skipped = len(paths) - len(new)
        if not new:
            return IngestResult(parts=0, skipped=skipped, outputs=0, rejects=0)
        parts, refused = in_transaction(self.path, self.retry, lambda con: ingest.census(con, run_id, store, new),
                                        commit=False)
        if refused:
            logger.warning("run %s: refused %d parts under %s, none of their rows stored: %s (e.g. %s)", run_id,
                           len(refused), store.uri, refused[0].reason, refused[0].path)
        written = outputs = rejects = 0
        for start in range(0, len(parts), chunk_parts):
            chunk = parts[start:start + chunk_parts]

            def work(con: duckdb.DuckDBPyConnection, chunk: list[ingest.PartCensus] = chunk) -> ingest.ChunkCounts:
                check(con)
                # another process may have ingested some since they were listed
                fresh = [p for p in chunk if p.part not in recorded(con)]
                if not fresh:
                    return ingest.ChunkCounts(0, 0)
                return ingest.ingest_chunk(con, run_id, store, fresh)

            counts = in_transaction(self.path, self.retry, work)
            written, outputs, rejects = written + counts.parts, outputs + counts.outputs, rejects + counts.rejects
        skipped += len(parts) - written
        logger.info("run %s: ingested %d parts (%d outputs, %d rejects) from %s; %d already ingested", run_id,
                    written, outputs, rejects, store.uri, skipped)
        return IngestResult(parts=written, skipped=skipped, outputs=outputs, rejects=rejects,
                            refused=tuple(r.path for r in refused))

    def record_attempt(self, run_id: str, launch_id: str, shard: int, attempt: int, docs: int,
                       flow_run_id: str | None = None) -> None:
        """Record the launch of one attempt of a shard (status ``running``), with the number of documents in
        its manifest and the flow run it runs as, where known. Recording a launch id again updates it (a
        flow run id learnt later is kept). Host, device and GPU type, capture mode and counters come from its parts
        when ingested."""
        check_launch_id(launch_id)
        check = _require_run(run_id)

        def work(con: duckdb.DuckDBPyConnection) -> None:
            check(con)
            con.execute(
                "INSERT INTO shard_attempts (run_id, launch_id, shard, attempt, flow_run_id, docs, status, host, "
                "device, gpu_type) "
                "SELECT $run_id, $launch_id, $shard, $attempt, $flow_run_id, $docs, 'running', "
                "any_value(host), any_value(device), any_value(gpu_type) "
                "FROM ingested_parts WHERE run_id = $run_id AND launch_id = $launch_id AND host IS NOT NULL "
                "ON CONFLICT (run_id, launch_id) DO UPDATE SET shard = excluded.shard, attempt = excluded.attempt, "
                "docs = excluded.docs, flow_run_id = coalesce(excluded.flow_run_id, shard_attempts.flow_run_id)",
                {"run_id": run_id, "launch_id": launch_id, "shard": shard, "attempt": attempt,
                 "flow_run_id": flow_run_id, "docs": docs})
            # parts ingested before the attempt was recorded (an earlier parent's) name its capture too
            con.execute(
                f"UPDATE shard_attempts AS a SET capture = c.capture, capture_counters = c.capture_counters "
                f"FROM ({ingest.LATEST_CAPTURE} AND launch_id = $launch_id GROUP BY launch_id) AS c "
                f"WHERE a.run_id = $run_id AND a.launch_id = c.launch_id AND a.capture IS NULL",
                {"run_id": run_id, "launch_id": launch_id})

        in_transaction(self.path, self.retry, work)

    def finish_attempt(self, run_id: str, launch_id: str, status: AttemptStatus, error: str | None = None) -> None:
        """Record how an attempt ended (``completed``, ``failed``, ``crashed`` or ``cancelled``, with
        ``error``) and stamp its finish time; an unknown launch id raises :class:`UnknownAttemptError`."""
        if status not in get_args(AttemptStatus) or status == "running":
            raise ValueError(f"an attempt ends as one of {get_args(AttemptStatus)[1:]}, not {status!r}")

        def work(con: duckdb.DuckDBPyConnection) -> None:
            updated = con.execute(
                "UPDATE shard_attempts SET status = ?, error = ?, finished_at = current_timestamp "
                "WHERE run_id = ? AND launch_id = ? RETURNING launch_id",
                [status, error, run_id, launch_id]).fetchall()
            if not updated:
                raise UnknownAttemptError(f"run {run_id!r} has no attempt {launch_id!r}; call record_attempt first")

        in_transaction(self.path, self.retry, work)

    def shard_attempts(self, run_id: str) -> list[dict[str, Any]]:
        """The run's ``shard_attempts`` rows, by shard and attempt."""
        return self.query("SELECT * FROM shard_attempts WHERE run_id = ? ORDER BY shard, attempt, started_at",
                          [run_id])

    # -- judgements and costs ------------------------------------------------------------------------

    def write_judgements(self, run_id: str, rows: Sequence[JudgementRecord],
                         settings: JudgeSettingsRecord | None = None,
                         scores: Sequence[JudgementScoreRecord] = ()) -> None:
        """Store judge games and likelihood scores, and with ``settings`` what their verdicts are read with, in
        one transaction; a game, score or settings row already stored under the same key is replaced."""
        records = [row("judgement_games", j, run_id=run_id) for j in rows]
        writes = [TableWrite("judgement_games", arrow_table("judgement_games", records))]
        if scores:
            scored = [row("judgement_scores", s, run_id=run_id) for s in scores]
            writes.append(TableWrite("judgement_scores", arrow_table("judgement_scores", scored)))
        if settings is not None:
            writes.append(TableWrite("judge_settings",
                                     arrow_table("judge_settings", [row("judge_settings", settings, run_id=run_id)])))
        write_tables(self.path, writes, self.retry, check=_require_run(run_id))

    def write_judge_tasks(self, run_id: str, tasks: Sequence[JudgeTaskRecord]) -> None:
        """Store what the judge found each of the run's sidecar tasks to be (judged, or not with why), replacing
        an earlier judge's row of the same task."""
        records = [row("judge_tasks", t, run_id=run_id) for t in tasks]
        write_tables(self.path, [TableWrite("judge_tasks", arrow_table("judge_tasks", records))], self.retry,
                     check=_require_run(run_id))

    def scored_doc_ids(self, run_id: str, judge_model: str, prompt_version: str, task: str = "hashtags") -> set[str]:
        """Documents of ``task`` done by this model and scorer prompt: both main outputs have a finite likelihood
        score and no stored score of theirs (a control's included) failed; a rerun scores the others again."""
        rows = self.query(
            "SELECT doc_id FROM judgement_scores WHERE run_id = ? AND task = ? AND judge_model = ? "
            "AND prompt_version = ? "
            "GROUP BY doc_id HAVING count(DISTINCT side) FILTER (WHERE kind = 'main' AND error IS NULL "
            "AND isfinite(given_own - given_baseline)) = 2 "
            "AND count(*) FILTER (WHERE error IS NOT NULL OR NOT coalesce(isfinite(given_own - given_baseline), "
            "false)) = 0",
            [run_id, task, judge_model, prompt_version],
        )
        return {row["doc_id"] for row in rows}

    def judged_doc_ids(self, run_id: str, judge_model: str, prompt_version: str, task: str = "hashtags") -> set[str]:
        """Documents of ``task`` whose two main games both got an answer: without an error, or with a raw answer
        that could not be parsed (asking again would give the same). Games that failed without an answer are
        retried."""
        rows = self.query(
            "SELECT doc_id FROM judgement_games WHERE run_id = ? AND task = ? AND judge_model = ? "
            "AND prompt_version = ? AND kind = 'main' AND (error IS NULL OR raw_answer IS NOT NULL) "
            "GROUP BY doc_id HAVING count(DISTINCT game) = 2",
            [run_id, task, judge_model, prompt_version],
        )
        return {row["doc_id"] for row in rows}

    def write_costs(self, rows: Sequence[CostRecord]) -> None:
        """Store cost report lines; a line with the same gpu_type, pair, mode, batch_size, source and
        run_id is replaced."""
        records = [row("cost_estimates", c) for c in rows]
        key_columns = TABLE_KEYS["cost_estimates"]
        keys = [tuple(r[k] for k in key_columns) for r in records]
        if len(set(keys)) != len(keys):
            raise ValueError(f"write_costs got two rows with the same {'/'.join(key_columns)}")
        write_tables(self.path, [TableWrite("cost_estimates", arrow_table("cost_estimates", records))], self.retry)

    # -- reading ---------------------------------------------------------------------------------------

    def query(self, sql: str, params: Sequence[Any] | dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Run one SQL statement with bound ``params`` and return its rows as dicts.

        Meant for the views; the statement runs in a transaction that is always rolled back, so a query
        cannot change the database.
        """

        def work(con: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
            return _rows_as_dicts(con.execute(sql, params))

        return in_transaction(self.path, self.retry, work, commit=False)

    def results(self, run_id: str | None = None) -> list[dict[str, Any]]:
        """Rows of the ``results`` view (all runs, or one), ordered by run and document."""
        if run_id is None:
            return self.query("SELECT * FROM results ORDER BY run_id, doc_id")
        return self.query("SELECT * FROM results WHERE run_id = ? ORDER BY doc_id", [run_id])

    def results_table(self, run_id: str) -> list[dict[str, Any]]:
        """The run's rows of the ``results`` view, as :data:`RESULTS_TABLE_SQL` selects them."""
        return self.query(RESULTS_TABLE_SQL, [run_id])

    def sidecar_tasks(self, run_id: str | None) -> dict[str, bool]:
        """The run's sidecar tasks (by name; None: every run's) with whether any of their outputs parsed as a list
        (of tags): what a judge of tag lists can compare; empty for a run without outputs."""
        rows = self.query("SELECT task, bool_or(coalesce(json_type(parsed) = 'ARRAY', false)) AS lists "
                          "FROM sidecar_outputs WHERE $run IS NULL OR run_id = $run GROUP BY task ORDER BY task",
                          {"run": run_id})
        return {row["task"]: row["lists"] for row in rows}

    def judge_outputs(self, run_id: str, task: str) -> list[dict[str, Any]]:
        """Per document of the run's ``results`` (every mode written), by document: ``doc_id``, ``summary`` (the
        main output) and ``task``'s parsed ``sidecar`` and ``standalone`` outputs (JSON values; None where the
        mode has no output of the task or it did not parse)."""
        rows = self.query(
            "SELECT r.doc_id, r.summary, s.parsed AS sidecar, t.parsed AS standalone FROM results AS r "
            "LEFT JOIN sidecar_outputs AS s ON s.run_id = r.run_id AND s.doc_id = r.doc_id AND s.mode = 'sidecar' "
            "AND s.task = $task "
            "LEFT JOIN sidecar_outputs AS t ON t.run_id = r.run_id AND t.doc_id = r.doc_id "
            "AND t.mode = 'standalone' AND t.task = $task "
            "WHERE r.run_id = $run_id ORDER BY r.doc_id", {"run_id": run_id, "task": task})
        return [row | {mode: None if row[mode] is None else json.loads(row[mode]) for mode in ("sidecar", "standalone")}
                for row in rows]

    def task_costs(self, run_id: str) -> list[dict[str, Any]]:
        """Per sidecar task and mode of the run: ``outputs``, their ``new_tokens`` and ``device_s`` (the ledger's
        seconds, summed over the outputs that have them; NULL when none has), by task and mode."""
        return self.query(
            "SELECT task, mode, count(*) AS outputs, "
            "sum(new_tokens) FILTER (WHERE device_s IS NOT NULL) AS new_tokens, sum(device_s) AS device_s "
            "FROM sidecar_outputs WHERE run_id = ? GROUP BY task, mode ORDER BY task, mode", [run_id])

    def task_outputs(self, run_id: str) -> list[dict[str, Any]]:
        """Every sidecar output of the run: ``doc_id``, ``task``, ``mode``, ``text``, ``parsed`` (the parsed value,
        decoded from its JSON; None when it did not parse) and ``parse_error``, by document, task and mode."""
        rows = self.query("SELECT doc_id, task, mode, text, parsed, parse_error FROM sidecar_outputs "
                          "WHERE run_id = ? ORDER BY doc_id, task, mode", [run_id])
        return [row | {"parsed": None if row["parsed"] is None else json.loads(row["parsed"])} for row in rows]

    def throughput(self, run_id: str | None = None) -> list[dict[str, Any]]:
        """Rows of the ``throughput`` view, each with its run's ``dtype`` (the dtype and why), ``capture`` (the
        capture mode(s) and why), its ``recompiles``, ``graph_breaks`` and ``cudagraph_skips``, and its steps'
        ``syncs_per_step`` and ``host_ms_per_step`` (``run_captures``): one run's, or every run's."""
        select = ("SELECT t.*, r.dtype, c.capture, c.recompiles, c.graph_breaks, c.cudagraph_skips, c.syncs_per_step, "
                  "c.host_ms_per_step "
                  "FROM throughput AS t "
                  "LEFT JOIN runs AS r ON r.run_id = t.run_id LEFT JOIN run_captures AS c ON c.run_id = t.run_id")
        if run_id is None:
            return self.query(f"{select} ORDER BY t.run_id, t.mode, t.phase")
        return self.query(f"{select} WHERE t.run_id = ? ORDER BY t.mode, t.phase", [run_id])

    def judge_tally(self, run_id: str) -> list[dict[str, Any]]:
        """The run's ``judgements`` counted per task, judge model and prompt version (and its ``method``): documents,
        sidecar ``wins``,
        ``losses`` (standalone won), ``ties``, ``undecided`` (a game without a parsed winner), ``consistent``
        (both position-swapped games named the same winner), ``mean_preference`` and the documents'
        ``preferences`` (probability mode; NULL and empty in the text mode) and ``reliable``."""
        return self.query(
            "SELECT task, judge_model, prompt_version, any_value(method) AS method, count(*) AS documents, "
            "count(*) FILTER (WHERE verdict = 'sidecar') AS wins, "
            "count(*) FILTER (WHERE verdict = 'standalone') AS losses, "
            "count(*) FILTER (WHERE verdict = 'tie') AS ties, "
            "count(*) FILTER (WHERE verdict IS NULL) AS undecided, "
            "count(*) FILTER (WHERE consistent) AS consistent, "
            "avg(preference) AS mean_preference, avg(difference) AS mean_difference, "
            "coalesce(list(preference ORDER BY doc_id) FILTER (WHERE preference IS NOT NULL), []) AS preferences, "
            "bool_and(reliable) AS reliable "
            "FROM judgements WHERE run_id = ? "
            "GROUP BY task, judge_model, prompt_version ORDER BY task, judge_model, prompt_version",
            [run_id],
        )

    def judge_quality(self, run_id: str) -> list[dict[str, Any]]:
        """The run's rows of the ``judge_quality`` view, per task, judge model and prompt version: control games,
        documents and accuracy, position bias, calibrated margin, threshold and whether it is reliable."""
        return self.query("SELECT * FROM judge_quality WHERE run_id = ? ORDER BY task, judge_model, prompt_version",
                          [run_id])

    def judge_verdicts(self, run_id: str) -> dict[str, dict[str, Any]]:
        """Per sidecar task of the run the judge looked at, its ``judge_verdicts`` row (``status`` judged, not
        judged or unreliable; ``verdict``, ``trusted``, ``reason``, ``instruction``) with ``quality``, the task's
        ``judge_quality`` rows (its numbers per method, judge model and prompt version)."""
        quality: dict[str, list[dict[str, Any]]] = {}
        for q in self.judge_quality(run_id):
            quality.setdefault(q["task"], []).append(q)
        rows = self.query("SELECT * FROM judge_verdicts WHERE run_id = ? ORDER BY task", [run_id])
        return {r["task"]: r | {"quality": quality.get(r["task"], [])} for r in rows}

    def request_acceptance(self, run_id: str | None = None) -> list[dict[str, Any]]:
        """Accepted / drafted per request of the speculative main phase (all runs, or one), with the run's
        ``pair`` and the GPU type the request ran on (its shard's, else the run's); requests that drafted nothing
        (gamma 0 throughout) have no rate and are left out. Columns: run_id, pair, gpu_type, mode, doc_id,
        drafted, accepted, acceptance_rate."""
        return self.query(
            "SELECT s.run_id, r.pair, coalesce(s.gpu_type, r.gpu_type) AS gpu_type, s.mode, s.doc_id, s.drafted, "
            "s.accepted, s.accepted / s.drafted AS acceptance_rate "
            "FROM request_stats AS s JOIN runs AS r ON r.run_id = s.run_id "
            "WHERE s.phase = 'main' AND s.drafted > 0 AND ($run_id IS NULL OR s.run_id = $run_id) "
            "ORDER BY s.run_id, s.mode, s.doc_id",
            {"run_id": run_id},
        )
