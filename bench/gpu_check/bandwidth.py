"""The memory bandwidth a device reaches, measured: a copy of one large buffer into another, whatever the device's
name. The catalog's peak (``study/cost/gpus.json``) is a datasheet's and needs the device's name to match one of
its entries; a lent GPU the catalog does not list (an H100 PCIe, an H200 NVL) still gets a bandwidth to read a
decode step's share against. A copy reads and writes every byte, so it moves twice the buffer; the fastest of
``ROUNDS`` rounds of ``COPIES`` copies counts (a copy's launch is microseconds against milliseconds of traffic).
"""

from __future__ import annotations

import torch

from sidecar.fastest import fastest_seconds
from sidecar.runtime.syncs import synchronize

# a buffer far larger than any cache (an H100's L2 is 50 MB), and copies enough to dwarf their launches
CUDA_BYTES = 1 << 30
CPU_BYTES = 1 << 26  # a CPU rehearsal: the code path, in a fraction of a second
COPIES = 10
ROUNDS = 3


def copy_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Bytes per second a device-to-device copy of ``nbytes`` (default: ``CUDA_BYTES`` on CUDA, ``CPU_BYTES``
    elsewhere) moves, read and written, the fastest of ``ROUNDS`` rounds."""
    nbytes = nbytes or (CUDA_BYTES if device.type == "cuda" else CPU_BYTES)
    seconds = fastest_copies(device, nbytes)  # its buffers are freed when it returns
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes * COPIES / seconds


def fastest_copies(device: torch.device, nbytes: int) -> float:
    """The fastest of ``ROUNDS`` rounds of ``COPIES`` copies of ``nbytes`` (``sidecar.fastest``; its untimed first
    round maps the pages and loads the kernel)."""
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)

    def copies() -> None:
        for _ in range(COPIES):
            target.copy_(source)
        synchronize(device)  # the round ends when the device has copied, not when the host has queued

    (fastest,) = fastest_seconds([copies], budget_s=0.0, min_calls=ROUNDS)
    return fastest
