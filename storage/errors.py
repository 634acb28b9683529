"""Errors raised by ``storage``; each message says what is wrong and what to do."""

from __future__ import annotations

import errno
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LockHolder:
    """Who holds a lock, as far as it is known; every field may be None."""

    pid: int | None
    process: str | None
    host: str | None = None
    since: str | None = None

    def describe(self) -> str:
        if self.pid is None:
            return "another process"
        where = f" on {self.host}" if self.host else ""
        what = f" ({self.process})" if self.process else ""
        since = f", since {self.since}" if self.since else ""
        return f"PID {self.pid}{where}{what}{since}"


class StorageError(RuntimeError):
    """Base class of the database errors."""


class SchemaTooNewError(StorageError):
    """The database was written by a newer sidecar whose migrations this code does not know."""

    def __init__(self, path: Path, db_version: int, code_version: int) -> None:
        self.path = path
        self.db_version = db_version
        self.code_version = code_version
        super().__init__(
            f"database {path} has schema version {db_version}, but this sidecar only knows migrations up "
            f"to {code_version}; upgrade sidecar or use another --db file (it was not modified)"
        )


class DatabaseOpenError(StorageError):
    """The database file cannot be opened or created: what is at the path, or where it is, is unusable.

    ``problem`` says what is wrong in a few words; the message names the path. The arguments are kept as
    the exception's ``args``, so it pickles (Prefect stores a failed flow's exception).
    """

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(path, problem)
        self.path = path
        self.problem = problem

    def __str__(self) -> str:
        return f"cannot open database {self.path}: {self.problem}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"

    @classmethod
    def explaining(cls, path: Path, cause: Exception) -> DatabaseOpenError:
        """The error for ``cause`` (an OSError, or DuckDB's error) raised while opening ``path``."""
        return cls(path, _open_problem(path, cause))


def _open_problem(path: Path, cause: Exception) -> str:
    if path.is_dir():
        return "it is a directory, not a database file"
    blocking = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        return f"{blocking} is a file, not a directory, so nothing can be created under it"
    message = str(cause)
    if "not a valid DuckDB database" in message:
        return "the file exists but is not a DuckDB database"
    if isinstance(cause, OSError) and cause.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{cause.strerror.lower()} (the file or its directory cannot be written)"
    for reason in ("Permission denied", "Read-only file system"):
        if reason in message:
            return f"{reason.lower()} (the file or its directory cannot be written)"
    # DuckDB's own words for the rest (a newer storage format, a damaged file ...), without its class prefix
    return message.removeprefix("IO Error: ")


class DatabaseLockedError(StorageError):
    """Another process held DuckDB's file lock through every retry."""

    def __init__(self, path: Path, holder_pid: int | None, holder_process: str | None, attempts: int,
                 waited_s: float, duckdb_message: str) -> None:
        self.path = path
        self.holder_pid = holder_pid
        self.holder_process = holder_process
        self.attempts = attempts
        self.waited_s = waited_s
        holder = (f"process {holder_process} (PID {holder_pid})" if holder_pid is not None
                  else "another process")
        super().__init__(
            f"database {path} is locked by {holder}; gave up after {attempts} attempts over "
            f"{waited_s:.1f} s. Stop that process or point this one at another database file. "
            f"DuckDB said: {duckdb_message}"
        )


class LockHeldError(StorageError):
    """Another process holds a lock (a run, a device) that this one was told not to wait for any longer."""

    def __init__(self, path: Path, what: str, holder: LockHolder, waited_s: float) -> None:
        self.path = path
        self.what = what
        self.holder = holder
        self.waited_s = waited_s
        waited = "refused at once" if waited_s < 0.05 else f"gave up after waiting {waited_s:.0f} s"
        super().__init__(f"{what} is held by {holder.describe()}; {waited} (lock file {path})")


class InvalidRunIdError(StorageError, ValueError):
    """A run id that is not a plain name (``storage.run_keys.check_run_id``); a ValueError, so that a
    pydantic validator reports it as the field's error."""


class ResultsLocationError(StorageError):
    """A results location (``--results-uri``) that cannot hold part files: a URI pyarrow cannot open, or a
    directory that cannot be created there (under a regular file, read-only)."""


class UnknownRunError(StorageError):
    """A write names a run that ``start_run`` never created."""


class UnknownAttemptError(StorageError):
    """An attempt's end names a launch id that ``record_attempt`` never recorded for the run."""


class PartRunMismatchError(StorageError):
    """A part file under a run's directory holds rows of another run; nothing was ingested."""


class RunMismatchError(StorageError):
    """A start under an existing run id that is not a resume of that run: other decisive settings, or
    input rows that differ from or leave out the ones the run stored. Nothing was written."""


class InputSchemaError(ValueError):
    """An input file lacks the columns it was asked to read."""
