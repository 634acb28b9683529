"""What each section of the report shows, computed before any text: the templates under ``templates/`` word it.

Every sum, ratio, choice of rows and unit a section needs is worked out here, from ``ReportData``; a template
only picks the words and writes the numbers with the named filters of ``study.report.filters``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from study.cost import GPU, ProjectionRow, Workload, find_gpu, usd_per_million_tokens
from study.report.assemble import ReportData
from study.report.measurements import MeasuredGroup, Measurement
from study.report.projections import Projection, tag_usd_per_million
from study.report.tagging_cost import TaggingCost
from study.report.task_costs import TaskCost
from study.report.verdicts import Verdict
from vocab.modes import MODES


@dataclass(frozen=True)
class Introduction:
    rows: int  # throughput rows measured (0: a report of projections only)
    runs: int
    devices: list[str]  # "GPU type in dtype, capture mode (why)"
    pairs: list[str]
    captures: list[str]  # the measured runs' capture modes, without why: "eager", "compile"
    # "run R (capture ...): 2 recompile(s) after warm-up": runs whose counters must be 0 and are not
    capture_faults: list[str]
    # "run R (eager): 1.2 syncs and 35.1 ms of host time per step": the runs whose steps were counted
    step_hosts: list[str]


@dataclass(frozen=True)
class VerdictRow:
    gpu_type: str
    basis: str
    pair: str
    cells: list[Verdict | None]  # one per batch of the table; None where none was reached


@dataclass(frozen=True)
class ProjectedSummary:
    """All projected verdicts of one workload: the savings per batch size, and what the prefill weighs at the
    reference batch (the shares None where a line is unpriced)."""

    workload: Workload
    gpu_types: int
    priced: bool  # every line priced, not decode steps only
    savings: list[tuple[int, list[float]]]  # batch -> the savings across GPU types, rounded to 0.1%
    standalone_share: list[int] | None  # the prefill's share of the tagging time at the reference batch, in %
    sidecar_share: list[int] | None
    standalone_prompt: int | None  # tokens the standalone tagger prefills
    sidecar_feed: int | None  # tokens the sidecar feeds into its kept cache
    sidecar_cached: int | None
    always_dearer: bool  # every verdict at the reference batch says the sidecar costs more


@dataclass(frozen=True)
class VerdictSection:
    measured: list[Verdict]
    projected: list[Verdict]
    lead: list[str]  # the workloads whose projections the table shows
    batches: list[int]  # the table's columns
    rows: list[VerdictRow]
    summaries: list[ProjectedSummary]
    at_reference: list[Verdict]  # projected verdicts at the reference batch with every line priced
    uncompared: list[str]  # "GPU type (pair)" measured with a ledger but not in both modes at a batch


@dataclass(frozen=True)
class MeasuredRow:
    group: MeasuredGroup
    usd_per_mtok: float | None
    ms_per_tag_token: float | None


@dataclass(frozen=True)
class Acceptance:
    gpu_type: str
    pair: str
    mode: str
    rates: list[float]


@dataclass(frozen=True)
class Eviction:
    gpu_type: str
    pair: str
    batch: int
    attended_ms: float
    evicted_ms: float
    measured_pct: float
    projected_pct: float | None


@dataclass(frozen=True)
class ProjectedRow:
    gpu: GPU
    batch: int
    attended: ProjectionRow | None
    evicted: ProjectionRow | None
    standalone: ProjectionRow | None
    speedup_pct: float | None  # attended over evicted step time, less one

    @property
    def sidecar_usd(self) -> float | None:
        return None if self.evicted is None else tag_usd_per_million(self.evicted)

    @property
    def standalone_usd(self) -> float | None:
        return None if self.standalone is None else tag_usd_per_million(self.standalone)


@dataclass(frozen=True)
class ProjectionTable:
    projection: Projection
    rows: list[ProjectedRow]


@dataclass(frozen=True)
class TaskRow:
    """One task's cost verdict, priced at the rent of the GPU type the run measured (None: not one catalogued
    GPU type)."""

    cost: TaskCost
    sidecar_usd_per_mtok: float | None
    standalone_usd_per_mtok: float | None


@dataclass(frozen=True)
class Sections:
    unit: str  # what the sidecar output tokens are called: "tag" (tokens), "headline", "output" for several tasks
    worker: str  # what the standalone mode is called: a standalone "tagger" for tags, else a standalone "draft"
    introduction: Introduction
    verdict: VerdictSection
    measured: list[MeasuredRow]
    acceptance: list[Acceptance]
    eviction: list[Eviction]
    projections: list[ProjectionTable]
    capture_batches: list[int]  # the batch sizes speculation is set against plain decoding at
    tasks: list[TaskRow]
    task_gpu: str | None  # the GPU type the tasks' rent is read for


def sections(data: ReportData) -> Sections:
    # one run's tasks ran on one GPU type: the rent of that type prices them
    gpu_types = {m.gpu_type for m in data.measurements}
    gpu = next(iter(gpu_types)) if len(gpu_types) == 1 else None
    price = None if gpu is None else data.price(gpu)
    return Sections(
        unit=data.unit,
        worker="tagger" if data.unit == "tag" else "draft",
        introduction=_introduction(data),
        verdict=_verdict_section(data),
        measured=[_measured_row(data, g) for g in data.groups],
        acceptance=[Acceptance(gpu, pair, mode, rates) for (gpu, pair, mode), rates in data.acceptance.items()],
        eviction=_eviction(data),
        projections=[ProjectionTable(p, _projected_rows(data, p)) for p in data.projections],
        capture_batches=sorted({r.batch for by_mode in data.capture.rows.values() for r in by_mode["eager"]}),
        tasks=[TaskRow(t, _usd(price, t.sidecar_ms_per_token), _usd(price, t.standalone_ms_per_token))
               for t in data.tasks],
        task_gpu=gpu if price is not None else None,
    )


def _usd(price: float | None, ms_per_token: float | None) -> float | None:
    return None if price is None or not ms_per_token else usd_per_million_tokens(price, 1000 / ms_per_token)


def _introduction(data: ReportData) -> Introduction:
    m = data.measurements
    return Introduction(
        rows=len(m),
        runs=len({x.run_id for x in m if x.run_id}),
        devices=sorted({_device(x) for x in m}),
        pairs=sorted({x.pair for x in m if x.pair}),
        captures=sorted({x.capture.split(" (")[0] for x in m if x.capture}),
        capture_faults=sorted({f"run {x.run_id} ({x.capture or 'capture mode not recorded'}): {x.capture_fault}"
                               for x in m if x.capture_fault}),
        step_hosts=sorted({f"run {x.run_id} ({x.capture.split(' (')[0] or 'capture mode not recorded'}): "
                           f"{x.syncs_per_step:.2f} syncs and {x.host_ms_per_step:.1f} ms of host time per step"
                           for x in m if x.syncs_per_step is not None and x.host_ms_per_step is not None}),
    )


def _device(m: Measurement) -> str:
    """Where and how a measurement ran: its GPU type, in its dtype, in its capture mode (each where known)."""
    said = f"{m.gpu_type} in {m.dtype}" if m.dtype else m.gpu_type
    return f"{said}, capture {m.capture}" if m.capture else said


def _verdict_section(data: ReportData) -> VerdictSection:
    measured = [v for v in data.verdicts if v.basis == "measured"]
    projected = [v for v in data.verdicts if v.basis == "projected"]
    # the measured pairs' projections, else the study's
    lead = [p.workload.name for p in data.projections if p.pair is not None] or [data.projections[0].workload.name]
    shown = [*measured, *(v for v in projected if v.pair in lead)]
    batches = sorted({v.batch for v in shown})
    by_row: dict[tuple[str, str, str], dict[int, Verdict]] = {}
    for v in shown:
        by_row.setdefault((v.gpu_type, v.basis, v.pair), {})[v.batch] = v
    compared = {(v.gpu_type, v.pair) for v in measured}
    uncompared = sorted({(g.gpu_type, g.pair) for g in data.groups if g.tag_cost is not None} - compared)
    return VerdictSection(
        measured=measured,
        projected=projected,
        lead=lead,
        batches=batches,
        rows=[VerdictRow(gpu, basis, pair, [cells.get(b) for b in batches])
              for (gpu, basis, pair), cells in by_row.items()],
        summaries=[
            _projected_summary(of_workload, p.workload, data.reference_batch)
            for p in data.projections
            if (of_workload := [v for v in projected if v.pair == p.workload.name])
        ],
        at_reference=[v for v in projected if v.batch == data.reference_batch and v.prefill_priced],
        uncompared=[f"{gpu} ({pair})" if pair else gpu for gpu, pair in uncompared],
    )


def _prefill_share(costs: Sequence[TaggingCost]) -> list[int] | None:
    """The prefill's share of each cost's tagging time, in whole percent; None if any is unpriced."""
    if not costs or any(c.prefill_s is None for c in costs):
        return None
    return [round((c.prefill_s or 0) / c.seconds * 100) for c in costs]


def _projected_summary(verdicts: Sequence[Verdict], workload: Workload, reference_batch: int) -> ProjectedSummary:
    savings: dict[int, list[float]] = {}
    for v in verdicts:
        savings.setdefault(v.batch, []).append(round(v.sidecar_saving_pct, 1))
    at_reference = [v for v in verdicts if v.batch == reference_batch]
    prompt = feed = cached = None
    if workload.tokens is not None:
        prompt, _ = workload.tokens.prefill("standalone")
        feed, cached = workload.tokens.prefill("sidecar")
    return ProjectedSummary(
        workload=workload,
        gpu_types=len({v.gpu_type for v in verdicts}),
        priced=all(v.prefill_priced for v in verdicts),
        savings=sorted(savings.items()),
        standalone_share=_prefill_share([v.standalone for v in at_reference]),
        sidecar_share=_prefill_share([v.sidecar for v in at_reference]),
        standalone_prompt=prompt,
        sidecar_feed=feed,
        sidecar_cached=cached,
        always_dearer=bool(at_reference) and all(v.sidecar_saving_pct < 0 for v in at_reference),
    )


def _measured_row(data: ReportData, g: MeasuredGroup) -> MeasuredRow:
    price = data.price(g.gpu_type)
    usd = None if price is None or g.tag_tokens_per_s is None else usd_per_million_tokens(price, g.tag_tokens_per_s)
    return MeasuredRow(g, usd, None if g.tag_cost is None else g.tag_cost.seconds_per_tag_token * 1000)


def _eviction(data: ReportData) -> list[Eviction]:
    """The same tagging step with the document's KV entries kept and evicted, measured and projected."""
    by_key = {(g.gpu_type, g.pair, g.mode, g.batch_size): g for g in data.groups if g.tag_ms_per_step}
    rows = []
    for (gpu_type, pair, mode, batch), evicted in by_key.items():
        attended = by_key.get((gpu_type, pair, "sidecar_attended", batch))
        if mode != "sidecar" or attended is None or not evicted.tag_ms_per_step or not attended.tag_ms_per_step:
            continue
        own = data.pair_projections.get(pair)
        projected = None
        if own is not None and find_gpu(gpu_type, data.catalog) is not None:
            full = own.workload.step_bytes("sidecar_attended", batch)
            projected = (full / own.workload.step_bytes("sidecar", batch) - 1) * 100
        rows.append(Eviction(gpu_type, pair, batch, attended.tag_ms_per_step, evicted.tag_ms_per_step,
                             (attended.tag_ms_per_step / evicted.tag_ms_per_step - 1) * 100, projected))
    return rows


def _projected_rows(data: ReportData, projection: Projection) -> list[ProjectedRow]:
    rows = []
    for gpu in data.catalog.values():
        for batch in _table_batches(data.batches):
            by_mode = {mode: projection.row(gpu.name, mode, batch) for mode in MODES}
            attended, evicted = by_mode["sidecar_attended"], by_mode["sidecar"]
            speedup = None
            if attended is not None and evicted:
                speedup = (attended.ms_per_step / evicted.ms_per_step - 1) * 100
            rows.append(ProjectedRow(gpu, batch, attended, evicted, by_mode["standalone"], speedup))
    return rows


def _table_batches(batches: Sequence[int]) -> list[int]:
    """Smallest, a middle and the largest batch size: enough rows to read the trend in a table."""
    ordered = sorted(set(batches))
    return sorted({ordered[0], ordered[len(ordered) // 2], ordered[-1]})
