"""The width a one-row eager decode forward runs at, measured on the machine it runs on.

A decode forward of one row and w tokens multiplies every weight by a w-row matrix, and a CPU's matmul library
picks its kernel by the rows (attention too, by the query's width): a narrower forward can take longer than a
wider one (docs/benchmarks.md, `python -m bench.padded_widths`). So an eager forward of one row runs at the
cheapest width that holds it (``PaddedWidths``); the extra columns are padding, written to the cache's trash
column and dropped, as any padding is.

The widths are chosen from the model's own whole one-row forwards of 1 to ``MAX_WIDTH`` columns, timed at load:
a forward's time is more than its products' (docs/design.md says why not the products alone).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from sidecar.fastest import fastest_seconds

# a forward is widened only where the wider forward is measured this much faster: timings of near-equal forwards
# differ by noise, and the padding computes columns no one reads
PADDING_MARGIN = 0.05
MAX_WIDTH = 8  # the widths timed: a one-token step up to a verify of 7 drafts
ROUNDS = 3  # of the widths' forwards, timed in turn (``sidecar.fastest``): each keeps its fastest
_TIMED: dict[Hashable, list[float]] = {}  # seconds per width, per model shape, dtype, layout and thread count


class PaddedWidths:
    """``of(w)``: the width a one-row eager decode forward of ``w`` columns runs at: the cheapest timed width of
    at least ``w`` whose forward takes ``PADDING_MARGIN`` less time than ``w``'s, else ``w``. ``widths[w - 1]``
    for ``w`` up to ``MAX_WIDTH``; a wider forward runs at its own width."""

    def __init__(self, widths: tuple[int, ...] = ()) -> None:
        self.widths = widths

    def of(self, width: int) -> int:
        return self.widths[width - 1] if width <= len(self.widths) else width

    @classmethod
    def choose(cls, seconds: list[float]) -> PaddedWidths:
        """From ``seconds[w - 1]``, the time of a forward of ``w`` columns."""
        widths = []
        for width in range(1, len(seconds) + 1):
            cheapest = min(range(width, len(seconds) + 1), key=lambda w: seconds[w - 1])
            widths.append(cheapest if seconds[cheapest - 1] < (1 - PADDING_MARGIN) * seconds[width - 1] else width)
        return cls(tuple(widths))


def padded_widths(device: torch.device, dtype: torch.dtype, key: Hashable,
                  forward: Callable[[int], Callable[[], object]]) -> PaddedWidths:
    """The widths for a model on ``device`` in ``dtype``: ``forward(w)`` is a call of its one-row eager decode
    forward of ``w`` columns, unpadded. Timed once per ``key`` (the model's shape and layout) and thread count,
    and for reduced precision on a CPU only (a GPU's narrow forward is not its bottleneck; in fp32 the packed
    one-row forward was the fastest, `python -m bench.kernels`); a plain width everywhere else."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return PaddedWidths()
    timed = (key, dtype, torch.get_num_threads())
    if timed not in _TIMED:
        _TIMED[timed] = fastest_seconds([forward(w) for w in range(1, MAX_WIDTH + 1)], budget_s=0.0,
                                        min_calls=ROUNDS, max_calls=ROUNDS)
    return PaddedWidths.choose(_TIMED[timed])
