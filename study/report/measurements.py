"""Measurements: rows of the storage ``throughput`` view, and their pooling per GPU type, pair, mode and batch.

A row of phase ``main`` is the speculative summary; every other phase, and every ``standalone`` row, is
tagging work, which is what the costs compare. Cost is read from the device-time ledger only (attributed
device seconds, ``study.report.tagging_cost``); wall-clock columns are latency (the decode step time, the
first token) and never divide a rate. A row without a ledger, written by an older engine, has no rate.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from study.cost import CostInputError
from study.report.tagging_cost import TaggingCost
from vocab.modes import MODES, Mode

MAIN_PHASE = "main"


def _number(value: Any, field: str = "a measurement") -> float | None:
    """A float, or None for missing values (None, NaN) as DuckDB and pandas hand them over; an infinite one is
    no measurement (``CostInputError`` naming ``field``)."""
    if value is None:
        return None
    number = float(value)
    if math.isinf(number):
        raise CostInputError(f"{field} must be a finite number, got {value!r}")
    return None if math.isnan(number) else number


# the fields of a Measurement that are the throughput view's columns of the same name, read as numbers
_VIEW_COLUMNS = ("ms_per_step", "acceptance_rate", "mean_kv_bytes", "prompt_tokens", "prefill_s", "decode_s",
                 "longest_row_tokens", "ledger_requests", "prefill_device_s", "decode_device_s",
                 "instruction_device_s", "prefill_tokens", "instruction_tokens", "mean_first_token_s",
                 "syncs_per_step", "host_ms_per_step")


@dataclass(frozen=True)
class Measurement:
    """One row of the storage ``throughput`` view (one run, mode and phase): its ledger (requests and new
    tokens that have one, their attributed device seconds per line, the tokens of their prefill and
    instruction lines) and its wall-clock latency (``seconds``, ``prefill_s``, ``decode_s``, the mean queue
    and first-token times)."""

    gpu_type: str
    mode: Mode
    phase: str
    batch_size: int
    pair: str = ""
    run_id: str | None = None
    # the dtype the run's pair loaded in, and why ("bf16 (auto: bf16 matmul 0.31 ms vs fp32 0.84 ms)")
    dtype: str = ""
    # its capture mode and why ("eager (auto: CPU, eager ...)"; storage's run_captures), and the run's recompiles
    # after warm-up, graph breaks and graphs left uncaptured in cudagraph mode, which must be 0 (None: not kept)
    capture: str = ""
    recompiles: float | None = None
    graph_breaks: float | None = None
    cudagraph_skips: float | None = None
    ms_per_step: float | None = None
    # its run's decoding steps (storage's run_captures): reads of the device per step, and host time per step (wall
    # less the reads: on a GPU the host's own work, the floor a captured step cannot go below; on a CPU the step)
    syncs_per_step: float | None = None
    host_ms_per_step: float | None = None
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
    ledger_requests: float | None = None
    ledger_tokens: float | None = None
    prefill_device_s: float | None = None
    decode_device_s: float | None = None
    instruction_device_s: float | None = None
    prefill_tokens: float | None = None
    instruction_tokens: float | None = None
    mean_first_token_s: float | None = None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Measurement:
        mode = row.get("mode")
        if mode not in MODES:
            raise CostInputError(f"measurement has mode {mode!r}; known: {', '.join(MODES)}")
        requests, batches = _number(row.get("requests"), "requests"), _number(row.get("batches"), "batches")
        batch_size = _number(row.get("batch_size"), "batch_size")
        if batch_size is None and requests and batches:
            batch_size = round(requests / batches)
        if batch_size is None or batch_size < 1 or batch_size != int(batch_size):
            # a batch of 1.9 is no batch: int() would make it 1 without a word
            raise CostInputError(f"measurement without a positive integer batch_size: {dict(row)}")
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
            dtype=str(row.get("dtype") or ""),
            capture=str(row.get("capture") or ""),
            recompiles=_number(row.get("recompiles"), "recompiles"),
            graph_breaks=_number(row.get("graph_breaks"), "graph_breaks"),
            cudagraph_skips=_number(row.get("cudagraph_skips"), "cudagraph_skips"),
            tokens=_number(tokens, "tokens"),
            seconds=_number(seconds, "seconds"),
            requests=requests,
            batches=batches,
            ledger_tokens=_number(row.get("ledger_new_tokens"), "ledger_new_tokens"),
            **{name: _number(row.get(name), name) for name in _VIEW_COLUMNS},
        )

    @property
    def capture_fault(self) -> str | None:
        """Its run's recompiles after warm-up, graph breaks and uncaptured graphs, in words, where any is above 0 (a
        fault: compiling, or forwards not replayed as CUDA graphs, were timed as its steps); else None."""
        counted = [(self.recompiles, "recompile(s) after warm-up"), (self.graph_breaks, "graph break(s)"),
                   (self.cudagraph_skips, "graph(s) left uncaptured")]
        said = [f"{n:g} {what}" for n, what in counted if n]
        return ", ".join(said) or None

    @property
    def is_tagging(self) -> bool:
        return self.mode == "standalone" or self.phase != MAIN_PHASE

    @property
    def has_ledger(self) -> bool:
        """Whether some of its requests carry the device-time ledger (its tokens and both phases' seconds)."""
        return bool(self.ledger_requests) and self.ledger_tokens is not None and \
            self.prefill_device_s is not None and self.decode_device_s is not None

    @property
    def step_ms(self) -> float | None:
        """Milliseconds per draft decode step of a tagging row, prefill excluded: wall clock, latency.

        A batch steps until its longest row finishes, and draft-only decoding takes each row's first token
        from the prefill forward: a batch whose longest row made n tokens ran n - 1 decode steps.
        """
        if self.ms_per_step:
            return self.ms_per_step
        if self.decode_s is None or not self.longest_row_tokens or not self.batches:
            return None
        steps = self.longest_row_tokens - self.batches
        return self.decode_s * 1000 / steps if steps > 0 else None


def pooled_cost(rows: Sequence[Measurement]) -> TaggingCost | None:
    """The lines per request of the rows' ledgered requests, pooled (summed, then divided by the requests);
    None when no row has a ledger or its requests made no token."""
    ledgered = [r for r in rows if r.has_ledger]
    requests = sum(r.ledger_requests or 0 for r in ledgered)
    tokens = sum(r.ledger_tokens or 0 for r in ledgered)
    if not requests or not tokens:
        return None
    cost = TaggingCost.per_request(
        requests,
        tokens,
        prefill_s=sum(r.prefill_device_s or 0 for r in ledgered),
        decode_s=sum(r.decode_device_s or 0 for r in ledgered),
        instruction_s=sum(r.instruction_device_s or 0 for r in ledgered),
    )
    return cost if cost.seconds > 0 else None


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _weighted_mean(pairs: Sequence[tuple[float | None, float | None]]) -> float | None:
    """The mean of values weighted by their counts, over the pairs that have both."""
    present = [(value, count) for value, count in pairs if value is not None and count]
    total = sum(count for _, count in present)
    return sum(value * count for value, count in present) / total if total else None


GroupKey = tuple[str, str, Mode, int]  # gpu_type, pair, mode, batch_size


@dataclass(frozen=True)
class MeasuredGroup:
    """Measurements of one GPU type, pair, mode and batch size, runs pooled: the tagging phase's lines per
    request (None without a ledger) and its latency, and the main phase's rate and acceptance."""

    gpu_type: str
    pair: str
    mode: Mode
    batch_size: int
    run_ids: tuple[str, ...]
    tag_rows: tuple[Measurement, ...]
    tag_cost: TaggingCost | None
    tag_ms_per_step: float | None
    tag_first_token_s: float | None
    kv_bytes_per_request: float | None
    summary_tokens_per_s: float | None
    acceptance_rate: float | None

    @property
    def tag_tokens_per_s(self) -> float | None:
        """Tag tokens per attributed device second."""
        return None if self.tag_cost is None else self.tag_cost.tokens_per_s


def group_measurements(measurements: Sequence[Measurement]) -> list[MeasuredGroup]:
    by_key: dict[GroupKey, list[Measurement]] = defaultdict(list)
    for m in measurements:
        by_key[(m.gpu_type, m.pair, m.mode, m.batch_size)].append(m)
    groups = []
    for key in sorted(by_key, key=lambda k: (k[0], k[1], MODES.index(k[2]), k[3])):
        rows = by_key[key]
        tag = [r for r in rows if r.is_tagging]
        main = [r for r in rows if not r.is_tagging]
        summary = pooled_cost(main)
        groups.append(
            MeasuredGroup(
                gpu_type=key[0],
                pair=key[1],
                mode=key[2],
                batch_size=key[3],
                run_ids=tuple(sorted({r.run_id for r in rows if r.run_id})),
                tag_rows=tuple(tag),
                tag_cost=pooled_cost(tag),
                tag_ms_per_step=_mean([r.step_ms for r in tag]),
                tag_first_token_s=_weighted_mean([(r.mean_first_token_s, r.requests) for r in tag]),
                kv_bytes_per_request=_mean([r.mean_kv_bytes for r in tag]),
                summary_tokens_per_s=None if summary is None else summary.tokens_per_s,
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
