"""Verdicts: is a sidecar tag token cheaper than a standalone tagger's, per GPU type (and pair)?

A measured verdict pools the batch sizes measured in both modes; a projected one reads the roofline at one
batch size.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from sidecar.cost import GPU, Workload, find_gpu, project, usd_per_million_tokens
from sidecar.modes import Mode
from sidecar.report.measurements import MeasuredGroup, pooled_throughput


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
        sidecar = pooled_throughput([r for b in common for r in modes["sidecar"][b].tag_rows])
        standalone = pooled_throughput([r for b in common for r in modes["standalone"][b].tag_rows])
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


def projected_verdict(workload: Workload, gpu: GPU, batch: int) -> Verdict | None:
    if not {"sidecar", "standalone"} <= set(workload.kv_bytes_per_request):
        return None
    rates = {row.mode: row.tokens_per_s for row in project(workload, gpu, [batch])}
    return Verdict(
        gpu.name, workload.name, "projected", (batch,), rates["sidecar"], rates["standalone"], gpu.usd_per_hour
    )
