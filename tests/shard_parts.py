"""Shard part files in tests: output records for a part, and what a shard attempt's directory under a run's
results location holds, read straight from its files (the documents of its manifest, and those its visible
parts finished in every mode)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pyarrow.parquet as pq

from storage import OutputRecord, RequestStats, SidecarRecord


def record(doc_id: str, mode: str, summary: str = "A summary.", batch_id: int = 0, tokens: int = 10,
           wall_s: float = 1.0, device_s: float | None = None) -> OutputRecord:
    """A record with a main phase and, but for standalone, a sidecar phase; with ``device_s``, the ledger the
    engine writes: the main phase charged ``device_s`` device seconds (a fifth of it prefill), the sidecar
    phase a tenth of that (a tenth of which is its instruction line)."""
    ledger: dict[str, float] = {}
    if device_s is not None:
        ledger = {"prefill_tokens": 50, "prefill_forwards": 1, "prefill_device_s": device_s / 5,
                  "decode_tokens": tokens, "decode_forwards": tokens, "decode_device_s": device_s * 4 / 5,
                  "queue_s": 0.0, "first_token_s": wall_s / tokens}
    stats = [RequestStats("main", new_tokens=tokens, drafted=12, accepted=9, target_forwards=4, wall_s=wall_s,
                          batch_size=2, **ledger)]
    if mode != "standalone":
        tagging = {}
        if device_s is not None:
            tagging = {"prefill_tokens": 3, "prefill_forwards": 1, "prefill_device_s": device_s / 50,
                       "decode_tokens": 5, "decode_forwards": 5, "decode_device_s": device_s * 7 / 100,
                       "instruction_tokens": 25, "instruction_device_s": device_s / 100}
        stats.append(RequestStats("sidecar", new_tokens=5, draft_forwards=5, decode_s=0.5, wall_s=0.5,
                                  kv_bytes=3_000_000, **tagging))
    return OutputRecord(doc_id=doc_id, mode=mode, summary=summary,
                        sidecars=[SidecarRecord.of("hashtags", "#a #b", ["#a", "#b"], finish_reason="eos")],
                        main_tokens=None if mode == "standalone" else tokens, finish_reason="eos",
                        batch_id=batch_id, stats=stats)


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
