"""Committing finished batches to DuckDB, grouped so that commits stay a small share of a run."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeline.run import BatchOutcome
from storage import Database, OutputRecord, RejectedDocument


def _rows(outcomes: Sequence[BatchOutcome]) -> tuple[list[OutputRecord], list[RejectedDocument]]:
    return [r for o in outcomes for r in o.records], [f.as_reject() for o in outcomes for f in o.failures]


def store_outcomes(db: Database, run_id: str, outcomes: Sequence[BatchOutcome], finish: str | None = None,
                   error: str | None = None) -> None:
    """Outputs of ``outcomes`` and their failed documents (as ``oom`` rejects) in one transaction; with
    ``finish``, that transaction also finishes the run with this status (see ``Database.write_batch``)."""
    records, rejects = _rows(outcomes)
    if records or rejects:
        db.write_batch(run_id, records, rejects, finish=finish, error=error)
    elif finish is not None:
        # nothing to write, but the caller relies on the run being finished
        db.finish_run(run_id, finish, error)


@dataclass
class PendingCommit:
    """Finished batches waiting to be committed together.

    A commit costs a DuckDB transaction (attach, commit, checkpoint, detach) whatever its size: committing
    every batch of a fast pair spends a large share of the model's time there. Batches are grouped until
    ``interval_s`` has passed since the oldest one finished, so a crash costs at most that much finished
    work plus the running batch; ``interval_s=0`` commits every batch.
    """

    interval_s: float
    outcomes: list[BatchOutcome] = field(default_factory=list)
    oldest: float = 0.0

    def add(self, outcome: BatchOutcome) -> None:
        if not self.outcomes:
            self.oldest = time.monotonic()
        self.outcomes.append(outcome)

    def due(self) -> bool:
        return bool(self.outcomes) and time.monotonic() - self.oldest >= self.interval_s

    def commit(self, db: Database, run_id: str, finish: str | None = None, error: str | None = None) -> int:
        """Write every pending batch in one transaction, finishing the run with status ``finish`` (and
        ``error``) in it if given; returns the documents it finished. A failed commit keeps the batches
        pending."""
        store_outcomes(db, run_id, self.outcomes, finish, error)
        done = sum(len(o.done_doc_ids) for o in self.outcomes)
        self.outcomes = []
        return done

    def defer(self, db: Database, run_id: str, finish: str | None = None, error: str | None = None) -> None:
        """Keep every pending batch, and the run's finish, beside the database for its next open to commit
        (``Database.defer_batch``): for when another process holds the file longer than the run waits."""
        records, rejects = _rows(self.outcomes)
        db.defer_batch(run_id, records, rejects, finish=finish, error=error)
        self.outcomes = []
