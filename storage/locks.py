"""Exclusive locks between processes: one OS file lock (``flock``) per lock file.

The kernel drops the lock when the process holding it ends, however it ends (``kill -9`` included), so a
lock is never left behind by a crash. The holder writes who it is (PID, host, command, since when) into
the file as it takes the lock, so a process that finds the lock taken can say by whom.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

from filelock import FileLock, Timeout

from storage.errors import LockHeldError, LockHolder

# How often a waiting process says again whom it waits for.
REPORT_EVERY_S = 30.0


def read_holder(path: Path) -> LockHolder:
    """The holder recorded in the lock file at ``path``; all None where it cannot be read."""
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
        return LockHolder(int(info["pid"]), info.get("process"), info.get("host"), info.get("since"))
    except (OSError, ValueError, KeyError, TypeError):
        return LockHolder(None, None)


def _this_process() -> dict[str, object]:
    # the command line as ps shows it, interpreter first (sys.orig_argv keeps "-m cli" where argv has a path)
    command = " ".join([Path(sys.orig_argv[0]).name, *sys.orig_argv[1:]])
    return {"pid": os.getpid(), "host": socket.gethostname(), "process": command[:200],
            "since": datetime.now(UTC).isoformat(timespec="seconds")}


def _write_holder(fd: int) -> None:
    # called by filelock with the locked descriptor, before acquire returns
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(_this_process()).encode(), 0)


@contextlib.contextmanager
def exclusive(path: Path, what: str, wait_s: float | None,
              on_wait: Callable[[LockHolder, float], None] | None = None) -> Iterator[None]:
    """Hold the lock file ``path`` (created with its folder) for the body, for ``what`` (said in errors).

    ``wait_s`` None waits as long as it takes, 0 refuses at once, else waits up to that many seconds; then
    :class:`LockHeldError` names the holder. ``on_wait(holder, waited_s)`` hears who holds the lock when it
    is first found taken and every :data:`REPORT_EVERY_S` seconds after.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    # thread_local=False: the hold belongs to the process, whichever thread releases it
    lock = FileLock(path, on_acquired=_write_holder, thread_local=False)
    started = time.monotonic()
    timeout = 0.0
    while True:
        try:
            lock.acquire(timeout=timeout)
            break
        except Timeout:
            waited = time.monotonic() - started
            holder = read_holder(path)
            if wait_s is not None and waited >= wait_s:
                raise LockHeldError(path, what, holder, waited) from None
            if on_wait is not None:
                on_wait(holder, waited)
            timeout = REPORT_EVERY_S if wait_s is None else min(REPORT_EVERY_S, wait_s - waited)
    try:
        yield
    finally:
        lock.release()
