"""Measured ÷ projected tagging-step time per catalogued GPU, mode and batch: how far a real run is from the
roofline."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from study.cost.catalog import GPU, find_gpu
from study.cost.errors import count, number
from study.cost.workload import Workload
from vocab.modes import Mode


@dataclass(frozen=True)
class MeasuredStep:
    """A measured tagging-phase decode speed: give ``ms_per_step`` or ``tokens_per_s`` (whole batch)."""

    gpu_type: str
    mode: Mode
    batch: int
    ms_per_step: float | None = None
    tokens_per_s: float | None = None

    def __post_init__(self) -> None:
        count("batch", self.batch)
        # 0 or None: not measured (``step_ms`` falls back); NaN, infinity or below 0: refused
        for name in ("ms_per_step", "tokens_per_s"):
            if (value := getattr(self, name)) is not None:
                number(f"{self.gpu_type} {self.mode} {name}", value, positive=False)

    @property
    def step_ms(self) -> float | None:
        if self.ms_per_step is not None and self.ms_per_step > 0:
            return self.ms_per_step
        if self.tokens_per_s is not None and self.tokens_per_s > 0:
            # Draft-only decoding adds one token per request per step.
            return self.batch / self.tokens_per_s * 1000
        return None


@dataclass(frozen=True)
class CalibrationRow:
    gpu_type: str
    catalog_gpu: str
    mode: Mode
    batch: int
    measured_ms_per_step: float
    projected_ms_per_step: float

    @property
    def measured_over_projected(self) -> float:
        """Above 1: slower than the roofline (the usual case)."""
        return self.measured_ms_per_step / self.projected_ms_per_step


def calibrate(measured: Iterable[MeasuredStep], workload: Workload, catalog: Mapping[str, GPU]) -> list[CalibrationRow]:
    """Measured ÷ projected step time, for measurements on catalogued GPUs in modes the workload knows."""
    rows = []
    for step in measured:
        gpu = find_gpu(step.gpu_type, catalog)
        step_ms = step.step_ms
        if gpu is None or step_ms is None or step.mode not in workload.kv_bytes_per_request:
            continue
        projected = workload.step_seconds(step.mode, step.batch, gpu.bandwidth_bytes_s, gpu.flops_s) * 1000
        rows.append(CalibrationRow(step.gpu_type, gpu.name, step.mode, step.batch, step_ms, projected))
    return rows
