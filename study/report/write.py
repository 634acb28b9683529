"""``write_cost_report``: the report's files (markdown, HTML, PNG plots) and its rows for ``cost_estimates``."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from study.cost import (
    DEFAULT_BATCHES,
    DEFAULT_GAMMA,
    GPU,
    STUDY_WORKLOAD,
    Workload,
    draft_config,
    load_catalog,
    usd_per_million_tokens,
)
from study.report.assemble import ReportData, assemble
from study.report.capture import SPECULATION_PAIR, report_floors
from study.report.headline import Headline, headline
from study.report.plots import plot_acceptance, plot_step_times, plot_usd
from study.report.projections import DraftConfig, tag_tokens_per_s, tag_usd_per_million
from study.report.render import render
from study.report.sections import sections
from study.report.verdicts import Verdict


@dataclass(frozen=True)
class CostReport:
    """What ``write_cost_report`` wrote, with the cost rows and verdicts it computed."""

    markdown: str
    markdown_path: Path
    html_path: Path
    plot_paths: dict[str, Path]
    cost_rows: list[dict[str, Any]]
    verdicts: list[Verdict]
    headline: Headline | None
    headline_path: Path  # headline.json: the headline as a dict, or null

    @property
    def paths(self) -> list[Path]:
        return [self.markdown_path, self.html_path, self.headline_path, *self.plot_paths.values()]


def write_cost_report(
    measurements: Sequence[Mapping[str, Any]],
    out_dir: Path,
    *,
    catalog: Mapping[str, GPU] | None = None,
    acceptance: Sequence[Mapping[str, Any]] = (),
    draft_config: DraftConfig = draft_config,
    study_workload: Workload = STUDY_WORKLOAD,
    batches: Sequence[int] = DEFAULT_BATCHES,
    reference_batch: int | None = None,
    host_overhead: str | Path | None = None,
    tasks: Sequence[str] = (),
    task_costs: Sequence[Mapping[str, Any]] = (),
) -> CostReport:
    """Write cost_report.md, cost_report.html, headline.json and three PNG plots to ``out_dir``; see
    ``study.report``. ``host_overhead``: the host-overhead result the host floors come from (default: the
    committed one, if any). ``tasks``: the sidecar tasks the measurements count, which name their tokens
    (``vocab.task_nouns``; none: hashtags' "tag tokens"); ``task_costs``: ``Database.task_costs`` rows of one
    run, for the cost verdict per task."""
    floors = report_floors(host_overhead)
    data = assemble(
        measurements,
        out_dir,
        catalog=load_catalog() if catalog is None else catalog,
        acceptance=acceptance,
        draft_config=draft_config,
        study_workload=study_workload,
        batches=batches,
        reference_batch=reference_batch,
        host_floors=floors,
        tasks=tasks,
        task_costs=task_costs,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_step_times(data.plot_paths["step_time"], data.step_time_panels, data.groups, data.panel_of, unit=data.unit)
    plot_usd(data.plot_paths["usd_per_mtok"], data.projections[0], data.reference_batch, data.groups, data.catalog,
             unit=data.unit)
    plot_acceptance(data.plot_paths["acceptance"], data.acceptance)

    view = sections(data)
    context = {"data": data, "view": view, "unit": view.unit, "worker": view.worker, "pair": SPECULATION_PAIR,
               "gamma": DEFAULT_GAMMA}
    markdown = render("cost_report.j2", "markdown", **context)
    markdown_path = out_dir / "cost_report.md"
    html_path = out_dir / "cost_report.html"
    markdown_path.write_text(markdown, encoding="utf-8")
    html_path.write_text(render("cost_report.j2", "html", **context), encoding="utf-8")
    summary = headline(data)
    headline_path = out_dir / "headline.json"
    headline_path.write_text(json.dumps(summary.as_dict() if summary else None, indent=2), encoding="utf-8")
    return CostReport(
        markdown=markdown,
        markdown_path=markdown_path,
        html_path=html_path,
        plot_paths=data.plot_paths,
        cost_rows=_cost_rows(data),
        verdicts=data.verdicts,
        headline=summary,
        headline_path=headline_path,
    )


def _cost_rows(data: ReportData) -> list[dict[str, Any]]:
    """Rows for the ``cost_estimates`` table (storage.records.CostRecord's fields); a measured group without a
    device-time ledger has no rate, and no row."""
    rows = []
    for g in data.groups:
        if g.tag_tokens_per_s is None:
            continue
        price = data.price(g.gpu_type)
        rows.append(
            {
                "gpu_type": g.gpu_type,
                "pair": g.pair,
                "mode": g.mode,
                "batch_size": g.batch_size,
                "tokens_per_s": g.tag_tokens_per_s,
                "ms_per_step": g.tag_ms_per_step,
                "usd_per_gpu_hour": price,
                "usd_per_mtok": None if price is None else usd_per_million_tokens(price, g.tag_tokens_per_s),
                "source": "measured",
                "run_id": g.run_ids[0] if len(g.run_ids) == 1 else None,
                "note": f"tagging phase, {data.unit} tokens per attributed device second ("
                + ("prefill + decode" if g.mode == "standalone" else "prefill + decode + instruction line")
                + f"), {len(g.run_ids)} run(s) pooled",
                "timed_by": "device_ledger",
            }
        )
    for projection in data.projections:
        modelled = "the source study's shapes" if projection.pair is None else "the measured pair"
        for gpu_rows in projection.rows.values():
            rows += [
                {
                    "gpu_type": r.gpu_type,
                    "pair": projection.workload.name,
                    "mode": r.mode,
                    "batch_size": r.batch,
                    "tokens_per_s": tag_tokens_per_s(r),
                    "ms_per_step": r.ms_per_step,
                    "usd_per_gpu_hour": r.usd_per_gpu_hour,
                    "usd_per_mtok": tag_usd_per_million(r),
                    "source": "projected",
                    "run_id": None,
                    "note": f"roofline of {modelled} in {data.capture.captured.plain.label}, tagging phase: "
                    + (("prefill and decode steps" + ("" if r.mode == "standalone" else " and instruction line"))
                       if r.tag_tokens_per_s is not None else "decode steps only"),
                    "timed_by": "roofline",
                }
                for r in gpu_rows
            ]
    return rows
