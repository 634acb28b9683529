"""A quantity measured at a few batches, read at any batch: linear between two measured batches, the smallest's
value below them, and beyond the largest one of two rules that say how it grows there.

- ``"segment"``: along the last segment, never falling (host work per row grows; it does not shrink);
- ``"proportional"``: the largest's value scaled by the batch (a forward's time grows at most linearly with it).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Literal

Beyond = Literal["segment", "proportional"]


def piecewise_linear(points: Sequence[tuple[int, float]], at: int, beyond: Beyond) -> float:
    """The value at batch ``at`` over ascending, non-empty (batch, value) ``points`` (see the module)."""
    batches = [b for b, _ in points]
    if at <= batches[0]:
        return points[0][1]
    last, last_value = points[-1]
    if at >= last:
        if beyond == "proportional":
            return last_value * at / last
        if len(points) == 1:
            return last_value
        (b0, v0) = points[-2]
        return last_value + max((last_value - v0) / (last - b0), 0.0) * (at - last)
    i = bisect.bisect_left(batches, at)
    (b0, v0), (b1, v1) = points[i - 1], points[i]
    return v0 + (v1 - v0) * (at - b0) / (b1 - b0)
