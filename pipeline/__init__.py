"""The steps a run is made of, in plain Python: documents through the engine, storage records out.

This layer sits between the engine library (``sidecar``) and storage below it and the Prefect flows
above it: the flows only sequence these calls and hold no model code and no SQL, and nothing here
imports Prefect. A batch runs every requested mode (``sidecar.modes``) for its documents; a batch that
runs out of accelerator memory is split in half and retried, down to single documents, and a document
that still runs out is returned as a failure while the others go on.

* ``settings``: what every batch does (task, modes, summary length);
* ``context``: the token-level context check that rejects over-long documents before any batch;
* ``batches``: cutting the documents into batches, the same way on every resume;
* ``run``: one batch, with out-of-memory bisection (``memory``: recognising OOM, freeing memory);
* ``modes``: one engine pass per mode, and the storage records it yields;
* ``commits``: grouping finished batches into DuckDB transactions;
* ``counts``: what a run did, for its summary.
"""

from pipeline.batches import Batch, plan_batches
from pipeline.commits import PendingCommit, store_outcomes
from pipeline.context import context_need, split_by_context
from pipeline.counts import RunCounts
from pipeline.memory import is_out_of_memory, release_memory
from pipeline.modes import run_modes, sidecar_record, standalone_record
from pipeline.run import OOM_REASON, BatchOutcome, DocumentFailure, run_batch
from pipeline.settings import DEFAULT_MODES, BatchSettings

__all__ = [
    "DEFAULT_MODES",
    "OOM_REASON",
    "Batch",
    "BatchOutcome",
    "BatchSettings",
    "DocumentFailure",
    "PendingCommit",
    "RunCounts",
    "context_need",
    "is_out_of_memory",
    "plan_batches",
    "release_memory",
    "run_batch",
    "run_modes",
    "sidecar_record",
    "split_by_context",
    "standalone_record",
    "store_outcomes",
]
