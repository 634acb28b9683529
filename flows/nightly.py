"""The ``nightly`` flow: Parquet in, the engine over every document in each mode, DuckDB out.

Run directly (``sidecar nightly``, or calling :func:`nightly`) it also runs ``judge`` (with the run's own
pair served on loopback as the judge) and ``cost-report`` afterwards, as subflows; run from its deployment
(``prefect.yaml``) it leaves that to the deployments' triggers, which pass the run id on: it is the name
of the flow run.

Documents stream through the engine a window at a time (``window`` documents, default 8 batches; each
window sorted by length, ``pipeline.windows``), at most ``batch_size`` rows decoding at once; windows are
Prefect tasks. From loading the pair until its last window, a run holds its accelerator
(``flows.accelerator``: the device's OS lock, and on a Prefect server a slot of the ``gpu`` limit), so two
runs never share an accelerator unknowingly (neither its memory nor its time), on the embedded API too; a
run waits for it up to ``device_wait_s`` (default: as long as it takes). It is taken once per run rather
than per window: a task tag would ask the API for a slot per task run, which on the SQLite-backed API
stalled tasks by up to 2 s (bench/orchestration_overhead.py), and the models stay loaded between the
windows anyway.

One process at a time runs a run id of a database: a second one refuses with ``storage.LockHeldError``,
naming the first one's PID and host, or waits up to ``run_wait_s`` for it and then resumes its run.

Each document goes to the commit buffer as soon as all of its modes are done (``pipeline.streams``), and
finished documents are committed to DuckDB together, one transaction at least every ``commit_every_s``
seconds (0: as they finish). A run whose ``run_id`` already exists resumes: committed documents are
skipped, so a crash costs at most that much finished work plus the documents in flight (at most a
window). A resume must
be the same run (the same corpus rows and decisive settings, :meth:`NightlyParams.resume_identity`);
anything else under an existing ``run_id`` is refused with ``storage.RunMismatchError`` before a row is
written. Every transaction waits up to ``lock_wait_s`` while another process (a notebook, the
judge) holds the file, logging who does; a run that gives up keeps its finished documents and its failure
beside the database, and the next open of the file commits them (``Database.defer_batch``).
"""

from __future__ import annotations

import gc
import hashlib
import json
import time
from datetime import UTC, datetime

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext
from prefect.runtime import flow_run as runtime_flow_run
from pydantic import BaseModel, ConfigDict, Field, field_validator

from flows.accelerator import holding_accelerator
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
    release_memory,
    run_window,
    split_by_context,
    window_size,
)
from sidecar.engine import SidecarEngine
from sidecar.models import load_pair
from sidecar.modes import Mode
from sidecar.prompts import DEFAULT_SYSTEM, SUMMARIZE_INSTRUCTION
from sidecar.tasks import HASHTAGS, SidecarTask
from storage import Database, DatabaseLockedError, Document, RejectedDocument, RetryPolicy
from storage.locks import LockHolder
from storage.parquet import read_documents

# Progress goes to the API at most this often: each update is a round trip of some 40 ms.
PROGRESS_INTERVAL_S = 2.0
# Fields that change where, how fast or when the outputs are made, not what they are.
NOT_DECISIVE = frozenset({"batch_size", "window", "db_path", "run_id", "commit_every_s", "trigger_judge",
                          "trigger_cost_report", "lock_wait_s", "run_wait_s", "device_wait_s"})
# Decisive fields a resume proves otherwise: the corpus by its stored rows (ids, titles and texts; a larger
# limit may extend a run), and pair, gamma and modes by the run's own columns (storage.resume).
PROVEN_BY_STORAGE = frozenset({"corpus", "limit", "pair", "gamma", "modes"})


class NightlyParams(BaseModel):
    """Everything a nightly run needs; the Prefect UI renders it as the run form."""

    model_config = ConfigDict(extra="forbid")

    corpus: str = Field("data/news.parquet", description="Parquet file with one document per row.")
    id_column: str = Field("id", description="Column with a unique document id.")
    text_column: str = Field("article", description="Column with the document text.")
    title_column: str | None = Field(None, description="Optional column with a title, stored with the document.")
    limit: int | None = Field(None, ge=1, description="Run only the first N usable documents.")
    max_chars: int | None = Field(
        100_000, ge=1, description="Reject longer texts before tokenizing them (the token check follows).")
    batch_size: int = Field(8, ge=1, le=1024, description="Documents decoded together, at most (the engine's "
                                                          "max batch); they join as others finish.")
    window: int | None = Field(
        None, ge=1, le=1_000_000,
        description="Documents read ahead and sorted by length before they stream through the engine; "
                    "default 8 x batch_size. With standalone among the modes, a window's documents are done "
                    "together at its end.")
    pair: str = Field("qwen-coder-small", description="Model pair: tiny, qwen-coder-small, qwen2.5-7b or T,D.")
    gamma: int = Field(4, ge=1, le=16, description="Tokens the draft proposes per target forward (adaptive).")
    max_new_tokens: int = Field(128, ge=1, le=4096, description="Summary tokens per document.")
    commit_every_s: float = Field(
        10.0, ge=0, le=3600,
        description="Commit finished documents at least this often (0: as they finish); a crash loses at "
                    "most this much finished work plus the documents in flight.")
    sidecar_tasks: list[SidecarTask] = Field(default_factory=lambda: [HASHTAGS],
                                             description="The sidecar task the draft runs after the summary.")
    modes: list[Mode] = Field(default_factory=lambda: ["sidecar", "standalone"],
                              description="sidecar (document evicted), sidecar_attended, standalone.")
    db_path: str = Field("data/sidecar.duckdb", description="The results database.")
    lock_wait_s: float = Field(
        600.0, ge=0, le=86_400,
        description="How long each database transaction waits while another process (a notebook, the judge) "
                    "holds the file before the run gives up; finished documents are then kept beside the file "
                    "for its next open to commit.")
    run_wait_s: float = Field(
        0.0, ge=0, le=86_400,
        description="How long to wait while another process runs the same run id (0: refuse at once); then "
                    "this run resumes it.")
    device_wait_s: float | None = Field(
        None, ge=0, description="How long to wait while another run holds the accelerator (None: as long "
                                "as it takes; 0: refuse at once).")
    run_id: str | None = Field(
        None, min_length=1, max_length=200,
        description="Resume or name a run; default: derived from these parameters and the scheduled date.")
    trigger_judge: bool = Field(True, description="Run `judge` afterwards (direct runs; deployments use triggers).")
    trigger_cost_report: bool = Field(True, description="Run `cost-report` afterwards (direct runs only).")

    @field_validator("sidecar_tasks")
    @classmethod
    def _one_task(cls, tasks: list[SidecarTask]) -> list[SidecarTask]:
        # outputs are stored per (document, mode): one sidecar output each
        if len(tasks) != 1:
            raise ValueError(f"give exactly one sidecar task (the database stores one per document and mode), "
                             f"got {len(tasks)}")
        return tasks

    @field_validator("modes")
    @classmethod
    def _distinct_modes(cls, modes: list[Mode]) -> list[Mode]:
        if not modes:
            raise ValueError("give at least one mode")
        return list(dict.fromkeys(modes))

    def settings(self) -> BatchSettings:
        return BatchSettings(self.sidecar_tasks[0], tuple(self.modes), self.max_new_tokens)

    def decisive(self) -> dict[str, object]:
        """The fields that decide what a run computes: all but :data:`NOT_DECISIVE`."""
        return self.model_dump(mode="json", exclude=set(NOT_DECISIVE))

    def resume_identity(self) -> dict[str, object]:
        """What a resume of the run must repeat besides what storage checks itself
        (:data:`PROVEN_BY_STORAGE`): the id, text and title columns and ``max_chars`` (which rows are
        usable), ``max_new_tokens`` and the sidecar task (the outputs), and the prompts the pipeline
        wraps every document in, which live in code (a changed instruction is another run)."""
        fields = {k: v for k, v in self.decisive().items() if k not in PROVEN_BY_STORAGE}
        return fields | {"instruction": SUMMARIZE_INSTRUCTION, "system": DEFAULT_SYSTEM}

    def resolved_run_id(self, day: datetime) -> str:
        """``run_id``, else ``nightly-YYYYMMDD-<hash of the decisive fields>``: a rerun of the same night
        with the same parameters gets the same id and resumes."""
        if self.run_id:
            return self.run_id
        digest = hashlib.sha256(json.dumps(self.decisive(), sort_keys=True).encode()).hexdigest()[:10]
        return f"nightly-{day:%Y%m%d}-{digest}"


def _params() -> NightlyParams:
    raw = runtime_flow_run.parameters.get("params")
    return raw if isinstance(raw, NightlyParams) else NightlyParams.model_validate(raw or {})


def _run_day() -> datetime:
    """The day the run was scheduled for, so that a late retry of a night's run resumes that night's run."""
    scheduled = runtime_flow_run.scheduled_start_time
    return datetime.fromtimestamp(scheduled.timestamp(), UTC) if scheduled else datetime.now(UTC)


def _flow_run_name() -> str:
    # The run id names the flow run: the deployment triggers hand it to `judge` from there.
    return _params().resolved_run_id(_run_day())


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


@flow(name="nightly", flow_run_name=_flow_run_name)
def nightly(params: NightlyParams = NightlyParams()) -> RunCounts:
    started = time.perf_counter()
    run_id = params.resolved_run_id(_run_day())
    counts = _process(params, run_id)
    counts.process_seconds = time.perf_counter() - started
    if not _from_deployment() and (params.trigger_judge or params.trigger_cost_report):
        # The pair lived in _process; collect it now, so that a judge served on the same GPU fits.
        gc.collect()
        release_memory()
        _run_downstream(params, run_id, counts)
    return counts


def _from_deployment() -> bool:
    # The flow run in the context says it; prefect.runtime.deployment.id asks the API for it (~60 ms).
    context = FlowRunContext.get()
    return context is not None and context.flow_run is not None and context.flow_run.deployment_id is not None


def _process(params: NightlyParams, run_id: str) -> RunCounts:
    counts = RunCounts(run_id)
    logger = get_run_logger()

    def waiting(holder: LockHolder, waited_s: float) -> None:
        logger.warning("run %s is being run by %s; waited %.0f s, waiting up to %.0f s", run_id,
                       holder.describe(), waited_s, params.run_wait_s)

    with counts.timed("storage"):
        db = Database(params.db_path, retry=RetryPolicy(wait_s=params.lock_wait_s))
    # before anything slow: a second process of the run refuses (or waits) at once
    with db.running(run_id, wait_s=params.run_wait_s, on_wait=waiting):
        with counts.timed("input"):
            docs, rejects = read_documents(params.corpus, id_column=params.id_column,
                                           text_column=params.text_column, title_column=params.title_column,
                                           max_chars=params.max_chars, limit=params.limit)
        with holding_accelerator(f"run {run_id}", params.device_wait_s):
            logger.info("run %s: loading the %s pair", run_id, params.pair)
            with counts.timed("input"):
                engine = SidecarEngine(load_pair(params.pair), gamma=params.gamma)
            _run(engine, params, db, docs, rejects, counts)
    return counts


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

    pair = engine.pair
    with counts.timed("storage"):
        # one transaction: a failure leaves no run behind to mark failed (a resumed one keeps its state), and
        # a start that is no resume of the existing run_id (other corpus or settings) is refused unwritten
        start = db.begin_run(run_id, params.model_dump(mode="json"), pair=pair.name, device=str(pair.device),
                             gpu_type=pair.gpu_type, gamma=params.gamma, batch_size=params.batch_size,
                             docs=docs, rejects=rejects, modes=params.modes, identity=params.resume_identity())
    pending = PendingCommit(params.commit_every_s)
    try:
        size = window_size(params.batch_size, params.window)
        windows, counts.skipped_done = plan_windows(docs, size, start.done_doc_ids)
        logger.info("run %s%s: %d documents, %d already done, %d rejected, %d windows of up to %d to run at "
                    "batch %d", run_id, " (resumed)" if start.resumed else "", len(docs), counts.skipped_done,
                    len(rejects), len(windows), size, params.batch_size)
        _run_windows(engine, windows, settings, params.batch_size, db, counts, pending)
    except BaseException as exc:
        _fail(db, run_id, pending, exc)
        raise
    create_markdown_artifact(counts.markdown(), key="nightly-summary", description=f"Nightly run {run_id}")


def _fail(db: Database, run_id: str, pending: PendingCommit, exc: BaseException) -> None:
    """Commit the finished documents and mark the run failed, in one transaction; when the database stays
    locked, keep both beside it for its next open instead (waiting once more would only double the wait)."""
    error = f"{type(exc).__name__}: {exc}"
    if not isinstance(exc, DatabaseLockedError):
        try:
            pending.commit(db, run_id, "failed", error)
            return
        except DatabaseLockedError as locked:
            error += f"; then {locked}"
    pending.defer(db, run_id, "failed", error)
    get_run_logger().error("run %s: the database stays locked; its finished documents and this failure are "
                           "kept beside it for the next open to commit", run_id)


def _run_windows(engine: SidecarEngine, windows: list[Window], settings: BatchSettings, max_batch: int,
                 db: Database, counts: RunCounts, pending: PendingCommit) -> None:
    """Run ``windows``, committing documents as they finish; the last commit also marks the run completed.
    On failure the documents not yet committed are left in ``pending``."""
    run_id = counts.run_id
    logger = get_run_logger()
    total = counts.documents - counts.skipped_done
    with RunProgress("nightly-progress", f"Documents of run {run_id} committed", total, "doc",
                     PROGRESS_INTERVAL_S) as progress:

        def commit(finish: str | None = None) -> None:
            if pending.docs:
                counts.commits += 1
            with counts.timed("storage"):
                progress.advance(pending.commit(db, run_id, finish))

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


def _run_downstream(params: NightlyParams, run_id: str, counts: RunCounts) -> None:
    """Judge, then cost report, as subflows. Their failure leaves this run's committed work as it is: it
    is logged and kept in ``counts.downstream``, and either flow can be run again on its own."""
    from flows.cost_report import cost_report
    from flows.judge import judge

    logger = get_run_logger()
    if params.trigger_judge:
        # no base_url: the judge flow serves this run's pair on loopback for the comparison
        state = judge(run_id=run_id, db_path=params.db_path, judge_pair=params.pair,
                      device_wait_s=params.device_wait_s, return_state=True)
        counts.downstream["judge"] = state.name
    if params.trigger_cost_report:
        state = cost_report(db_path=params.db_path, run_id=run_id, return_state=True)
        counts.downstream["cost-report"] = state.name
    for name, state_name in counts.downstream.items():
        if state_name != "Completed":
            logger.warning("%s ended %s for run %s; rerun it on its own (its flow is idempotent)", name,
                           state_name, run_id)
