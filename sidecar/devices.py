"""Which physical accelerator a model pair runs on, named the same way by every process of the machine."""

from __future__ import annotations

import os
import re

import torch


def accelerator_id(device: str | None = None) -> str:
    """``cpu``, or ``cuda-<id>`` for the CUDA device that ``device`` (default: as ``load_pair`` picks it)
    is in this process: its entry of ``CUDA_VISIBLE_DEVICES`` (an index or a UUID), else its index.

    Processes that name one GPU differently in ``CUDA_VISIBLE_DEVICES`` (an index in one, its UUID in
    another) get different ids; give them the same form.
    """
    resolved = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if resolved.type != "cuda":
        return resolved.type
    # an index-less "cuda" is device 0 unless the process selected another, which this project never does
    index = resolved.index or 0
    visible = [entry.strip() for entry in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    physical = visible[index] if index < len(visible) else str(index)
    return "cuda-" + re.sub(r"[^A-Za-z0-9._-]+", "_", physical)
