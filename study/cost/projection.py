"""Roofline projections of the tagging phase: bytes, time, tokens/s and $ per 1M tokens per mode and batch.

A decode step at the batch sizes sidecar runs is memory-bandwidth bound: it streams the weights once and
every request's KV cache once, so

    bytes per step = weight bytes read per step + batch x KV bytes per request
    seconds per step = bytes per step / bandwidth   (or FLOPs / peak FLOP/s, if longer: see ``roofline``)
    tokens/s = batch / seconds per step          (one new token per request per step)
    $ per 1M tokens = $/GPU-hour / 3600 / tokens/s x 1e6

With the draft's shape and token counts the whole tagging phase is priced too: a prefill forward (the
standalone tagger's whole prompt, the sidecar's few fed tokens), then ``tags - 1`` decode steps, and for a
sidecar its instruction's share of the main draft prefill, so

    tag tokens/s = batch x tags / (prefill + (tags - 1) x seconds per step + instruction)

which is what a measured tag tok/s counts: tag tokens per attributed device second, the same lines.

Every forward also pays the host floor of a capture mode (``host_floor``), given as ``host``: a row names
its mode in ``capture`` ("roofline" without a floor).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from study.cost.catalog import GPU, usd_per_million_tokens
from study.cost.errors import CostInputError, count, number
from study.cost.host_floor import HostFloor
from study.cost.roofline import Peaks
from study.cost.units import GB
from study.cost.workload import Workload
from vocab.modes import MODES, SIDECAR_MODES, Mode

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class ProjectionRow:
    """One mode at one batch size. ``ms_per_step``, ``tokens_per_s`` and ``usd_per_million_tokens`` are of
    decode steps; ``prefill_ms`` and ``decode_ms`` are one batch's tagging prefill and its ``tags - 1``
    decode steps, ``instruction_ms`` a sidecar's share of the batch's main draft prefill (0 standalone),
    and ``tag_tokens_per_s``/``usd_per_million_tag_tokens`` the whole tagging phase's (None where the
    workload has no shape to price FLOPs, or the device no FLOP/s)."""

    gpu_type: str
    mode: Mode
    batch: int
    gb_per_step: float
    ms_per_step: float
    tokens_per_s: float
    usd_per_gpu_hour: float | None
    usd_per_million_tokens: float | None
    prefill_ms: float | None = None
    decode_ms: float | None = None
    instruction_ms: float | None = None
    tag_tokens_per_s: float | None = None
    usd_per_million_tag_tokens: float | None = None
    capture: str = "roofline"  # the capture mode whose host floor each forward pays; "roofline": none


def _capture(host: HostFloor | None) -> str:
    return "roofline" if host is None else host.capture


def _usd(usd_per_hour: float | None, tokens_per_s: float | None) -> float | None:
    return None if usd_per_hour is None or tokens_per_s is None else usd_per_million_tokens(usd_per_hour, tokens_per_s)


def _projection_row(
    workload: Workload,
    gpu_type: str,
    mode: Mode,
    batch: int,
    bandwidth_bytes_s: float,
    flops_s: float | None,
    usd_per_hour: float | None,
    host: HostFloor | None = None,
) -> ProjectionRow:
    seconds = workload.step_seconds(mode, batch, bandwidth_bytes_s, flops_s, host)
    tokens_per_s = batch / seconds
    tagging = (None if flops_s is None
               else workload.tagging_time(mode, batch, Peaks(bandwidth_bytes_s, flops_s), host))
    tag_tokens_per_s = None
    if tagging is not None and workload.tokens is not None:
        tag_tokens_per_s = batch * workload.tokens.tags / tagging.seconds
    return ProjectionRow(
        gpu_type=gpu_type,
        mode=mode,
        batch=batch,
        gb_per_step=workload.step_bytes(mode, batch) / GB,
        ms_per_step=seconds * 1000,
        tokens_per_s=tokens_per_s,
        usd_per_gpu_hour=usd_per_hour,
        usd_per_million_tokens=_usd(usd_per_hour, tokens_per_s),
        prefill_ms=None if tagging is None else tagging.prefill_s * 1000,
        decode_ms=None if tagging is None else tagging.decode_s * 1000,
        instruction_ms=None if tagging is None else tagging.instruction_s * 1000,
        tag_tokens_per_s=tag_tokens_per_s,
        usd_per_million_tag_tokens=_usd(usd_per_hour, tag_tokens_per_s),
        capture=_capture(host),
    )


def check_batches(batches: Sequence[int]) -> None:
    """Raises :class:`CostInputError` unless ``batches`` is a non-empty list of sizes of at least 1."""
    if not batches:
        raise CostInputError("batch sizes must be positive integers, got none")
    for batch in batches:
        count("batch sizes", batch)


def project(workload: Workload, gpu: GPU, batches: Sequence[int] = DEFAULT_BATCHES,
            host: HostFloor | None = None) -> list[ProjectionRow]:
    """One row per mode the workload knows and per batch size, on ``gpu``, each forward paying ``host``'s floor."""
    check_batches(batches)
    return [
        _projection_row(workload, gpu.name, mode, batch, gpu.bandwidth_bytes_s, gpu.flops_s, gpu.usd_per_hour, host)
        for mode in MODES
        if mode in workload.kv_bytes_per_request
        for batch in batches
    ]


@dataclass(frozen=True)
class RooflineRow:
    """Document attended (full KV) against evicted (masked KV) at one batch size; standalone if known.

    The ``*_prefill_ms`` and ``*_decode_ms`` fields are one batch's tagging prefill and its decode steps,
    ``*_instruction_ms`` a sidecar's instruction line (its share of the main draft prefill), and
    ``sidecar_saving_pct`` how much less the evicted sidecar's tagging phase takes than the standalone
    tagger's, all lines included; None without the draft's shape and token counts or without a FLOP/s peak.
    """

    batch: int
    full_gb_per_step: float
    masked_gb_per_step: float
    full_ms_per_step: float
    masked_ms_per_step: float
    full_tokens_per_s: float
    masked_tokens_per_s: float
    speedup_pct: float
    standalone_gb_per_step: float | None
    standalone_ms_per_step: float | None
    standalone_tokens_per_s: float | None
    usd_per_million_full: float | None
    usd_per_million_masked: float | None
    usd_per_million_standalone: float | None
    full_prefill_ms: float | None = None
    masked_prefill_ms: float | None = None
    standalone_prefill_ms: float | None = None
    full_decode_ms: float | None = None
    masked_decode_ms: float | None = None
    standalone_decode_ms: float | None = None
    full_instruction_ms: float | None = None
    masked_instruction_ms: float | None = None
    sidecar_saving_pct: float | None = None
    capture: str = "roofline"


def roofline_table(
    workload: Workload,
    bandwidth_bytes_s: float,
    batches: Sequence[int],
    usd_per_hour: float | None = None,
    flops_s: float | None = None,
    host: HostFloor | None = None,
) -> list[RooflineRow]:
    """One row per batch size on a device of ``bandwidth_bytes_s`` (and ``flops_s``, which prices the prefill),
    each forward paying ``host``'s floor."""
    number("bandwidth", bandwidth_bytes_s)
    if flops_s is not None:
        number("FLOP/s", flops_s)
    for mode in SIDECAR_MODES:
        if mode not in workload.kv_bytes_per_request:
            raise CostInputError(f"the workload needs KV bytes per request for {mode}")
    check_batches(batches)
    rows = []
    for batch in batches:
        full, masked = (
            _projection_row(workload, "", mode, batch, bandwidth_bytes_s, flops_s, usd_per_hour, host)
            for mode in ("sidecar_attended", "sidecar")
        )
        alone = (
            _projection_row(workload, "", "standalone", batch, bandwidth_bytes_s, flops_s, usd_per_hour, host)
            if "standalone" in workload.kv_bytes_per_request
            else None
        )
        saving = None
        if alone is not None and alone.tag_tokens_per_s and masked.tag_tokens_per_s:
            saving = (1 - alone.tag_tokens_per_s / masked.tag_tokens_per_s) * 100
        alone_values = (
            (None, None, None, None)
            if alone is None
            else (alone.gb_per_step, alone.ms_per_step, alone.tokens_per_s, alone.usd_per_million_tokens)
        )
        rows.append(
            RooflineRow(
                batch=batch,
                full_gb_per_step=full.gb_per_step,
                masked_gb_per_step=masked.gb_per_step,
                full_ms_per_step=full.ms_per_step,
                masked_ms_per_step=masked.ms_per_step,
                full_tokens_per_s=full.tokens_per_s,
                masked_tokens_per_s=masked.tokens_per_s,
                speedup_pct=(full.ms_per_step / masked.ms_per_step - 1) * 100,
                standalone_gb_per_step=alone_values[0],
                standalone_ms_per_step=alone_values[1],
                standalone_tokens_per_s=alone_values[2],
                usd_per_million_full=full.usd_per_million_tokens,
                usd_per_million_masked=masked.usd_per_million_tokens,
                usd_per_million_standalone=alone_values[3],
                full_prefill_ms=full.prefill_ms,
                masked_prefill_ms=masked.prefill_ms,
                standalone_prefill_ms=None if alone is None else alone.prefill_ms,
                full_decode_ms=full.decode_ms,
                masked_decode_ms=masked.decode_ms,
                standalone_decode_ms=None if alone is None else alone.decode_ms,
                full_instruction_ms=full.instruction_ms,
                masked_instruction_ms=masked.instruction_ms,
                sidecar_saving_pct=saving,
                capture=_capture(host),
            )
        )
    return rows
