"""Part files: how the shards of a run hand their finished documents to the run's parent, the only process
that writes the DuckDB file (``Database.ingest_parts``).

Under a results location (a local directory, a shared mount, or any URI ``pyarrow.fs.FileSystem.from_uri``
opens; by default ``<db_path>.runs/parts``)::

    <location>/<run_key>/<launch_id>/manifest.parquet                   # the attempt's documents
    <location>/<run_key>/<launch_id>/part-000001.parquet                # finished documents, in order
    <location>/<run_key>/<launch_id>/.part-000002.parquet.tmp-<uuid>    # being written: never listed
    <location>/<run_key>/<launch_id>/device-state                       # "waiting" or "held": its accelerator

``run_key`` is ``storage.run_keys.run_key(run_id)``; ``launch_id`` names one attempt of one shard, unique
across the parent's reruns. Every file is written under a hidden temporary name and then renamed, so a
visible part or manifest is always complete: a writer killed mid-write leaves only a temporary file,
which nothing lists, and which the parent removes once the attempt is over (:meth:`PartStore.remove_temporary`).

A part is one Parquet table with one row per output record or reject (:data:`PART_SCHEMA`):

- who wrote it, the same on every row: ``run_id``, ``launch_id``, ``shard``, ``attempt``, ``host``,
  ``device``, ``gpu_type`` and ``run_nonce``, the nonce of the run's start that wrote the attempt's manifest
  (:class:`ShardInfo`);
- how its forwards ran, the same on every row: ``capture``, the capture mode and why, and
  ``capture_counters``, JSON text of the attempt's capture counters so far, per model (:class:`PartCapture`;
  NULL in parts written before migration 014 or without them);
- ``kind``: ``output`` (one mode of one document) or ``reject`` (a document that failed, e.g. ``oom``);
- ``doc_id``: the document (NULL only for a reject of a row whose id was null), and ``text_sha256``, the
  SHA-256 of the text the attempt ran (:func:`text_sha256`);
- an output's columns, NULL on a reject: those of ``OutputRecord`` (``mode``, ``summary``, ...) with its
  sidecar tasks' outputs as ``sidecars``, a list of structs with ``SidecarRecord``'s fields, and its
  per-phase stats as ``stats``, a list of structs with ``RequestStats``' fields;
- a reject's columns, NULL on an output: those of ``RejectedDocument`` but its id (``reason``,
  ``row_index``, ``detail``, ``title``, ``text``).

An attempt says in ``device-state`` whether it waits for its accelerator or holds it (:data:`DeviceState`), so
that the parent does not take a wait for the device, however long, for a stall.

The columns are derived from the record dataclasses (``storage.tables.record_columns``), so a field added
to a record reaches the parts as well as the tables. A manifest carries its run's nonce in its Parquet
metadata; the attempt copies it to its parts, so the parent can refuse a part that another start of the run
id launched, and a document's text hash lets it refuse outputs of another text (``storage.ingest``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from storage.capture_counters import checked_counters
from storage.errors import ResultsLocationError
from storage.records import Document, OutputRecord, RejectedDocument, RequestStats, SidecarRecord, check_outputs
from storage.run_keys import run_key
from storage.tables import record_columns

MANIFEST = "manifest.parquet"
DEVICE_STATE = "device-state"
# an attempt's accelerator: waited for (the device lock, or a slot of its concurrency limit), or held
DeviceState = Literal["waiting", "held"]
_PART_NAME = re.compile(r"^part-(?P<seq>\d{6,})\.parquet$")
# write_atomically's temporary files: ".<visible name><suffix><random hex>"
_TEMPORARY_SUFFIX = ".tmp-"
_TEMPORARY_NAME = re.compile(rf"^\..+{re.escape(_TEMPORARY_SUFFIX)}[0-9a-f]+$")
_GLOB = re.compile(r"[*?\[\]{}]")
# a launch id is one directory name: no separators, not hidden
_LAUNCH_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_NONCE_KEY = b"sidecar.run_nonce"


def text_sha256(text: str) -> str:
    """The hex SHA-256 of ``text`` as UTF-8: what DuckDB's ``sha256()`` gives for the stored text."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class ShardInfo:
    """Who wrote a part: one attempt of one shard of a run, on one host and device. Stored on each row."""

    run_id: str
    launch_id: str
    shard: int
    attempt: int
    host: str
    device: str | None  # e.g. "cuda:0", "cpu"
    gpu_type: str | None  # e.g. "NVIDIA H100 80GB HBM3"; None on a CPU
    run_nonce: str  # the nonce of the run's start, from the attempt's manifest

    def __post_init__(self) -> None:
        check_launch_id(self.launch_id)
        if not self.run_nonce:
            raise ValueError("a part needs the nonce of its run's start")
        if self.shard < 0 or self.attempt < 1:
            raise ValueError(f"shard counts from 0 and attempt from 1, got shard {self.shard}, "
                             f"attempt {self.attempt}")
        if not self.host:
            raise ValueError("a part needs the host that wrote it")


@dataclass(frozen=True)
class PartCapture:
    """How an attempt's forwards ran when it wrote a part: its capture mode and why
    (``ModelPair.capture_report``) and its counters so far, per model (``capture_stats(pair)["counters"]``)."""

    capture: str
    counters: Mapping[str, Mapping[str, float]]

    def columns(self) -> dict[str, str]:
        return {"capture": self.capture, "capture_counters": json.dumps(checked_counters(self.counters),
                                                                        sort_keys=True)}


@dataclass(frozen=True)
class IngestResult:
    """What one ``Database.ingest_parts`` call did."""

    parts: int  # parts ingested now
    skipped: int  # parts found already ingested, not read again
    outputs: int  # output rows written now
    rejects: int  # reject rows written now
    refused: tuple[str, ...] = ()  # paths of parts not of this start of the run, or of other documents; unread


def _nullable(fields: Sequence[pa.Field]) -> list[pa.Field]:
    return [f.with_nullable(True) for f in fields]


STATS_TYPE = pa.list_(pa.struct(record_columns(RequestStats)))
# JSON as its plain string storage: pyarrow builds no extension type inside a struct from Python rows, and the
# ingest's insert makes the text JSON again
SIDECARS_TYPE = pa.list_(pa.struct([f.with_type(f.type.storage_type) if isinstance(f.type, pa.BaseExtensionType) else f
                                    for f in record_columns(SidecarRecord)]))
_OUTPUT_FIELDS = record_columns(OutputRecord, skip=("doc_id", "sidecars", "stats"))
_REJECT_FIELDS = record_columns(RejectedDocument, skip=("doc_id",))
_SHARD_FIELDS = record_columns(ShardInfo)
PART_SCHEMA = pa.schema([
    # parts written before parts carried a nonce read with it NULL, to be refused rather than fail the read
    *(f.with_nullable(True) if f.name == "run_nonce" else f for f in _SHARD_FIELDS),
    pa.field("capture", pa.string()),
    pa.field("capture_counters", pa.string()),
    pa.field("kind", pa.string(), nullable=False),
    pa.field("doc_id", pa.string()),
    pa.field("text_sha256", pa.string()),
    *_nullable(_OUTPUT_FIELDS),
    pa.field("sidecars", SIDECARS_TYPE),
    pa.field("stats", STATS_TYPE),
    *_nullable(_REJECT_FIELDS),
])
_MANIFEST_SCHEMA = pa.schema(record_columns(Document))


def check_launch_id(launch_id: str) -> None:
    if not _LAUNCH_ID.match(launch_id):
        raise ValueError(f"a launch id is one plain directory name (letters, digits, '_', '.', '-'), "
                         f"got {launch_id!r}")


def _struct_row(record: RequestStats | SidecarRecord, of: pa.ListType) -> dict[str, Any]:
    return {f.name: getattr(record, f.name) for f in of.value_type}


@dataclass(frozen=True)
class Manifest:
    """An attempt's documents, and the nonce of the run's start that launched it."""

    run_nonce: str
    docs: list[Document]


def part_table(info: ShardInfo, records: Sequence[OutputRecord], rejects: Sequence[RejectedDocument],
               text_hashes: Mapping[str, str], capture: PartCapture | None = None) -> pa.Table:
    """The rows of one part, as :data:`PART_SCHEMA` lays them out; ``text_hashes`` are the attempt's documents'
    :func:`text_sha256` by id, ``capture`` how its forwards ran so far."""
    check_outputs(records, "a part")
    unknown = sorted({r.doc_id for r in records} - set(text_hashes))
    if unknown:
        raise ValueError(f"outputs of documents not in the attempt's manifest: {unknown[:5]}")
    shard = asdict(info) | (capture.columns() if capture else {"capture": None, "capture_counters": None})
    absent_output = dict.fromkeys([f.name for f in _OUTPUT_FIELDS] + ["sidecars", "stats"])
    absent_reject = dict.fromkeys(f.name for f in _REJECT_FIELDS)
    rows = [{**shard, "kind": "output", "doc_id": r.doc_id, "text_sha256": text_hashes[r.doc_id], **absent_reject,
             **{f.name: getattr(r, f.name) for f in _OUTPUT_FIELDS},
             "sidecars": [_struct_row(s, SIDECARS_TYPE) for s in r.sidecars],
             "stats": [_struct_row(s, STATS_TYPE) for s in r.stats]} for r in records]
    rows += [{**shard, "kind": "reject", "doc_id": r.doc_id,
              "text_sha256": None if r.text is None else text_sha256(r.text), **absent_output,
              **{f.name: getattr(r, f.name) for f in _REJECT_FIELDS}} for r in rejects]
    return pa.Table.from_pylist(rows, schema=PART_SCHEMA)


def _publish(fs: pafs.FileSystem, source: str, target: str) -> None:
    """Rename a complete temporary file to its visible name (atomic on a local or POSIX file system)."""
    fs.move(source, target)


def write_atomically(fs: pafs.FileSystem, path: str, content: pa.Table | bytes) -> str:
    """Write ``content`` (a table, as Parquet) to ``path`` through a hidden temporary file in the same
    directory, renamed once complete; returns ``path``. A failure removes the temporary file where it still can."""
    directory, _, name = path.rpartition("/")
    fs.create_dir(directory, recursive=True)
    temporary = f"{directory}/.{name}{_TEMPORARY_SUFFIX}{uuid.uuid4().hex}"
    try:
        if isinstance(content, bytes):
            with fs.open_output_stream(temporary) as out:
                out.write(content)
        else:
            pq.write_table(content, temporary, filesystem=fs)
        _publish(fs, temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            fs.delete_file(temporary)
        raise
    return path


class PartStore:
    """The results location of part files and manifests: a local path or a pyarrow file system URI."""

    def __init__(self, uri: str | Path) -> None:
        self.uri = str(uri)
        if "://" in self.uri:
            try:
                self.filesystem, root = pafs.FileSystem.from_uri(self.uri)
            except (pa.ArrowException, ValueError, OSError) as exc:
                raise ResultsLocationError(f"cannot use results location {self.uri}: "
                                           f"{' '.join(str(exc).split())}") from None
        else:
            # DuckDB reads local parts by path, whatever the working directory is then
            self.filesystem, root = pafs.LocalFileSystem(), Path(self.uri).expanduser().resolve().as_posix()
        self.root = root.rstrip("/")

    @classmethod
    def opened(cls, uri: str | Path) -> PartStore:
        """The store at ``uri`` with its root directory made, so that a location that cannot hold parts is
        refused (:class:`ResultsLocationError`) before a run writes anything anywhere."""
        store = cls(uri)
        try:
            store.filesystem.create_dir(store.root, recursive=True)
        except (pa.ArrowException, OSError) as exc:
            blocking = next((p for p in Path(store.root).parents if p.is_file()), None) if store.is_local else None
            problem = (f"{blocking} is a file, not a directory" if blocking is not None
                       else " ".join(str(exc).split()))
            raise ResultsLocationError(f"cannot use results location {store.uri}: {problem}") from None
        return store

    @classmethod
    def beside(cls, db_path: str | Path) -> PartStore:
        """The default location: ``<db_path>.runs/parts``, next to the database file's locks."""
        path = Path(db_path)
        return cls(path.parent / f"{path.name}.runs" / "parts")

    def __repr__(self) -> str:
        return f"PartStore({self.uri!r})"

    @property
    def is_local(self) -> bool:
        """Whether the parts are local files, which DuckDB reads by path (unless the path holds characters
        DuckDB would take for a glob pattern)."""
        return isinstance(self.filesystem, pafs.LocalFileSystem) and not _GLOB.search(self.root)

    def run_dir(self, run_id: str) -> str:
        return f"{self.root}/{run_key(run_id)}"

    def launch_dir(self, run_id: str, launch_id: str) -> str:
        check_launch_id(launch_id)
        return f"{self.run_dir(run_id)}/{launch_id}"

    def write_manifest(self, run_id: str, launch_id: str, manifest: Manifest) -> str:
        """Write the attempt's documents and run nonce, atomically; returns the manifest's path."""
        table = pa.Table.from_pylist([asdict(d) for d in manifest.docs],
                                     schema=_MANIFEST_SCHEMA.with_metadata({_NONCE_KEY: manifest.run_nonce}))
        return write_atomically(self.filesystem, f"{self.launch_dir(run_id, launch_id)}/{MANIFEST}", table)

    def read_manifest(self, run_id: str, launch_id: str) -> Manifest:
        path = f"{self.launch_dir(run_id, launch_id)}/{MANIFEST}"
        nonce = (pq.read_schema(path, filesystem=self.filesystem).metadata or {}).get(_NONCE_KEY)
        if not nonce:
            raise ValueError(f"manifest {path} names no run nonce: it was written by an older sidecar")
        table = pq.read_table(path, filesystem=self.filesystem, schema=_MANIFEST_SCHEMA)
        return Manifest(nonce.decode(), [Document(**row) for row in table.to_pylist()])

    def write_device_state(self, run_id: str, launch_id: str, state: DeviceState) -> None:
        """Say whether the attempt waits for its accelerator or holds it (replacing what it said before)."""
        write_atomically(self.filesystem, f"{self.launch_dir(run_id, launch_id)}/{DEVICE_STATE}", state.encode())

    def read_device_state(self, run_id: str, launch_id: str) -> DeviceState | None:
        """What the attempt last said of its accelerator; None before it said anything."""
        try:
            with self.filesystem.open_input_stream(f"{self.launch_dir(run_id, launch_id)}/{DEVICE_STATE}") as f:
                said = f.read().decode()
        except FileNotFoundError:
            return None
        if said not in get_args(DeviceState):
            raise ValueError(f"attempt {launch_id} of run {run_id!r} says its device is {said!r}")
        return said  # type: ignore[return-value]

    def writer(self, info: ShardInfo, docs: Sequence[Document],
               capture: Callable[[], PartCapture] | None = None) -> PartWriter:
        """The parts of one attempt, of its manifest's ``docs``; each part carries what ``capture`` says when it
        is written."""
        return PartWriter(self, info, docs, capture)

    def parts(self, run_id: str) -> list[str]:
        """The visible part files of the run, sorted by launch id and then by number (the order written)."""
        return [path for _, _, path in self._listed(self.run_dir(run_id))]

    def remove_temporary(self, run_id: str, launch_id: str) -> int:
        """Delete the temporary files a killed writer of the attempt left; returns how many. Only for an attempt
        whose processes are gone: a live writer's file would vanish before its rename."""
        selector = pafs.FileSelector(self.launch_dir(run_id, launch_id), allow_not_found=True)
        left = [info.path for info in self.filesystem.get_file_info(selector)
                if info.type == pafs.FileType.File and _TEMPORARY_NAME.match(info.base_name)]
        for path in left:
            with contextlib.suppress(FileNotFoundError):
                self.filesystem.delete_file(path)
        return len(left)

    def part_name(self, run_id: str, path: str) -> str:
        """A part's name within its run, ``<launch_id>/part-NNNNNN.parquet``: what ``ingested_parts`` keys."""
        prefix = self.run_dir(run_id) + "/"
        if not path.startswith(prefix):
            raise ValueError(f"{path} is not a part of run {run_id!r} under {self.uri}")
        return path[len(prefix):]

    def read_part(self, path: str, columns: Sequence[str] | None = None) -> pa.Table:
        """A part as Arrow (``columns`` only, if given), for a location DuckDB cannot read by path."""
        return pq.read_table(path, filesystem=self.filesystem, schema=PART_SCHEMA,
                             columns=None if columns is None else list(columns))

    def _listed(self, directory: str) -> list[tuple[str, int, str]]:
        selector = pafs.FileSelector(directory, recursive=True, allow_not_found=True)
        found = []
        for info in self.filesystem.get_file_info(selector):
            parent, _, name = info.path.rpartition("/")
            match = _PART_NAME.match(name)
            if info.type == pafs.FileType.File and match is not None:
                found.append((parent, int(match["seq"]), info.path))
        return sorted(found)


class PartWriter:
    """Writes one attempt's parts, numbered 1, 2, ... in its launch directory; each ``write`` is one part.

    A writer for a launch that already has parts (a restarted process reusing its launch id) numbers on
    after them, so it never replaces a part the parent may have ingested already. ``capture`` gives each part
    the attempt's capture mode and counters at the time it is written (the parent keeps the latest part's)."""

    def __init__(self, store: PartStore, info: ShardInfo, docs: Sequence[Document],
                 capture: Callable[[], PartCapture] | None = None) -> None:
        self.store = store
        self.info = info
        self.capture = capture
        self.text_hashes = {d.doc_id: text_sha256(d.text) for d in docs}
        self.directory = store.launch_dir(info.run_id, info.launch_id)
        existing = [seq for _, seq, _ in store._listed(self.directory)]
        self._next_seq = max(existing, default=0) + 1

    def write(self, records: Sequence[OutputRecord], rejects: Sequence[RejectedDocument] = ()) -> str | None:
        """One part holding ``records`` and ``rejects``; returns its path, None (nothing written) when both are
        empty. The part is visible only once it is complete."""
        if not records and not rejects:
            return None
        table = part_table(self.info, records, rejects, self.text_hashes, self.capture() if self.capture else None)
        path = write_atomically(self.store.filesystem, f"{self.directory}/part-{self._next_seq:06d}.parquet",
                                table)
        self._next_seq += 1
        return path
