"""Warm-up at a run's start: the compiled or captured decode forwards its windows will run, before the first."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from pipeline.context import context_need
from pipeline.settings import BatchSettings
from sidecar.runtime.warmup import summary, warms_at_load
from sidecar.tasks.engine import SidecarEngine
from storage import Document


def warm_run(engine: SidecarEngine, docs: Sequence[Document], settings: BatchSettings, max_batch: int,
             log: Callable[[str], object]) -> list[dict]:
    """Warm (``SpeculativeDecoder.warm_at_load``, where ``SIDECAR_WARMUP`` says so) ``max_batch`` main rows and
    as many draft-only rows (the sidecars', the standalone tagger's) at the capacity buckets from the shortest
    document's need to the longest's (by characters: two documents tokenized, not the run), and ``log`` what
    it took; the reports, one per capacity (none in eager and hf modes)."""
    if not docs or not warms_at_load(engine.pair.capture_mode):
        return []
    started = time.perf_counter()
    by_length = sorted(docs, key=lambda doc: len(doc.text))
    shortest, longest = (context_need(engine, doc, settings)[0] for doc in (by_length[0], by_length[-1]))
    # the run's requests decode greedy (``streams``: no sampling asked): its sampled draft chains need no warm-up
    reports = engine.decoder.warm_at_load(max_batch, shortest, longest, max_draft_rows=max_batch, sampled=False)
    log(summary(reports, time.perf_counter() - started))
    return reports
