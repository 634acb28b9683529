"""The steps a run is made of, in plain Python: documents through the engine, storage records out.

This layer sits between the engine library (``sidecar``) and storage below it and the Prefect flows
above it: the flows only sequence these calls and hold no model code and no SQL, and nothing here
imports Prefect. The documents stream through the engine a window at a time, each window sorted by
length; a document is handed to the commit buffer as soon as every requested mode (``vocab.modes``)
is done for it. A stream that runs out of accelerator memory is retried with a smaller batch, down to
single documents, and a document that still runs out is returned as a failure while the others go on.

* ``settings``: what every document goes through (task, modes, summary length);
* ``context``: the token-level context check that rejects over-long documents before any window;
* ``windows``: cutting the documents into windows, the same way on every resume, sorted by length;
* ``shards``: cutting a run's documents into shards balanced by tokens, for shard processes;
* ``streams``: one window through the engine, a stream per mode, with out-of-memory retries
  (``memory``: recognising OOM, freeing memory);
* ``records``: the storage records of a document in a mode; ``batch_ids``: the engine batches they ran in;
* ``finished``: what a window hands on per document;
* ``commits``: grouping finished documents into DuckDB transactions;
* ``counts``: what a run did, for its summary;
* ``warmup``: compiling (and capturing) the decode forwards the windows will run, at the run's start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sidecar.lazy_names import lazy_names

if TYPE_CHECKING:
    from pipeline.batch_ids import EngineBatch
    from pipeline.commits import PendingCommit, store_documents
    from pipeline.context import context_need, keep_over_context, split_by_context
    from pipeline.counts import RunCounts
    from pipeline.finished import OOM_REASON, DocumentDone, DocumentFailure, FinishedDocument, OnDocuments
    from pipeline.memory import is_out_of_memory, release_memory
    from pipeline.records import sidecar_record, standalone_record
    from pipeline.settings import DEFAULT_MODES, BatchSettings
    from pipeline.shards import Shard, plan_shards, token_counts
    from pipeline.streams import WindowStats, run_window
    from pipeline.warmup import warm_run
    from pipeline.windows import WINDOW_BATCHES, Window, plan_windows, window_size

# The names load on first use: the flows import this package to be read (deployed, listed, their parameters
# checked) without the engine, torch and transformers that streams, memory and warm-up import (seconds).
_EXPORTS = {
    "pipeline.batch_ids": ("EngineBatch",),
    "pipeline.commits": ("PendingCommit", "store_documents"),
    "pipeline.context": ("context_need", "keep_over_context", "split_by_context"),
    "pipeline.counts": ("RunCounts",),
    "pipeline.finished": ("OOM_REASON", "DocumentDone", "DocumentFailure", "FinishedDocument", "OnDocuments"),
    "pipeline.memory": ("is_out_of_memory", "release_memory"),
    "pipeline.records": ("sidecar_record", "standalone_record"),
    "pipeline.settings": ("DEFAULT_MODES", "BatchSettings"),
    "pipeline.shards": ("Shard", "plan_shards", "token_counts"),
    "pipeline.streams": ("WindowStats", "run_window"),
    "pipeline.warmup": ("warm_run",),
    "pipeline.windows": ("WINDOW_BATCHES", "Window", "plan_windows", "window_size"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [
    "DEFAULT_MODES",
    "OOM_REASON",
    "WINDOW_BATCHES",
    "BatchSettings",
    "DocumentDone",
    "DocumentFailure",
    "EngineBatch",
    "FinishedDocument",
    "OnDocuments",
    "PendingCommit",
    "RunCounts",
    "Shard",
    "Window",
    "WindowStats",
    "context_need",
    "is_out_of_memory",
    "keep_over_context",
    "plan_shards",
    "plan_windows",
    "release_memory",
    "run_window",
    "sidecar_record",
    "split_by_context",
    "standalone_record",
    "store_documents",
    "token_counts",
    "warm_run",
    "window_size",
]


__getattr__, __dir__ = lazy_names(__name__, _MODULE_OF, __all__)
