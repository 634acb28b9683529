"""One batch through the engine, split in halves on out-of-memory down to single documents."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeline.memory import is_out_of_memory, release_memory
from pipeline.modes import run_modes
from pipeline.settings import BatchSettings
from sidecar.engine import SidecarEngine
from sidecar.progress import ProgressCallback
from storage import Document, OutputRecord, RejectedDocument

# The reject reason of a document that ran out of memory on its own; resuming the run retries it.
OOM_REASON = "oom"
# CUDA OOM messages run to a paragraph of allocator advice; the stored error keeps the start.
MAX_ERROR_CHARS = 500


@dataclass
class DocumentFailure:
    doc: Document
    error: str

    def as_reject(self) -> RejectedDocument:
        return RejectedDocument(doc_id=self.doc.doc_id, reason=OOM_REASON, row_index=self.doc.row_index,
                                detail=self.error, title=self.doc.title, text=self.doc.text)


@dataclass
class BatchOutcome:
    records: list[OutputRecord] = field(default_factory=list)
    failures: list[DocumentFailure] = field(default_factory=list)
    # sub-batches that ran to the end; 1 when the batch needed no split
    sub_batches: int = 0
    oom_splits: int = 0
    # time inside engine calls, failed attempts included
    model_seconds: float = 0.0

    @property
    def done_doc_ids(self) -> list[str]:
        return list(dict.fromkeys(r.doc_id for r in self.records))


def run_batch(engine: SidecarEngine, docs: Sequence[Document], settings: BatchSettings,
              on_progress: ProgressCallback | None = None) -> BatchOutcome:
    """Run ``docs`` in every mode of ``settings``; on OOM split in halves down to single documents.

    Each sub-batch that completes gets ``batch_id`` = the ``row_index`` of its first document, which is
    unique in a run and the same when a resumed run repeats the batch.
    """
    outcome = BatchOutcome()
    pending: list[list[Document]] = [list(docs)] if docs else []
    while pending:
        chunk = pending.pop(0)
        started = time.perf_counter()
        error: str | None = None
        try:
            outcome.records += run_modes(engine, chunk, settings, batch_id=chunk[0].row_index, on_progress=on_progress)
            outcome.sub_batches += 1
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
        finally:
            outcome.model_seconds += time.perf_counter() - started
        if error is None:
            continue
        # Outside the except block the traceback, and the activations its frames hold, are gone, so the
        # allocator can hand their memory to the retry.
        release_memory()
        if len(chunk) == 1:
            outcome.failures.append(DocumentFailure(chunk[0], error))
        else:
            outcome.oom_splits += 1
            middle = len(chunk) // 2
            pending[:0] = [chunk[:middle], chunk[middle:]]
    return outcome
