"""Host-overhead results as ``python -m bench.host_overhead`` writes them, for the host floor's tests."""

from __future__ import annotations

import json
from pathlib import Path


def outside_graphs(by_batch: dict[int, float]) -> dict:
    """A compiled row's host work outside its compiled calls, ``by_batch`` ms per forward (batch 1 among them)."""
    fields = {"fixed_host_ms_per_step_outside_graphs": 4.8 * by_batch[1],
              "fixed_host_ms_per_forward_outside_graphs": by_batch[1]}
    for batch, ms in by_batch.items():
        if batch != 1:
            fields |= {f"fixed_host_ms_per_step_outside_graphs_at_{batch}": 4.8 * ms,
                       f"fixed_host_ms_per_forward_outside_graphs_at_{batch}": ms}
    return fields


def plain_outside_graphs(by_batch: dict[int, float]) -> dict:
    """A compiled row's plain step's host work outside its compiled calls, ``by_batch`` ms per step (one forward)."""
    return {"plain_host_ms_per_step_outside_graphs" + ("" if batch == 1 else f"_at_{batch}"): ms
            for batch, ms in by_batch.items()}


def host_result(path: Path, eager_ms: float = 5.0, cudagraph_ms: float | None = None, layers: int = 28,
                outside_graphs_ms: float | dict[int, float] | None = None,
                cudagraph_outside_ms: dict[int, float] | None = None,
                plain_outside_ms: dict[int, float] | None = None) -> Path:
    """A result at ``path`` with an eager row (a compile row whose host work outside its compiled calls is
    ``outside_graphs_ms`` per forward, at batch 1 or by batch, and its plain step's ``plain_outside_ms`` by batch,
    and a cudagraph row, with its own such work where given): the fields the floor reads, and some it does not."""
    rows = [{"mode": "eager", "hf_forward_ms": 7.7, "our_forward_ms": eager_ms, "fixed_ms_per_target_forward": 30.0}]
    if outside_graphs_ms is not None:
        by_batch = outside_graphs_ms if isinstance(outside_graphs_ms, dict) else {1: outside_graphs_ms}
        rows.append({"mode": "compile", "hf_forward_ms": 7.7, "our_forward_ms": 2.9, **outside_graphs(by_batch),
                     **(plain_outside_graphs(plain_outside_ms) if plain_outside_ms else {})})
    if cudagraph_ms is not None:
        rows.append({"mode": "cudagraph", "hf_forward_ms": 7.7, "our_forward_ms": cudagraph_ms,
                     **(outside_graphs(cudagraph_outside_ms) if cudagraph_outside_ms else {})})
    payload = {"environment": {"device": "NVIDIA H100 80GB HBM3", "commit": "abc1234"}, "layers": layers,
               "profile": "standard", "rows": rows}
    path.write_text(json.dumps(payload))
    return path
