"""Short transactions on a DuckDB file: attach it, run one transaction, detach; retry while another
process holds the file lock.

DuckDB lets one process at a time open a database file for writing and reports the holder in the
error ("Conflicting lock is held in /usr/bin/python3 (PID 4242)"). Keeping every transaction short lets
a flow, the server and the judge share one file; the retry covers the moments they overlap, and a
patient policy (``RetryPolicy(wait_s=...)``) waits out a reader that keeps the file open for minutes,
logging who holds it while it waits.

Files are attached to one in-memory DuckDB per process rather than opened with ``duckdb.connect(path)``:
every ``connect`` builds a database instance with its own catalog of built-in functions (20-30 ms of
CPU on a 2-core machine, even for ``:memory:``), while attaching and detaching a file costs about 4 ms.
Detaching checkpoints the file and releases its lock exactly as closing a connection does. Transactions
of several threads on one file share the attachment; the last one to finish detaches it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import duckdb

from storage.errors import DatabaseLockedError, LockHolder
from storage.locks import REPORT_EVERY_S

T = TypeVar("T")
logger = logging.getLogger(__name__)

# A patient writer says whom it waits for once the wait is longer than the usual overlap of two writers.
FIRST_REPORT_S = 5.0

_LOCK_CONFLICT = "Could not set lock on file"
# the file is open through another DuckDB instance of this very process (a raw duckdb.connect)
_IN_PROCESS_CONFLICT = "Unique file handle conflict"
_LOCK_HOLDER = re.compile(r"Conflicting lock is held in (?P<process>.+?) \(PID (?P<pid>\d+)\)")


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter: delays first_delay_s, 2x, 4x ... capped at max_delay_s.

    A locked file is tried ``attempts`` times, or with ``wait_s`` for that many seconds however many
    attempts it takes. ``attempts`` also bounds the reruns of a transaction that met a write conflict.
    """

    attempts: int = 10
    first_delay_s: float = 0.05
    max_delay_s: float = 2.0
    wait_s: float | None = None

    def delay(self, attempt: int) -> float:
        """The pause after failed attempt number ``attempt`` (0-based)."""
        capped = min(self.max_delay_s, self.first_delay_s * 2**attempt)
        # jitter keeps two waiting processes from retrying in lockstep
        return capped * random.uniform(0.5, 1.0)

    def gives_up(self, attempt: int, waited_s: float) -> bool:
        """Whether to stop after failed attempt number ``attempt`` (0-based), ``waited_s`` after the first."""
        if self.wait_s is None:
            return attempt + 1 >= self.attempts
        return waited_s >= self.wait_s


def parse_lock_holder(message: str) -> LockHolder:
    """The process and PID named in DuckDB's lock conflict message, None where it names none."""
    if _IN_PROCESS_CONFLICT in message:
        return LockHolder(os.getpid(), "this process (another DuckDB connection to the file is open)")
    match = _LOCK_HOLDER.search(message)
    if match is None:
        return LockHolder(None, None)
    return LockHolder(int(match["pid"]), match["process"])


def is_lock_conflict(exc: BaseException) -> bool:
    return ((isinstance(exc, duckdb.IOException) and _LOCK_CONFLICT in str(exc))
            or (isinstance(exc, duckdb.ResourceInUseException) and _IN_PROCESS_CONFLICT in str(exc)))


def _is_write_conflict(exc: BaseException) -> bool:
    # Two threads of one process writing the same rows: DuckDB aborts one transaction, which can simply
    # run again.
    return isinstance(exc, duckdb.TransactionException) and "Conflict" in str(exc)


def attach_file(host: duckdb.DuckDBPyConnection, path: str, alias: str) -> None:
    """Attach the database file ``path`` read-write as ``alias`` (a name this module made up)."""
    host.execute(f"ATTACH ? AS {alias}", [path])


@dataclass
class _Attachment:
    alias: str
    users: int = 0


@dataclass
class _Host:
    """This process's in-memory DuckDB and the files attached to it."""

    pid: int = field(default_factory=os.getpid)
    connection: duckdb.DuckDBPyConnection = field(default_factory=lambda: duckdb.connect(":memory:"))
    lock: threading.Lock = field(default_factory=threading.Lock)
    attached: dict[str, _Attachment] = field(default_factory=dict)
    aliases: Iterator[int] = field(default_factory=itertools.count)

    def try_attach(self, key: str) -> str:
        """The alias of ``key``, attaching it unless it already is; counts one more user."""
        with self.lock:
            attachment = self.attached.get(key)
            if attachment is None:
                attachment = _Attachment(f"sidecar_db_{next(self.aliases)}")
                attach_file(self.connection, key, attachment.alias)
                self.attached[key] = attachment
            attachment.users += 1
            return attachment.alias

    def cursor(self) -> duckdb.DuckDBPyConnection:
        # the host connection itself is not safe to use from two threads at once
        with self.lock:
            return self.connection.cursor()

    def release(self, key: str) -> None:
        with self.lock:
            attachment = self.attached[key]
            attachment.users -= 1
            if attachment.users == 0:
                # kept on failure, so that the next user reuses the attachment and detaches it again
                self.connection.execute(f"DETACH {attachment.alias}")
                del self.attached[key]


_host: _Host | None = None
_host_lock = threading.Lock()


def _process_host() -> _Host:
    global _host
    with _host_lock:
        # a forked child must not use its parent's DuckDB
        if _host is None or _host.pid != os.getpid():
            _host = _Host()
        return _host


@contextlib.contextmanager
def attached(path: Path, retry: RetryPolicy) -> Iterator[duckdb.DuckDBPyConnection]:
    """A fresh connection whose default database is the file at ``path``, retrying while another process
    holds the lock; the file is detached (checkpointed, lock released) once no transaction uses it."""
    host = _process_host()
    key = str(path.resolve())
    started = time.monotonic()
    next_report = FIRST_REPORT_S
    attempt = 0
    while True:
        try:
            alias = host.try_attach(key)
            break
        except duckdb.Error as exc:
            if not is_lock_conflict(exc):
                raise
            waited = time.monotonic() - started
            holder = parse_lock_holder(str(exc))
            if retry.gives_up(attempt, waited):
                raise DatabaseLockedError(path, holder.pid, holder.process, attempt + 1, waited, str(exc)) from exc
            if retry.wait_s is not None and waited >= next_report:
                next_report = waited + REPORT_EVERY_S
                logger.warning("database %s is locked by %s; waited %.0f s, waiting up to %.0f s", path,
                               holder.describe(), waited, retry.wait_s)
            delay = retry.delay(attempt)
            if retry.wait_s is not None:
                delay = min(delay, max(0.0, retry.wait_s - waited))
            time.sleep(delay)
            attempt += 1
    try:
        with host.cursor() as con:
            con.execute(f"USE {alias}")
            yield con
    finally:
        host.release(key)


def in_transaction(path: Path, retry: RetryPolicy, work: Callable[[duckdb.DuckDBPyConnection], T],
                   commit: bool = True) -> T:
    """Run ``work`` in one transaction on the file at ``path``, then commit (or roll back).

    Any exception inside ``work`` rolls everything back, so readers see all of its writes or none.
    ``commit=False`` always rolls back: a way to run a statement that must not change anything.
    """
    for attempt in range(retry.attempts):
        with attached(path, retry) as con:
            try:
                con.execute("BEGIN TRANSACTION")
                result = work(con)
                con.execute("COMMIT" if commit else "ROLLBACK")
                return result
            except duckdb.Error as exc:
                _rollback(con)
                if not _is_write_conflict(exc) or attempt + 1 == retry.attempts:
                    raise
            except BaseException:
                _rollback(con)
                raise
        time.sleep(retry.delay(attempt))
    raise AssertionError("unreachable: the last attempt returns or raises")


def _rollback(con: duckdb.DuckDBPyConnection) -> None:
    # fails harmlessly when no transaction is open (BEGIN itself failed) or DuckDB already aborted it
    with contextlib.suppress(duckdb.Error):
        con.execute("ROLLBACK")
