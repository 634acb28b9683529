"""The host floor: what the host spends on each forward, whatever the GPU, per capture mode.

The roofline prices a forward's bytes and FLOPs; in eager PyTorch a forward also costs its host work (Python,
dispatch, kernel launches, building its inputs), per layer, whatever the width. ``bench/host_overhead.py``
measures it on a pair of production depth and tiny width, where compute is about zero. A projected forward
of a batch of ``rows`` then takes

    seconds = max(bytes / bandwidth, FLOPs / peak) + floor(capture mode, rows)
    floor   = forward's own host cost + the step's host work around its forwards, per forward, at ``rows``

- **A forward's own host cost**: the mode's row's ``our_forward_ms`` (the engine's one-token forward at the
  benchmark's depth, its ``layers``, 28). Eager host work is per layer, so a model of another depth scales it
  by its layers (a workload without a shape, ``Workload`` without ``facts``, is taken at the benchmark's
  depth); a captured forward is one launch, the same at any depth.
- **The step's host work around its forwards** (planning, bookkeeping, inputs, reads): a compiled step's host
  time outside its compiled calls, per forward (``fixed_host_ms_per_forward_outside_graphs``, ``..._at_8``,
  ``..._at_32``), which grows with the rows; the same code runs in every mode, so both modes pay it, from the
  ``cudagraph`` row where a GPU measured one, else the ``compile`` row (a CPU host's, named as such). Between
  the measured batches it is interpolated, beyond the largest extended along its last segment (per-row work
  grows linearly), below the smallest taken as the smallest's. A result without it (eager rows only) adds 0.
  A speculative step's forwards pay it per forward, as a fixed-gamma-4 step measured it; a plain step's one
  forward pays what a plain step (gamma 0) measured (``plain_host_ms_per_step_outside_graphs``, ``..._at_8``,
  ``..._at_32``; ``HostFloor.plain``): less than a speculative step's, more than its per-forward share. A result
  from before the plain step was measured charges plain forwards the per-forward share, which favours plain
  decoding, and says so.

Two readings of how a forward's own host cost meets its device time (``HostFloor.overlapped``):

- **serial** (the default, every projection's): added, as above. Where the host waits on the device between
  launches, or where one of the two dwarfs the other, this is the forward's time; where they are comparable it is
  an upper bound.
- **overlapped** (``HostFloor.overlapping()``): a GPU runs a forward's kernels while the host launches the next,
  so the forward takes the larger of its device time and its own host cost, plus the step's work (which reads the
  forwards' results, so it waits). An eager forward whose host cost exceeds its device time then costs its host
  cost, whatever its bytes. ``sidecar cost speculation`` and the GPU check price eager both ways; which holds is
  for a GPU to say (the check's eager rows against both projections).

Two capture modes are projected:

- ``eager``: the benchmark's ``eager`` row;
- ``captured``: CUDA graphs, the benchmark's ``cudagraph`` row, which only a run on CUDA writes. Without one, or
  where its graphs were not all captured (``cudagraph_skips``: it timed compile mode), a captured forward's own
  cost is not measured, 0 stands in (no guessed constant), and every figure of that mode is labelled a lower
  bound.

By default the floors come from the committed GPU result (``bench/results/host_overhead_gpu.json``), else the
CPU one (``host_overhead_cpu.json``, whose host costs stand in for a GPU host's and are named as such).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from study.cost.errors import CostInputError
from study.cost.piecewise import piecewise_linear

Capture = Literal["eager", "captured"]
CAPTURES: tuple[Capture, ...] = ("eager", "captured")
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
GPU_RESULT = RESULTS / "host_overhead_gpu.json"
CPU_RESULT = RESULTS / "host_overhead_cpu.json"
BENCH_LAYERS = 28  # bench.host_overhead's depth (Qwen2.5-1.5B's and -7B's); a result states its own in ``layers``
# the benchmark's row that gives each capture mode's floor
BENCH_MODE: dict[Capture, str] = {"eager": "eager", "captured": "cudagraph"}


# per forward of a speculative step, per plain step (one forward): at batch 1; ``_at_<rows>`` at other batches
STEP_WORK_FIELD = "fixed_host_ms_per_forward_outside_graphs"
PLAIN_STEP_WORK_FIELD = "plain_host_ms_per_step_outside_graphs"
# each field's step, as a label names it, and what it measures
STEP_WORK_KINDS = {STEP_WORK_FIELD: ("step", "a step's host work around its forwards"),
                   PLAIN_STEP_WORK_FIELD: ("plain step", "a plain step's host work around its forward")}


@dataclass(frozen=True)
class StepWork:
    """A step's host work around its forwards, per forward: ascending (rows, ms) points, where they were measured
    in ``source``; none: 0 at any batch."""

    points: tuple[tuple[int, float], ...] = ()
    source: str = ""
    what: str = "a step's host work around its forwards"

    def ms(self, rows: int) -> float:
        """At ``rows`` rows: interpolated between the points; the first point's below them; beyond them along the
        last segment, never falling (per-row work grows, it does not shrink)."""
        return piecewise_linear(self.points, rows, "segment") if self.points else 0.0

    @property
    def label(self) -> str:
        if not self.points:
            return ""
        (first, first_ms), (last, last_ms) = self.points[0], self.points[-1]
        span = f"{first_ms:.3g} ms per forward at {first} row{'s' * (first != 1)}" + (
            f" to {last_ms:.3g} at {last}" if last != first else "")
        return f"{self.what}, {span} ({self.source})"


@dataclass(frozen=True)
class HostFloor:
    """One capture mode's host cost per forward: a forward's own, ``ms`` at the benchmark's depth
    ``bench_layers`` (scaled by a model's depth where ``per_layer``; ``measured`` False where the benchmark has no
    row for the mode, then 0 and the projection a lower bound), and the step's work around it (``step``)."""

    capture: Capture
    ms: float
    bench_layers: int
    measured: bool
    source: str  # where it was measured, or why it was not
    per_layer: bool = True
    step: StepWork = StepWork()  # a speculative step's, per forward
    plain_step: StepWork | None = None  # a plain step's (one forward); None: not measured, ``step`` stands in
    # how a forward's own host cost meets its device time (``with_own``). False: added, the host serial with the
    # device (the projections' reading). True: the larger of the two, its launches running ahead of the device
    # within the forward; the step's work around its forwards, which reads their results, stays added.
    overlapped: bool = False

    @property
    def plain(self) -> HostFloor:
        """The floor of a plain step's one forward: the same forward's own, and the plain step's work around it
        where it was measured (else a speculative step's per-forward share, which favours plain decoding, and the
        label says so)."""
        if self.plain_step is None:
            why = "a speculative step's host work per forward (a plain step's unmeasured: this favours plain decoding)"
            return replace(self, step=replace(self.step, what=why)) if self.step.points else self
        return replace(self, step=self.plain_step)

    def forward_seconds(self, device_s: float, layers: int | None, rows: int = 1) -> float:
        """One forward over ``rows`` rows of a model of ``layers`` layers (None: the benchmark's depth) that keeps
        the device busy ``device_s``: with its own host cost (``with_own``), then its share of the step's work."""
        return self.with_own(device_s, layers) + self.step.ms(rows) / 1000

    def with_own(self, device_s: float, layers: int | None) -> float:
        """A forward's device time with its own host cost: added (serial), or the larger of the two where its
        launches overlap the device (``overlapped``)."""
        own = self.own_seconds(layers)
        return max(device_s, own) if self.overlapped else device_s + own

    def overlapping(self) -> HostFloor:
        """This floor read as overlapping the device (``overlapped``)."""
        return replace(self, overlapped=True)

    def own_seconds(self, layers: int | None) -> float:
        """A forward's own host cost, without the step's work around it."""
        return (self.ms if not self.per_layer or layers is None else self.ms * layers / self.bench_layers) / 1000

    def step_seconds(self, rows: int, forwards: int) -> float:
        """The host work around one step of ``forwards`` forwards over ``rows`` rows: that many shares of a
        speculative step's, and never less than a plain step's (one forward; the share where it is unmeasured)."""
        plain = (self.plain_step or self.step).ms(rows)
        return max(plain, forwards * self.step.ms(rows)) / 1000

    @property
    def label(self) -> str:
        """The mode as the report names it, with its floor and where it comes from."""
        name = "eager" if self.capture == "eager" else "captured (CUDA graphs)"
        if self.overlapped:
            name += ", a forward's own host cost overlapping its device time (the larger of the two)"
        if not self.measured:
            own = f"{name}, a forward's host floor unmeasured on a GPU, projected as 0: a lower bound ({self.source})"
        else:
            own = f"{name}, host floor {self.ms:.3g} ms per {self.bench_layers}-layer forward, {self.source}"
        return own + (f"; plus {self.step.label}" if self.step.points else "")


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


def step_work(rows: dict[Any, dict], path: Path, where: str, field: str = STEP_WORK_FIELD) -> StepWork | None:
    """The step's host work ``field`` (a speculative step's per forward, or a plain step's) at each batch the
    ``cudagraph`` row (a GPU's) measured it, else the ``compile`` row; None where neither has it (a result from
    before it was measured, or of eager rows only)."""
    at = re.compile(re.escape(field) + r"_at_([1-9][0-9]*)")
    for mode in ("cudagraph", "compile"):
        row = rows.get(mode)
        if row is None or row.get(field) is None:
            continue
        points = {1: floor_value(row[field], path, f"rows[mode={mode}].{field}")}
        for key, value in row.items():
            if (match := at.fullmatch(str(key))) is not None:
                points[int(match.group(1))] = floor_value(value, path, f"rows[mode={mode}].{key}")
        kind, what = STEP_WORK_KINDS[field]
        return StepWork(tuple(sorted(points.items())),
                        f"a {mode} {kind}'s host time outside its compiled calls, {where}", what)
    return None


def unmeasured_captured_floor(why: str) -> HostFloor:
    """The captured floor where no CUDA-graph measurement exists: 0, and so a lower bound."""
    return HostFloor("captured", 0.0, BENCH_LAYERS, False, why, per_layer=False)


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
    step = step_work(rows, path, where) or StepWork()
    plain_step = step_work(rows, path, where, PLAIN_STEP_WORK_FIELD)
    floors = {}
    for capture in CAPTURES:
        mode = BENCH_MODE[capture]
        row = rows.get(mode)
        if row is None and capture == "eager":
            raise CostInputError(f"{path}: rows has no mode 'eager' row, so no eager host floor")
        # a graph inductor left uncaptured ran at compile mode's speed: the row is no captured floor
        uncaptured = 0 if row is None else row.get("cudagraph_skips") or 0
        if row is None or (capture == "captured" and uncaptured):
            why = (f"{path.name} has no cudagraph row" if row is None else f"{path.name}'s cudagraph row left "
                   f"{uncaptured} graphs uncaptured, so it timed compile mode")
            floors[capture] = replace(unmeasured_captured_floor(why), bench_layers=layers, step=step,
                                      plain_step=plain_step)
            continue
        ms = floor_value(row.get("our_forward_ms"), path, f"rows[mode={mode}].our_forward_ms")
        floors[capture] = HostFloor(capture, ms, layers, True, where, per_layer=capture == "eager", step=step,
                                    plain_step=plain_step)
    return HostFloors(floors["eager"], floors["captured"], path)
