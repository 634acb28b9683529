"""Verdicts: is a sidecar tag token cheaper than a standalone tagger's, per GPU type (and pair)?

A measured verdict pools the batch sizes measured in both modes; a projected one reads the roofline at one
batch size. Both count the tagging phase whole: the prefill that yields the first tag token (the standalone
tagger's whole prompt, the sidecar's few fed tokens), then the decode steps; each verdict carries the two
per request, side by side, where they are known.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from study.cost import GPU, ProjectionRow, Workload, find_gpu, project, usd_per_million_tokens
from study.report.measurements import MeasuredGroup, Measurement, pooled_throughput
from study.report.projections import tag_tokens_per_s
from vocab.modes import Mode


@dataclass(frozen=True)
class PhaseSplit:
    """Seconds per request of the tagging phase: the prefill forward, and the decode steps after it."""

    prefill_s: float
    decode_s: float


@dataclass(frozen=True)
class Verdict:
    """Sidecar (document evicted) against a standalone tagger on one GPU type.

    ``prefill_priced`` says whether the rates include the tagging prefill; a projection of a workload
    without the draft's shape prices decode steps only. ``sidecar_split``/``standalone_split`` are the
    prefill and decode seconds per request, where measured or projected.
    """

    gpu_type: str
    pair: str
    basis: Literal["measured", "projected"]
    batch_sizes: tuple[int, ...]
    sidecar_tokens_per_s: float
    standalone_tokens_per_s: float
    usd_per_gpu_hour: float | None
    prefill_priced: bool = True
    sidecar_split: PhaseSplit | None = None
    standalone_split: PhaseSplit | None = None

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
        counted = "prefill and decode" if self.prefill_priced else "decode steps only"
        return f"{self.gpu_type}: projected at {batches}, {counted}, a sidecar tag token {comparison}."


def _measured_split(rows: Sequence[Measurement]) -> PhaseSplit | None:
    """Prefill and decode seconds per request, when every row measured both and its requests."""
    if not rows or any(r.prefill_s is None or r.decode_s is None or not r.requests for r in rows):
        return None
    requests = sum(r.requests or 0 for r in rows)
    return PhaseSplit(sum(r.prefill_s or 0 for r in rows) / requests, sum(r.decode_s or 0 for r in rows) / requests)


def measured_verdicts(groups: Sequence[MeasuredGroup], catalog: Mapping[str, GPU]) -> list[Verdict]:
    by_device: dict[tuple[str, str], dict[Mode, dict[int, MeasuredGroup]]] = defaultdict(lambda: defaultdict(dict))
    for g in groups:
        if g.tag_rows:
            by_device[(g.gpu_type, g.pair)][g.mode][g.batch_size] = g
    verdicts = []
    for (gpu_type, pair), modes in by_device.items():
        common = sorted(set(modes["sidecar"]) & set(modes["standalone"]))
        if not common:
            continue
        sidecar_rows = [r for b in common for r in modes["sidecar"][b].tag_rows]
        standalone_rows = [r for b in common for r in modes["standalone"][b].tag_rows]
        sidecar, standalone = pooled_throughput(sidecar_rows), pooled_throughput(standalone_rows)
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
                sidecar_split=_measured_split(sidecar_rows),
                standalone_split=_measured_split(standalone_rows),
            )
        )
    return verdicts


def _projected_split(row: ProjectionRow) -> PhaseSplit | None:
    if row.prefill_ms is None or row.decode_ms is None:
        return None
    return PhaseSplit(row.prefill_ms / 1000 / row.batch, row.decode_ms / 1000 / row.batch)


def projected_verdict(workload: Workload, gpu: GPU, batch: int) -> Verdict | None:
    """The roofline's verdict at ``batch``: the whole tagging phase where the workload has the draft's shape
    and token counts, else its decode steps only."""
    if not {"sidecar", "standalone"} <= set(workload.kv_bytes_per_request):
        return None
    rows = {row.mode: row for row in project(workload, gpu, [batch])}
    sidecar, standalone = rows["sidecar"], rows["standalone"]
    return Verdict(
        gpu.name,
        workload.name,
        "projected",
        (batch,),
        tag_tokens_per_s(sidecar),
        tag_tokens_per_s(standalone),
        gpu.usd_per_hour,
        prefill_priced=sidecar.tag_tokens_per_s is not None,
        sidecar_split=_projected_split(sidecar),
        standalone_split=_projected_split(standalone),
    )
