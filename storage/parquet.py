"""Documents from a corpus file with an id column and a text column (CNN/DailyMail: ``id``, ``article``):
Parquet, JSON Lines or CSV, by its extension (``storage.corpus_files``; the module keeps its first format's name).

Columns are checked against the file's schema before a single row is read, so a wrong column name fails
fast, before any model loads or a database is opened (:func:`check_corpus`). Every row that cannot be run
comes back as a reject with its reason; nothing is dropped silently.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from storage.corpus_files import CorpusFile, open_corpus
from storage.errors import InputSchemaError
from storage.records import Document, RejectedDocument, RejectReason


def _is_text_type(dtype: pa.DataType) -> bool:
    return pa.types.is_string(dtype) or pa.types.is_large_string(dtype) or pa.types.is_string_view(dtype)


def _is_bytes_type(dtype: pa.DataType) -> bool:
    return pa.types.is_binary(dtype) or pa.types.is_large_binary(dtype) or pa.types.is_binary_view(dtype)


def _check_columns(path: Path, schema: pa.Schema, id_column: str | None, text_column: str,
                   title_column: str | None) -> None:
    wanted = {"text": text_column} if id_column is None else {"id": id_column, "text": text_column}
    if title_column is not None:
        wanted["title"] = title_column
    missing = [f"{role} column {name!r}" for role, name in wanted.items() if name not in schema.names]
    if missing:
        raise InputSchemaError(
            f"{path} has no {' and no '.join(missing)}; its columns are: {', '.join(schema.names)}. "
            "Choose the columns with the id/text/title column options."
        )
    for role in ("text", "title"):
        name = wanted.get(role)
        if name is None:
            continue
        dtype = schema.field(name).type
        if not (_is_text_type(dtype) or _is_bytes_type(dtype)):
            raise InputSchemaError(f"{role} column {name!r} of {path} has type {dtype}; expected string or binary")


def _cells(batch: pa.RecordBatch, name: str) -> list[object]:
    """A column's cells as Python values, a text column's as bytes: pyarrow decodes a whole string column at
    once and one cell that is not UTF-8 (a Parquet writer need not check, nor does pyarrow's JSON reader)
    raises for the whole file; as bytes each cell is decoded on its own (``_decode``), so a bad one is that
    row's reject. A CSV's columns come as bytes already (``storage.corpus_files``)."""
    column = batch.column(name)
    dtype = column.type
    if pa.types.is_string(dtype):
        column = column.cast(pa.binary())
    elif pa.types.is_large_string(dtype):
        column = column.cast(pa.large_binary())
    elif pa.types.is_string_view(dtype):
        column = column.cast(pa.binary_view())
    return column.to_pylist()


def _decode(value: object) -> str | None:
    """A cell as text; None when it is bytes that are not UTF-8. Non-text ids (integers) become str."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return None
    return value if isinstance(value, str) else str(value)


def _opened(path: str | Path, id_column: str | None, text_column: str, title_column: str | None) -> CorpusFile:
    corpus = open_corpus(path, [c for c in (id_column, text_column, title_column) if c is not None])
    _check_columns(corpus.path, corpus.schema, id_column, text_column, title_column)
    return corpus


def check_corpus(path: str | Path, id_column: str | None = "id", text_column: str = "article",
                 title_column: str | None = None) -> None:
    """Raise what :func:`read_documents` would raise before its first row: a missing or unreadable file,
    an unknown format, a missing column or one of the wrong type."""
    _opened(path, id_column, text_column, title_column)


def read_documents(path: str | Path, id_column: str | None = "id", text_column: str = "article",
                   title_column: str | None = None, max_chars: int | None = None,
                   limit: int | None = None) -> tuple[list[Document], list[RejectedDocument]]:
    """Read documents and rejects from ``path`` (``id_column`` None: each row's index is its id).

    Rejects and their reasons: ``null`` (id or text is null), ``not_utf8`` (a string or binary cell that is
    not UTF-8: every text column is read as bytes and decoded cell by cell, so one bad cell is that row's
    reject and the rest of the file is read; a title that is not UTF-8 keeps its text with U+FFFD for the
    bad bytes), ``empty`` (id or text is empty or nothing but whitespace), ``duplicate_id`` (an earlier row
    had the id; the first row keeps its own verdict), ``too_long`` (more than ``max_chars`` characters).
    The detail names the column. A document's id is the key of its outputs, so only a non-blank id that
    no earlier row has makes a row usable. A reject keeps the id as read; when there is none (null or not
    UTF-8) its ``doc_id`` is None rather than a made-up name that a real id could also have, and the row
    is known by its ``row_index``. Ids and texts are kept exactly as stored. ``limit`` stops reading once
    that many usable documents were found; the rejects met on the way are returned too.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of documents, got {limit}")
    corpus = _opened(path, id_column, text_column, title_column)
    columns = list(dict.fromkeys(c for c in (id_column, text_column, title_column) if c is not None))

    documents: list[Document] = []
    rejects: list[RejectedDocument] = []
    seen_ids: set[str] = set()
    row_index = 0
    for batch in corpus.batches(columns):
        ids = (_cells(batch, id_column) if id_column is not None
               else [str(row_index + i) for i in range(batch.num_rows)])
        texts = _cells(batch, text_column)
        titles = _cells(batch, title_column) if title_column is not None else [None] * len(ids)
        for raw_id, raw_text, raw_title in zip(ids, texts, titles, strict=True):
            if limit is not None and len(documents) >= limit:
                return documents, rejects
            title = raw_title.decode("utf-8", errors="replace") if isinstance(raw_title, bytes) else raw_title
            doc_id = None if raw_id is None else _decode(raw_id)
            text = None if raw_text is None else _decode(raw_text)
            reason: RejectReason | None = None
            detail = ""
            if raw_id is None:
                reason, detail = "null", f"{id_column} is null"
            elif doc_id is None:
                reason, detail = "not_utf8", f"{id_column} bytes are not UTF-8"
            elif not doc_id.strip():
                reason, detail = "empty", f"{id_column} is empty or whitespace"
            elif doc_id in seen_ids:
                reason, detail = "duplicate_id", f"an earlier row has {id_column} {doc_id!r}"
            elif raw_text is None:
                reason, detail = "null", f"{text_column} is null"
            elif text is None:
                reason, detail = "not_utf8", f"{text_column} bytes are not UTF-8"
            elif not text.strip():
                reason, detail = "empty", f"{text_column} is empty or whitespace ({len(text)} characters)"
            elif max_chars is not None and len(text) > max_chars:
                reason, detail = "too_long", f"{len(text)} characters, the limit is {max_chars}"
            if doc_id is not None:
                seen_ids.add(doc_id)
            if reason is None:
                documents.append(Document(doc_id=doc_id, text=text, row_index=row_index, title=title))
            else:
                rejects.append(RejectedDocument(doc_id=doc_id, reason=reason, row_index=row_index, detail=detail,
                                                title=title, text=text))
            row_index += 1
    return documents, rejects
