"""Short-lived DuckDB connections: open, run one transaction, close; retry while another process holds
the file lock.

DuckDB lets one process at a time open a database file for writing and reports the holder in the
error ("Conflicting lock is held in /usr/bin/python3 (PID 4242)"). Keeping every connection short lets
a flow, the server and the judge share one file; the retry covers the moments they overlap.
"""

from __future__ import annotations

import contextlib
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import duckdb

from storage.errors import DatabaseLockedError

T = TypeVar("T")

_LOCK_CONFLICT = "Could not set lock on file"
_LOCK_HOLDER = re.compile(r"Conflicting lock is held in (?P<process>.+?) \(PID (?P<pid>\d+)\)")


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter: delays first_delay_s, 2x, 4x ... capped at max_delay_s."""

    attempts: int = 10
    first_delay_s: float = 0.05
    max_delay_s: float = 2.0

    def delay(self, attempt: int) -> float:
        """The pause after failed attempt number ``attempt`` (0-based)."""
        capped = min(self.max_delay_s, self.first_delay_s * 2**attempt)
        # jitter keeps two waiting processes from retrying in lockstep
        return capped * random.uniform(0.5, 1.0)


@dataclass(frozen=True)
class LockHolder:
    pid: int | None
    process: str | None


def parse_lock_holder(message: str) -> LockHolder:
    """The process and PID named in DuckDB's lock conflict message, None where it names none."""
    match = _LOCK_HOLDER.search(message)
    if match is None:
        return LockHolder(None, None)
    return LockHolder(int(match["pid"]), match["process"])


def is_lock_conflict(exc: BaseException) -> bool:
    return isinstance(exc, duckdb.IOException) and _LOCK_CONFLICT in str(exc)


def _is_write_conflict(exc: BaseException) -> bool:
    # Two connections of one process writing the same rows: DuckDB aborts one transaction, which can
    # simply run again.
    return isinstance(exc, duckdb.TransactionException) and "Conflict" in str(exc)


def connect(path: Path, retry: RetryPolicy) -> duckdb.DuckDBPyConnection:
    """Open ``path`` read-write, retrying while another process holds the lock.

    Every connection is read-write: DuckDB refuses, inside one process, a read-only connection to a
    file that is also open read-write, and the connections here are short enough not to block readers.
    """
    started = time.monotonic()
    last_error: duckdb.IOException | None = None
    for attempt in range(retry.attempts):
        try:
            return duckdb.connect(str(path))
        except duckdb.IOException as exc:
            if not is_lock_conflict(exc):
                raise
            last_error = exc
            if attempt + 1 < retry.attempts:
                time.sleep(retry.delay(attempt))
    assert last_error is not None
    holder = parse_lock_holder(str(last_error))
    raise DatabaseLockedError(path, holder.pid, holder.process, retry.attempts,
                              time.monotonic() - started, str(last_error)) from last_error


def in_transaction(path: Path, retry: RetryPolicy, work: Callable[[duckdb.DuckDBPyConnection], T],
                   commit: bool = True) -> T:
    """Run ``work`` in one transaction on a fresh connection, then commit (or roll back) and close.

    Any exception inside ``work`` rolls everything back, so readers see all of its writes or none.
    ``commit=False`` always rolls back: a way to run a statement that must not change anything.
    """
    for attempt in range(retry.attempts):
        con = connect(path, retry)
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
        finally:
            con.close()
        time.sleep(retry.delay(attempt))
    raise AssertionError("unreachable: the last attempt returns or raises")


def _rollback(con: duckdb.DuckDBPyConnection) -> None:
    # fails harmlessly when no transaction is open (BEGIN itself failed) or DuckDB already aborted it
    with contextlib.suppress(duckdb.Error):
        con.execute("ROLLBACK")
