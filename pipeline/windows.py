"""Cutting a run's documents into windows, the same way on every resume, each sorted by length.

A window is the read-ahead of a stream: its documents are taken from the input in order and sorted by
length within the window only, so the engine admits documents of similar length together (little
padding in a prefill) and starts the long ones first (the window's last steps, when slots empty, are
short documents'). Nothing moves across windows: a run's first documents are done first, and a resume
that skips finished documents forms the same windows as the run it resumes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from storage import Document

# The default window, in batches: enough read-ahead to refill the slots from similar lengths, small enough
# that a window's documents are done (with standalone among the modes: all at once) soon after they start.
WINDOW_BATCHES = 8


def window_size(batch_size: int, window: int | None = None) -> int:
    """``window``, or :data:`WINDOW_BATCHES` batches of ``batch_size`` documents."""
    size = window if window is not None else WINDOW_BATCHES * batch_size
    if size < 1:
        raise ValueError(f"a window holds at least one document, got {size}")
    return size


def length_key(doc: Document) -> int:
    """A document's length for sorting: characters, which follow tokens closely and need no tokenizer."""
    return len(doc.text)


@dataclass(frozen=True)
class Window:
    """Window ``index``: its unfinished documents ``docs``, longest first; ``skipped`` of its documents
    were finished before."""

    index: int
    docs: list[Document]
    skipped: int = 0


def plan_windows(docs: Sequence[Document], size: int, done_ids: set[str]) -> tuple[list[Window], int]:
    """Cut ``docs`` into windows of ``size`` in input order, leave out finished documents and sort each
    window longest first (ties in input order); returns (windows, skipped)."""
    if size < 1:
        raise ValueError(f"a window holds at least one document, got {size}")
    windows: list[Window] = []
    skipped = 0
    for index, start in enumerate(range(0, len(docs), size)):
        chunk = docs[start : start + size]
        todo = sorted((d for d in chunk if d.doc_id not in done_ids), key=length_key, reverse=True)
        skipped += len(chunk) - len(todo)
        if todo:
            windows.append(Window(index, todo, len(chunk) - len(todo)))
    return windows, skipped
