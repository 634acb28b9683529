"""A run's capture counters (``runs.capture_counters``, migrations 014, 015 and 016): each model's counters as
``sidecar.decoding.decoder.capture_stats`` gives them, its decoding steps' under ``steps`` (steps, host syncs,
seconds: ``sidecar.runtime.step_counters``), and how the counters of a resumed run's starts add up."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

# counted by every process afresh (a resume loads the pair again): a run's are the sum of its starts'
SUMMED = ("compiles", "recompiles", "graph_breaks", "forwards", "graph_calls", "chained_forwards", "compile_seconds",
          "cudagraph_skips")
# what one process holds at once: a run's is the largest of its starts'
LARGEST = ("distinct_shapes", "graph_bytes")
# the entry that holds the steps' counters, not a model's; every one is summed over starts
STEPS = "steps"
STEP_SUMMED = ("steps", "syncs", "step_seconds", "read_seconds")


def _number(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"capture counter {where} must be a number >= 0, got {value!r}")
    return value


def checked_counters(counters: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """``counters`` ({model: {counter: number}}) as stored; a missing or negative counter raises ``ValueError``
    naming the model and the counter, before anything is written."""
    checked: dict[str, dict[str, float]] = {}
    for model, values in counters.items():
        if not isinstance(values, Mapping):
            raise ValueError(f"capture counters of model {model!r} must be a mapping, got {values!r}")
        names = STEP_SUMMED if model == STEPS else (*SUMMED, *LARGEST)
        checked[str(model)] = {name: _number(f"{model}.{name}", values.get(name)) for name in names}
    return checked


def merged(stored: str | None, added: Mapping[str, Mapping[str, float]]) -> str:
    """The JSON of ``stored`` (an earlier start's, or None) with a further start's ``added`` counters."""
    total: dict[str, dict[str, float]] = json.loads(stored) if stored else {}
    for model, values in added.items():
        before = total.get(model, {})
        summed, largest = (STEP_SUMMED, ()) if model == STEPS else (SUMMED, LARGEST)
        total[model] = {
            **{name: before.get(name, 0) + values[name] for name in summed},
            **{name: max(before.get(name, 0), values[name]) for name in largest},
        }
    return json.dumps(total, sort_keys=True)
