"""Shard part files in tests: output records for a part, and what a shard attempt's directory under a run's
results location holds, read straight from its files (the documents of its manifest, and those its visible
parts finished in every mode)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pyarrow.parquet as pq

from storage import OutputRecord, RequestStats


def record(doc_id: str, mode: str, summary: str = "A summary.", batch_id: int = 0, tokens: int = 10,
           wall_s: float = 1.0) -> OutputRecord:
    stats = [RequestStats("main", new_tokens=tokens, drafted=12, accepted=9, target_forwards=4, wall_s=wall_s,
                          batch_size=2)]
    if mode != "standalone":
        stats.append(RequestStats.sidecar_phase({"new_tokens": 5, "seconds": 0.5, "kv_bytes": 3_000_000}))
    return OutputRecord(doc_id=doc_id, mode=mode, summary=summary, sidecar_name="hashtags", sidecar_text="#a #b",
                        tags=["#a", "#b"], main_tokens=None if mode == "standalone" else tokens,
                        finish_reason="eos", sidecar_finish_reason="eos", batch_id=batch_id, stats=stats)


def both_modes(doc_id: str, **kwargs) -> list[OutputRecord]:
    return [record(doc_id, "sidecar", **kwargs), record(doc_id, "standalone", **kwargs)]


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
