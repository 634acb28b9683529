"""The cost report: measured sidecar vs standalone tagging, roofline projections, calibration and plots.

Plain data in, files out. The Prefect flow reads storage and publishes what this writes::

    from sidecar.report import write_cost_report

    report = write_cost_report(
        measurements,            # rows of the storage `throughput` view: list of dicts (see below)
        out_dir,                 # created if missing
        catalog=None,            # dict[str, cost.GPU]; default: sidecar/data/gpus.json
        acceptance=(),           # rows of Database.request_acceptance(): per-request acceptance to plot
        draft_config=cost.draft_config,    # pair name -> its draft's config (raises CostInputError if absent)
        study_workload=cost.STUDY_WORKLOAD,  # the extra projection with the source study's shapes
        batches=cost.DEFAULT_BATCHES,
        reference_batch=None,    # batch size of the $ plot; default: the most common measured one, else 32
    )
    report.markdown              # the report as markdown (also at report.markdown_path)
    report.markdown_path, report.html_path      # cost_report.md, cost_report.html (PNGs embedded)
    report.plot_paths            # {"step_time": ..., "usd_per_mtok": ..., "acceptance": ...} PNG paths
    report.cost_rows             # dicts with storage.records.CostRecord's fields: rows for `cost_estimates`
    report.verdicts              # list[Verdict], one per GPU type (and pair, when measured)

Measurement rows need ``gpu_type``, ``mode`` (sidecar | sidecar_attended | standalone), ``phase`` and
``batch_size``; they may carry ``pair``, ``run_id``, ``tokens_per_s`` (whole batch), ``ms_per_step``,
``acceptance_rate``, ``tokens`` or ``new_tokens``, ``seconds`` or ``wall_s``, ``requests``, ``batches``,
``mean_kv_bytes``, ``prompt_tokens``, ``prefill_s``, ``decode_s`` and ``longest_row_tokens`` - the
throughput view's columns are accepted as they come. Phase ``main`` is the speculative summary; every
other phase, and every ``standalone`` row, is tagging work, which is what the costs compare. Without
``ms_per_step`` a tagging row's step time is its decode time over the decode steps of its batches' longest
rows (prefill excluded); a row with neither has no step time.

Each measured pair is projected from its draft's config (``draft_config``) in the dtype ``load_pair`` gives
it on a CUDA device, with the measured mean prompt, summary and tag tokens per request; measured step
times are calibrated against that projection only. A pair whose config is not on this machine (or rows
without a pair) gets no projection and no calibration, and the report says why. The study workload is
projected on every catalog GPU as well, labelled as such.
"""

from __future__ import annotations

import base64
import html
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from matplotlib.figure import Figure

from sidecar.cost import (
    DEFAULT_BATCHES,
    GB,
    GPU,
    MB,
    MODES,
    STUDY_WORKLOAD,
    CalibrationRow,
    CostInputError,
    MeasuredStep,
    Mode,
    ModelFacts,
    ProjectionRow,
    TagTokens,
    Workload,
    calibrate,
    default_dtype,
    draft_config,
    find_gpu,
    load_catalog,
    project,
    usd_per_million_tokens,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MAIN_PHASE = "main"
DEFAULT_REFERENCE_BATCH = 32
MODE_LABELS: dict[str, str] = {
    "sidecar": "sidecar, document evicted",
    "sidecar_attended": "sidecar, document attended",
    "standalone": "standalone tagger",
}
MODE_COLOURS: dict[str, str] = {"sidecar": "tab:blue", "sidecar_attended": "tab:red", "standalone": "tab:green"}


# -- measurements ------------------------------------------------------------------------------------------


def _number(value: Any) -> float | None:
    """A float, or None for missing values (None, NaN) as DuckDB and pandas hand them over."""
    if value is None:
        return None
    number = float(value)
    return None if math.isnan(number) else number


@dataclass(frozen=True)
class Measurement:
    """One row of the storage ``throughput`` view (one run, mode and phase)."""

    gpu_type: str
    mode: Mode
    phase: str
    batch_size: int
    pair: str = ""
    run_id: str | None = None
    tokens_per_s: float | None = None
    ms_per_step: float | None = None
    acceptance_rate: float | None = None
    tokens: float | None = None
    seconds: float | None = None
    requests: float | None = None
    batches: float | None = None
    mean_kv_bytes: float | None = None
    prompt_tokens: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    longest_row_tokens: float | None = None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Measurement:
        mode = row.get("mode")
        if mode not in MODES:
            raise CostInputError(f"measurement has mode {mode!r}; known: {', '.join(MODES)}")
        requests, batches = _number(row.get("requests")), _number(row.get("batches"))
        batch_size = _number(row.get("batch_size"))
        if batch_size is None and requests and batches:
            batch_size = round(requests / batches)
        if batch_size is None or batch_size < 1:
            raise CostInputError(f"measurement without a positive batch_size: {dict(row)}")
        tokens = row.get("tokens", row.get("new_tokens"))
        seconds = row.get("seconds", row.get("wall_s"))
        return cls(
            # A run on an unnamed device still counts; it just has no catalog price.
            gpu_type=str(row.get("gpu_type") or row.get("device") or "unknown device"),
            mode=mode,
            phase=str(row.get("phase") or ""),
            batch_size=int(batch_size),
            pair=str(row.get("pair") or ""),
            run_id=row.get("run_id"),
            tokens_per_s=_number(row.get("tokens_per_s")),
            ms_per_step=_number(row.get("ms_per_step")),
            acceptance_rate=_number(row.get("acceptance_rate")),
            tokens=_number(tokens),
            seconds=_number(seconds),
            requests=requests,
            batches=batches,
            mean_kv_bytes=_number(row.get("mean_kv_bytes")),
            prompt_tokens=_number(row.get("prompt_tokens")),
            prefill_s=_number(row.get("prefill_s")),
            decode_s=_number(row.get("decode_s")),
            longest_row_tokens=_number(row.get("longest_row_tokens")),
        )

    @property
    def is_tagging(self) -> bool:
        return self.mode == "standalone" or self.phase != MAIN_PHASE

    @property
    def throughput(self) -> float | None:
        """Tokens/s of the whole batch."""
        if self.tokens is not None and self.seconds:
            return self.tokens / self.seconds
        return self.tokens_per_s

    @property
    def step_ms(self) -> float | None:
        """Milliseconds per draft decode step of a tagging row, prefill excluded.

        A batch steps until its longest row finishes, and draft-only decoding takes each row's first token
        from the prefill forward: a batch whose longest row made n tokens ran n - 1 decode steps.
        """
        if self.ms_per_step:
            return self.ms_per_step
        if self.decode_s is None or not self.longest_row_tokens or not self.batches:
            return None
        steps = self.longest_row_tokens - self.batches
        return self.decode_s * 1000 / steps if steps > 0 else None


def _pooled_throughput(rows: Sequence[Measurement]) -> float | None:
    """Tokens over seconds when every row has both; otherwise the mean of the rows' tokens/s."""
    if rows and all(r.tokens is not None and r.seconds for r in rows):
        return sum(r.tokens or 0 for r in rows) / sum(r.seconds or 0 for r in rows)
    rates = [r.throughput for r in rows if r.throughput]
    return sum(rates) / len(rates) if rates else None


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _per_batch(seconds: Sequence[float | None], batch_count: float) -> float | None:
    """Seconds per batch from rows' total seconds, when every row has them."""
    if not batch_count or any(s is None for s in seconds):
        return None
    return sum(s or 0 for s in seconds) / batch_count


GroupKey = tuple[str, str, Mode, int]  # gpu_type, pair, mode, batch_size


@dataclass(frozen=True)
class MeasuredGroup:
    """Measurements of one GPU type, pair, mode and batch size, runs pooled."""

    gpu_type: str
    pair: str
    mode: Mode
    batch_size: int
    run_ids: tuple[str, ...]
    tag_rows: tuple[Measurement, ...]
    tag_tokens_per_s: float | None
    tag_ms_per_step: float | None
    tag_seconds_per_batch: float | None
    tag_prefill_s_per_batch: float | None
    kv_bytes_per_request: float | None
    summary_tokens_per_s: float | None
    acceptance_rate: float | None


def group_measurements(measurements: Sequence[Measurement]) -> list[MeasuredGroup]:
    by_key: dict[GroupKey, list[Measurement]] = defaultdict(list)
    for m in measurements:
        by_key[(m.gpu_type, m.pair, m.mode, m.batch_size)].append(m)
    groups = []
    for key in sorted(by_key, key=lambda k: (k[0], k[1], MODES.index(k[2]), k[3])):
        rows = by_key[key]
        tag = [r for r in rows if r.is_tagging]
        main = [r for r in rows if not r.is_tagging]
        batch_count = sum(r.batches or 0 for r in tag)
        groups.append(
            MeasuredGroup(
                gpu_type=key[0],
                pair=key[1],
                mode=key[2],
                batch_size=key[3],
                run_ids=tuple(sorted({r.run_id for r in rows if r.run_id})),
                tag_rows=tuple(tag),
                tag_tokens_per_s=_pooled_throughput(tag),
                tag_ms_per_step=_mean([r.step_ms for r in tag]),
                tag_seconds_per_batch=_per_batch([r.seconds for r in tag], batch_count),
                tag_prefill_s_per_batch=_per_batch([r.prefill_s for r in tag], batch_count),
                kv_bytes_per_request=_mean([r.mean_kv_bytes for r in tag]),
                summary_tokens_per_s=_pooled_throughput(main),
                acceptance_rate=_mean([r.acceptance_rate for r in main]),
            )
        )
    return groups


# -- verdicts ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """Sidecar (document evicted) against a standalone tagger on one GPU type."""

    gpu_type: str
    pair: str
    basis: Literal["measured", "projected"]
    batch_sizes: tuple[int, ...]
    sidecar_tokens_per_s: float
    standalone_tokens_per_s: float
    usd_per_gpu_hour: float | None

    @property
    def sidecar_saving_pct(self) -> float:
        """How much less a sidecar tag token costs than a standalone one (negative: it costs more).

        On one GPU type the price per token is inversely proportional to tokens/s, so this needs no price.
        """
        return (1 - self.standalone_tokens_per_s / self.sidecar_tokens_per_s) * 100

    @property
    def sidecar_usd_per_mtok(self) -> float | None:
        if self.usd_per_gpu_hour is None:
            return None
        return usd_per_million_tokens(self.usd_per_gpu_hour, self.sidecar_tokens_per_s)

    @property
    def standalone_usd_per_mtok(self) -> float | None:
        if self.usd_per_gpu_hour is None:
            return None
        return usd_per_million_tokens(self.usd_per_gpu_hour, self.standalone_tokens_per_s)

    @property
    def sentence(self) -> str:
        saving = self.sidecar_saving_pct
        comparison = f"costs {abs(saving):.1f}% {'less' if saving >= 0 else 'more'} than a standalone tagger's"
        if self.sidecar_usd_per_mtok is not None and self.standalone_usd_per_mtok is not None:
            comparison += (
                f" (${self.sidecar_usd_per_mtok:.4f} vs ${self.standalone_usd_per_mtok:.4f} per 1M tag tokens"
                f" at ${self.usd_per_gpu_hour:.2f}/GPU-hour)"
            )
        else:
            comparison += " in device time (no catalog price for this device)"
        batches = ("batch " if len(self.batch_sizes) == 1 else "batches ") + ", ".join(map(str, self.batch_sizes))
        if self.basis == "measured":
            return f"{self.gpu_type}: measured at {batches}, a sidecar tag token {comparison}."
        return f"{self.gpu_type}: projected at {batches}, decode steps only, a sidecar tag token {comparison}."


def _measured_verdicts(groups: Sequence[MeasuredGroup], catalog: Mapping[str, GPU]) -> list[Verdict]:
    by_device: dict[tuple[str, str], dict[Mode, dict[int, MeasuredGroup]]] = defaultdict(lambda: defaultdict(dict))
    for g in groups:
        if g.tag_rows:
            by_device[(g.gpu_type, g.pair)][g.mode][g.batch_size] = g
    verdicts = []
    for (gpu_type, pair), modes in by_device.items():
        common = sorted(set(modes["sidecar"]) & set(modes["standalone"]))
        if not common:
            continue
        sidecar = _pooled_throughput([r for b in common for r in modes["sidecar"][b].tag_rows])
        standalone = _pooled_throughput([r for b in common for r in modes["standalone"][b].tag_rows])
        if not sidecar or not standalone:
            continue
        gpu = find_gpu(gpu_type, catalog)
        verdicts.append(
            Verdict(
                gpu_type,
                pair,
                "measured",
                tuple(common),
                sidecar,
                standalone,
                None if gpu is None else gpu.usd_per_hour,
            )
        )
    return verdicts


def _projected_verdict(workload: Workload, gpu: GPU, batch: int) -> Verdict | None:
    if not {"sidecar", "standalone"} <= set(workload.kv_bytes_per_request):
        return None
    rates = {row.mode: row.tokens_per_s for row in project(workload, gpu, [batch])}
    return Verdict(
        gpu.name, workload.name, "projected", (batch,), rates["sidecar"], rates["standalone"], gpu.usd_per_hour
    )


# -- projections of the measured pairs ---------------------------------------------------------------------

DraftConfig = Callable[[str], "PretrainedConfig"]


@dataclass(frozen=True)
class Projection:
    """One workload on every catalog GPU; ``pair`` is the measured pair it models, None for the study's."""

    workload: Workload
    rows: dict[str, list[ProjectionRow]]  # by catalog GPU name
    pair: str | None = None

    def row(self, gpu_name: str, mode: Mode, batch: int) -> ProjectionRow | None:
        return next((r for r in self.rows.get(gpu_name, ()) if r.mode == mode and r.batch == batch), None)


def _measured_tag_tokens(rows: Sequence[Measurement]) -> TagTokens | None:
    """Mean token counts per request: the main phase's prompt and summary, and the tags of every mode."""
    main = [r for r in rows if not r.is_tagging and r.requests and r.prompt_tokens is not None and r.tokens]
    tag = [r for r in rows if r.is_tagging and r.requests and r.tokens]
    if not main or not tag:
        return None
    main_requests = sum(r.requests or 0 for r in main)
    return TagTokens.from_measured(
        main_prompt=sum((r.prompt_tokens or 0) * (r.requests or 0) for r in main) / main_requests,
        summary=sum(r.tokens or 0 for r in main) / main_requests,
        tags=sum(r.tokens or 0 for r in tag) / sum(r.requests or 0 for r in tag),
    )


def _pair_workloads(
    measurements: Sequence[Measurement], draft_config: DraftConfig
) -> tuple[dict[str, Workload], list[str]]:
    """A workload per measured pair, and why the measurements that have none have none."""
    by_pair: dict[str, list[Measurement]] = defaultdict(list)
    for m in measurements:
        by_pair[m.pair].append(m)
    unnamed = by_pair.pop("", [])
    missing = [f"rows without a pair (on {', '.join(sorted({m.gpu_type for m in unnamed}))})"] if unnamed else []
    # The catalog's GPUs are CUDA devices: a pair is projected in the dtype load_pair gives it there.
    dtype, dtype_bytes = default_dtype("cuda")
    workloads = {}
    for pair, rows in sorted(by_pair.items()):
        tokens = _measured_tag_tokens(rows)
        if tokens is None:
            missing.append(f"{pair}: no main-phase prompt and summary tokens with tag tokens were measured")
            continue
        try:
            facts = ModelFacts.from_config(draft_config(pair), dtype_bytes)
        except CostInputError as exc:
            missing.append(f"{pair}: {exc}")
            continue
        workloads[pair] = Workload.from_model(facts, tokens, name=f"{pair} ({dtype})")
    return workloads, missing


# -- document blocks, rendered to markdown and to HTML -----------------------------------------------------


@dataclass(frozen=True)
class _Heading:
    text: str
    level: int = 2


@dataclass(frozen=True)
class _Paragraph:
    text: str


@dataclass(frozen=True)
class _Bullets:
    items: tuple[str, ...]


@dataclass(frozen=True)
class _Table:
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class _Image:
    path: Path
    alt: str


_Block = _Heading | _Paragraph | _Bullets | _Table | _Image


def _markdown(blocks: Sequence[_Block]) -> str:
    parts = []
    for block in blocks:
        if isinstance(block, _Heading):
            parts.append(f"{'#' * block.level} {block.text}")
        elif isinstance(block, _Paragraph):
            parts.append(block.text)
        elif isinstance(block, _Bullets):
            parts.append("\n".join(f"- {item}" for item in block.items))
        elif isinstance(block, _Table):
            lines = ["| " + " | ".join(block.headers) + " |", "|" + "---|" * len(block.headers)]
            lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in block.rows]
            parts.append("\n".join(lines))
        else:
            parts.append(f"![{block.alt}]({block.path.name})")
    return "\n\n".join(parts) + "\n"


_HTML_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 70rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
table { border-collapse: collapse; margin: 1rem 0; font-size: 0.9rem; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.6rem; text-align: right; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; }
img { max-width: 100%; }
"""


def _html(blocks: Sequence[_Block], title: str) -> str:
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_HTML_STYLE}</style></head><body>",
    ]
    for block in blocks:
        if isinstance(block, _Heading):
            parts.append(f"<h{block.level}>{html.escape(block.text)}</h{block.level}>")
        elif isinstance(block, _Paragraph):
            parts.append(f"<p>{html.escape(block.text)}</p>")
        elif isinstance(block, _Bullets):
            parts.append("<ul>" + "".join(f"<li>{html.escape(item)}</li>" for item in block.items) + "</ul>")
        elif isinstance(block, _Table):
            head = "".join(f"<th>{html.escape(h)}</th>" for h in block.headers)
            body = "".join(
                "<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in block.rows
            )
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        else:
            encoded = base64.b64encode(block.path.read_bytes()).decode("ascii")
            parts.append(f'<figure><img alt="{html.escape(block.alt)}" src="data:image/png;base64,{encoded}"></figure>')
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _fmt(value: float | None, digits: int = 3) -> str:
    """Significant digits for small numbers, thousands separators for large ones, a dash for none."""
    if value is None:
        return "–"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def _fmt_usd(value: float | None) -> str:
    return "–" if value is None else f"${value:.4f}"


# -- plots -------------------------------------------------------------------------------------------------


def _plot_step_times(
    path: Path,
    panels: Mapping[str, Projection | None],
    groups: Sequence[MeasuredGroup],
    panel_of: Mapping[str, str],
) -> None:
    """One panel per catalog GPU with its projection, then one per measured device outside the catalog."""
    columns = min(4, len(panels))
    fig = Figure(figsize=(3.6 * columns, 3.0 * math.ceil(len(panels) / columns)), layout="constrained")
    axes = fig.subplots(math.ceil(len(panels) / columns), columns, squeeze=False).ravel()
    for ax, (panel, projection) in zip(axes, panels.items(), strict=False):
        projected = [] if projection is None else projection.rows[panel]
        for mode in MODES:
            line = [r for r in projected if r.mode == mode]
            if line:
                ax.plot(
                    [r.batch for r in line],
                    [r.ms_per_step for r in line],
                    color=MODE_COLOURS[mode],
                    linestyle="--" if mode == "standalone" else "-",
                    label=f"projected: {MODE_LABELS[mode]}",
                )
            measured = [g for g in groups if panel_of[g.gpu_type] == panel and g.mode == mode and g.tag_ms_per_step]
            if measured:
                ax.scatter(
                    [g.batch_size for g in measured],
                    [g.tag_ms_per_step for g in measured],
                    color=MODE_COLOURS[mode],
                    edgecolors="black",
                    zorder=3,
                    label=f"measured: {MODE_LABELS[mode]}",
                )
        ax.set_xscale("log", base=2)
        ticks = sorted({r.batch for r in projected} | {g.batch_size for g in groups if panel_of[g.gpu_type] == panel})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_title(
            f"{panel} (measured only)" if projection is None else f"{panel}\nprojected: {projection.workload.name}",
            fontsize=8,
        )
        ax.set_xlabel("batch size")
        ax.set_ylabel("ms per decode step")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    legend: dict[str, Any] = {}
    for ax in axes[: len(panels)]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend), loc="outside lower center", ncols=3, fontsize=8)
    fig.suptitle("Draft decode step time vs batch size: document attended vs evicted")
    fig.savefig(path, dpi=110)


def _plot_usd(
    path: Path,
    projection: Projection,
    reference_batch: int,
    groups: Sequence[MeasuredGroup],
    catalog: Mapping[str, GPU],
) -> None:
    """Projected and (where measured at the reference batch) measured $ per 1M tag tokens per catalog GPU."""
    gpus = list(projection.rows)
    series: list[tuple[str, str, str | None, list[float | None]]] = []
    for mode in MODES:
        values = [
            None if (row := projection.row(g, mode, reference_batch)) is None else row.usd_per_million_tokens
            for g in gpus
        ]
        if any(v is not None for v in values):
            series.append((f"projected: {MODE_LABELS[mode]}", MODE_COLOURS[mode], None, values))
    for mode in MODES:
        values = []
        for name in gpus:
            # The first pair measured on this GPU type at the reference batch, if any.
            rate = next(
                (
                    g.tag_tokens_per_s
                    for g in groups
                    if g.mode == mode
                    and g.batch_size == reference_batch
                    and g.tag_tokens_per_s
                    and (gpu := find_gpu(g.gpu_type, catalog)) is not None
                    and gpu.name == name
                ),
                None,
            )
            values.append(None if rate is None else usd_per_million_tokens(catalog[name].usd_per_hour, rate))
        if any(v is not None for v in values):
            series.append((f"measured: {MODE_LABELS[mode]}", MODE_COLOURS[mode], "//", values))
    fig = Figure(figsize=(max(7.0, 1.3 * len(gpus)), 4.2), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / max(1, len(series))
    for index, (label, colour, hatch, values) in enumerate(series):
        xs = [i + (index - (len(series) - 1) / 2) * width for i in range(len(gpus))]
        present = [(x, v) for x, v in zip(xs, values, strict=True) if v is not None]
        if present:
            ax.bar(
                [x for x, _ in present],
                [v for _, v in present],
                width=width,
                color=colour,
                hatch=hatch,
                edgecolor="black" if hatch else colour,
                alpha=0.55 if hatch else 0.9,
                label=label,
            )
    ax.set_xticks(range(len(gpus)), gpus)
    ax.set_ylabel("$ per 1M tag tokens")
    ax.set_title(
        f"Tagging cost per GPU type at batch {reference_batch} (hatched: measured)\n"
        f"projected: {projection.workload.name}",
        fontsize=10,
    )
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)


AcceptanceKey = tuple[str, str, Mode]  # gpu_type, pair, mode


def _acceptance_by_key(rows: Sequence[Mapping[str, Any]]) -> dict[AcceptanceKey, list[float]]:
    """Per-request acceptance rates per GPU type, pair and mode, in the report's order."""
    rates: dict[AcceptanceKey, list[float]] = defaultdict(list)
    for row in rows:
        rate, mode = _number(row.get("acceptance_rate")), row.get("mode")
        if rate is not None and mode in MODES:
            rates[(str(row.get("gpu_type") or "unknown device"), str(row.get("pair") or ""), mode)].append(rate)
    return {key: rates[key] for key in sorted(rates, key=lambda k: (k[0], k[1], MODES.index(k[2])))}


def _plot_acceptance(path: Path, rates: Mapping[AcceptanceKey, Sequence[float]]) -> None:
    """A box per GPU type, pair and mode over its requests, with every request drawn as a point."""
    fig = Figure(figsize=(max(7.0, 1.6 * len(rates)), 4.5), layout="constrained")
    ax = fig.subplots()
    if rates:
        values = list(rates.values())
        boxes = ax.boxplot(values, widths=0.5, showfliers=False, patch_artist=True)
        for box, (_, _, mode) in zip(boxes["boxes"], rates, strict=True):
            box.set(facecolor=MODE_COLOURS[mode], alpha=0.35)
        for position, ((_, _, mode), points) in enumerate(rates.items(), start=1):
            # spread the points evenly across the box, so equal rates stay visible as a row of points
            offsets = [0.3 * (i / (len(points) - 1) - 0.5) if len(points) > 1 else 0.0 for i in range(len(points))]
            ax.scatter([position + o for o in offsets], sorted(points), s=10, color=MODE_COLOURS[mode], zorder=3)
        labels = [f"{gpu}\n{pair}\n{mode} (n={len(points)})" for (gpu, pair, mode), points in rates.items()]
        ax.set_xticks(range(1, len(rates) + 1), labels, fontsize=7)
    else:
        ax.text(0.5, 0.5, "no acceptance measurements", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylim(-0.03, 1.03)  # rates of exactly 0 or 1 are common: keep their points off the frame
    ax.set_ylabel("accepted / drafted tokens, per request")
    ax.set_title("Acceptance of draft tokens in the main (summary) phase, per request")
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(path, dpi=110)


# -- the report --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CostReport:
    markdown: str
    markdown_path: Path
    html_path: Path
    plot_paths: dict[str, Path]
    cost_rows: list[dict[str, Any]]
    verdicts: list[Verdict]

    @property
    def paths(self) -> list[Path]:
        return [self.markdown_path, self.html_path, *self.plot_paths.values()]


def _table_batches(batches: Sequence[int]) -> list[int]:
    """Smallest, a middle and the largest batch size: enough rows to read the trend in a table."""
    ordered = sorted(set(batches))
    return sorted({ordered[0], ordered[len(ordered) // 2], ordered[-1]})


@dataclass(frozen=True)
class _ReportData:
    """Everything the report's text is written from."""

    measurements: list[Measurement]
    groups: list[MeasuredGroup]
    verdicts: list[Verdict]
    projections: list[Projection]  # the measured pairs', then the study's
    pair_projections: dict[str, Projection]
    unprojected: list[str]  # why measurements have no projection of their own pair
    calibration: list[tuple[Projection, CalibrationRow]]
    acceptance: dict[AcceptanceKey, list[float]]
    uncatalogued: list[str]
    catalog: Mapping[str, GPU]
    batches: list[int]
    reference_batch: int
    plot_paths: dict[str, Path]

    def price(self, gpu_type: str) -> float | None:
        gpu = find_gpu(gpu_type, self.catalog)
        return None if gpu is None else gpu.usd_per_hour


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
) -> CostReport:
    """Write cost_report.md, cost_report.html and three PNG plots to ``out_dir``; see the module docstring."""
    catalog = load_catalog() if catalog is None else catalog
    rows = [Measurement.from_row(row) for row in measurements]
    groups = group_measurements(rows)
    tag_groups = [g for g in groups if g.tag_rows]
    if reference_batch is None:
        counts = Counter(g.batch_size for g in tag_groups)
        # The most often measured batch size (the largest of a tie), so measured and projected bars meet.
        reference_batch = max(counts, key=lambda b: (counts[b], b)) if counts else DEFAULT_REFERENCE_BATCH
    if reference_batch < 1:
        raise CostInputError(f"reference_batch must be positive, got {reference_batch}")
    all_batches = sorted(set(batches) | {reference_batch})

    def projection(workload: Workload, pair: str | None = None) -> Projection:
        return Projection(workload, {gpu.name: project(workload, gpu, all_batches) for gpu in catalog.values()}, pair)

    workloads, unprojected = _pair_workloads(rows, draft_config)
    pair_projections = {pair: projection(workload, pair) for pair, workload in workloads.items()}
    projections = [*pair_projections.values(), projection(study_workload)]

    measured_verdicts = _measured_verdicts(groups, catalog)
    # A catalog GPU type with a measured verdict needs no projected one.
    measured_catalog_names = {gpu.name for v in measured_verdicts if (gpu := find_gpu(v.gpu_type, catalog)) is not None}
    projected_verdicts = [
        v
        for p in projections
        for gpu in catalog.values()
        if gpu.name not in measured_catalog_names and (v := _projected_verdict(p.workload, gpu, reference_batch))
    ]
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

    data = _ReportData(
        measurements=rows,
        groups=groups,
        verdicts=measured_verdicts + projected_verdicts,
        projections=projections,
        pair_projections=pair_projections,
        unprojected=unprojected,
        calibration=calibration,
        acceptance=_acceptance_by_key(acceptance),
        uncatalogued=uncatalogued,
        catalog=catalog,
        batches=all_batches,
        reference_batch=reference_batch,
        plot_paths={
            "step_time": out_dir / "step_time_vs_batch.png",
            "usd_per_mtok": out_dir / "usd_per_million_tag_tokens.png",
            "acceptance": out_dir / "acceptance_per_request.png",
        },
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    _plot_step_times(data.plot_paths["step_time"], panels, groups, panel_of)
    _plot_usd(data.plot_paths["usd_per_mtok"], projections[0], reference_batch, groups, catalog)
    _plot_acceptance(data.plot_paths["acceptance"], data.acceptance)

    blocks = _report_blocks(data)
    markdown = _markdown(blocks)
    markdown_path = out_dir / "cost_report.md"
    html_path = out_dir / "cost_report.html"
    markdown_path.write_text(markdown, encoding="utf-8")
    html_path.write_text(_html(blocks, "Sidecar cost report"), encoding="utf-8")
    return CostReport(
        markdown=markdown,
        markdown_path=markdown_path,
        html_path=html_path,
        plot_paths=data.plot_paths,
        cost_rows=_cost_rows(data),
        verdicts=data.verdicts,
    )


def _cost_rows(data: _ReportData) -> list[dict[str, Any]]:
    """Rows for the ``cost_estimates`` table (storage.records.CostRecord's fields)."""
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
                "note": f"tagging phase, {len(g.run_ids)} run(s) pooled",
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
                    "tokens_per_s": r.tokens_per_s,
                    "ms_per_step": r.ms_per_step,
                    "usd_per_gpu_hour": r.usd_per_gpu_hour,
                    "usd_per_mtok": r.usd_per_million_tokens,
                    "source": "projected",
                    "run_id": None,
                    "note": f"bandwidth roofline of {modelled}, tagging decode steps only",
                }
                for r in gpu_rows
            ]
    return rows


def _report_blocks(data: _ReportData) -> list[_Block]:
    return [
        _Heading("Sidecar cost report", 1),
        _Paragraph(_introduction(data)),
        *_verdict_section(data),
        *_measured_section(data),
        *_projection_section(data),
        *_calibration_section(data),
        _Heading("What the roofline leaves out"),
        _Bullets(
            (
                "Prefill. A standalone tagger prefills its prompt and the whole summary; the sidecar prefills only "
                "its instruction. Prefill is compute-bound at these lengths and is not projected; measured tag "
                "tok/s and $ include it (see tag prefill s/batch), measured ms/step does not.",
                "Deployment. A standalone tagger is a deployment of its own, paid for even when tag traffic is low "
                "or bursty, and the summary has to be shipped to it; the sidecar reuses the draft already "
                "resident next to the target. Projections price busy GPU-seconds only.",
                "Overheads. Compute, kernel launches and framework time come on top of the memory traffic; the "
                "calibration ratios show how far measured steps are from the roofline.",
                "KV per request is averaged over one request's tag tokens; requests that finish early leave the "
                "batch and make later steps cheaper.",
            )
        ),
        _Heading("Plots"),
        _Image(data.plot_paths["step_time"], "decode step time vs batch size, document attended vs evicted"),
        _Image(data.plot_paths["usd_per_mtok"], "$ per 1M tag tokens, sidecar vs standalone, per GPU type"),
        _Image(data.plot_paths["acceptance"], "acceptance of drafted tokens per request, per GPU type, pair and mode"),
    ]


def _introduction(data: _ReportData) -> str:
    text = (
        "This report compares the draft model's tagging phase run as a sidecar - after the summary, on the "
        "same GPU, with the document's KV entries evicted (sidecar) or kept (sidecar_attended) - with a "
        "standalone tagger given only the summary (standalone). "
    )
    if data.measurements:
        runs = {m.run_id for m in data.measurements if m.run_id}
        devices = sorted({m.gpu_type for m in data.measurements})
        pairs = sorted({m.pair for m in data.measurements if m.pair})
        text += (
            f"Measured: {len(data.measurements)} throughput rows from {len(runs)} run(s) on {', '.join(devices)}"
            + (f" with pair(s) {', '.join(pairs)}. " if pairs else ". ")
        )
    else:
        text += "Nothing was measured for this report: every figure below is a projection. "
    text += f"Projected: a memory-bandwidth roofline on the {len(data.catalog)} GPU types of the catalog for " + (
        "; ".join(f"{p.workload.name} ({p.workload.description})" for p in data.projections) + ". "
    )
    if data.pair_projections:
        text += (
            "A measured pair is projected from its draft's config, in the dtype it is loaded in on a GPU, with "
            "the measured mean prompt, summary and tag tokens per request (the document is the main prompt "
            "less an estimate of the chat template and instruction); the source study's shapes are an extra "
            "projection, not derived from the measurements. "
        )
    if data.unprojected:
        text += (
            "No projection of the measured pair, so no calibration, for: "
            + "; ".join(data.unprojected)
            + ". Their GPU types are projected with the source study's shapes only, which model another pair. "
        )
    return text.rstrip()


def _saving_cell(verdict: Verdict) -> str:
    saving = verdict.sidecar_saving_pct
    return f"{abs(saving):.1f}% {'cheaper' if saving >= 0 else 'dearer'}"


def _verdict_section(data: _ReportData) -> list[_Block]:
    blocks: list[_Block] = [
        _Heading("Verdict per GPU type"),
        _Paragraph(
            "Is a sidecar tag token cheaper than one from a standalone deployment of the same draft model? "
            "Measured verdicts pool the batch sizes measured in both modes; GPU types without measurements "
            f"get a projection at batch {data.reference_batch} for each projected workload (pair column)."
        ),
    ]
    if data.verdicts:
        blocks.append(
            _Table(
                (
                    "GPU type",
                    "pair",
                    "basis",
                    "batch",
                    "sidecar tok/s",
                    "standalone tok/s",
                    "sidecar $/1M tag tok",
                    "standalone $/1M tag tok",
                    "sidecar vs standalone",
                ),
                tuple(
                    (
                        v.gpu_type,
                        v.pair,
                        v.basis,
                        ", ".join(map(str, v.batch_sizes)),
                        _fmt(v.sidecar_tokens_per_s),
                        _fmt(v.standalone_tokens_per_s),
                        _fmt_usd(v.sidecar_usd_per_mtok),
                        _fmt_usd(v.standalone_usd_per_mtok),
                        _saving_cell(v),
                    )
                    for v in data.verdicts
                ),
            )
        )
        measured = [v for v in data.verdicts if v.basis == "measured"]
        if measured:
            blocks.append(_Bullets(tuple(v.sentence for v in measured)))
        for projection in data.projections:
            projected = [v for v in data.verdicts if v.basis == "projected" and v.pair == projection.workload.name]
            if projected:
                blocks.append(_Paragraph(_projected_summary(projected, projection.workload)))
    else:
        blocks.append(
            _Paragraph("No verdict: nothing was measured in both modes and the projection has no standalone KV.")
        )
    compared = {(v.gpu_type, v.pair) for v in data.verdicts if v.basis == "measured"}
    uncompared = sorted({(g.gpu_type, g.pair) for g in data.groups if g.tag_rows} - compared)
    if uncompared:
        names = ", ".join(f"{gpu} ({pair})" if pair else gpu for gpu, pair in uncompared)
        blocks.append(
            _Paragraph(
                "Measured but not compared, for want of sidecar and standalone tagging at a common batch "
                f"size: {names}."
            )
        )
    return blocks


def _projected_summary(verdicts: Sequence[Verdict], workload: Workload) -> str:
    """One paragraph for all projected verdicts: on a roofline the ratio does not depend on bandwidth."""
    savings = [round(v.sidecar_saving_pct, 1) for v in verdicts]
    low, high = min(savings), max(savings)
    spread = f"{abs(low):.1f}%" if low == high else f"{min(map(abs, savings)):.1f}-{max(map(abs, savings)):.1f}%"
    direction = "less" if low >= 0 else "more" if high <= 0 else "more or less"
    text = (
        f"Projected with {workload.name} on {', '.join(v.gpu_type for v in verdicts)}, batch "
        f"{verdicts[0].batch_sizes[0]}, decode steps only: a sidecar tag token costs {spread} {direction} than a "
        "standalone tagger's."
    )
    kv = workload.kv_bytes_per_request
    if high < 0:
        text += (
            f" With the document evicted, the sidecar still reads its main prompt's KV entries "
            f"({kv['sidecar'] / MB:.2f} vs {kv['standalone'] / MB:.2f} MB per request), so per decode step it cannot "
            "beat a standalone tagger; what it saves is what the roofline leaves out (see below): "
            "the standalone's summary prefill and its separate deployment."
        )
    return text


def _measured_section(data: _ReportData) -> list[_Block]:
    blocks: list[_Block] = [_Heading("What was measured")]
    if not data.groups:
        return [*blocks, _Paragraph("No measurements were given.")]
    table_rows = []
    for g in data.groups:
        price = data.price(g.gpu_type)
        usd = None if price is None or g.tag_tokens_per_s is None else usd_per_million_tokens(price, g.tag_tokens_per_s)
        table_rows.append(
            (
                g.gpu_type,
                g.pair,
                g.mode,
                str(g.batch_size),
                str(len(g.run_ids)),
                _fmt(g.tag_tokens_per_s),
                _fmt(g.tag_ms_per_step),
                _fmt(g.tag_seconds_per_batch),
                _fmt(g.tag_prefill_s_per_batch),
                _fmt(None if g.kv_bytes_per_request is None else g.kv_bytes_per_request / MB),
                _fmt(g.summary_tokens_per_s),
                _fmt(g.acceptance_rate),
                _fmt_usd(usd),
            )
        )
    blocks += [
        _Table(
            (
                "GPU type",
                "pair",
                "mode",
                "batch",
                "runs",
                "tag tok/s",
                "tag ms/step",
                "tag s/batch",
                "tag prefill s/batch",
                "KV MB/request",
                "summary tok/s",
                "acceptance",
                "$/1M tag tok",
            ),
            tuple(table_rows),
        ),
        _Paragraph(
            "Tag tok/s is every tag token of a batch over the batch's tagging wall time, prefill included; "
            "ms/step is the batches' decode time per decode step, prefill excluded: a batch steps until its "
            "longest row is done, and the first tag token comes from the prefill, so a batch whose longest row "
            "made n tokens took n - 1 steps. Prefill s/batch is the tagging prefill (the standalone tagger's "
            "whole prompt, the sidecar's instruction). Summary tok/s and acceptance (accepted / drafted) come "
            "from the speculative main phase. $ uses the catalog price of the GPU type; devices outside the "
            "catalog have none."
        ),
    ]
    if data.acceptance:
        blocks += [
            _Paragraph("Acceptance per request in the main phase (requests that drafted), as plotted below:"),
            _Table(
                ("GPU type", "pair", "mode", "requests", "min", "median", "max"),
                tuple(
                    (
                        gpu,
                        pair,
                        mode,
                        str(len(rates)),
                        _fmt(min(rates)),
                        _fmt(statistics.median(rates)),
                        _fmt(max(rates)),
                    )
                    for (gpu, pair, mode), rates in data.acceptance.items()
                ),
            ),
        ]
    eviction = _eviction_rows(data)
    if eviction:
        blocks += [
            _Paragraph("Eviction: the same tagging step with the document's KV entries kept and evicted."),
            _Table(
                (
                    "GPU type",
                    "pair",
                    "batch",
                    "attended ms/step",
                    "evicted ms/step",
                    "measured speedup %",
                    "projected speedup %",
                ),
                tuple(eviction),
            ),
        ]
    return blocks


def _eviction_rows(data: _ReportData) -> list[tuple[str, ...]]:
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
        rows.append(
            (
                gpu_type,
                pair,
                str(batch),
                _fmt(attended.tag_ms_per_step),
                _fmt(evicted.tag_ms_per_step),
                _fmt((attended.tag_ms_per_step / evicted.tag_ms_per_step - 1) * 100),
                _fmt(projected),
            )
        )
    return rows


def _projection_section(data: _ReportData) -> list[_Block]:
    blocks: list[_Block] = [
        _Heading("What was projected"),
        _Paragraph(
            "A tagging decode step is memory-bandwidth bound: it reads the draft's weights once and each "
            "request's KV cache once, so bytes per step = weights + batch x KV per request, time = bytes / "
            "bandwidth, tokens/s = batch / time and $ per 1M tokens = $/GPU-hour / 3600 / tokens/s x 1e6. "
            "Bandwidth and rent come from the GPU catalog (sidecar/data/gpus.json, with a source per entry). "
            "The full grid of batch sizes is in the cost rows and the plots."
        ),
    ]
    for projection in data.projections:
        workload = projection.workload
        kv = ", ".join(f"{mode} {kv / MB:.3g} MB" for mode, kv in workload.kv_bytes_per_request.items())
        source = (
            "Not derived from the measurements"
            if projection.pair is None
            else f"The measured pair {projection.pair}, from its draft's config and the measured token counts"
        )
        rows = []
        for gpu in data.catalog.values():
            for batch in _table_batches(data.batches):
                by_mode = {mode: projection.row(gpu.name, mode, batch) for mode in MODES}
                attended, evicted, alone = by_mode["sidecar_attended"], by_mode["sidecar"], by_mode["standalone"]
                speedup = (
                    (attended.ms_per_step / evicted.ms_per_step - 1) * 100 if attended is not None and evicted else None
                )
                rows.append(
                    (
                        gpu.name,
                        f"{gpu.bandwidth_gb_s:,.0f}",
                        f"{gpu.usd_per_hour:.2f}",
                        str(batch),
                        *(_fmt(None if row is None else row.ms_per_step) for row in (attended, evicted, alone)),
                        _fmt(speedup),
                        *(_fmt_usd(None if row is None else row.usd_per_million_tokens) for row in (evicted, alone)),
                    )
                )
        blocks += [
            _Heading(workload.name, 3),
            _Paragraph(
                f"{source}: {workload.description}. Weights read per step: "
                f"{workload.weight_bytes_per_step / GB:.3g} GB; KV per request: {kv}."
            ),
            _Table(
                (
                    "GPU",
                    "GB/s",
                    "$/GPU-hour",
                    "batch",
                    "attended ms/step",
                    "evicted ms/step",
                    "standalone ms/step",
                    "eviction speedup %",
                    "sidecar $/1M tag tok",
                    "standalone $/1M tag tok",
                ),
                tuple(rows),
            ),
        ]
    return blocks


def _calibration_section(data: _ReportData) -> list[_Block]:
    blocks: list[_Block] = [_Heading("Calibration: measured ÷ projected")]
    if data.calibration:
        blocks += [
            _Table(
                (
                    "GPU type",
                    "catalog GPU",
                    "projected as",
                    "mode",
                    "batch",
                    "measured ms/step",
                    "projected ms/step",
                    "measured ÷ projected",
                ),
                tuple(
                    (
                        c.gpu_type,
                        c.catalog_gpu,
                        projection.workload.name,
                        c.mode,
                        str(c.batch),
                        _fmt(c.measured_ms_per_step),
                        _fmt(c.projected_ms_per_step),
                        f"{c.measured_over_projected:.2f}",
                    )
                    for projection, c in data.calibration
                ),
            ),
            _Paragraph(
                "Each measured decode step is divided by the projection of its own pair (draft config, GPU dtype, "
                "measured token counts) on the catalog's figures for its GPU type. Above 1 the measured step is "
                "slower than the bandwidth roofline."
            ),
        ]
    else:
        blocks.append(
            _Paragraph(
                "Nothing is calibrated: no decode step was measured on a catalogued GPU with a projection of its "
                "own pair."
            )
        )
    if data.unprojected:
        blocks.append(
            _Paragraph(f"Not calibrated, for want of a projection of their pair: {'; '.join(data.unprojected)}.")
        )
    if data.uncatalogued:
        blocks.append(
            _Paragraph(
                f"Measured only (not in the GPU catalog, so no bandwidth or price): {', '.join(data.uncatalogued)}."
            )
        )
    return blocks
