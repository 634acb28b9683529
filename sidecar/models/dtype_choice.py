"""Which dtype a pair runs in, and why: the caller's, else ``SIDECAR_DTYPE``, else the device's best.

On CUDA the best is bf16, the GPUs' native fast path. On a CPU it depends on the chip: one with native bf16
matmuls (AMX, avx512_bf16) runs bf16 faster than fp32, one without emulates bf16 several times slower than
fp32 (whose Linear layers then run on oneDNN's packed kernels, ``sidecar.models.cpu_kernels``). So a CPU
times one verify-sized matmul at the target's shapes in each dtype (well under a second) and takes the
faster; ``SIDECAR_DTYPE=auto`` asks for the same.

A loaded machine stalls a two-thread matmul for a whole scheduler slice now and then, several times its own
length, so one short burst of timings can crown the wrong dtype. The two are timed in turn, call by call, until
each has had ``TIMING_BUDGET_S``, and each keeps its fastest call: the one least disturbed by the load.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sidecar.errors import InputError
from sidecar.models.cpu_kernels import PACKED_ROWS, onednn_available
from sidecar.models.pair import dtype_name
from sidecar.settings import Settings

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                                  "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
AUTO = "auto"
# a verify of gamma + 1 = 5 positions for each of 4 rows: the forward a CPU runs most
VERIFY_ROWS = 4 * 5
MIN_CALLS = 5  # timed calls of each dtype at least
MAX_CALLS = 200  # and at most, however fast
TIMING_BUDGET_S = 0.15  # seconds of timed calls of each dtype, unless MAX_CALLS come first


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    # why this dtype: "argument dtype=bf16", "SIDECAR_DTYPE=fp32", "auto: bf16 matmul 0.31 ms vs fp32 0.84 ms"
    reason: str


def parse_dtype(name: str, source: str) -> torch.dtype:
    """The dtype called ``name``; an unknown name is one line naming ``source`` (where it came from)."""
    if name not in DTYPES:
        raise InputError(f"unknown dtype {name!r} in {source}: use fp32, bf16, fp16 or {AUTO}")
    return DTYPES[name]


def faster_dtype(bf16_s: float, fp32_s: float) -> DtypeChoice:
    """bf16 where its matmul took less time than fp32's, fp32 otherwise (a tie keeps fp32, the reference)."""
    dtype = torch.bfloat16 if bf16_s < fp32_s else torch.float32
    return DtypeChoice(dtype, f"auto: bf16 matmul {bf16_s * 1e3:.2f} ms vs fp32 {fp32_s * 1e3:.2f} ms")


def matmul_call(dtype: torch.dtype, hidden: int, intermediate: int, rows: int = VERIFY_ROWS) -> Callable[[], object]:
    """One CPU matmul of ``rows`` x ``hidden`` activations by a ``hidden`` x ``intermediate`` weight (an MLP up
    projection) in ``dtype``; fp32 on the packed oneDNN kernel its Linear layers would run on."""
    weight = torch.full((intermediate, hidden), 0.01, dtype=dtype)
    x = torch.full((rows, hidden), 0.5, dtype=dtype)
    if dtype == torch.float32 and onednn_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_ROWS)
        return lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return lambda: torch.nn.functional.linear(x, weight)


def fastest_seconds(calls: Sequence[Callable[[], object]], budget_s: float = TIMING_BUDGET_S,
                    min_calls: int = MIN_CALLS, max_calls: int = MAX_CALLS,
                    clock: Callable[[], float] = time.perf_counter, cap_s: float | None = None) -> list[float]:
    """Each call's fastest time, the calls timed in turn (one of each per round, so a burst of load falls on
    all of them alike) until each has run ``min_calls`` times and ``budget_s`` or ``max_calls`` is spent, or
    the timed rounds have taken ``cap_s`` in all (after one round at least: calls of seconds each)."""
    best, spent = [float("inf")] * len(calls), [0.0] * len(calls)
    with torch.inference_mode():
        for call in calls:
            call()  # the first call picks and prepares its kernel
        for done in range(1, max_calls + 1):
            for i, call in enumerate(calls):
                began = clock()
                call()
                took = clock() - began
                best[i], spent[i] = min(best[i], took), spent[i] + took
            if (done >= min_calls and min(spent) >= budget_s) or (cap_s is not None and sum(spent) >= cap_s):
                break
    return best


def requested_dtype(dtype: str | torch.dtype | None) -> DtypeChoice | None:
    """The dtype asked for: the argument ``dtype`` if given, else ``SIDECAR_DTYPE``; None for neither or
    ``auto``."""
    if isinstance(dtype, torch.dtype):
        return DtypeChoice(dtype, f"argument dtype={dtype_name(dtype)}")
    if dtype is not None:
        dtype = dtype.strip().lower()
        if dtype == AUTO:
            return None
        return DtypeChoice(parse_dtype(dtype, "the dtype argument"), f"argument dtype={dtype}")
    env = Settings().dtype
    return None if env in (None, AUTO) else DtypeChoice(parse_dtype(env, "SIDECAR_DTYPE"), f"SIDECAR_DTYPE={env}")


def choose_dtype(device: torch.device, dtype: str | torch.dtype | None, hidden: int, intermediate: int) -> DtypeChoice:
    """:func:`requested_dtype` if any, else bf16 on CUDA and on a CPU the faster of bf16 and fp32, timed at
    the target's ``hidden`` x ``intermediate``."""
    if (requested := requested_dtype(dtype)) is not None:
        return requested
    if device.type == "cuda":
        return DtypeChoice(torch.bfloat16, "default on CUDA: bf16")
    if device.type != "cpu":
        return DtypeChoice(torch.float32, f"default on {device.type}: fp32")
    bf16_s, fp32_s = fastest_seconds([matmul_call(torch.bfloat16, hidden, intermediate),
                                      matmul_call(torch.float32, hidden, intermediate)])
    return faster_dtype(bf16_s, fp32_s)
