"""The columns of each writable table, derived from the dataclass whose instances become its rows.

A table's Arrow schema is the record's fields: their names, Arrow types from the annotations (``int`` is
int32 unless the field's metadata names another ``arrow_type``), NOT NULL unless annotated ``| None``;
plus the columns the writer supplies from the context (the run id, the parent record's key).
Columns with an SQL default (``written_at``, ``created_at``) are the database's own and are not written.
The migrations create the same columns in SQL; ``tests/test_storage.py`` checks that the two agree.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import pyarrow as pa

from storage.records import (
    CostRecord,
    Document,
    JudgementRecord,
    JudgementScoreRecord,
    JudgeSettingsRecord,
    JudgeTaskRecord,
    OutputRecord,
    RejectedDocument,
    RejectReason,
    RequestStats,
    SidecarRecord,
)

DocumentStatus = Literal["ok", "rejected"]
_ARROW_TYPES: dict[type, pa.DataType] = {str: pa.string(), int: pa.int32(), float: pa.float64()}


@dataclass(frozen=True)
class DocumentRow:
    """One input row of a run as the ``documents`` table stores it: usable (``ok``) or rejected, with why."""

    row_index: int
    doc_id: str | None  # None only for a rejected row whose id was null
    title: str | None
    text: str | None
    n_chars: int | None
    status: DocumentStatus
    reject_reason: RejectReason | None
    reject_detail: str | None

    @classmethod
    def usable(cls, doc: Document) -> DocumentRow:
        return cls(doc.row_index, doc.doc_id, doc.title, doc.text, len(doc.text), "ok", None, None)

    @classmethod
    def rejected(cls, reject: RejectedDocument) -> DocumentRow:
        return cls(reject.row_index, reject.doc_id, reject.title, reject.text,
                   None if reject.text is None else len(reject.text), "rejected", reject.reason,
                   reject.detail or None)


def _arrow_type(hint: Any, metadata: Mapping[str, Any]) -> tuple[pa.DataType, bool]:
    """The Arrow type of an annotation, and whether it admits None."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        [inner] = [arg for arg in get_args(hint) if arg is not type(None)]
        return _arrow_type(inner, metadata)[0], True
    if "arrow_type" in metadata:
        # JSON text travels as Arrow's canonical JSON extension type, which DuckDB reads as its JSON type
        alias = metadata["arrow_type"]
        return (pa.json_() if alias == "json" else pa.type_for_alias(alias)), False
    if origin is Literal:
        [kind] = {type(arg) for arg in get_args(hint)}
        return _arrow_type(kind, metadata)
    if origin is list:
        [item] = get_args(hint)
        return pa.list_(_arrow_type(item, {})[0]), False
    if hint not in _ARROW_TYPES:
        raise TypeError(f"no Arrow column type for {hint!r}")
    return _ARROW_TYPES[hint], False


def record_columns(record: type, only: Sequence[str] | None = None, skip: Sequence[str] = ()) -> list[pa.Field]:
    """The record dataclass's fields as Arrow columns, in field order: those in ``only`` (default all),
    less those in ``skip``."""
    hints = get_type_hints(record)
    columns = []
    for f in dataclasses.fields(record):
        if f.name in skip or (only is not None and f.name not in only):
            continue
        dtype, nullable = _arrow_type(hints[f.name], f.metadata)
        columns.append(pa.field(f.name, dtype, nullable=nullable))
    return columns


RUN_ID = pa.field("run_id", pa.string(), nullable=False)
# Where a request ran: the shard attempt whose part file held it (``storage.parts``; NULL for rows a run
# wrote itself), its host, device and GPU type (``Database.write_batch``'s ``ran_on`` for a run's own rows).
SHARD_COLUMNS = [pa.field(name, pa.string()) for name in ("launch_id", "host", "device", "gpu_type")]

SCHEMAS: dict[str, pa.Schema] = {
    "documents": pa.schema([RUN_ID, *record_columns(DocumentRow)]),
    # the sidecar outputs and the stats are rows of their own tables
    "outputs": pa.schema([RUN_ID, *record_columns(OutputRecord, skip=("sidecars", "stats"))]),
    # each sidecar task's output carries its request's key from the OutputRecord it belongs to
    "sidecar_outputs": pa.schema([RUN_ID, *record_columns(OutputRecord, only=("doc_id", "mode")),
                                  *record_columns(SidecarRecord)]),
    # a request's stats carry its key and batch from the OutputRecord they belong to
    "request_stats": pa.schema([RUN_ID, *record_columns(OutputRecord, only=("doc_id", "mode", "batch_id")),
                                *record_columns(RequestStats), *SHARD_COLUMNS]),
    "judgement_games": pa.schema([RUN_ID, *record_columns(JudgementRecord)]),
    "judgement_scores": pa.schema([RUN_ID, *record_columns(JudgementScoreRecord)]),
    "judge_settings": pa.schema([RUN_ID, *record_columns(JudgeSettingsRecord)]),
    "judge_tasks": pa.schema([RUN_ID, *record_columns(JudgeTaskRecord)]),
    "cost_estimates": pa.schema(record_columns(CostRecord)),
}


def row(table: str, record: object, **context: Any) -> dict[str, Any]:
    """``record`` as a row of ``table``: each column from ``context`` where given there, else the
    record's attribute of that name."""
    names = SCHEMAS[table].names
    unknown = sorted(set(context) - set(names))
    if unknown:
        raise ValueError(f"{table} has no columns {unknown}")
    return {name: context[name] if name in context else getattr(record, name) for name in names}


def arrow_table(table: str, rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """Rows made by :func:`row` as an Arrow table with ``table``'s schema."""
    return pa.Table.from_pylist(list(rows), schema=SCHEMAS[table])
