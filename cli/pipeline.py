"""``sidecar nightly`` and ``sidecar demo``: the nightly flow, with judge and cost report, in this process."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import typer

from cli.demo_report import DemoFindings, render
from cli.run_ids import checked_run_id
from flows.embedded import embedded_prefect
from sidecar.settings import DTYPE_HELP, pin_dtype
from sidecar.tasks.prompts import DEFAULT_SYSTEM, SUMMARIZE_INSTRUCTION
from vocab.modes import MODES

if TYPE_CHECKING:
    from pipeline import RunCounts
    from storage import Database

pipeline_app = typer.Typer()

CORPUS_HELP = "Corpus file, one document per row: .parquet, .jsonl (a JSON object a line) or .csv (a header row)."
INSTRUCTION_HELP = "The main task: what the target writes after each document ('' for none)."
SYSTEM_HELP = "The system prompt before each document ('' for none)."
TASKS_HELP = "A .yaml or .json list of sidecar tasks (docs/tasks.md) in place of the hashtags task."


def _tasks(path: str | None) -> list[dict[str, Any]] | None:
    """The tasks of ``--tasks``, as NightlyParams's ``sidecar_tasks`` (None: the default)."""
    if path is None:
        return None
    from sidecar.tasks.tasks_file import load_tasks

    return [task.model_dump() for task in load_tasks(path)]


def _run_nightly(**values: Any) -> tuple[RunCounts, Database]:
    # a bad parameter, corpus or database raises its own error, which cli.errors turns into one line; the
    # parameters and the corpus's columns are checked before a Prefect API starts (neither imports Prefect)
    from flows.nightly_params import NightlyParams

    values["modes"] = [m.strip() for m in values["modes"].split(",") if m.strip()]
    if values.get("sidecar_tasks") is None:
        values.pop("sidecar_tasks", None)
    params = NightlyParams(**values)
    from storage.parquet import check_corpus

    check_corpus(params.corpus, params.id_column, params.text_column, params.title_column)
    # entered before Prefect is imported: its settings read the environment once
    with embedded_prefect():
        from flows.nightly import nightly
        from storage import Database

        counts = nightly(**params.model_dump())
    return counts, Database(params.db_path)


@pipeline_app.command("nightly")
def nightly_command(
    corpus: str = typer.Option("data/news.parquet", help=CORPUS_HELP),
    limit: int | None = typer.Option(None, min=1, help="Run only the first N usable documents."),
    pair: str = typer.Option("qwen-coder-small", help="Model pair: tiny, qwen-coder-small, qwen2.5-7b or T,D."),
    dtype: str | None = typer.Option(None, help=DTYPE_HELP + " Sets SIDECAR_DTYPE for the run's processes."),
    db: str = typer.Option("data/sidecar.duckdb", help="Results database (DuckDB)."),
    batch_size: int = typer.Option(8, min=1, help="Documents decoded together, at most; they join as others "
                                   "finish."),
    window: int | None = typer.Option(None, min=1, help="Documents read ahead and sorted by length before they "
                                      "stream through the engine (default: 8 x batch size)."),
    gamma: int = typer.Option(4, min=1, help="Draft tokens per target forward (adaptive)."),
    max_new_tokens: int = typer.Option(128, min=1, help="Main output tokens per document."),
    instruction: str = typer.Option(SUMMARIZE_INSTRUCTION, help=INSTRUCTION_HELP),
    system: str = typer.Option(DEFAULT_SYSTEM, help=SYSTEM_HELP),
    tasks: str | None = typer.Option(None, help=TASKS_HELP),
    modes: str = typer.Option("sidecar,standalone", help=f"Comma-separated: {', '.join(MODES)}."),
    id_column: str = typer.Option("id", help="Id column of the corpus."),
    text_column: str = typer.Option("article", help="Text column of the corpus."),
    title_column: str | None = typer.Option(None, help="Optional title column of the corpus."),
    run_id: str | None = typer.Option(None, callback=checked_run_id,
                                      help="Resume or name a run (default: from parameters and date)."),
    commit_every: float = typer.Option(10.0, min=0, help="Commit finished documents at least this often, in "
                                       "seconds (0: as they finish)."),
    lock_wait_s: float = typer.Option(600.0, min=0, help="How long each database write waits while another "
                                      "process (a notebook, the judge) holds the file."),
    run_wait_s: float = typer.Option(0.0, min=0, help="How long to wait while another process runs the same "
                                     "run id (0: refuse, exit code 4)."),
    device_wait_s: float | None = typer.Option(None, min=0, help="How long to wait while another run holds the "
                                               "accelerator (default: as long as it takes; 0: refuse, exit 4)."),
    judge: bool = typer.Option(True, help="Run the judge flow afterwards."),
    cost_report: bool = typer.Option(True, help="Run the cost-report flow afterwards."),
    workers: int = typer.Option(1, min=1, help="Shard processes at once on this machine: one per GPU, or on a "
                                "CPU each with its share of the cores (1: the run in this process)."),
    shards: int | None = typer.Option(None, min=1, help="Shards the documents are cut into, balanced by tokens "
                                      "(default: --workers)."),
    results_uri: str | None = typer.Option(None, help="Where shards write their part files: a directory or a URI "
                                           "pyarrow opens (default: beside the database, <db>.runs/parts)."),
    shard_retries: int = typer.Option(2, min=0, help="Relaunches per shard after a failed, crashed or stalled "
                                      "attempt; then the run ends failed naming the missing documents (exit 1)."),
    shard_stall_s: float = typer.Option(3600.0, min=0.001, help="Cancel and relaunch an attempt that wrote no part "
                                        "for this long, in seconds."),
) -> None:
    """Run the nightly flow once, on an embedded Prefect API (no server needed); a rerun resumes it."""
    pin_dtype(dtype)
    counts, _ = _run_nightly(
        corpus=corpus, limit=limit, pair=pair, db_path=db, batch_size=batch_size, window=window, gamma=gamma,
        max_new_tokens=max_new_tokens, instruction=instruction, system=system, sidecar_tasks=_tasks(tasks),
        modes=modes, id_column=id_column, text_column=text_column, title_column=title_column, run_id=run_id,
        commit_every_s=commit_every,
        lock_wait_s=lock_wait_s, run_wait_s=run_wait_s, device_wait_s=device_wait_s, trigger_judge=judge,
        trigger_cost_report=cost_report, workers=workers, shards=shards, results_uri=results_uri,
        shard_retries=shard_retries, shard_stall_s=shard_stall_s)
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
    corpus: str = typer.Option("data/news.parquet", help=CORPUS_HELP),
    limit: int = typer.Option(4, min=1, help="Documents to run."),
    db: str = typer.Option("data/sidecar.duckdb", help="Results database (DuckDB)."),
    pair: str = typer.Option("qwen-coder-small", help="Model pair."),
    dtype: str | None = typer.Option(None, help=DTYPE_HELP),
    batch_size: int = typer.Option(4, min=1, help="Documents decoded together."),
    max_new_tokens: int = typer.Option(128, min=1, help="Main output tokens per document."),
    instruction: str = typer.Option(SUMMARIZE_INSTRUCTION, help=INSTRUCTION_HELP),
    system: str = typer.Option(DEFAULT_SYSTEM, help=SYSTEM_HELP),
    tasks: str | None = typer.Option(None, help=TASKS_HELP),
    title_column: str | None = typer.Option("title", help="Title column of the corpus (empty: none)."),
) -> None:
    """Nightly, judge and cost report on a few real news articles, then the results table and its SQL."""
    pin_dtype(dtype)
    started = time.perf_counter()
    typer.secho("The nightly flow, then the judge and the cost report, on a temporary Prefect API in this\n"
                "process: no server to set up (`sidecar ui` starts one). What they found is reported last.", fg="cyan")
    counts, database = _run_nightly(
        corpus=corpus, limit=limit, pair=pair, db_path=db, batch_size=batch_size, gamma=4,
        max_new_tokens=max_new_tokens, instruction=instruction, system=system, sidecar_tasks=_tasks(tasks),
        modes="sidecar,standalone", id_column="id", text_column="article", title_column=title_column or None,
        run_id=None, trigger_judge=True, trigger_cost_report=True)
    typer.echo(f"{counts.done} documents done, {counts.skipped_done} already done, "
               f"{sum(counts.rejected.values())} rejected, {len(counts.errors)} errors.")
    render(findings(database, counts.run_id, time.perf_counter() - started))
    _echo_downstream(counts)


def findings(db: Database, run_id: str, seconds: float) -> DemoFindings:
    """What the demo's closing report shows, from the database and the cost report's files."""
    import json

    from flows.cost_report import report_dir
    from study.judge import bootstrap_ci

    out_dir = report_dir(db.path, run_id)
    headline = out_dir / "headline.json"
    html = out_dir / "cost_report.html"
    # judged per task (migration 013): every key holds the task
    tallies = {(t["task"], t["judge_model"], t["prompt_version"]): t for t in db.judge_tally(run_id)}
    judge = []
    for quality in db.judge_quality(run_id):  # a method that gave nothing (unavailable) has no tally
        tally = tallies.get((quality["task"], quality["judge_model"], quality["prompt_version"]),
                            {"documents": 0, "preferences": []})
        judge.append(quality | tally | {"preference_ci": bootstrap_ci(tally["preferences"])})
    # the run's headline verdict is its results task's (hashtags), as the report's rows show it
    verdict = db.query("SELECT verdict FROM judge_headline WHERE run_id = ? ORDER BY task <> 'hashtags', task "
                       "LIMIT 1", [run_id])
    return DemoFindings(run_id=run_id, db_path=db.path, rows=db.results_table(run_id), judge=judge,
                        headline=json.loads(headline.read_text()) if headline.exists() else None,
                        html_path=html if html.exists() else None, seconds=seconds,
                        judge_verdict=verdict[0]["verdict"] if verdict else None,
                        tasks=tuple(db.sidecar_tasks(run_id)) or ("hashtags",), outputs=db.task_outputs(run_id),
                        judge_tasks=db.judge_verdicts(run_id))
