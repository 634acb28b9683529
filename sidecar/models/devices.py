"""Which physical accelerator a model pair runs on, named the same way by every process of the machine.

Torch loads where a function needs it, not with the module: a sharded run's parent asks which GPUs its shard
processes can have (``visible_gpus``) and holds no model, and on a machine without a GPU driver it need not pay
for torch (seconds)."""

from __future__ import annotations

import ctypes
import os
import platform
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# A CPU process that runs on its share of the machine's cores (a local shard process) names its share here: the
# shares are accelerators of their own, so that N shard processes run side by side instead of taking turns.
CPU_SLOT_ENV = "SIDECAR_CPU_SLOT"


def accelerator_id(device: str | None = None) -> str:
    """``cpu`` (``cpu-<slot>`` for share ``slot`` of the cores, :data:`CPU_SLOT_ENV`), or ``cuda-<id>`` for
    the CUDA device that ``device`` (default: as ``load_pair`` picks it) is in this process: its entry of
    ``CUDA_VISIBLE_DEVICES`` (an index or a UUID), else its index.

    Processes that name one GPU differently in ``CUDA_VISIBLE_DEVICES`` (an index in one, its UUID in
    another) get different ids; give them the same form. Where no GPU driver loads, the default is the CPU,
    named without importing torch (a judge serving its pair from another process holds the device by this name).
    """
    if device is None and not gpu_driver_present():
        kind, index = "cpu", None  # what torch would pick
    else:
        import torch

        resolved = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        kind, index = resolved.type, resolved.index
    if kind != "cuda":
        slot = os.environ.get(CPU_SLOT_ENV, "").strip()
        return f"{kind}-{_safe(slot)}" if kind == "cpu" and slot else kind
    # an index-less "cuda" is device 0 unless the process selected another, which this project never does
    index = index or 0
    visible = [entry.strip() for entry in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    physical = visible[index] if index < len(visible) else str(index)
    return "cuda-" + _safe(physical)


def _safe(name: str) -> str:
    # ids name lock files
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def visible_gpus() -> list[str]:
    """This process's CUDA devices as a child would select them in ``CUDA_VISIBLE_DEVICES``: its own entries
    of that variable, else the indexes; none without CUDA. Without a GPU driver, none, without importing torch."""
    if not gpu_driver_present():
        return []
    import torch

    if not torch.cuda.is_available():
        return []
    visible = [entry.strip() for entry in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    return visible[: torch.cuda.device_count()] or [str(i) for i in range(torch.cuda.device_count())]


def gpu_driver_present() -> bool:
    """Whether torch may find a GPU on this machine, told without importing it: the CUDA driver's library loads
    (a CUDA build's runtime loads it to find any device), or the ROCm kernel driver's device exists (a ROCm
    build's). Where neither holds, torch finds none, whatever its build; off Linux, only torch tells."""
    if sys.platform != "linux" or Path("/dev/kfd").exists():
        return True
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return "CPU " + line.split(":", 1)[1].strip()
    return "CPU " + (platform.processor() or platform.machine())
