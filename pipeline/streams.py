"""A window of documents through the engine: a stream per sidecar mode, then the standalone tagger, each
document handed on as soon as all of its modes are done. Every mode runs all the run's sidecar tasks: a stream's
rows decode each task from their one main output, the standalone tagger runs each task on the main output.

Invariant: every document of the window is handed to ``on_documents`` exactly once, as a ``DocumentDone``
with one record per mode or as a ``DocumentFailure``, at the moment its last mode finished.

Each sidecar mode streams the window through ``SidecarEngine.stream`` on its own, documents joining the
batch as slots free, so a mode's rows never share steps with another mode's and each mode's times in
``request_stats`` are its own. The standalone tagger needs the summaries, so it runs after the sidecar
modes, one continuous call per window: with standalone among the modes a window's documents are done
together when that call returns, otherwise each one when its last sidecar mode yields it.

Out of memory: a stream that runs out is given up, keeping what it finished. The documents it had taken
in run again in a stream of half its batch, those it had not taken yet in a stream of its batch; at a batch
of one the documents taken in run one per stream, and one that still runs out alone is rejected (reason
``oom``) while the others go on. A standalone call that runs out is split in halves with half the batch,
down to single documents.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

from pipeline.batch_ids import EngineBatch
from pipeline.finished import DocumentDone, DocumentFailure, OnDocuments
from pipeline.memory import is_out_of_memory, release_memory
from pipeline.records import sidecar_record, standalone_record
from pipeline.settings import BatchSettings
from sidecar.progress import ProgressCallback
from sidecar.tasks.engine import SidecarEngine
from sidecar.tasks.rows import DocumentResult, SidecarRequest
from sidecar.tasks.task import SidecarTask
from storage import Document, OutputRecord
from vocab.modes import SIDECAR_MODES

# CUDA OOM messages run to a paragraph of allocator advice; the stored error keeps the start.
MAX_ERROR_CHARS = 500

# (document, its result, the batch it ran in, seconds on that batch's clock when its main output and when
# its sidecars were done)
OnResult = Callable[[Document, DocumentResult, EngineBatch, float, float], None]


@dataclass
class WindowStats:
    # engine streams and standalone calls run, out-of-memory retries included
    engine_batches: int = 0
    # streams and calls given up on out-of-memory and run again smaller
    oom_retries: int = 0
    # time inside the engine, failed attempts included; what ``on_documents`` does in between is not
    model_seconds: float = 0.0


@dataclass
class _Attempt:
    """What one stream did: the documents it took in (in order), those it finished, and its OOM error."""

    taken: list[Document] = field(default_factory=list)
    done: set[str] = field(default_factory=set)
    error: str | None = None


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]


class WindowRun:
    """One window's documents in every mode of ``settings``, at most ``max_batch`` rows at a time."""

    def __init__(self, engine: SidecarEngine, settings: BatchSettings, max_batch: int, on_documents: OnDocuments,
                 on_progress: ProgressCallback | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.engine, self.settings, self.max_batch = engine, settings, max_batch
        self.on_documents, self.on_progress = on_documents, on_progress
        self.stats = WindowStats()
        # per unfinished document: its modes' records, each waiting for its batch's id
        self.parts: dict[str, list[tuple[EngineBatch, Callable[[int], OutputRecord]]]] = {}
        self.failed: set[str] = set()

    def run(self, docs: Sequence[Document]) -> WindowStats:
        alive = list(docs)
        summaries: dict[str, str] = {}
        sidecar_modes = [m for m in self.settings.modes if m in SIDECAR_MODES]
        for mode in sidecar_modes:

            def keep(doc: Document, result: DocumentResult, batch: EngineBatch, main_ended: float,
                     ended: float, mode: str = mode) -> None:
                summaries.setdefault(doc.doc_id, result.main.text)
                done = self._add(doc, batch, partial(sidecar_record, doc, mode, result,
                                                     main_ended_s=main_ended, sidecar_ended_s=ended))
                if done is not None:
                    self.on_documents([done])

            alive = self._stream(alive, mode, self.settings.mode_tasks(mode), keep)
        if "standalone" in self.settings.modes:
            if not sidecar_modes:  # standalone only: the summaries still come from the speculative pass

                def summary(doc: Document, result: DocumentResult, *_: object) -> None:
                    summaries[doc.doc_id] = result.main.text

                alive = self._stream(alive, "standalone", [], summary)
            self._standalone(alive, summaries)
        return self.stats

    # -- handing documents on --

    def _add(self, doc: Document, batch: EngineBatch, record: Callable[[int], OutputRecord]) -> DocumentDone | None:
        """Keep one mode's record of ``doc``; with its last mode, the document, to be handed on right away
        (the batch ids are taken in hand-over order, ``pipeline.batch_ids``)."""
        parts = self.parts.setdefault(doc.doc_id, [])
        parts.append((batch, record))
        if len(parts) < len(self.settings.modes):
            return None
        del self.parts[doc.doc_id]
        return DocumentDone(doc, [build(batch.name(doc)) for batch, build in parts])

    def _fail(self, doc: Document, error: str) -> None:
        self.failed.add(doc.doc_id)
        self.parts.pop(doc.doc_id, None)
        self.on_documents([DocumentFailure(doc, error)])

    def _progress(self, mode: str) -> ProgressCallback | None:
        report = self.on_progress
        if report is None:
            return None
        return lambda phase, done, total: report(f"{mode}: {phase}", done, total)

    # -- sidecar modes: streams --

    def _stream(self, docs: list[Document], mode: str, tasks: list[SidecarTask], on_result: OnResult) -> list[Document]:
        """Stream ``docs`` in ``mode``, retrying smaller on OOM; returns the documents that did not fail."""
        queue: list[tuple[list[Document], int]] = [(docs, self.max_batch)] if docs else []
        while queue:
            chunk, size = queue.pop(0)
            attempt = self._attempt(chunk, size, mode, tasks, on_result)
            if attempt.error is None:
                continue
            # Outside the except block the traceback, and the activations its frames hold, are gone, so the
            # allocator can hand their memory to the retry.
            release_memory()
            in_flight = [d for d in attempt.taken if d.doc_id not in attempt.done]
            retries: list[tuple[list[Document], int]] = []
            if in_flight and size > 1:
                retries.append((in_flight, size // 2))
            elif len(in_flight) > 1:  # which of them ran out is unknown: each alone
                retries += [([d], 1) for d in in_flight]
            else:
                for doc in in_flight:
                    self._fail(doc, attempt.error)
            if retries:
                self.stats.oom_retries += 1
            untaken = chunk[len(attempt.taken):]
            if untaken:
                retries.append((untaken, size))
            queue[:0] = retries
        return [d for d in docs if d.doc_id not in self.failed]

    def _attempt(self, chunk: list[Document], size: int, mode: str, tasks: list[SidecarTask],
                 on_result: OnResult) -> _Attempt:
        """One stream of ``chunk`` with at most ``size`` rows; stops at the first OOM."""
        attempt = _Attempt()
        batch = EngineBatch()
        last_token: dict[int, float] = {}
        self.stats.engine_batches += 1

        def requests():
            for doc in chunk:
                attempt.taken.append(doc)  # the engine takes a request only when it has a slot for it
                yield SidecarRequest(doc.text, self.settings.instruction, self.settings.system, sidecars=tasks,
                                     max_new_tokens=self.settings.max_new_tokens)

        def on_tokens(index: int, ids: list[int], logprobs: object) -> None:
            # a main output's last tokens are committed in the step that finishes it
            last_token[index] = time.perf_counter()

        results = self.engine.stream(requests(), max_batch=size, on_tokens=on_tokens,
                                     on_progress=self._progress(mode), expected=len(chunk))
        while True:
            started = time.perf_counter()
            try:
                item = next(results, None)
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                attempt.error, item = _error_text(exc), None
            finally:
                self.stats.model_seconds += time.perf_counter() - started
            if item is None:
                return attempt
            index, result = item
            doc = chunk[index]
            attempt.done.add(doc.doc_id)
            on_result(doc, result, batch, batch.seconds_at(last_token.pop(index)),
                      batch.seconds_at(time.perf_counter()))

    # -- standalone: calls --

    def _standalone(self, docs: list[Document], summaries: dict[str, str]) -> None:
        """Run each task on each summary with the standalone tagger; on OOM split in halves down to single documents."""
        tasks = self.settings.mode_tasks("standalone")
        queue: list[tuple[list[Document], int]] = [(docs, self.max_batch)] if docs else []
        while queue:
            chunk, size = queue.pop(0)
            size = min(size, len(chunk))
            batch = EngineBatch()
            self.stats.engine_batches += 1
            error: str | None = None
            try:
                # the tagger gets the run's system prompt too: it differs from the sidecar by its context only
                tagged = self.engine.standalone([summaries[d.doc_id] for d in chunk], tasks, batch_size=size,
                                                system=self.settings.system, on_progress=self._progress("standalone"))
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                error = _error_text(exc)
            finally:
                self.stats.model_seconds += time.perf_counter() - batch.started
            if error is None:
                # the call hands every output back at its end: that is when the caller has them
                ended = batch.seconds_at(time.perf_counter())
                done = [self._add(doc, batch, partial(standalone_record, doc, summaries[doc.doc_id],
                                                      outputs, ended_s=ended))
                        for doc, outputs in zip(chunk, tagged, strict=True)]
                self.on_documents([d for d in done if d is not None])
                continue
            release_memory()
            if len(chunk) == 1:
                self._fail(chunk[0], error)
                continue
            self.stats.oom_retries += 1
            middle, half = len(chunk) // 2, max(1, size // 2)
            queue[:0] = [(chunk[:middle], half), (chunk[middle:], half)]


def run_window(engine: SidecarEngine, docs: Sequence[Document], settings: BatchSettings, max_batch: int,
               on_documents: OnDocuments, on_progress: ProgressCallback | None = None) -> WindowStats:
    """Run ``docs`` (one window, in the order given) in every mode of ``settings``, at most ``max_batch``
    rows at a time, handing each document to ``on_documents`` as soon as it is done or has failed.
    ``on_progress`` hears the engine's phases, named ``"<mode>: <phase>"``."""
    return WindowRun(engine, settings, max_batch, on_documents, on_progress).run(docs)
