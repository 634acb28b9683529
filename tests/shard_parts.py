"""What a shard attempt's directory under a run's results location holds, read straight from its files: the
documents of its manifest, and those its visible parts finished in every mode."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pyarrow.parquet as pq


def part_doc_ids(launch: Path, modes: Iterable[str] = ("sidecar", "standalone")) -> set[str]:
    """Documents with every one of ``modes`` in the attempt's visible parts."""
    found: dict[str, set[str]] = {}
    for part in sorted(launch.glob("part-*.parquet")):
        for row in pq.read_table(part, columns=["kind", "doc_id", "mode"]).to_pylist():
            if row["kind"] == "output":
                found.setdefault(row["doc_id"], set()).add(row["mode"])
    return {doc_id for doc_id, got in found.items() if got >= set(modes)}


def manifest_ids(launch: Path) -> set[str]:
    """The documents the attempt was launched with."""
    return set(pq.read_table(launch / "manifest.parquet", columns=["doc_id"]).column("doc_id").to_pylist())
