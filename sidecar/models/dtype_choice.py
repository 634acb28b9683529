"""Which dtype a pair runs in, and why: the caller's, else ``SIDECAR_DTYPE``, else the device's best; and
whether its Linear layers run in oneDNN's packed layout on a CPU (``packs``).

On CUDA the best is bf16, the GPUs' native fast path. On a CPU it depends on the chip: one with native bf16
matmuls (AMX, avx512_bf16) runs bf16 faster than fp32, one without emulates bf16 several times slower than
fp32 (whose Linear layers then run on oneDNN's packed kernels, ``sidecar.models.cpu_kernels``). So a CPU
times one verify-sized matmul at the target's shapes in each dtype (well under a second) and takes the
faster; ``SIDECAR_DTYPE=auto`` asks for the same.

A loaded machine stalls a two-thread matmul for a whole scheduler slice now and then, several times its own
length, so one short burst of timings can crown the wrong dtype. The two are timed in turn, call by call, until
each has had ``TIMING_BUDGET_S``, and each keeps its fastest call: the one least disturbed by the load.

fp32 Linear layers always run packed on a CPU with oneDNN (``python -m bench.kernels``). bf16 ones run packed
where oneDNN has bf16 kernels and the packed product, timed at decode widths over more weight bytes than a
CPU caches, beats the plain one by ``PACKING_MARGIN``: both matmuls the dtype choice compares are then the
ones the layers would run.
"""

from __future__ import annotations

import functools
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
# the packed layout is kept where its products take this much less time than the plain ones: the packed copy
# costs memory while the model loads
PACKING_MARGIN = 0.05
PACKING_ROWS = (1, 5)  # the rows of the products timed: a one-token decode forward and a verify of gamma + 1
# the weights timed in turn hold at least this many bytes, more than a CPU's last-level cache, as a model's do:
# one cached weight times the cache, not the layout
PACKING_BYTES = 96 << 20
PACKING_WEIGHTS = 64  # and no more weights than this (a small model's fit in a cache anyway)


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


def product(x: torch.Tensor, weight: torch.Tensor, packed: bool) -> Callable[[], object]:
    """``x`` [rows, in] times ``weight`` [out, in] transposed, on the plain kernel or oneDNN's packed one."""
    if packed:
        layout = torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_ROWS)
        return lambda: torch.ops.mkldnn._linear_pointwise(x, layout, None, "none", [], "")
    return lambda: torch.nn.functional.linear(x, weight)


def matmul_call(dtype: torch.dtype, hidden: int, intermediate: int, rows: int = VERIFY_ROWS) -> Callable[[], object]:
    """One CPU matmul of ``rows`` x ``hidden`` activations by a ``hidden`` x ``intermediate`` weight (an MLP up
    projection) in ``dtype``, on the kernel its Linear layers would run on (``packs``)."""
    weight = torch.full((intermediate, hidden), 0.01, dtype=dtype)
    return product(torch.full((rows, hidden), 0.5, dtype=dtype), weight, packs(dtype, hidden, intermediate))


def packs(dtype: torch.dtype, hidden: int, intermediate: int) -> bool:
    """Whether a CPU's Linear layers in ``dtype`` run in oneDNN's packed layout (``use_onednn_linear``): fp32
    wherever oneDNN is; bf16 where oneDNN has bf16 kernels and they are measured faster at the MLP's shape,
    once per shape, dtype and thread count."""
    if dtype == torch.float32 or not onednn_available(dtype):
        return onednn_available(dtype)
    return _packing_pays((intermediate, hidden), dtype, torch.get_num_threads())


@functools.cache
def _packing_pays(shape: tuple[int, int], dtype: torch.dtype, threads: int) -> bool:
    count = min(max(2, -(-PACKING_BYTES // (shape[0] * shape[1] * dtype.itemsize))), PACKING_WEIGHTS)
    weights = [torch.full(shape, 0.01, dtype=dtype) for _ in range(count)]
    inputs = [torch.full((rows, shape[1]), 0.5, dtype=dtype) for rows in PACKING_ROWS]
    plain, packed = ([product(x, w, layout) for x in inputs for w in weights] for layout in (False, True))
    plain_s, packed_s = fastest_seconds([lambda: [call() for call in plain], lambda: [call() for call in packed]])
    return packed_s < (1 - PACKING_MARGIN) * plain_s


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
