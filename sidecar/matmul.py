"""CPU matrix products: oneDNN's packed weight layout, and timing products over a model's worth of weights.

oneDNN reorders a Linear weight into blocks sized for an expected number of input rows; its packed product
then reads the weight once (``sidecar.models.cpu_kernels`` runs a model's Linear layers so). Whether that layout
pays (``sidecar.models.dtype_choice.packs``) is measured here, by products over a ring of weights larger than a
CPU's last-level cache: one cached weight would time the cache, not the kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from sidecar.fastest import fastest_seconds

# the number of input rows oneDNN lays each packed weight out for: a verify or an 8-row step streams it once
PACKED_ROWS = 8
RING_BYTES = 96 << 20  # the weights timed in turn hold at least this many bytes, as a model's do
RING_WEIGHTS = 64  # and no more weights than this (a small model's fit in a cache anyway)


def pack(weight: torch.Tensor, rows: int = PACKED_ROWS) -> torch.Tensor:
    """``weight`` [out, in] in oneDNN's layout for products of about ``rows`` input rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., in] times a ``pack``-ed weight transposed, plus ``bias``: [..., out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def product(weight: torch.Tensor, packed_rows: int | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x`` -> ``x`` times ``weight`` [out, in] transposed, on the plain kernel (``packed_rows`` None) or oneDNN's
    packed one laid out for ``packed_rows`` rows."""
    if packed_rows is None:
        return functools.partial(torch.nn.functional.linear, weight=weight)
    return functools.partial(packed_linear, packed=pack(weight, packed_rows))


def ring_seconds(shape: tuple[int, int], dtype: torch.dtype, products: Sequence[tuple[int, int | None]],
                 **timing: float) -> list[float]:
    """For each ``(rows, packed_rows)`` of ``products``: the fastest time of a ``rows``-row product by every
    weight of a ring of ``shape`` [out, in] in ``dtype`` holding at least ``RING_BYTES``, on the layout
    ``packed_rows`` names (``product``), the products timed in turn (``fastest_seconds``, given ``timing``)."""
    count = min(max(2, -(-RING_BYTES // (shape[0] * shape[1] * dtype.itemsize))), RING_WEIGHTS)
    weights = [torch.full(shape, 0.01, dtype=dtype) for _ in range(count)]
    layouts = {packed_rows: [product(w, packed_rows) for w in weights] for _, packed_rows in products}

    def over_the_ring(rows: int, packed_rows: int | None) -> Callable[[], object]:
        x = torch.full((rows, shape[1]), 0.5, dtype=dtype)
        return lambda: [call(x) for call in layouts[packed_rows]]

    return fastest_seconds([over_the_ring(rows, packed_rows) for rows, packed_rows in products], **timing)
