"""Measurements: rows of the storage ``throughput`` view, and their pooling per GPU type, pair, mode and batch.

A row of phase ``main`` is the speculative summary; every other phase, and every ``standalone`` row, is
tagging work, which is what the costs compare.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from study.cost import CostInputError
from vocab.modes import MODES, Mode

MAIN_PHASE = "main"


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


def pooled_throughput(rows: Sequence[Measurement]) -> float | None:
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
                tag_tokens_per_s=pooled_throughput(tag),
                tag_ms_per_step=_mean([r.step_ms for r in tag]),
                tag_seconds_per_batch=_per_batch([r.seconds for r in tag], batch_count),
                tag_prefill_s_per_batch=_per_batch([r.prefill_s for r in tag], batch_count),
                kv_bytes_per_request=_mean([r.mean_kv_bytes for r in tag]),
                summary_tokens_per_s=pooled_throughput(main),
                acceptance_rate=_mean([r.acceptance_rate for r in main]),
            )
        )
    return groups


AcceptanceKey = tuple[str, str, Mode]  # gpu_type, pair, mode


def acceptance_by_key(rows: Sequence[Mapping[str, Any]]) -> dict[AcceptanceKey, list[float]]:
    """Per-request acceptance rates per GPU type, pair and mode, in the report's order."""
    rates: dict[AcceptanceKey, list[float]] = defaultdict(list)
    for row in rows:
        rate, mode = _number(row.get("acceptance_rate")), row.get("mode")
        if rate is not None and mode in MODES:
            rates[(str(row.get("gpu_type") or "unknown device"), str(row.get("pair") or ""), mode)].append(rate)
    return {key: rates[key] for key in sorted(rates, key=lambda k: (k[0], k[1], MODES.index(k[2])))}
