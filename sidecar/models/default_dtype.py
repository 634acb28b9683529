"""The dtype a pair runs in on a device when nothing chooses one, by name: bf16 on CUDA, fp32 elsewhere.

Without torch, so that the cost report, which projects a pair in the dtype it gets on a GPU, does not load it
(seconds); ``sidecar.models.loading.default_device_dtype`` gives the torch dtype of the same name."""

from __future__ import annotations


def device_default_dtype(device: str) -> tuple[str, int]:
    """Name and bytes per element of the default dtype on ``device`` (``cuda``, ``cuda:1``, ``cpu``, ...)."""
    return ("bfloat16", 2) if device.split(":")[0] == "cuda" else ("float32", 4)
