"""Writes a run could not commit because another process held the database file: kept next to the file
and committed by the next open.

A deferred write is a folder holding its tables as Arrow IPC files and a manifest; it appears whole or
not at all (written under a temporary name, then renamed), and each one is applied in one transaction and
then removed. Applying one twice changes nothing: table writes replace their keys, and the run's finish
is only recorded while the run is still ``running``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from storage.writer import TableWrite

_MANIFEST = "manifest.json"
_SUFFIX = ".pending"


@dataclass(frozen=True)
class DeferredWrite:
    """Table writes of one run and, optionally, the status and error that finish it."""

    run_id: str
    writes: list[TableWrite]
    status: str | None
    error: str | None
    path: Path


def _write_arrow(path: Path, table: pa.Table | pa.RecordBatch) -> None:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write(table)


def _read_arrow(path: Path) -> pa.Table:
    with pa.memory_map(str(path), "r") as source:
        return pa.ipc.open_file(source).read_all()


def save(folder: Path, stem: str, run_id: str, writes: Sequence[TableWrite], status: str | None,
         error: str | None) -> Path:
    """Keep ``writes`` (and the finish ``status``/``error``) under ``folder`` as ``<stem>.<time>.pending``."""
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{stem}.{time.time_ns()}"
    staging = folder / f".{name}.{os.getpid()}.tmp"
    staging.mkdir()
    manifest: dict[str, object] = {"run_id": run_id, "status": status, "error": error, "writes": []}
    for number, write in enumerate(writes):
        entry: dict[str, str | None] = {"table": write.table, "rows": f"{number}-rows.arrow", "replace": None}
        _write_arrow(staging / entry["rows"], write.rows)
        if write.replace is not None:
            entry["replace"] = f"{number}-replace.arrow"
            _write_arrow(staging / entry["replace"], write.replace)
        manifest["writes"].append(entry)
    (staging / _MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")
    final = folder / f"{name}{_SUFFIX}"
    staging.rename(final)
    return final


def pending(folder: Path, stem: str = "*") -> list[Path]:
    """Deferred writes under ``folder`` (of ``stem`` only, or all), oldest first."""
    if not folder.is_dir():
        return []
    return sorted(folder.glob(f"{stem}.*{_SUFFIX}"), key=lambda p: int(p.name.split(".")[-2]))


def load(path: Path) -> DeferredWrite:
    manifest = json.loads((path / _MANIFEST).read_text(encoding="utf-8"))
    writes = [TableWrite(entry["table"], _read_arrow(path / entry["rows"]),
                         None if entry["replace"] is None else _read_arrow(path / entry["replace"]))
              for entry in manifest["writes"]]
    return DeferredWrite(manifest["run_id"], writes, manifest["status"], manifest["error"], path)


def remove(deferred: DeferredWrite) -> None:
    shutil.rmtree(deferred.path, ignore_errors=True)
