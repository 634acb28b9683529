"""A corpus file as Arrow record batches, its format chosen by its extension: Parquet (``.parquet``), JSON
Lines (``.jsonl``, ``.ndjson``: one JSON object per line) or CSV (``.csv``, with a header row).

pyarrow reads all three (``pyarrow.parquet``, ``pyarrow.json``, ``pyarrow.csv``), streaming, so a large
corpus is never held whole. A CSV's chosen columns are read as bytes, so an id like ``007`` stays ``007``
and a cell that is not UTF-8 is not the whole file's error (pyarrow checks a CSV's string columns as it
reads them; ``storage.parquet`` decodes every format's text cells one by one); JSON values keep their JSON
types. A file that cannot be read, or whose rows change type half-way, is an
:class:`InputSchemaError` naming it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.json as pjson
import pyarrow.parquet as pq

from storage.errors import InputSchemaError

FORMATS = {".parquet": "Parquet", ".jsonl": "JSON Lines", ".ndjson": "JSON Lines", ".csv": "CSV"}
_READ_BATCH_ROWS = 1024
# bytes pyarrow reads per block of a JSON Lines or CSV file; the first block decides the column types
_BLOCK_BYTES = 1 << 20


@dataclass
class CorpusFile:
    """An opened corpus: its path, format and schema; ``batches`` reads it from the start."""

    path: Path
    kind: str
    schema: pa.Schema
    _reader: pa.RecordBatchReader | pq.ParquetFile

    def batches(self, columns: Sequence[str]) -> Iterator[pa.RecordBatch]:
        """The file's rows, ``columns`` only, in batches; once."""
        try:
            if isinstance(self._reader, pq.ParquetFile):
                yield from self._reader.iter_batches(batch_size=_READ_BATCH_ROWS, columns=list(columns))
                return
            for batch in self._reader:
                yield batch.select(list(columns))
        except (pa.ArrowInvalid, OSError) as exc:
            raise InputSchemaError(f"{self.path} is not a readable {self.kind} file: {_one_line(exc)}") from exc


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def open_corpus(path: str | Path, text_columns: Sequence[str] = ()) -> CorpusFile:
    """Open ``path`` by its extension; ``text_columns`` of a CSV are read as bytes."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"input file {path} does not exist")
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise InputSchemaError(f"{path}: a corpus is a {', '.join(FORMATS)} file, chosen by its extension; "
                               f"{path.suffix or 'no extension'} is none of them")
    try:
        if kind == "Parquet":
            parquet = pq.ParquetFile(path)
            return CorpusFile(path, kind, parquet.schema_arrow, parquet)
        if kind == "CSV":
            reader = pcsv.open_csv(path, read_options=pcsv.ReadOptions(block_size=_BLOCK_BYTES),
                                   convert_options=pcsv.ConvertOptions(
                                       column_types={name: pa.binary() for name in text_columns}))
        else:
            reader = pjson.open_json(path, read_options=pjson.ReadOptions(block_size=_BLOCK_BYTES))
    except (pa.ArrowInvalid, OSError) as exc:
        raise InputSchemaError(f"{path} is not a readable {kind} file: {_one_line(exc)}") from exc
    return CorpusFile(path, kind, reader.schema, reader)
