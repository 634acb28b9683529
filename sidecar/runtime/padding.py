"""Whether a one-token forward runs faster two columns wide, measured on the machine it runs on.

A decode forward of one row and one token multiplies every weight by a one-row matrix. In bf16 on the AMD EPYC
this project runs on, PyTorch's one-row product took 1.18x a two-row one at the 1.5B target's MLP shapes (a
matrix-vector kernel slower than the matrix one), and a one-token forward of the target 1.18-1.19x a two-token
one (`python -m bench.schedule_bound` times both). So an eager forward of one token runs with a padding column
where that is measured to pay (``sidecar.runtime.capture.StackRunner``); the padding column is written to the
cache's trash column and dropped, as any padding is.
"""

from __future__ import annotations

import functools
import time

import torch

# a one-row product pads to two rows only when the two-row one is measured this much faster: a forward's other
# ops and the padding itself cost a little
PADDING_MARGIN = 0.05


def one_row_padding_pays(weight: torch.Tensor) -> bool:
    """Whether a one-row product with a weight like ``weight`` [out, in] runs faster padded to two rows, timed
    once per shape, dtype and thread count on a random weight. Reduced precision on a CPU only (a GPU's one-row
    products are not its bottleneck), and plain Linear layers only: the runner does not ask for oneDNN-packed
    ones (``sidecar.models.cpu_kernels``: fp32, and bf16 where timed faster), whose one-row product is the
    faster (``python -m bench.kernels``)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float16):
        return False
    return _padding_pays(tuple(weight.shape), weight.dtype, torch.get_num_threads())


@functools.cache
def _padding_pays(shape: tuple[int, int], dtype: torch.dtype, threads: int, rounds: int = 10) -> bool:
    weight = torch.randn(shape, dtype=dtype)
    one, two = torch.randn(1, shape[1], dtype=dtype), torch.randn(2, shape[1], dtype=dtype)
    best = [float("inf"), float("inf")]
    with torch.inference_mode():
        for i in range(rounds + 2):  # in turn, the first two rounds untimed; the fastest of each counts
            for j, x in enumerate((one, two)):
                start = time.perf_counter()
                torch.nn.functional.linear(x, weight)
                if i >= 2:
                    best[j] = min(best[j], time.perf_counter() - start)
    return best[1] < (1 - PADDING_MARGIN) * best[0]
