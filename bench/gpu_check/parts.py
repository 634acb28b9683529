"""The check's parts in the order they run (``PARTS``), and ``check_pair``, which runs them on one pair.

Each part gets a share of the time its pair has left when it starts. A part that raises is reported and fails the
check (``errors``) while the others still run; so does a pair that cannot be loaded, and the next pair still runs.
A part whose measurement breaks its guarantee (a token that differs from HF's, a sync over the budget) lists why
under ``failed``, which fails the check the same way.
"""

from __future__ import annotations

import argparse
import gc
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import REPO
from bench.gpu_check.check import Check, prepare
from bench.gpu_check.deadline import Deadline
from bench.gpu_check.identity import identity
from bench.gpu_check.memory import memory
from bench.gpu_check.sdpa import sdpa
from bench.gpu_check.syncs import source_line, syncs
from bench.gpu_check.throughput import throughput

# (name, function, share of the pair's time left when the part starts)
PARTS: list[tuple[str, Callable[[Check, Deadline], dict], float]] = [
    ("identity", identity, 0.2),
    ("syncs", syncs, 0.1),
    ("sdpa", sdpa, 0.1),
    ("memory", memory, 0.15),
    ("throughput", throughput, 1.0),
]


def failure(exc: BaseException) -> str:
    """The exception in one line, with the innermost line of this repository it passed through."""
    ours = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).is_relative_to(REPO)]
    where = f" (at {source_line(ours[-1].filename, ours[-1].lineno)})" if ours else ""
    return f"{type(exc).__name__}: {str(exc).strip()[:300]}{where}"


def check_pair(name: str, spec: str, args: argparse.Namespace, deadline: Deadline) -> dict:
    try:
        check, result = prepare(name, spec, args)
    except Exception as exc:  # reported, and fails the check; the next pair still runs
        return {"pair": name, "loaded_from": spec, "error": failure(exc)}
    for part, run, share in PARTS:
        if reason := deadline.skip_reason():
            result[part] = {"skipped": reason}
            continue
        began = time.monotonic()
        try:
            result[part] = run(check, deadline.share(share))
        except Exception as exc:  # one failing part must not cost the others: it is reported, and fails the check
            result[part] = {"error": failure(exc)}
            if check.cuda:
                torch.cuda.empty_cache()
        result[part]["seconds"] = time.monotonic() - began
        print(f"{name} {part}: {result[part]}", flush=True)
    del check
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def errors(payload: dict) -> list[str]:
    """Every pair that failed to load, every part that raised (the step costs too) and every guarantee a part found
    broken: what makes the check exit non-zero."""
    loads = [f"{r['pair']}: {r['error']}" for r in payload["pairs"] if "error" in r]
    if "error" in payload.get("step_costs", {}):
        loads.append(f"step costs: {payload['step_costs']['error']}")
    floors = payload.get("host_floor", {})
    loads += [f"host floor: {why}" for why in ([floors["error"]] if "error" in floors else floors.get("failed", []))]
    captured = payload.get("capture", {})
    loads += [f"capture modes: {why}" for why in ([captured["error"]] if "error" in captured
                                                   else captured.get("failed", []))]
    parts = [(r["pair"], part, r.get(part, {})) for r in payload["pairs"] for part, _, _ in PARTS]
    return loads + [f"{pair} {part}: {why}" for pair, part, result in parts
                    for why in ([result["error"]] if "error" in result else result.get("failed", []))]
