"""Host data onto the device without waiting for the device.

``torch.tensor(data, device="cuda")`` copies from pageable memory with a blocking copy, which first waits
for every kernel queued before it: the GPU then idles until the host has queued the next ones. A copy from
pinned memory with ``non_blocking=True`` is queued like a kernel instead; the caching host allocator keeps
the pinned block until the copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(data: Sequence | np.ndarray, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A new tensor on ``device`` holding host ``data`` (nested lists or an array), queued without a wait."""
    host = torch.tensor(np.asarray(data), dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
