"""Host data onto the device without waiting for the device, and device values back to the host, counted.

``torch.tensor(data, device="cuda")`` copies from pageable memory with a blocking copy, which first waits
for every kernel queued before it: the GPU then idles until the host has queued the next ones. A copy from
pinned memory with ``non_blocking=True`` is queued like a kernel instead; the caching host allocator keeps
the pinned block until the copy has run.

The other way, every read a decoding step makes goes through ``to_host``, so that the step's syncs are counted
where they happen (``sidecar.runtime.step_counters``) instead of by intercepting every torch call.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from sidecar.runtime.step_counters import current


def to_device(data: Sequence | np.ndarray, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A new tensor on ``device`` holding host ``data`` (nested lists or an array), queued without a wait."""
    host = torch.tensor(np.asarray(data), dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def to_host(tensor: torch.Tensor) -> list:
    """``tensor.tolist()``: one read of the device (a sync on a GPU), counted in the running step's counters."""
    counters = current()
    if counters is None:
        return tensor.tolist()
    started = time.perf_counter()
    values = tensor.tolist()
    counters.syncs += 1
    counters.read_seconds += time.perf_counter() - started
    return values
