"""The report's data: measurements pooled, projected, compared and calibrated, before any text or plot.

Measured step times are calibrated only against the projection of their own pair; the study workload is
projected on every catalog GPU as an extra, labelled projection. Every projection gives a verdict per
catalog GPU at the measured (reference) batch and at the batch sizes nightly jobs run on GPUs
(:data:`VERDICT_BATCHES`), measured GPU types included, so a measured row can be read beside its projection.
Every projection assumes captured mode: each forward pays the captured host floor (``capture``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from study.cost import (
    GPU,
    CalibrationRow,
    HostFloors,
    MeasuredStep,
    Workload,
    calibrate,
    count,
    find_gpu,
    project,
)
from study.report.capture import CaptureModes, capture_modes
from study.report.measurements import (
    AcceptanceKey,
    MeasuredGroup,
    Measurement,
    acceptance_by_key,
    group_measurements,
)
from study.report.projections import DraftConfig, Projection, pair_workloads
from study.report.task_costs import TaskCost, task_verdicts
from study.report.verdicts import Verdict, measured_verdicts, projected_verdict
from vocab.task_nouns import tokens_noun

DEFAULT_REFERENCE_BATCH = 32
# the batch sizes nightly jobs run on GPUs: every verdict table projects them, whatever batch was measured
VERDICT_BATCHES = (32, 64, 128)


@dataclass(frozen=True)
class ReportData:
    """Everything the report's text, plots and cost rows are written from."""

    measurements: list[Measurement]
    groups: list[MeasuredGroup]
    verdicts: list[Verdict]
    projections: list[Projection]  # the measured pairs', then the study's
    pair_projections: dict[str, Projection]
    unprojected: list[str]  # why measurements have no projection of their own pair
    unledgered: list[str]  # "GPU type (pair), batch N": tagging measured without a device-time ledger
    verdict_batches: list[int]  # the projected verdicts' batch sizes: the reference batch and VERDICT_BATCHES
    calibration: list[tuple[Projection, CalibrationRow]]
    acceptance: dict[AcceptanceKey, list[float]]
    uncatalogued: list[str]
    catalog: Mapping[str, GPU]
    batches: list[int]
    reference_batch: int
    panel_of: dict[str, str]  # measured GPU type -> its step-time panel: catalog name, else the GPU type
    step_time_panels: dict[str, Projection | None]  # panel -> projection drawn there (None: measured only)
    plot_paths: dict[str, Path]
    capture: CaptureModes  # the floors the projections assume (captured), and eager against captured
    # what the sidecar output tokens are called (vocab.task_nouns): "tag" for hashtags, "output" for several tasks
    unit: str = "tag"
    tasks: list[TaskCost] = field(default_factory=list)  # the cost verdict per sidecar task, by task

    def price(self, gpu_type: str) -> float | None:
        gpu = find_gpu(gpu_type, self.catalog)
        return None if gpu is None else gpu.usd_per_hour


def assemble(
    measurements: Sequence[Mapping[str, Any]],
    out_dir: Path,
    *,
    catalog: Mapping[str, GPU],
    acceptance: Sequence[Mapping[str, Any]],
    draft_config: DraftConfig,
    study_workload: Workload,
    batches: Sequence[int],
    reference_batch: int | None,
    host_floors: HostFloors | None = None,
    tasks: Sequence[str] = (),
    task_costs: Sequence[Mapping[str, Any]] = (),
) -> ReportData:
    """The report's data for ``write_cost_report``'s arguments; plots are to be drawn under ``out_dir``.
    ``tasks``: the sidecar tasks the measurements count (their tokens' name; none: hashtags); ``task_costs``:
    ``Database.task_costs`` rows, for a verdict per task."""
    rows = [Measurement.from_row(row) for row in measurements]
    groups = group_measurements(rows)
    tag_groups = [g for g in groups if g.tag_rows]
    if reference_batch is None:
        counts = Counter(g.batch_size for g in tag_groups)
        # The most often measured batch size (the largest of a tie), so measured and projected bars meet.
        reference_batch = max(counts, key=lambda b: (counts[b], b)) if counts else DEFAULT_REFERENCE_BATCH
    count("reference_batch", reference_batch)
    verdict_batches = sorted({reference_batch, *VERDICT_BATCHES})
    all_batches = sorted(set(batches) | set(verdict_batches))

    capture = capture_modes(host_floors, groups, catalog)
    host = capture.captured

    def projection(workload: Workload, pair: str | None = None) -> Projection:
        return Projection(workload, {gpu.name: project(workload, gpu, all_batches, host) for gpu in catalog.values()},
                          pair)

    unit = tokens_noun([*tasks, *(row["task"] for row in task_costs)])
    workloads, unprojected = pair_workloads(rows, draft_config, unit)
    pair_projections = {pair: projection(workload, pair) for pair, workload in workloads.items()}
    projections = [*pair_projections.values(), projection(study_workload)]

    measured = measured_verdicts(groups, catalog)
    projected = [
        v
        for p in projections
        for gpu in catalog.values()
        for batch in verdict_batches
        if (v := projected_verdict(p.workload, gpu, batch, host))
    ]
    unledgered = [f"{g.gpu_type} ({g.pair}), {g.mode} at batch {g.batch_size}" if g.pair
                  else f"{g.gpu_type}, {g.mode} at batch {g.batch_size}" for g in tag_groups if g.tag_cost is None]
    # Each measured step against the projection of its own pair: another model's projection says nothing.
    calibration = []
    for g in tag_groups:
        if (own := pair_projections.get(g.pair)) is not None:
            step = MeasuredStep(g.gpu_type, g.mode, g.batch_size, ms_per_step=g.tag_ms_per_step)
            calibration += [(own, row) for row in calibrate([step], own.workload, catalog)]
    panel_of = {g.gpu_type: (gpu.name if (gpu := find_gpu(g.gpu_type, catalog)) else g.gpu_type) for g in groups}
    uncatalogued = sorted({t for t in panel_of if find_gpu(t, catalog) is None})
    # A measured GPU type's panel shows the projection of the pair measured there; the others the first one.
    measured_panels: dict[str, Projection] = {}
    for g in groups:
        if (own := pair_projections.get(g.pair)) is not None:
            measured_panels.setdefault(panel_of[g.gpu_type], own)
    panels: dict[str, Projection | None] = {gpu: measured_panels.get(gpu, projections[0]) for gpu in catalog}
    panels |= {name: None for name in uncatalogued}

    return ReportData(
        measurements=rows,
        groups=groups,
        verdicts=measured + projected,
        projections=projections,
        pair_projections=pair_projections,
        unprojected=unprojected,
        unledgered=unledgered,
        verdict_batches=verdict_batches,
        calibration=calibration,
        acceptance=acceptance_by_key(acceptance),
        uncatalogued=uncatalogued,
        catalog=catalog,
        batches=all_batches,
        reference_batch=reference_batch,
        panel_of=panel_of,
        step_time_panels=panels,
        plot_paths={
            "step_time": out_dir / "step_time_vs_batch.png",
            "usd_per_mtok": out_dir / "usd_per_million_tag_tokens.png",
            "acceptance": out_dir / "acceptance_per_request.png",
        },
        capture=capture,
        unit=unit,
        tasks=task_verdicts(task_costs),
    )
