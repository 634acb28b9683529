"""The width a one-row eager decode forward runs at, measured on the machine it runs on.

A decode forward of one row and w tokens multiplies every weight by a w-row matrix, and a CPU's matmul library
picks its kernel by the rows: a narrower product can take longer than a wider one. On this project's AMD EPYC in
bf16, a plain one-row product is slower than a two-row one, and with the weights in oneDNN's packed layout
(``sidecar.models.cpu_kernels``) the target's forward of one column is slower than its forwards of four to six
(docs/benchmarks.md, `python -m bench.schedule_bound`). So an eager forward of one row runs at the cheapest width
that holds it (``PaddedWidths``); the extra columns are padding, written to the cache's trash column and dropped,
as any padding is.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from sidecar.matmul import ring_seconds

# a forward is widened only where the wider products are measured this much faster: a forward's other ops (its
# attention, its LM head over the real columns) and the padding itself cost a little
PADDING_MARGIN = 0.05
MAX_WIDTH = 8  # the widths timed: a one-token step up to a verify of 7 drafts
ROUNDS = 8  # of the widths' products, timed in turn (``sidecar.matmul.ring_seconds``): each keeps its fastest


class PaddedWidths:
    """``of(w)``: the width a one-row eager decode forward of ``w`` columns runs at: the cheapest timed width of
    at least ``w`` whose products take ``PADDING_MARGIN`` less time than ``w``'s, else ``w``. ``widths[w - 1]``
    for ``w`` up to ``MAX_WIDTH``; a wider forward runs at its own width."""

    def __init__(self, widths: tuple[int, ...] = ()) -> None:
        self.widths = widths

    def of(self, width: int) -> int:
        return self.widths[width - 1] if width <= len(self.widths) else width

    @classmethod
    def choose(cls, seconds: list[float]) -> PaddedWidths:
        """From ``seconds[w - 1]``, the time of a product of ``w`` rows."""
        widths = []
        for width in range(1, len(seconds) + 1):
            cheapest = min(range(width, len(seconds) + 1), key=lambda w: seconds[w - 1])
            widths.append(cheapest if seconds[cheapest - 1] < (1 - PADDING_MARGIN) * seconds[width - 1] else width)
        return cls(tuple(widths))


def padded_widths(layer: nn.Module) -> PaddedWidths:
    """The widths for a model whose widest decoder Linear is ``layer`` (a plain ``nn.Linear`` or a oneDNN-packed
    one: a module with ``packed`` and ``packed_rows``), timed once per shape, dtype, layout and thread count.
    Reduced precision on a CPU only (a GPU's narrow products are not its bottleneck; fp32's packed products are
    the fastest at one row, `python -m bench.kernels`); a plain width everywhere else."""
    weight = layer.packed if hasattr(layer, "packed") else layer.weight
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float16):
        return PaddedWidths()
    shape = (layer.out_features, layer.in_features)
    return PaddedWidths.choose(_product_seconds(shape, weight.dtype, getattr(layer, "packed_rows", None),
                                                torch.get_num_threads()))


@functools.cache
def _product_seconds(shape: tuple[int, int], dtype: torch.dtype, packed_rows: int | None, threads: int) -> list[float]:
    widths = [(rows, packed_rows) for rows in range(1, MAX_WIDTH + 1)]
    return ring_seconds(shape, dtype, widths, budget_s=0.0, min_calls=ROUNDS, max_calls=ROUNDS)
