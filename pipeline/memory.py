"""Accelerator memory: recognising an out-of-memory error, and handing cached memory back."""

from __future__ import annotations

import torch

from sidecar.runtime.pools import release_free


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA OOM: ``torch.OutOfMemoryError``, or the plain RuntimeError older kernels and backends raise."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


def release_memory() -> None:
    """Hand cached, unused accelerator memory back, for a retry or for another process's model: the KV caches
    kept for the next batches first (``sidecar.runtime.pools``), then the allocator's cache."""
    release_free()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
