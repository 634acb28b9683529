"""The decoding half of the nightly flows: loading the pair on the held accelerator and running a run's
windows through the engine in this process, as ``nightly``'s in-process run (committing to DuckDB) and as a
``nightly-shard`` attempt (writing part files).

It imports torch, transformers and the engine (seconds); ``flows.nightly`` and ``flows.nightly_shard`` import it
inside their flow bodies, so that importing a flow to read it (``prefect deploy``, the UI's parameter forms,
the command line) does not.
"""

from __future__ import annotations

import contextlib
import socket

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from flows.accelerator import holding_accelerator
from flows.nightly_params import NightlyParams
from flows.progress import PhaseBars, RunProgress
from pipeline import (
    BatchSettings,
    DocumentFailure,
    FinishedDocument,
    OnDocuments,
    PendingCommit,
    RunCounts,
    Window,
    WindowStats,
    plan_windows,
    run_window,
    split_by_context,
    warm_run,
    window_size,
)
from sidecar.decoding.decoder import capture_stats, recorded_counters
from sidecar.models.loading import load_pair
from sidecar.models.pair import ModelPair
from sidecar.tasks.engine import SidecarEngine
from storage import Database, DatabaseLockedError, Document, RanOn, RejectedDocument
from storage.parts import Manifest, PartCapture, PartStore, PartWriter, ShardInfo

# Progress goes to the API at most this often: each update is a round trip of some 40 ms.
PROGRESS_INTERVAL_S = 2.0


@task(name="run-window", cache_policy=NO_CACHE, task_run_name="window-{window.index}")
def run_window_task(engine: SidecarEngine, window: Window, settings: BatchSettings, max_batch: int,
                    on_documents: OnDocuments) -> WindowStats:
    """Run one window, handing each document to ``on_documents`` (the flow's commit buffer) as it is done."""
    logger = get_run_logger()
    logger.info("window %d: %d documents (%d finished before)", window.index, len(window.docs), window.skipped)
    bars = PhaseBars(prefix=f"window {window.index}: ", logger=logger)
    try:
        return run_window(engine, window.docs, settings, max_batch, on_documents, on_progress=bars)
    finally:
        bars.close()


def run_in_process(params: NightlyParams, db: Database, docs: list[Document], rejects: list[RejectedDocument],
                   counts: RunCounts) -> None:
    """The run's documents in this process, one shard committing to ``db`` itself: holds the accelerator, loads
    the pair, runs the windows."""
    run_id = counts.run_id
    with holding_accelerator(f"run {run_id}", params.device_wait_s):
        get_run_logger().info("run %s: loading the %s pair", run_id, params.pair)
        with counts.timed("input"):
            engine = SidecarEngine(load_pair(params.pair), gamma=params.gamma, max_batch=params.batch_size)
        _run(engine, params, db, docs, rejects, counts)


def _run(engine: SidecarEngine, params: NightlyParams, db: Database, docs: list[Document],
         rejects: list[RejectedDocument], counts: RunCounts) -> None:
    logger = get_run_logger()
    settings = params.settings()
    run_id = counts.run_id
    with counts.timed("input"):
        docs, over_context = split_by_context(engine, docs, settings)
    rejects = rejects + over_context
    counts.documents = len(docs)
    counts.add_rejects(rejects)
    warm_run(engine, docs, settings, params.batch_size, logger.info)  # compiles before the first window, not in it

    pair = engine.pair
    ran_on = RanOn(host=socket.gethostname(), device=str(pair.device), gpu_type=pair.gpu_type)
    with counts.timed("storage"):
        # one transaction: a failure leaves no run behind to mark failed (a resumed one keeps its state), and
        # a start that is no resume of the existing run_id (other corpus or settings) is refused unwritten
        start = db.begin_run(run_id, params.model_dump(mode="json"), pair=pair.name, device=str(pair.device),
                             gpu_type=pair.gpu_type, gamma=params.gamma, batch_size=params.batch_size,
                             docs=docs, rejects=rejects, modes=params.modes, identity=params.resume_identity(),
                             dtype=pair.dtype_report, capture=pair.capture_report)
    pending = PendingCommit(params.commit_every_s)
    try:
        size = window_size(params.batch_size, params.window)
        windows, counts.skipped_done = plan_windows(docs, size, start.done_doc_ids)
        logger.info("run %s%s: %d documents, %d already done, %d rejected, %d windows of up to %d to run at "
                    "batch %d, %s, capture %s", run_id, " (resumed)" if start.resumed else "", len(docs),
                    counts.skipped_done, len(rejects), len(windows), size, params.batch_size, pair.dtype_report,
                    pair.capture_report)
        _run_windows(engine, windows, settings, params.batch_size, db, ran_on, counts, pending)
    except BaseException as exc:
        _fail(db, run_id, ran_on, pending, exc)
        if not isinstance(exc, DatabaseLockedError):
            # what this start decoded before failing counts too; a locked file is not waited for twice
            with contextlib.suppress(DatabaseLockedError):
                _record_capture(db, run_id, pair)
        raise
    _record_capture(db, run_id, pair)
    create_markdown_artifact(counts.markdown(), key="nightly-summary", description=f"Nightly run {run_id}")


def _record_capture(db: Database, run_id: str, pair: ModelPair) -> None:
    """Add this process's capture counters to the run's, once, at the end of its decoding (a resume adds its
    own: ``Database.record_capture``); recompiles after warm-up, graph breaks or graphs left uncaptured in cudagraph
    mode are a fault, said here too."""
    db.record_capture(run_id, recorded_counters(pair))
    faults = {model: {name: c[name] for name in ("recompiles", "graph_breaks", "cudagraph_skips") if c[name]}
              for model, c in capture_stats(pair)["counters"].items()}
    if any(faults.values()):
        get_run_logger().error("run %s: capture %s had recompiles, graph breaks or uncaptured graphs, which must be 0: "
                               "%s", run_id,
                               pair.capture_report, {m: f for m, f in faults.items() if f})


def _fail(db: Database, run_id: str, ran_on: RanOn, pending: PendingCommit, exc: BaseException) -> None:
    """Commit the finished documents and mark the run failed, in one transaction; when the database stays
    locked, keep both beside it for its next open instead (waiting once more would only double the wait)."""
    error = f"{type(exc).__name__}: {exc}"
    if not isinstance(exc, DatabaseLockedError):
        try:
            pending.commit(db, run_id, ran_on, "failed", error)
            return
        except DatabaseLockedError as locked:
            error += f"; then {locked}"
    pending.defer(db, run_id, ran_on, "failed", error)
    get_run_logger().error("run %s: the database stays locked; its finished documents and this failure are "
                           "kept beside it for the next open to commit", run_id)


def _run_windows(engine: SidecarEngine, windows: list[Window], settings: BatchSettings, max_batch: int,
                 db: Database, ran_on: RanOn, counts: RunCounts, pending: PendingCommit) -> None:
    """Run ``windows``, committing documents as they finish (their stats naming ``ran_on``); the last commit
    also marks the run completed. On failure the documents not yet committed are left in ``pending``."""
    run_id = counts.run_id
    logger = get_run_logger()
    total = counts.documents - counts.skipped_done
    with RunProgress("nightly-progress", f"Documents of run {run_id} committed", total, "doc",
                     PROGRESS_INTERVAL_S) as progress:

        def commit(finish: str | None = None) -> None:
            if pending.docs:
                counts.commits += 1
            with counts.timed("storage"):
                progress.advance(pending.commit(db, run_id, ran_on, finish))

        def finished(docs: list[FinishedDocument]) -> None:
            for doc in docs:
                if isinstance(doc, DocumentFailure):
                    logger.error("document %r failed on its own and is recorded as an error: %s", doc.doc.doc_id,
                                 doc.error)
            counts.add_documents(docs)
            pending.add(docs)
            if pending.due():
                commit()

        for window in windows:
            counts.add_window(run_window_task(engine, window, settings, max_batch, finished))
        # the run's last outputs and its completion in one transaction: a connection less per run
        commit("completed")


def run_shard(run: NightlyParams, store: PartStore, manifest: Manifest, run_id: str, launch_id: str, shard: int,
              attempt: int, what: str, counts: RunCounts) -> None:
    """Attempt ``launch_id`` of shard ``shard`` of run ``run_id`` (``what``, for the log) in this process: holds
    the accelerator, loads the pair, runs the manifest's documents, writing them as parts under ``store``."""
    docs = manifest.docs
    with holding_accelerator(what, run.device_wait_s):
        store.write_device_state(run_id, launch_id, "held")
        get_run_logger().info("%s: loading the %s pair for %d documents", what, run.pair, len(docs))
        with counts.timed("input"):
            engine = SidecarEngine(load_pair(run.pair), gamma=run.gamma, max_batch=run.batch_size)
        pair = engine.pair
        # the run's nonce from the manifest, and the documents' texts, bind the parts to this start of the run
        # each part says how the attempt's forwards ran so far: the parent keeps its latest part's counters
        writer = store.writer(ShardInfo(run_id=run_id, launch_id=launch_id, shard=shard, attempt=attempt,
                                        host=socket.gethostname(), device=str(pair.device), gpu_type=pair.gpu_type,
                                        run_nonce=manifest.run_nonce), docs,
                              capture=lambda: PartCapture(pair.capture_report, recorded_counters(pair)))
        _run_shard(engine, run, writer, docs, counts)


def _run_shard(engine: SidecarEngine, run: NightlyParams, writer: PartWriter, docs: list[Document],
               counts: RunCounts) -> None:
    """The windows of ``docs``, their finished documents written as parts; on failure the documents finished
    so far are written before the error goes on."""
    settings = run.settings()
    with counts.timed("input"):
        docs, over_context = split_by_context(engine, docs, settings)
    counts.documents = len(docs)
    counts.add_rejects(over_context)
    if over_context:
        writer.write([], over_context)
    warm_run(engine, docs, settings, run.batch_size, get_run_logger().info)  # compiles before the first window
    pending = PendingCommit(run.commit_every_s)

    def write() -> None:
        if pending.docs:
            counts.commits += 1
        with counts.timed("storage"):
            pending.write_part(writer)

    def finished(done: list[FinishedDocument]) -> None:
        counts.add_documents(done)
        pending.add(done)
        if pending.due():
            write()

    windows, _ = plan_windows(docs, window_size(run.batch_size, run.window), set())
    try:
        for window in windows:
            counts.add_window(run_window_task(engine, window, settings, run.batch_size, finished))
    finally:
        write()
