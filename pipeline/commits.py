"""Committing finished documents to DuckDB, or writing them to a part file, grouped so that commits stay a
small share of a run."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pipeline.finished import DocumentDone, DocumentFailure, FinishedDocument
from storage import Database, OutputRecord, RanOn, RejectedDocument

if TYPE_CHECKING:
    from storage.parts import PartWriter


def _rows(docs: Sequence[FinishedDocument]) -> tuple[list[OutputRecord], list[RejectedDocument]]:
    return ([r for d in docs if isinstance(d, DocumentDone) for r in d.records],
            [d.as_reject() for d in docs if isinstance(d, DocumentFailure)])


def store_documents(db: Database, run_id: str, docs: Sequence[FinishedDocument], ran_on: RanOn,
                    finish: str | None = None, error: str | None = None) -> bool:
    """Outputs of ``docs`` and their failures (as ``oom`` rejects) in one transaction, each request's stats
    naming where it ran (``ran_on``); with ``finish``, that transaction also finishes the run with this status
    (see ``Database.write_batch``). Returns whether anything was written."""
    records, rejects = _rows(docs)
    if records or rejects:
        db.write_batch(run_id, records, rejects, finish=finish, error=error, ran_on=ran_on)
        return True
    if finish is not None:
        # nothing to write, but the caller relies on the run being finished
        db.finish_run(run_id, finish, error)
    return False


@dataclass
class PendingCommit:
    """Finished documents waiting to be committed together, in the order they finished.

    A commit costs a DuckDB transaction (attach, commit, checkpoint, detach) whatever its size: committing
    every document of a fast pair spends a large share of the model's time there (and a part file per
    document would leave a shard's parent that many files to ingest). Documents are grouped
    until ``interval_s`` has passed since the oldest one finished, so a crash costs at most that much
    finished work plus the documents in flight; ``interval_s=0`` commits documents as they finish (those
    that finish together, in one transaction).
    """

    interval_s: float
    docs: list[FinishedDocument] = field(default_factory=list)
    oldest: float = 0.0

    def add(self, docs: Sequence[FinishedDocument]) -> None:
        """Documents that finished together, in the order they finished."""
        if docs and not self.docs:
            self.oldest = time.monotonic()
        self.docs += docs

    def due(self) -> bool:
        return bool(self.docs) and time.monotonic() - self.oldest >= self.interval_s

    def commit(self, db: Database, run_id: str, ran_on: RanOn, finish: str | None = None,
               error: str | None = None) -> int:
        """Write every pending document in one transaction (its stats naming ``ran_on``), finishing the run with
        status ``finish`` (and ``error``) in it if given; returns the documents it finished. A failed commit
        keeps them pending."""
        store_documents(db, run_id, self.docs, ran_on, finish, error)
        done = sum(isinstance(d, DocumentDone) for d in self.docs)
        self.docs = []
        return done

    def write_part(self, writer: PartWriter) -> int:
        """Write every pending document to one part file (a shard's commit: the parent ingests it); returns the
        documents it finished. A failed write keeps them pending."""
        records, rejects = _rows(self.docs)
        writer.write(records, rejects)
        done = sum(isinstance(d, DocumentDone) for d in self.docs)
        self.docs = []
        return done

    def defer(self, db: Database, run_id: str, ran_on: RanOn, finish: str | None = None,
              error: str | None = None) -> None:
        """Keep every pending document, and the run's finish, beside the database for its next open to commit
        (``Database.defer_batch``): for when another process holds the file longer than the run waits."""
        records, rejects = _rows(self.docs)
        db.defer_batch(run_id, records, rejects, finish=finish, error=error, ran_on=ran_on)
        self.docs = []
