"""The report's plots: step time vs batch size, $ per 1M tag tokens per GPU type, acceptance per request.

Each function draws one PNG with matplotlib's object API (no pyplot state), from figures the report has
already computed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from study.cost import GPU, find_gpu, usd_per_million_tokens
from study.report.measurements import AcceptanceKey, MeasuredGroup
from study.report.projections import Projection, tag_usd_per_million
from vocab.modes import MODES

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MODE_LABELS: dict[str, str] = {
    "sidecar": "sidecar, document evicted",
    "sidecar_attended": "sidecar, document attended",
    "standalone": "standalone tagger",
}


def _figure(**options: Any) -> Figure:
    """A new figure; matplotlib is imported here, when a report draws, not with the flows that import the report
    (`prefect deploy` and every flow run's process import their entrypoints)."""
    from matplotlib.figure import Figure

    return Figure(**options)


def mode_labels(unit: str) -> dict[str, str]:
    """The legend's names of the modes: a standalone tagger writes tag tokens, any other task's a standalone draft."""
    return MODE_LABELS if unit == "tag" else MODE_LABELS | {"standalone": "standalone draft"}
MODE_COLOURS: dict[str, str] = {"sidecar": "tab:blue", "sidecar_attended": "tab:red", "standalone": "tab:green"}


def plot_step_times(
    path: Path,
    panels: Mapping[str, Projection | None],
    groups: Sequence[MeasuredGroup],
    panel_of: Mapping[str, str],
    unit: str = "tag",
) -> None:
    """One panel per catalog GPU with its projection, then one per measured device outside the catalog."""
    labels = mode_labels(unit)
    columns = min(4, len(panels))
    fig = _figure(figsize=(3.6 * columns, 3.0 * math.ceil(len(panels) / columns)), layout="constrained")
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
                    label=f"projected: {labels[mode]}",
                )
            measured = [g for g in groups if panel_of[g.gpu_type] == panel and g.mode == mode and g.tag_ms_per_step]
            if measured:
                ax.scatter(
                    [g.batch_size for g in measured],
                    [g.tag_ms_per_step for g in measured],
                    color=MODE_COLOURS[mode],
                    edgecolors="black",
                    zorder=3,
                    label=f"measured: {labels[mode]}",
                )
        ax.set_xscale("log", base=2)
        ticks = sorted({r.batch for r in projected} | {g.batch_size for g in groups if panel_of[g.gpu_type] == panel})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        # y=1.0 where matplotlib would put it anyway (no top ticks; the y axis starts at 0, so it has no offset
        # text to clear): a title placed by hand skips the automatic placement, which measures every y tick
        # label three times per panel and draw, a fifth of the figure's draw time
        ax.set_title(
            f"{panel} (measured only)" if projection is None else f"{panel}\nprojected: {projection.workload.name}",
            fontsize=8,
            y=1.0,
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


def plot_usd(
    path: Path,
    projection: Projection,
    reference_batch: int,
    groups: Sequence[MeasuredGroup],
    catalog: Mapping[str, GPU],
    unit: str = "tag",
) -> None:
    """Projected and (where measured at the reference batch) measured $ per 1M ``unit`` tokens per catalog GPU, over
    the tagging phase, every line included: prefill, decode and a sidecar's instruction line, measured as the
    ledger's attributed device seconds (a projection without the draft's shape: decode steps only)."""
    gpus = list(projection.rows)
    series: list[tuple[str, str, str | None, list[float | None]]] = []
    for mode in MODES:
        values = [
            None if (row := projection.row(g, mode, reference_batch)) is None else tag_usd_per_million(row)
            for g in gpus
        ]
        if any(v is not None for v in values):
            series.append((f"projected: {mode_labels(unit)[mode]}", MODE_COLOURS[mode], None, values))
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
            series.append((f"measured: {mode_labels(unit)[mode]}", MODE_COLOURS[mode], "//", values))
    fig = _figure(figsize=(max(7.0, 1.3 * len(gpus)), 4.2), layout="constrained")
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
    ax.set_ylabel(f"$ per 1M {unit} tokens")
    ax.set_title(
        f"Tagging cost per GPU type at batch {reference_batch} (hatched: measured)\n"
        f"projected: {projection.workload.name}",
        fontsize=10,
    )
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def plot_acceptance(path: Path, rates: Mapping[AcceptanceKey, Sequence[float]]) -> None:
    """A box per GPU type, pair and mode over its requests, with every request drawn as a point."""
    fig = _figure(figsize=(max(7.0, 1.6 * len(rates)), 4.5), layout="constrained")
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
