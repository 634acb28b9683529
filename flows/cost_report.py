"""The ``cost-report`` flow: measured throughput from DuckDB in, the cost report and its plots out.

The report files (markdown, HTML, PNG plots; for one run with a cost verdict per sidecar task,
``study.report.task_costs``, each named by its task) go next to the database, under ``cost_report/<run key>/``
(``storage.run_keys.run_key``: a run id never names a path) or ``cost_report/all-runs/``; the cost lines
go into the ``cost_estimates`` table; the markdown and the lines are published as Prefect artifacts, and
the HTML page and each plot as a link artifact to its file (the markdown's images are relative links,
which the Prefect UI cannot resolve).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

from storage import CostRecord, Database
from storage.run_keys import check_run_id, run_key
from study.report import write_cost_report


@dataclass(frozen=True)
class CostReportResult:
    out_dir: Path
    measurements: int
    cost_rows: int
    files: list[Path]


def report_dir(db_path: str | Path, run_id: str | None) -> Path:
    """Where the report of ``run_id`` (None: of every run) goes; a run key never reads ``all-runs``."""
    return Path(db_path).parent / "cost_report" / (run_key(run_id) if run_id is not None else "all-runs")


@flow(name="cost-report")
def cost_report(db_path: str = "data/sidecar.duckdb", run_id: str | None = None) -> CostReportResult:
    """Cost report for one run's measurements, or for every run's when ``run_id`` is not given."""
    if run_id is not None:
        check_run_id(run_id)
    logger = get_run_logger()
    db = Database(db_path)
    measurements = db.throughput(run_id)
    out_dir = report_dir(db_path, run_id).resolve()
    # the run's sidecar tasks name its tokens ("headline tokens"), and one run's get a verdict each
    report = write_cost_report(measurements, out_dir, acceptance=db.request_acceptance(run_id),
                               tasks=list(db.sidecar_tasks(run_id)),
                               task_costs=db.task_costs(run_id) if run_id is not None else ())
    records = [CostRecord(**row) for row in report.cost_rows]
    db.write_costs(records)
    scope = f"run {run_id}" if run_id else "all runs"
    paths = list(report.paths)
    files = "\n".join(f"- `{path}`" for path in paths)
    create_markdown_artifact(f"{report.markdown}\n## Files\n\nOn the machine that ran this flow (the link "
                             f"artifacts point to them):\n\n{files}\n", key="cost-report",
                             description=f"Cost report, {scope}")
    if report.cost_rows:
        create_table_artifact(report.cost_rows, key="cost-report-lines", description=f"Cost lines, {scope}")
    for name, path in {"html": report.html_path, **report.plot_paths}.items():
        create_link_artifact(path.as_uri(), link_text=path.name, key=f"cost-report-{name.replace('_', '-')}",
                             description=f"Cost report {name.replace('_', ' ')}, {scope}")
    logger.info("cost report for %s: %d measurement rows, %d cost lines, files in %s", scope, len(measurements),
                len(records), out_dir)
    return CostReportResult(out_dir, len(measurements), len(records), paths)
