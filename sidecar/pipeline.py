"""Orchestration helpers for the flows: documents through the engine, storage records out.

Everything here is plain Python (no Prefect), so the flows in ``flows/`` only sequence these calls and
hold no model code and no SQL. A batch runs every requested mode for its documents:

* ``sidecar``: the sidecar task with the document evicted from the draft's cache;
* ``sidecar_attended``: the same task attending to the document;
* ``standalone``: the draft model as a separate tagger, prompted with only the produced summary.

A batch that runs out of accelerator memory is split in half and retried, down to single documents; a
document that still runs out is returned as a failure and the others go on.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import typer

from sidecar.engine import DocumentResult, SidecarEngine, SidecarOutput, SidecarRequest
from sidecar.prompts import encode
from sidecar.tasks import SidecarTask
from storage import RESULTS_TABLE_SQL, Database, Document, OutputRecord, RejectedDocument, RequestStats

SIDECAR_MODES = ("sidecar", "sidecar_attended")
DEFAULT_MODES = ("sidecar", "standalone")
# The reject reason of a document that ran out of memory on its own; resuming the run retries it.
OOM_REASON = "oom"
# CUDA OOM messages run to a paragraph of allocator advice; the stored error keeps the start.
MAX_ERROR_CHARS = 500



def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA OOM: ``torch.OutOfMemoryError``, or the plain RuntimeError older kernels and backends raise."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


@dataclass(frozen=True)
class BatchSettings:
    """What every batch of a run does: one sidecar task, in the given modes."""

    task: SidecarTask
    modes: tuple[str, ...] = DEFAULT_MODES
    max_new_tokens: int = 128

    def __post_init__(self) -> None:
        unknown = sorted(set(self.modes) - {*SIDECAR_MODES, "standalone"})
        if not self.modes or unknown:
            raise ValueError(f"modes must be a non-empty subset of sidecar, sidecar_attended, standalone; "
                             f"got {list(self.modes)}")

    def mode_task(self, mode: str) -> SidecarTask:
        """The task as a mode runs it: only ``sidecar_attended`` keeps the document in the draft's cache."""
        return self.task.model_copy(update={"attend_document": mode == "sidecar_attended"})


@dataclass
class DocumentFailure:
    doc: Document
    error: str

    def as_reject(self) -> RejectedDocument:
        return RejectedDocument(doc_id=self.doc.doc_id, reason=OOM_REASON, row_index=self.doc.row_index,
                                detail=self.error, title=self.doc.title, text=self.doc.text)


@dataclass
class BatchOutcome:
    records: list[OutputRecord] = field(default_factory=list)
    failures: list[DocumentFailure] = field(default_factory=list)
    # sub-batches that ran to the end; 1 when the batch needed no split
    sub_batches: int = 0
    oom_splits: int = 0
    # time inside engine calls, failed attempts included
    model_seconds: float = 0.0

    @property
    def done_doc_ids(self) -> list[str]:
        return list(dict.fromkeys(r.doc_id for r in self.records))


# -- input checks -----------------------------------------------------------------------------------------


def context_need(engine: SidecarEngine, doc: Document, settings: BatchSettings) -> tuple[int, int]:
    """(tokens the document's longest phase needs, the context it has), as the engine will count them."""
    tasks = [settings.mode_task(mode) for mode in settings.modes if mode in SIDECAR_MODES]
    bare, compound = engine.prompts(SidecarRequest(doc.text, sidecars=tasks[:1]))
    gamma = engine.decoder.gamma
    # the speculative phase checks prompt + new tokens + one draft window against the target's context
    need = max(len(bare.token_ids), len(compound.token_ids)) + settings.max_new_tokens + gamma + 1
    if tasks:
        # the draft continues the same cache with the bridge and the sidecar task's tokens
        bridge = len(encode(engine.pair.tokenizer, settings.task.bridge))
        need = max(need, len(compound.token_ids) + settings.max_new_tokens + bridge + settings.task.max_new_tokens + 1)
    limit = min(engine.pair.max_context, int(engine.pair.draft.config.max_position_embeddings))
    return need, limit


def split_by_context(engine: SidecarEngine, docs: Iterable[Document],
                     settings: BatchSettings) -> tuple[list[Document], list[RejectedDocument]]:
    """Documents that fit the models' context, and rejects (reason ``over_context``) for those that do not.

    Checked in tokens before any batch runs, so one over-long article is a reject instead of an
    InputError that fails its whole batch.
    """
    fit: list[Document] = []
    rejects: list[RejectedDocument] = []
    for doc in docs:
        need, limit = context_need(engine, doc, settings)
        if need <= limit:
            fit.append(doc)
        else:
            rejects.append(RejectedDocument(
                doc_id=doc.doc_id, reason="over_context", row_index=doc.row_index, title=doc.title, text=doc.text,
                detail=f"needs {need} tokens (prompt, {settings.max_new_tokens} summary tokens and the sidecar "
                       f"task); the model context is {limit} tokens"))
    return fit, rejects


# -- batches ------------------------------------------------------------------------------------------------


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


def run_batch(engine: SidecarEngine, docs: Sequence[Document], settings: BatchSettings) -> BatchOutcome:
    """Run ``docs`` in every mode of ``settings``; on OOM split in halves down to single documents.

    Each sub-batch that completes gets ``batch_id`` = the ``row_index`` of its first document, which is
    unique in a run and the same when a resumed run repeats the batch.
    """
    outcome = BatchOutcome()
    pending: list[list[Document]] = [list(docs)] if docs else []
    while pending:
        chunk = pending.pop(0)
        started = time.perf_counter()
        error: str | None = None
        try:
            outcome.records += run_modes(engine, chunk, settings, batch_id=chunk[0].row_index)
            outcome.sub_batches += 1
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
        finally:
            outcome.model_seconds += time.perf_counter() - started
        if error is None:
            continue
        # Outside the except block the traceback, and the activations its frames hold, are gone, so the
        # allocator can hand their memory to the retry.
        release_memory()
        if len(chunk) == 1:
            outcome.failures.append(DocumentFailure(chunk[0], error))
        else:
            outcome.oom_splits += 1
            middle = len(chunk) // 2
            pending[:0] = [chunk[:middle], chunk[middle:]]
    return outcome


def release_memory() -> None:
    """Hand cached, unused accelerator memory back, for a retry or for another process's model."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_modes(engine: SidecarEngine, docs: Sequence[Document], settings: BatchSettings,
              batch_id: int | None = None) -> list[OutputRecord]:
    """One engine pass per sidecar mode, then the standalone tagger on the summaries; records per mode.

    The two sidecar modes run as separate passes although one pass could carry both tasks: the engine
    decodes all of a pass's sidecar rows in shared chunks, and rows of both modes in one chunk would
    give neither mode its own batch time in ``request_stats``.
    """
    size = len(docs)
    records: list[OutputRecord] = []
    sidecar_modes = [m for m in settings.modes if m in SIDECAR_MODES]
    summaries: list[DocumentResult] | None = None
    for mode in sidecar_modes:
        task = settings.mode_task(mode)
        results = engine.run([SidecarRequest(d.text, sidecars=[task]) for d in docs],
                             max_new_tokens=settings.max_new_tokens, batch_size=size)
        records += [sidecar_record(d, mode, r, task.name, batch_id) for d, r in zip(docs, results, strict=True)]
        summaries = summaries or results
    if "standalone" in settings.modes:
        if summaries is None:  # standalone only: the summaries still come from the speculative pass
            summaries = engine.run([SidecarRequest(d.text) for d in docs], max_new_tokens=settings.max_new_tokens,
                                   batch_size=size)
        task = settings.mode_task("standalone")
        texts = [r.main.text for r in summaries]
        tagged = engine.standalone(texts, [task], batch_size=size)
        records += [standalone_record(d, text, outputs[task.name], batch_id)
                    for d, text, outputs in zip(docs, texts, tagged, strict=True)]
    return records


def _tags(output: SidecarOutput) -> list[str] | None:
    return output.parsed if isinstance(output.parsed, list) else None


def sidecar_record(doc: Document, mode: str, result: DocumentResult, task_name: str,
                   batch_id: int | None) -> OutputRecord:
    main = result.main
    output = result.sidecars[task_name]
    main_stats = main.stats.as_dict()
    return OutputRecord(
        doc_id=doc.doc_id, mode=mode, summary=main.text, sidecar_name=task_name, sidecar_text=output.text,
        tags=_tags(output), main_tokens=main.stats.new_tokens, parse_error=output.parse_error,
        finish_reason=main.finish_reason, sidecar_finish_reason=output.finish_reason, batch_id=batch_id,
        stats=[RequestStats.main_phase(main_stats),
               RequestStats.sidecar_phase(output.stats.as_dict())],
    )


def standalone_record(doc: Document, summary: str, output: SidecarOutput, batch_id: int | None) -> OutputRecord:
    return OutputRecord(
        doc_id=doc.doc_id, mode="standalone", summary=summary, sidecar_name=output.name,
        sidecar_text=output.text, tags=_tags(output), parse_error=output.parse_error,
        sidecar_finish_reason=output.finish_reason, batch_id=batch_id,
        stats=[RequestStats.sidecar_phase(output.stats.as_dict())],
    )


# -- storage -------------------------------------------------------------------------------------------------


def store_outcomes(db: Database, run_id: str, outcomes: Sequence[BatchOutcome], finish: str | None = None) -> None:
    """Outputs of ``outcomes`` and their failed documents (as ``oom`` rejects) in one transaction; with
    ``finish``, that transaction also finishes the run with this status (see ``Database.write_batch``)."""
    records = [r for o in outcomes for r in o.records]
    rejects = [f.as_reject() for o in outcomes for f in o.failures]
    if records or rejects:
        db.write_batch(run_id, records, rejects, finish=finish)
    elif finish is not None:
        # nothing to write, but the caller relies on the run being finished
        db.finish_run(run_id, finish)


@dataclass
class PendingCommit:
    """Finished batches waiting to be committed together.

    A commit costs a DuckDB connection and a transaction, some 50-70 ms on a local disk whatever its
    size: committing every batch of a fast pair spends a large share of the model's time there
    (bench/orchestration_overhead.py). Batches are grouped until ``interval_s`` has passed since the
    oldest one finished, so a crash costs at most that much finished work plus the running batch;
    ``interval_s=0`` commits every batch.
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

    def commit(self, db: Database, run_id: str, finish: str | None = None) -> int:
        """Write every pending batch in one transaction, finishing the run with status ``finish`` in it if
        given; returns the documents it finished."""
        store_outcomes(db, run_id, self.outcomes, finish)
        done = sum(len(o.done_doc_ids) for o in self.outcomes)
        self.outcomes = []
        return done


@dataclass
class RunCounts:
    """What a run did, for the summary artifact and the command line."""

    run_id: str
    documents: int = 0
    done: int = 0
    skipped_done: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    batches: int = 0
    # DuckDB transactions that committed outputs (several batches each when they are fast)
    commits: int = 0
    oom_splits: int = 0
    # where the run's time went: engine calls; DuckDB (every call); reading, tokenizing and checking the
    # input, loading the pair. The rest of a run's wall time is Prefect's: inside the flow function
    # (``process_seconds``, its wall time before judge and cost report), task runs and artifacts; around
    # it, the flow run's start and finish.
    model_seconds: float = 0.0
    storage_seconds: float = 0.0
    input_seconds: float = 0.0
    process_seconds: float = 0.0
    # final state of each flow run afterwards (judge, cost-report), when the run triggered them itself
    downstream: dict[str, str] = field(default_factory=dict)

    @contextlib.contextmanager
    def timed(self, what: Literal["storage", "input"]) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            name = f"{what}_seconds"
            setattr(self, name, getattr(self, name) + time.perf_counter() - started)

    def add_rejects(self, rejects: Iterable[RejectedDocument]) -> None:
        for reject in rejects:
            self.rejected[reject.reason] = self.rejected.get(reject.reason, 0) + 1

    def add_outcome(self, outcome: BatchOutcome) -> None:
        self.done += len(outcome.done_doc_ids)
        self.batches += 1
        self.oom_splits += outcome.oom_splits
        self.model_seconds += outcome.model_seconds
        self.errors.update({f.doc.doc_id: f.error for f in outcome.failures})

    def markdown(self) -> str:
        lines = [
            f"# Nightly run `{self.run_id}`", "",
            "| documents | count |", "|---|---:|",
            f"| usable in input | {self.documents} |",
            f"| done in this run | {self.done} |",
            f"| skipped, already done | {self.skipped_done} |",
            *(f"| rejected: {reason} | {count} |" for reason, count in sorted(self.rejected.items())),
            f"| errors | {len(self.errors)} |", "",
            f"{self.batches} batches in {self.commits} commits, {self.oom_splits} out-of-memory splits; "
            f"{self.model_seconds:.1f} s in the models, {self.storage_seconds:.2f} s in DuckDB, "
            f"{self.input_seconds:.2f} s reading the input and loading the pair.",
        ]
        if self.errors:
            lines += ["", "## Errors", "", "| doc | error |", "|---|---|"]
            lines += [f"| {_cell(doc_id)} | {_cell(error)} |" for doc_id, error in self.errors.items()]
        return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")



# -- command line: `sidecar nightly` and `sidecar demo` ---------------------------------------------------------

pipeline_app = typer.Typer()


@contextlib.contextmanager
def embedded_prefect() -> Iterator[None]:
    """Settings for flows run in this process, as ``sidecar nightly`` runs them.

    Without ``PREFECT_API_URL``, Prefect starts an embedded API for the run; on a busy two-core machine it
    needs more than its default 20 s to come up. Analytics stay off: the machine may have no network.

    On that embedded API, flow run heartbeats are off. They exist so that a server's automations can mark
    a silent run crashed, but the embedded API stops with this process, so nobody watches them; and
    Prefect stops the heartbeat thread by waiting for its 1 s sleep, 0-1 s per flow run, at random
    (bench/orchestration_overhead.py). A crashed run is recovered by rerunning it, which resumes from
    DuckDB. With ``PREFECT_API_URL`` set (a real server, or a worker's runs) heartbeats stay as configured.
    """
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    if PREFECT_API_URL.value():
        yield
        return
    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


def _run_nightly(**values: Any) -> tuple[RunCounts, Database]:
    # entered before Prefect is imported: its settings read the environment once
    with embedded_prefect():
        from pydantic import ValidationError

        from flows.nightly import NightlyParams, nightly
        from sidecar.errors import PairError
        from storage import InputSchemaError

        values["modes"] = [m.strip() for m in values["modes"].split(",") if m.strip()]
        try:
            params = NightlyParams(**values)
            counts = nightly(params)
        except (ValidationError, InputSchemaError, FileNotFoundError, PairError) as exc:
            typer.secho(f"error: {exc}", fg="red", err=True)
            raise typer.Exit(2) from exc
    return counts, Database(params.db_path)


@pipeline_app.command("nightly")
def nightly_command(
    corpus: str = typer.Option("data/news.parquet", help="Parquet file, one document per row."),
    limit: int | None = typer.Option(None, min=1, help="Run only the first N usable documents."),
    pair: str = typer.Option("qwen-coder-small", help="Model pair: tiny, qwen-coder-small, qwen2.5-7b or T,D."),
    db: str = typer.Option("data/sidecar.duckdb", help="Results database (DuckDB)."),
    batch_size: int = typer.Option(8, min=1, help="Documents decoded together."),
    gamma: int = typer.Option(4, min=1, help="Draft tokens per target forward (adaptive)."),
    max_new_tokens: int = typer.Option(128, min=1, help="Summary tokens per document."),
    modes: str = typer.Option("sidecar,standalone", help="Comma-separated: sidecar, sidecar_attended, standalone."),
    id_column: str = typer.Option("id", help="Id column of the corpus."),
    text_column: str = typer.Option("article", help="Text column of the corpus."),
    title_column: str | None = typer.Option(None, help="Optional title column of the corpus."),
    run_id: str | None = typer.Option(None, help="Resume or name a run (default: from parameters and date)."),
    commit_every: float = typer.Option(10.0, min=0, help="Commit finished batches at least this often, in "
                                       "seconds (0: every batch)."),
    judge: bool = typer.Option(True, help="Run the judge flow afterwards."),
    cost_report: bool = typer.Option(True, help="Run the cost-report flow afterwards."),
) -> None:
    """Run the nightly flow once, on an embedded Prefect API (no server needed); a rerun resumes it."""
    counts, _ = _run_nightly(
        corpus=corpus, limit=limit, pair=pair, db_path=db, batch_size=batch_size, gamma=gamma,
        max_new_tokens=max_new_tokens, modes=modes, id_column=id_column, text_column=text_column,
        title_column=title_column, run_id=run_id, commit_every_s=commit_every, trigger_judge=judge,
        trigger_cost_report=cost_report)
    typer.echo(counts.markdown())
    _echo_downstream(counts)


def _echo_downstream(counts: RunCounts) -> None:
    """Print how judge and cost report ended; exit 1 after printing when one of them did not complete."""
    for name, state in counts.downstream.items():
        typer.secho(f"{name}: {state}", fg="green" if state == "Completed" else "red")
    if any(state != "Completed" for state in counts.downstream.values()):
        raise typer.Exit(1)


@pipeline_app.command("demo")
def demo_command(
    corpus: str = typer.Option("data/news.parquet", help="Parquet file, one document per row."),
    limit: int = typer.Option(4, min=1, help="Documents to run."),
    db: str = typer.Option("data/sidecar.duckdb", help="Results database (DuckDB)."),
    pair: str = typer.Option("qwen-coder-small", help="Model pair."),
    batch_size: int = typer.Option(4, min=1, help="Documents decoded together."),
    max_new_tokens: int = typer.Option(128, min=1, help="Summary tokens per document."),
    title_column: str | None = typer.Option("title", help="Title column of the corpus (empty: none)."),
) -> None:
    """Nightly, judge and cost report on a few real news articles, then the results table and its SQL."""
    started = time.perf_counter()
    counts, database = _run_nightly(
        corpus=corpus, limit=limit, pair=pair, db_path=db, batch_size=batch_size, gamma=4,
        max_new_tokens=max_new_tokens, modes="sidecar,standalone", id_column="id", text_column="article",
        title_column=title_column or None, run_id=None, trigger_judge=True, trigger_cost_report=True)
    print_results(database, counts.run_id)
    typer.echo(f"{counts.done} documents done, {counts.skipped_done} already done, "
               f"{sum(counts.rejected.values())} rejected, {len(counts.errors)} errors; "
               f"{time.perf_counter() - started:.0f} s in all.")
    if counts.downstream.get("cost-report") == "Completed":
        from flows.cost_report import report_dir

        typer.echo(f"cost report: {report_dir(db, counts.run_id) / 'cost_report.md'}")
    _echo_downstream(counts)


def print_results(db: Database, run_id: str) -> None:
    from rich.console import Console
    from rich.syntax import Syntax
    from rich.table import Table

    rows = db.results_table(run_id)
    table = Table(title=f"results of run {run_id}", show_lines=True)
    for name in ("doc_id", "title", "summary", "sidecar_tags", "standalone_tags"):
        table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(row["doc_id"], row["title"] or "", row["summary"],
                      *(" ".join(f"#{t}" for t in tags) if tags else "(unparsed)"
                        for tags in (row["sidecar_tags"], row["standalone_tags"])))
    console = Console()
    console.print(table)
    console.print(f"-- {len(rows)} rows from {db.path}, with ? = {run_id!r}")
    console.print(Syntax(RESULTS_TABLE_SQL, "sql"))
