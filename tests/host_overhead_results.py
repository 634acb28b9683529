"""Host-overhead results as ``python -m bench.host_overhead`` writes them, for the host floor's tests."""

from __future__ import annotations

import json
from pathlib import Path


def host_result(path: Path, eager_ms: float = 5.0, cudagraph_ms: float | None = None, layers: int = 28,
                outside_graphs_ms: float | None = None) -> Path:
    """A result at ``path`` with an eager row (a compile row whose host work outside its compiled calls is
    ``outside_graphs_ms`` per forward, and a cudagraph row, where given): the fields the floor reads, and some it
    does not."""
    rows = [{"mode": "eager", "hf_forward_ms": 7.7, "our_forward_ms": eager_ms, "fixed_ms_per_target_forward": 30.0}]
    if outside_graphs_ms is not None:
        rows.append({"mode": "compile", "hf_forward_ms": 7.7, "our_forward_ms": 2.9,
                     "fixed_host_ms_per_step_outside_graphs": 4.8 * outside_graphs_ms,
                     "fixed_host_ms_per_forward_outside_graphs": outside_graphs_ms})
    if cudagraph_ms is not None:
        rows.append({"mode": "cudagraph", "hf_forward_ms": 7.7, "our_forward_ms": cudagraph_ms})
    payload = {"environment": {"device": "NVIDIA H100 80GB HBM3", "commit": "abc1234"}, "layers": layers,
               "profile": "standard", "rows": rows}
    path.write_text(json.dumps(payload))
    return path
