"""The host-floor part: ``bench.host_overhead`` on the check's device, so that the first run on a lent GPU measures
the host floors the cost model prices every forward with (``study.cost.host_floor``), the captured one measured
nowhere else, without a second command.

``full`` (the default on CUDA): the benchmark's pair (28 layers, hidden 64: compute about zero, bf16 on the GPU),
per capture mode of the check (``--capture-modes``: eager and cudagraph on CUDA) at the check's profile's sizes;
the rows go to ``bench/results/host_overhead_gpu.json``, the file the cost model reads before the CPU's, as
``python -m bench.host_overhead`` writes it, rewritten after each mode (a check its machine's time limit cuts off
keeps the modes it finished). ``small``: two layers, the code path only, no result file (a CPU's
floors are ``python -m bench.host_overhead``'s own). ``off`` (the default elsewhere) skips it.

A mode starts only where ``MIN_SECONDS`` of the part's time are left (a mode that compiles spends most of its
time compiling); dynamo forgets the pair's graphs after the part, so the capture modes' part compiles its own
(dynamo keeps graphs by code object, and the same layers' code at new shapes would count as recompiles there). A
graph break, a compile after warm-up or, in cudagraph mode, a graph left uncaptured fails the check, by the
capture modes' own rule (``capture_modes.faults``).
"""

from __future__ import annotations

import time

import torch
import torch._dynamo

from bench import host_overhead
from bench.gpu_check.capture_modes import faults
from bench.gpu_check.deadline import Deadline

HOST_FLOOR_SCALES = ("full", "small", "off")
SMALL_LAYERS = 2
MIN_SECONDS = 60.0


def host_floor(scale: str, modes: list[str], profile: str, device: torch.device, deadline: Deadline) -> dict:
    """Each mode's ``bench.host_overhead`` row at ``scale`` within ``deadline``; at ``full`` on CUDA, written as the
    benchmark's result."""
    layers = host_overhead.LAYERS if scale == "full" else SMALL_LAYERS
    sizes = host_overhead.SIZES[profile]
    rows: list[dict] = []
    skipped: dict[str, str] = {}
    written = None
    torch._dynamo.reset()  # this pair compiles its own graphs
    for mode in modes:
        if reason := deadline.skip_reason(MIN_SECONDS if mode != "eager" else 0.0):
            skipped[mode] = reason
            continue
        began = time.monotonic()
        rows.append(host_overhead.measure_mode(mode, sizes["calls"], sizes["runs"], device, layers))
        print(f"host floor {mode}: {time.monotonic() - began:.0f} s", flush=True)
        if scale == "full" and device.type == "cuda":  # after each mode: a check cut off keeps the modes it finished
            written = f"bench/results/{host_overhead.write(rows, device, profile, sizes, layers)}.json"
    torch._dynamo.reset()  # ... and the capture modes' part its own
    return {"scale": scale, "layers": layers, "dtype": str(host_overhead.dtype_for(device)).removeprefix("torch."),
            "rows": rows, "skipped_modes": skipped, "written": written, "failed": faults(rows)}
