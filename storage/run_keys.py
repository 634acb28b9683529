"""File names for run ids: run ids are arbitrary text, so everything kept on disk per run (locks, deferred
writes, part files) is named by a digest of the id, the same one everywhere."""

from __future__ import annotations

import hashlib


def run_key(run_id: str) -> str:
    """``run-`` and the first 20 hex digits of the id's SHA-256: safe in any file name or URI."""
    return "run-" + hashlib.sha256(run_id.encode()).hexdigest()[:20]
