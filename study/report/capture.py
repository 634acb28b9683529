"""The report's capture modes: which host floor its projections assume, and eager against captured for
speculation with the study's pair at the measured acceptance.

The tagging projections assume captured mode (CUDA graphs, as the engine runs on a GPU): each forward pays
the captured floor, measured or, without a ``cudagraph`` row in the host-overhead result, 0 and a lower
bound. Beside them, per catalog GPU and at batch 1, 8 and 32, speculation with Qwen2.5-7B/1.5B (their
published shapes, the pair users run) against plain decoding of the target, in eager mode (its host cost added to
the device's time, and overlapping it: ``HostFloor.overlapped``) and in captured mode (``study.cost.speculation``),
at the mean acceptance of the report's main phase, over the study's context.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from study.cost import (
    GPU,
    HostFloor,
    HostFloors,
    SpeculationRow,
    default_host_overhead_path,
    load_host_floors,
    speculation_vs_plain,
)
from study.cost.host_floor import unmeasured_captured_floor
from study.cost.speculation import STUDY_CONTEXT
from study.cost.workload import QWEN2_5_1_5B, QWEN2_5_7B
from study.report.measurements import MeasuredGroup

SPECULATION_BATCHES = (1, 8, 32)
SPECULATION_PAIR = "Qwen2.5-7B/1.5B"


@dataclass(frozen=True)
class CaptureModes:
    """The floors the report read (``eager`` None: no host-overhead result), the acceptance speculation is
    priced at (None: none measured) and, per catalog GPU and capture mode, a row per batch."""

    captured: HostFloor
    eager: HostFloor | None
    path: Path | None
    acceptance: float | None
    acceptance_pairs: tuple[str, ...]
    # GPU -> reading (``SpeculationRow.reading``: eager, eager overlapped, captured) -> a row per batch
    rows: dict[str, dict[str, list[SpeculationRow]]] = field(default_factory=dict)

    def slower(self, reading: str) -> dict[str, list[int]]:
        """GPU -> the batches at which speculation in ``reading`` is slower than plain decoding."""
        slower = {gpu: [r.batch for r in by_mode[reading] if r.slower] for gpu, by_mode in self.rows.items()}
        return {gpu: batches for gpu, batches in slower.items() if batches}


def report_floors(host_overhead: str | Path | None) -> HostFloors | None:
    """The floors of ``host_overhead``, else of the committed result; None where neither exists. A file that
    exists but cannot be used raises, naming it and the field."""
    path = host_overhead if host_overhead is not None else default_host_overhead_path()
    return None if path is None else load_host_floors(path)


def capture_modes(floors: HostFloors | None, groups: Sequence[MeasuredGroup],
                  catalog: Mapping[str, GPU]) -> CaptureModes:
    captured = floors.captured if floors is not None else unmeasured_captured_floor(
        "no host-overhead result is committed")
    rates = [g.acceptance_rate for g in groups if g.acceptance_rate is not None]
    acceptance = statistics.fmean(rates) if rates else None
    pairs = tuple(sorted({g.pair for g in groups if g.acceptance_rate is not None and g.pair}))
    modes = CaptureModes(captured, None if floors is None else floors.eager, None if floors is None else floors.path,
                         acceptance, pairs)
    if floors is None or acceptance is None:
        return modes
    hosts = (floors.eager, floors.eager.overlapping(), floors.captured)
    for gpu in catalog.values():
        for host in hosts:
            rows = [speculation_vs_plain(QWEN2_5_7B, QWEN2_5_1_5B, gpu, batch, STUDY_CONTEXT, acceptance, host)
                    for batch in SPECULATION_BATCHES]
            modes.rows.setdefault(gpu.name, {})[rows[0].reading] = rows
    return modes
