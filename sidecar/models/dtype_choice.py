"""Which dtype a pair runs in, and why: the caller's, else ``SIDECAR_DTYPE``, else the device's best; and
whether its Linear layers run in oneDNN's packed layout on a CPU (``packs``).

On CUDA the best is bf16, the GPUs' native fast path. On a CPU it depends on the chip: one with native bf16
matmuls (AMX, avx512_bf16) runs bf16 faster than fp32, one without emulates bf16 several times slower than
fp32 (whose Linear layers then run on oneDNN's packed kernels, ``sidecar.models.cpu_kernels``). So a CPU
times one verify-sized matmul at the target's shapes in each dtype (well under a second) and takes the
faster; ``SIDECAR_DTYPE=auto`` asks for the same.

The two are timed in turn, each keeping its fastest call (``sidecar.fastest``): a loaded machine's bursts
would otherwise crown the wrong dtype.

fp32 Linear layers always run packed on a CPU with oneDNN (``python -m bench.kernels``). bf16 ones run packed
where oneDNN has bf16 kernels and the packed product, timed at decode widths over more weight bytes than a
CPU caches, beats the plain one by ``PACKING_MARGIN``: both matmuls the dtype choice compares are then the
ones the layers would run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sidecar.errors import InputError
from sidecar.fastest import fastest_seconds
from sidecar.matmul import PACKED_ROWS, product, ring_seconds
from sidecar.models.cpu_kernels import onednn_available
from sidecar.models.pair import dtype_name
from sidecar.settings import Settings

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                                  "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
AUTO = "auto"
# a verify of gamma + 1 = 5 positions for each of 4 rows: the forward a CPU runs most
VERIFY_ROWS = 4 * 5
# the packed layout is kept where its products take this much less time than the plain ones: the packed copy
# costs memory while the model loads
PACKING_MARGIN = 0.05
PACKING_ROWS = (1, 5)  # the rows of the products timed: a one-token decode forward and a verify of gamma + 1


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
    projection) in ``dtype``, on the kernel its Linear layers would run on (``packs``)."""
    call = product(torch.full((intermediate, hidden), 0.01, dtype=dtype),
                   PACKED_ROWS if packs(dtype, hidden, intermediate) else None)
    x = torch.full((rows, hidden), 0.5, dtype=dtype)
    return lambda: call(x)


def packs(dtype: torch.dtype, hidden: int, intermediate: int) -> bool:
    """Whether a CPU's Linear layers in ``dtype`` run in oneDNN's packed layout (``use_onednn_linear``): fp32
    wherever oneDNN is; bf16 where oneDNN has bf16 kernels and they are measured faster at the MLP's shape,
    once per shape, dtype and thread count."""
    if dtype == torch.float32 or not onednn_available(dtype):
        return onednn_available(dtype)
    return _packing_pays((intermediate, hidden), dtype, torch.get_num_threads())


@functools.cache
def _packing_pays(shape: tuple[int, int], dtype: torch.dtype, threads: int) -> bool:
    plain_1, plain_5, packed_1, packed_5 = ring_seconds(
        shape, dtype, [(rows, layout) for layout in (None, PACKED_ROWS) for rows in PACKING_ROWS])
    return packed_1 + packed_5 < (1 - PACKING_MARGIN) * (plain_1 + plain_5)


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
