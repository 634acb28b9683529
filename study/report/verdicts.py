"""Verdicts: is a sidecar tag token cheaper than a standalone tagger's, per GPU type, pair and batch size?

A verdict holds the two modes' tagging lines per request (``study.report.tagging_cost``) and nothing else:
its rates, prices and saving are computed from them, so the verdict and the lines printed under it cannot
disagree. A measured verdict reads the lines from the device-time ledger of the runs at one batch size; a
projected one from the roofline at one batch size. Both count the same lines: a sidecar's prefill, decode
and instruction line, a standalone tagger's prefill and decode.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from study.cost import GPU, HostFloor, ProjectionRow, Workload, find_gpu, project, usd_per_million_tokens
from study.report.measurements import MeasuredGroup, pooled_cost
from study.report.tagging_cost import TaggingCost, saving_pct
from vocab.modes import Mode


@dataclass(frozen=True)
class Verdict:
    """Sidecar (document evicted) against a standalone tagger on one GPU type at one batch size.

    ``sidecar`` and ``standalone`` are the lines per request everything else is computed from; a
    projection of a workload without the draft's shape prices decode steps only (``prefill_priced``).
    """

    gpu_type: str
    pair: str
    basis: Literal["measured", "projected"]
    batch: int
    sidecar: TaggingCost
    standalone: TaggingCost
    usd_per_gpu_hour: float | None

    @property
    def prefill_priced(self) -> bool:
        return self.sidecar.prefill_s is not None and self.standalone.prefill_s is not None

    @property
    def sidecar_tokens_per_s(self) -> float:
        return self.sidecar.tokens_per_s

    @property
    def standalone_tokens_per_s(self) -> float:
        return self.standalone.tokens_per_s

    @property
    def sidecar_saving_pct(self) -> float:
        """How much less a sidecar tag token costs than a standalone one (negative: it costs more)."""
        return saving_pct(self.sidecar, self.standalone)

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


def measured_verdicts(groups: Sequence[MeasuredGroup], catalog: Mapping[str, GPU]) -> list[Verdict]:
    """One verdict per GPU type, pair and batch size measured in both modes with a ledger, runs pooled."""
    by_batch: dict[tuple[str, str, int], dict[Mode, MeasuredGroup]] = defaultdict(dict)
    for g in groups:
        if g.tag_rows:
            by_batch[(g.gpu_type, g.pair, g.batch_size)][g.mode] = g
    verdicts = []
    for (gpu_type, pair, batch), modes in by_batch.items():
        if "sidecar" not in modes or "standalone" not in modes:
            continue
        sidecar, standalone = pooled_cost(modes["sidecar"].tag_rows), pooled_cost(modes["standalone"].tag_rows)
        if sidecar is None or standalone is None:
            continue
        gpu = find_gpu(gpu_type, catalog)
        verdicts.append(
            Verdict(gpu_type, pair, "measured", batch, sidecar, standalone, None if gpu is None else gpu.usd_per_hour)
        )
    return verdicts


def _projected_cost(row: ProjectionRow, tags: int) -> TaggingCost:
    """A projection row's lines per request; decode steps only (one token per request each) where the row
    has no prefill."""
    if row.prefill_ms is None or row.decode_ms is None:
        return TaggingCost(tag_tokens=1, prefill_s=None, decode_s=row.ms_per_step / 1000 / row.batch)
    return TaggingCost.per_request(
        row.batch,
        tags * row.batch,
        prefill_s=row.prefill_ms / 1000,
        decode_s=row.decode_ms / 1000,
        instruction_s=(row.instruction_ms or 0.0) / 1000,
    )


def projected_verdict(workload: Workload, gpu: GPU, batch: int, host: HostFloor | None = None) -> Verdict | None:
    """The roofline's verdict at ``batch``, each forward paying ``host``'s floor: every line where the workload
    has the draft's shape and token counts, else its decode steps only."""
    if not {"sidecar", "standalone"} <= set(workload.kv_bytes_per_request):
        return None
    rows = {row.mode: row for row in project(workload, gpu, [batch], host)}
    tags = workload.tokens.tags if workload.tokens is not None else 1
    return Verdict(
        gpu.name,
        workload.name,
        "projected",
        batch,
        _projected_cost(rows["sidecar"], tags),
        _projected_cost(rows["standalone"], tags),
        gpu.usd_per_hour,
    )
