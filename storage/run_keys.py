"""Run ids and the file names made from them. A run id is a plain name (:func:`check_run_id`), refused at
every entry; everything kept on disk per run (locks, deferred writes, part files, cost reports) is still
named by a digest of the id, the same one everywhere, so no id can name a path."""

from __future__ import annotations

import hashlib
import re

from storage.errors import InvalidRunIdError

MAX_RUN_ID_CHARS = 200
# letters, digits, '.', '_' and '-', starting with a letter or digit: never a path, a hidden name or blank
_RUN_ID = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_RUN_ID_CHARS - 1}}}")


def check_run_id(run_id: str) -> str:
    """``run_id`` if it is a plain name; otherwise :class:`InvalidRunIdError` saying what one may be."""
    if not _RUN_ID.fullmatch(run_id):
        raise InvalidRunIdError(f"run id {run_id!r} is not a plain name: use 1 to {MAX_RUN_ID_CHARS} letters, "
                                f"digits, '.', '_' or '-', starting with a letter or digit")
    return run_id


def run_key(run_id: str) -> str:
    """``run-`` and the first 20 hex digits of the id's SHA-256: safe in any file name or URI."""
    return "run-" + hashlib.sha256(run_id.encode()).hexdigest()[:20]
