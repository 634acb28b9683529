"""What a window hands on for each of its documents: one record per mode, or the failure that rejected it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from storage import Document, OutputRecord, RejectedDocument

# The reject reason of a document that ran out of memory on its own; resuming the run retries it.
OOM_REASON = "oom"


@dataclass(frozen=True)
class DocumentDone:
    """A document with every mode of its run done: one record per mode."""

    doc: Document
    records: list[OutputRecord]


@dataclass(frozen=True)
class DocumentFailure:
    """A document that ran out of memory alone; ``error`` is the start of the error."""

    doc: Document
    error: str

    def as_reject(self) -> RejectedDocument:
        return RejectedDocument(doc_id=self.doc.doc_id, reason=OOM_REASON, row_index=self.doc.row_index,
                                detail=self.error, title=self.doc.title, text=self.doc.text)


FinishedDocument = DocumentDone | DocumentFailure
# Hears each document of a window once, as soon as it is done or has failed, together with the documents
# that finished at the same moment (those of one standalone call), in the order they finished.
OnDocuments = Callable[[list[FinishedDocument]], None]
