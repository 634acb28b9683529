"""A run's capture counters (``runs.capture_counters``, migration 014): each model's counters as
``sidecar.decoding.decoder.capture_stats`` gives them, and how the counters of a resumed run's starts add up."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

# counted by every process afresh (a resume loads the pair again): a run's are the sum of its starts'
SUMMED = ("compiles", "recompiles", "graph_breaks", "forwards", "compile_seconds")
# what one process holds at once: a run's is the largest of its starts'
LARGEST = ("distinct_shapes", "graph_bytes")


def checked_counters(counters: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """``counters`` ({model: {counter: number}}) as stored; a missing or negative counter raises ``ValueError``
    naming the model and the counter, before anything is written."""
    checked: dict[str, dict[str, float]] = {}
    for model, values in counters.items():
        if not isinstance(values, Mapping):
            raise ValueError(f"capture counters of model {model!r} must be a mapping, got {values!r}")
        row = {}
        for name in (*SUMMED, *LARGEST):
            value = values.get(name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"capture counter {model}.{name} must be a number >= 0, got {value!r}")
            row[name] = value
        checked[str(model)] = row
    return checked


def merged(stored: str | None, added: Mapping[str, Mapping[str, float]]) -> str:
    """The JSON of ``stored`` (an earlier start's, or None) with a further start's ``added`` counters."""
    total: dict[str, dict[str, float]] = json.loads(stored) if stored else {}
    for model, values in added.items():
        before = total.get(model, {})
        total[model] = {
            **{name: before.get(name, 0) + values[name] for name in SUMMED},
            **{name: max(before.get(name, 0), values[name]) for name in LARGEST},
        }
    return json.dumps(total, sort_keys=True)
