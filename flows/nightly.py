"""The ``nightly`` flow: a corpus in (Parquet, JSON Lines or CSV), the engine over every document in each mode,
DuckDB out.

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
written; where it runs is no part of that: each request's stats name the host, device and GPU type it ran
on, so a run may be resumed on another device, or with other ``workers``. Every transaction waits up to
``lock_wait_s`` while another process (a notebook, the
judge) holds the file, logging who does; a run that gives up keeps its finished documents and its failure
beside the database, and the next open of the file commits them (``Database.defer_batch``).

Sharded (``workers`` > 1, ``shards`` > 1 or a ``shard_deployment``), this flow is the run's parent and holds
no accelerator: it records the run and its documents once, cuts the documents not yet done into shards
balanced by tokens (``pipeline.shards``) and launches a ``nightly-shard`` flow run per shard
(``flows.nightly_shard``: local processes, ``flows.shard_processes``, or a deployment's runs on a work pool).
Shards write part files; this process alone writes the database, ingesting them as they arrive, relaunches
what failed with only its unfinished documents and marks the run completed once
(``flows.shard_supervisor``). Judge and cost report follow the parent only.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from functools import partial
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.context import FlowRunContext
from prefect.runtime import flow_run as runtime_flow_run

from flows.model_parameters import takes_fields_of
from flows.nightly_params import NOT_DECISIVE, PROVEN_BY_STORAGE, NightlyParams
from flows.shard_launch import ShardLauncher
from flows.shard_supervisor import IncompleteRunError, ShardSupervisor, missing_error
from pipeline import RunCounts, Shard, plan_shards, token_counts
from storage import Database, DatabaseLockedError, Document, RejectedDocument, RetryPolicy
from storage.errors import LockHolder
from storage.parquet import check_corpus, read_documents
from storage.parts import PartStore

__all__ = ["NOT_DECISIVE", "PROVEN_BY_STORAGE", "NightlyParams", "nightly"]
def _params() -> NightlyParams:
    return NightlyParams.model_validate(runtime_flow_run.parameters)


def _run_day() -> datetime:
    """The day the run was scheduled for, so that a late retry of a night's run resumes that night's run."""
    scheduled = runtime_flow_run.scheduled_start_time
    return datetime.fromtimestamp(scheduled.timestamp(), UTC) if scheduled else datetime.now(UTC)


def _flow_run_name() -> str:
    # The run id names the flow run: the deployment triggers hand it to `judge` from there.
    return _params().resolved_run_id(_run_day())


@flow(name="nightly", flow_run_name=_flow_run_name)
@takes_fields_of(NightlyParams)
def nightly(**fields: Any) -> RunCounts:
    """Run a nightly run: its parameters are :class:`NightlyParams`'s fields (call it with
    ``**params.model_dump()``); a value a field refuses fails the run before anything is read or written."""
    started = time.perf_counter()
    params = NightlyParams.model_validate(fields)
    # the corpus's format and columns first: an input that cannot be read leaves no database file behind
    check_corpus(params.corpus, params.id_column, params.text_column, params.title_column)
    run_id = params.resolved_run_id(_run_day())
    counts = _process_sharded(params, run_id) if params.sharded() else _process(params, run_id)
    counts.process_seconds = time.perf_counter() - started
    if not _from_deployment() and (params.trigger_judge or params.trigger_cost_report):
        # The pair lived in _process; collect it now, so that a judge served on the same GPU fits.
        from pipeline.memory import release_memory  # torch: imported where it is used

        gc.collect()
        release_memory()
        _run_downstream(params, run_id, counts)
    return counts


def _from_deployment() -> bool:
    # The flow run in the context says it; prefect.runtime.deployment.id asks the API for it (~60 ms).
    context = FlowRunContext.get()
    return context is not None and context.flow_run is not None and context.flow_run.deployment_id is not None


def _waiting(params: NightlyParams, run_id: str):
    logger = get_run_logger()

    def waiting(holder: LockHolder, waited_s: float) -> None:
        logger.warning("run %s is being run by %s; waited %.0f s, waiting up to %.0f s", run_id,
                       holder.describe(), waited_s, params.run_wait_s)

    return waiting


def _read_input(params: NightlyParams, counts: RunCounts) -> tuple[list[Document], list[RejectedDocument]]:
    with counts.timed("input"):
        return read_documents(params.corpus, id_column=params.id_column, text_column=params.text_column,
                              title_column=params.title_column, max_chars=params.max_chars, limit=params.limit)


def _process(params: NightlyParams, run_id: str) -> RunCounts:
    """The run in this process: one shard, committing to the database itself."""
    counts = RunCounts(run_id)
    with counts.timed("storage"):
        db = Database(params.db_path, retry=RetryPolicy(wait_s=params.lock_wait_s))
    # before anything slow: a second process of the run refuses (or waits) at once
    with db.running(run_id, wait_s=params.run_wait_s, on_wait=_waiting(params, run_id)):
        # the engine (torch, transformers: seconds) loads here, once the run is this process's: not with this
        # module (deploying the flow only reads it), nor in a second process of the run, which refuses first
        from flows.nightly_decode import run_in_process

        docs, rejects = _read_input(params, counts)
        run_in_process(params, db, docs, rejects, counts)
    return counts


def _process_sharded(params: NightlyParams, run_id: str) -> RunCounts:
    """The run cut into shards that run elsewhere and write part files, which this process alone ingests;
    a rerun ingests the parts an earlier parent left and plans only the documents still missing."""
    counts = RunCounts(run_id)
    # an unusable results location is refused before the database is opened: nothing written, no run row
    store = PartStore.opened(params.results_uri) if params.results_uri else PartStore.beside(params.db_path)
    # the pair first: a mistyped one is one error line, before the database holds anything of the run
    # the tokenizer and the context check need transformers: imported when a parent runs, not with the flow
    # (the tiny pair's tokenizer loads no torch, a real pair's AutoTokenizer does)
    from pipeline import keep_over_context
    from sidecar.models.pair_tokenizer import load_tokenizer

    with counts.timed("input"):
        count_tokens = partial(token_counts, load_tokenizer(params.pair))
    with counts.timed("storage"):
        db = Database(params.db_path, retry=RetryPolicy(wait_s=params.lock_wait_s))
    with db.running(run_id, wait_s=params.run_wait_s, on_wait=_waiting(params, run_id)):
        docs, rejects = _read_input(params, counts)
        with counts.timed("storage"):
            # what a shard found over the context stays rejected: no rerun launches a shard for it again
            docs, over_context = keep_over_context(docs, db.rejected_documents(run_id))
            rejects = rejects + over_context
            # the parent holds no accelerator: the run's device and GPU type are its shards', per part
            start = db.begin_run(run_id, params.model_dump(mode="json"), pair=params.pair, device=None,
                                 gpu_type=None, gamma=params.gamma, batch_size=params.batch_size, docs=docs,
                                 rejects=rejects, modes=params.modes, identity=params.resume_identity())
        try:
            missing = _supervise(params, db, store, docs, count_tokens, start.nonce, counts)
        except BaseException as exc:
            if not isinstance(exc, DatabaseLockedError):
                db.finish_run(run_id, "failed", f"{type(exc).__name__}: {exc}")
            raise
        with counts.timed("storage"):
            if missing:
                error = missing_error(missing, params.shard_retries)
                db.finish_run(run_id, "failed", error)
                raise IncompleteRunError(f"run {run_id}: {error}")
            db.finish_run(run_id, "completed")
    create_markdown_artifact(counts.markdown(), key="nightly-summary", description=f"Nightly run {run_id}")
    return counts


def _supervise(params: NightlyParams, db: Database, store: PartStore, docs: list[Document],
               count_tokens: Callable[[Sequence[Document]], list[int]], nonce: str,
               counts: RunCounts) -> list[Document]:
    """Ingest what an earlier parent's attempts of this start of the run (``nonce``) left, plan the rest into
    shards and run them to the end; returns the documents no attempt finished."""
    logger = get_run_logger()
    run_id, modes = counts.run_id, list(params.modes)
    # a deployment's runs are limited by its pool's workers: as many at once as there can be shards
    max_running = _max_running(params, params.shard_count())
    supervisor = ShardSupervisor(db, store, _launcher(params), params, run_id, nonce, max_running, counts, logger)
    supervisor.ingest()
    with counts.timed("storage"):
        done = db.done_doc_ids(run_id, modes)
    todo = [d for d in docs if d.doc_id not in done]
    counts.documents, counts.skipped_done = len(docs), len(docs) - len(todo)
    shards = _plan(params, todo, count_tokens, counts)
    logger.info("run %s: %d documents, %d already done, %d shards of %s tokens, at most %d at once", run_id,
                len(docs), counts.skipped_done, len(shards), "/".join(str(s.tokens) for s in shards),
                min(max_running, len(shards)))
    missing = supervisor.run(shards)
    with counts.timed("storage"):
        counts.done = len(db.done_doc_ids(run_id, modes) - done)
    return missing


def _plan(params: NightlyParams, docs: list[Document], count_tokens: Callable[[Sequence[Document]], list[int]],
          counts: RunCounts) -> list[Shard]:
    with counts.timed("input"):
        tokens = count_tokens(docs)
    return plan_shards(docs, params.shard_count(), tokens)


def _max_running(params: NightlyParams, shards: int) -> int:
    # a work pool's workers limit a deployment's runs themselves; local processes are this machine's slots
    return shards if params.shard_deployment else params.workers


def _launcher(params: NightlyParams) -> ShardLauncher:
    if params.shard_deployment:
        from flows.shard_deployments import ShardDeployments

        return ShardDeployments(params.shard_deployment)
    from prefect import get_client

    from flows.embedded import on_embedded_api
    from flows.shard_processes import ShardProcesses

    # this flow's own API, the embedded one too: the shards' flow runs are listed beside this one
    return ShardProcesses(params.workers, str(get_client(sync_client=True).api_url), embedded=on_embedded_api())


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
