"""The engine batches a run's rows ran in: one clock each, and the ``batch_id`` that groups their rows.

A batch is one engine stream (one sidecar mode over a window, or what an out-of-memory retry runs) or
one standalone call. It is named, for ``batch_id``, by the ``row_index`` of its first document handed to
the commit buffer, when that document is handed on. Documents are committed in the order they are handed
on, so a batch with any committed row has that document committed too, and a later batch (in this run or
in a resume of it) is named by a document that was not: ids stay unique within a run, and a batch that a
crash cut short keeps its id for the rows it did commit.
"""

from __future__ import annotations

import time

from storage import Document


class EngineBatch:
    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.batch_id: int | None = None

    def seconds_at(self, moment: float) -> float:
        """Seconds from the batch's start to ``moment`` (a ``time.perf_counter`` value)."""
        return moment - self.started

    def name(self, doc: Document) -> int:
        """The batch's id; the first document handed on names it."""
        if self.batch_id is None:
            self.batch_id = doc.row_index
        return self.batch_id
