"""Cutting a run's documents into batches, the same way on every resume."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from storage import Document


@dataclass(frozen=True)
class Batch:
    """Documents ``docs`` of batch ``index``; ``skipped`` of its documents were finished before."""

    index: int
    docs: list[Document]
    skipped: int = 0


def plan_batches(docs: Sequence[Document], batch_size: int, done_ids: set[str]) -> tuple[list[Batch], int]:
    """Cut ``docs`` into batches in input order, leaving out finished documents; (batches, skipped).

    Batches are cut from the whole document list, finished or not, so a resumed run forms the same
    batches as the run it resumes and a half-written batch is the only one that shrinks.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    batches: list[Batch] = []
    skipped = 0
    for index, start in enumerate(range(0, len(docs), batch_size)):
        chunk = docs[start : start + batch_size]
        todo = [d for d in chunk if d.doc_id not in done_ids]
        skipped += len(chunk) - len(todo)
        if todo:
            batches.append(Batch(index, todo, len(chunk) - len(todo)))
    return batches, skipped
