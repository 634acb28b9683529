"""The GPU catalog: memory bandwidth, peak dense compute and hourly rent per GPU type, from
``study/cost/gpus.json``.

Every entry has a finite positive bandwidth, compute peak and price (``load_catalog`` refuses others, naming
the entry and field) and names the
source of each. The compute peak is the dense one: datasheets' figures "with sparsity" are twice as high.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from study.cost.errors import UnknownGPUError, number
from study.cost.units import GB, TERA


@dataclass(frozen=True)
class GPU:
    """One GPU type. ``dense_tflops`` is its peak dense tensor-core TFLOP/s for 16-bit matmuls, in
    ``tflops_dtype`` (bf16, or fp16 on a part without bf16 tensor cores)."""

    name: str
    bandwidth_gb_s: float
    dense_tflops: float
    tflops_dtype: str
    usd_per_hour: float
    source: str
    device_names: tuple[str, ...] = ()
    usd_per_hour_quoted: tuple[float, float] | None = None

    @property
    def bandwidth_bytes_s(self) -> float:
        return self.bandwidth_gb_s * GB

    @property
    def flops_s(self) -> float:
        return self.dense_tflops * TERA


def load_catalog(path: Path | None = None) -> dict[str, GPU]:
    """The GPU catalog keyed by name, from ``path`` or the packaged ``study/cost/gpus.json``."""
    if path is None:
        text = resources.files("study.cost").joinpath("gpus.json").read_text(encoding="utf-8")
    else:
        text = path.read_text(encoding="utf-8")
    catalog: dict[str, GPU] = {}
    for entry in json.loads(text)["gpus"]:
        quoted = entry.get("usd_per_hour_quoted")
        name = entry["name"]

        def positive(field: str, value: object, name: str = name) -> float:
            return number(f"catalog entry {name!r} {field}", value)

        gpu = GPU(
            name=name,
            bandwidth_gb_s=positive("bandwidth_gb_s", entry["bandwidth_gb_s"]),
            dense_tflops=positive("dense_tflops", entry["dense_tflops"]),
            tflops_dtype=entry["tflops_dtype"],
            usd_per_hour=positive("usd_per_hour", entry["usd_per_hour"]),
            source=entry["source"],
            device_names=tuple(entry.get("device_names", ())),
            usd_per_hour_quoted=(positive("usd_per_hour_quoted", quoted[0]), positive("usd_per_hour_quoted",
                                                                                       quoted[1])) if quoted else None,
        )
        catalog[gpu.name] = gpu
    return catalog


def _normalised(name: str) -> str:
    return " ".join(name.lower().split())


def find_gpu(name: str, catalog: Mapping[str, GPU]) -> GPU | None:
    """The catalog entry whose name or one of whose device names equals ``name`` (case-insensitive)."""
    wanted = _normalised(name)
    for gpu in catalog.values():
        if wanted == _normalised(gpu.name) or wanted in {_normalised(d) for d in gpu.device_names}:
            return gpu
    return None


def get_gpu(name: str, catalog: Mapping[str, GPU]) -> GPU:
    gpu = find_gpu(name, catalog)
    if gpu is None:
        raise UnknownGPUError(f"unknown GPU {name!r}; known: {', '.join(catalog)}")
    return gpu


def usd_per_million_tokens(usd_per_hour: float, tokens_per_s: float) -> float:
    return usd_per_hour / 3600 / tokens_per_s * 1e6
