"""The host floor: what the host spends on each forward, whatever the GPU, per capture mode.

The roofline prices a forward's bytes and FLOPs; in eager PyTorch a forward also costs its host work (Python,
dispatch, kernel launches, building its inputs), per layer, whatever the width. ``bench/host_overhead.py``
measures it on a pair of production depth and tiny width, where compute is about zero, so its
``our_forward_ms`` (the engine's one-token forward) is the host cost of one forward at the benchmark's depth
(its ``layers``, 28). A projected forward then takes

    seconds = max(bytes / bandwidth, FLOPs / peak) + floor(capture mode)
    floor   = our_forward_ms / 1000 x layers of the projected model / layers of the benchmark

Eager host work is per layer, so a model of another depth scales it by its layers (a captured forward is one
launch: its floor is the same at any depth); a workload without a shape (``Workload`` without ``facts``) is
taken at the benchmark's depth. Two capture modes are projected:

- ``eager``: the benchmark's ``eager`` row;
- ``captured``: CUDA graphs, the benchmark's ``cudagraph`` row, which only a run on CUDA writes. Without one
  the captured floor is not measured and every figure of that mode is labelled a lower bound (no guessed
  constant stands in for it): where the result has a ``compile`` row, its step's host work outside its compiled
  calls, per forward, stands in (``fixed_host_ms_per_forward_outside_graphs``: planning, bookkeeping, inputs
  and reads, which a CUDA graph does not take away; without the guards, wrapper and replay a GPU adds, and on
  this CPU's host, not the GPU's), the same at any depth, since a captured forward is one launch whatever its
  layers; else 0.

By default the floors come from the committed GPU result (``bench/results/host_overhead_gpu.json``), else the
CPU one (``host_overhead_cpu.json``, whose eager host cost stands in for a GPU host's and is named as such).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from study.cost.errors import CostInputError

Capture = Literal["eager", "captured"]
CAPTURES: tuple[Capture, ...] = ("eager", "captured")
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
GPU_RESULT = RESULTS / "host_overhead_gpu.json"
CPU_RESULT = RESULTS / "host_overhead_cpu.json"
BENCH_LAYERS = 28  # bench.host_overhead's depth (Qwen2.5-1.5B's and -7B's); a result states its own in ``layers``
# the benchmark's row that gives each capture mode's floor
BENCH_MODE: dict[Capture, str] = {"eager": "eager", "captured": "cudagraph"}


@dataclass(frozen=True)
class HostFloor:
    """One capture mode's host cost per forward: ``ms`` at the benchmark's depth ``bench_layers``, scaled by a
    model's depth where ``per_layer``; ``measured`` False where the benchmark has no row for the mode (then ``ms``
    stands in, 0 where nothing does, and the projection is labelled a lower bound)."""

    capture: Capture
    ms: float
    bench_layers: int
    measured: bool
    source: str  # where it was measured, or why it was not
    per_layer: bool = True

    def seconds(self, layers: int | None) -> float:
        """The floor of one forward of a model of ``layers`` layers (None: the benchmark's depth)."""
        if not self.per_layer or layers is None:
            return self.ms / 1000
        return self.ms / 1000 * layers / self.bench_layers

    @property
    def label(self) -> str:
        """The mode as the report names it, with its floor and where it comes from."""
        name = "eager" if self.capture == "eager" else "captured (CUDA graphs)"
        if not self.measured and self.ms:
            return f"{name}, host floor not measured on a GPU, {self.ms:.3g} ms per forward stands in ({self.source})"
        if not self.measured:
            return f"{name}, host floor unmeasured, projected as 0: a lower bound"
        return f"{name}, host floor {self.ms:.3g} ms per {self.bench_layers}-layer forward, {self.source}"


@dataclass(frozen=True)
class HostFloors:
    """Both capture modes' floors from one benchmark result."""

    eager: HostFloor
    captured: HostFloor
    path: Path

    def of(self, capture: str) -> HostFloor:
        if capture not in CAPTURES:
            raise CostInputError(f"unknown capture mode {capture!r}; known: {', '.join(CAPTURES)}")
        return self.eager if capture == "eager" else self.captured


def captured_lower_bound(compiled: dict | None, path: Path, layers: int, where: str) -> HostFloor:
    """The captured floor where no GPU measured one: the ``compile`` row's host work outside its compiled calls per
    forward, at any depth (not a GPU's measure, so still labelled a lower bound); 0 where the result has none (a
    result from before it was measured)."""
    field = "fixed_host_ms_per_forward_outside_graphs"
    if compiled is None or compiled.get(field) is None:
        return replace(unmeasured_captured_floor(f"{path.name} has no cudagraph row"), bench_layers=layers)
    ms = floor_value(compiled.get(field), path, f"rows[mode=compile].{field}")
    return HostFloor("captured", ms, layers, False, f"a compiled step's host work outside its compiled calls, less "
                     f"the guards and graph launches a GPU adds, {where}", per_layer=False)


def unmeasured_captured_floor(why: str) -> HostFloor:
    """The captured floor where no CUDA-graph measurement exists: 0, and so a lower bound."""
    return HostFloor("captured", 0.0, BENCH_LAYERS, False, why)


def default_host_overhead_path() -> Path | None:
    """The committed benchmark result the floors come from: the GPU one, else the CPU one; None if neither."""
    return next((path for path in (GPU_RESULT, CPU_RESULT) if path.exists()), None)


def floor_value(value: Any, path: Path, field: str) -> float:
    """``value`` as a host cost in ms, or :class:`CostInputError` naming the file and the field: a number,
    finite and not negative. (The one place a floor is validated.)"""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CostInputError(f"{path}: {field} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise CostInputError(f"{path}: {field} must be finite and not negative, got {value!r}")
    return float(value)


def load_host_floors(path: str | Path | None = None) -> HostFloors:
    """The eager and captured floors of the ``bench.host_overhead`` result at ``path`` (default:
    :func:`default_host_overhead_path`); a missing or unreadable file, or a bad field, raises
    :class:`CostInputError` naming it."""
    if path is None:
        path = default_host_overhead_path()
        if path is None:
            raise CostInputError(f"no host-overhead result at {GPU_RESULT} or {CPU_RESULT}: run "
                                 "python -m bench.host_overhead")
    path = Path(path)
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CostInputError(f"{path}: not a readable host-overhead result ({type(exc).__name__}: {exc})") from exc
    if not isinstance(result, dict) or not isinstance(result.get("rows"), list):
        raise CostInputError(f"{path}: rows must be a list of the benchmark's capture modes")
    layers = result.get("layers")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise CostInputError(f"{path}: layers must be a positive integer, got {layers!r}")
    env = result.get("environment") if isinstance(result.get("environment"), dict) else {}
    commit = str(env.get("commit"))[:12] + (" with uncommitted changes" if env.get("dirty") else "")
    where = f"measured on {env.get('device', 'an unnamed device')} ({path.name}, commit {commit})"
    rows = {row.get("mode"): row for row in result["rows"] if isinstance(row, dict)}
    floors = {}
    for capture in CAPTURES:
        mode = BENCH_MODE[capture]
        row = rows.get(mode)
        if row is None:
            if capture == "eager":
                raise CostInputError(f"{path}: rows has no mode 'eager' row, so no eager host floor")
            floors[capture] = captured_lower_bound(rows.get("compile"), path, layers, where)
            continue
        ms = floor_value(row.get("our_forward_ms"), path, f"rows[mode={mode}].our_forward_ms")
        floors[capture] = HostFloor(capture, ms, layers, True, where, per_layer=capture == "eager")
    return HostFloors(floors["eager"], floors["captured"], path)
