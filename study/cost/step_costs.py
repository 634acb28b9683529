"""Measured step costs: ms per forward the GPU check timed (``bench/gpu_check/step_costs.py``), to price a
replayed decode forward in place of the roofline's projection.

The table (``bench/results/gpu_check_step_costs.json``) has one row per model (``7b``, ``1.5b``), kind (``draft``:
one token per row; ``verify``: gamma + 1 tokens per row, logits at each), batch and ``ms``, all at one context
length per row, with the environment it was measured in. ``StepCosts.seconds`` answers for a measured
(model, kind, tokens per row) at any batch:

- a measured batch: its time;
- between two measured batches: linear interpolation between them;
- below the smallest: the smallest's time (a smaller batch is not slower);
- above the largest: the largest's time scaled by the batch (a forward's time grows at most linearly with it).

Every row is priced at the table's context length whatever its own: this is a calibration, not a model of
context. A (model, kind, tokens) the table lacks raises :class:`CostInputError`; ``covers`` says which it has.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from study.cost.errors import CostInputError, count, number
from study.cost.piecewise import piecewise_linear

KINDS = ("draft", "verify")


@dataclass(frozen=True)
class StepCosts:
    """Measured ms per forward by (model, kind, tokens per row): ascending (batch, ms) points; ``source`` says
    where they were measured, ``device`` on what (the name torch reports, which ``find_gpu`` matches).
    ``target`` and ``draft`` name the table's models that play those roles."""

    points: dict[tuple[str, str, int], list[tuple[int, float]]]
    source: str
    device: str = ""
    target: str = "7b"
    draft: str = "1.5b"

    def covers(self, model: str, kind: str, tokens: int) -> bool:
        return (model, kind, tokens) in self.points

    def seconds(self, model: str, kind: str, tokens: int, batch: int) -> float:
        """Seconds of one forward of ``tokens`` tokens per row at ``batch`` rows (see the module for between
        and beyond the measured batches)."""
        if batch < 1:
            raise CostInputError(f"a forward needs a batch of at least 1, got {batch}")
        points = self.points.get((model, kind, tokens))
        if points is None:
            raise CostInputError(f"the step costs ({self.source}) have no {model} {kind} of {tokens} tokens per row")
        ms = piecewise_linear(points, batch, "proportional")
        return ms / 1000


def load_step_costs(path: str | Path, target: str = "7b", draft: str = "1.5b") -> StepCosts:
    """The step-cost table the GPU check wrote at ``path``; rows it skipped are left out."""
    try:
        table = json.loads(Path(path).read_text())
        env, rows = table["environment"], table["rows"]
        points: dict[tuple[str, str, int], list[tuple[int, float]]] = {}
        for index, row in enumerate(rows):
            if "ms" not in row:
                continue
            if row["kind"] not in KINDS:
                raise CostInputError(f"{path}: row {index}: kind must be one of {', '.join(KINDS)}, got {row}")
            # a batch of 1.9 read as int was a batch of 1: every field is checked, not converted
            field = f"{path}: row {index}"
            batch, tokens = count(f"{field} batch", row["batch"]), count(f"{field} tokens", row["tokens"])
            points.setdefault((row["model"], row["kind"], tokens), []).append((batch, number(f"{field} ms", row["ms"])))
        context = count(f"{path}: context", table["context"])
        # a table from before the forwards named their mode timed Hugging Face's (``hf``)
        source = (f"measured on {env['device']} ({table['dtype']}, {table.get('capture', 'hf')} forwards, {context} "
                  f"tokens of context"
                  f"{'' if table.get('scale', 'full') == 'full' else ', small shapes: not the real models'})")
    except CostInputError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CostInputError(f"{path}: not a step-cost table the GPU check wrote ({type(exc).__name__}: {exc})"
                             ) from exc
    if not points:
        raise CostInputError(f"{path}: the step-cost table has no measured row")
    return StepCosts({key: sorted(p) for key, p in points.items()}, source, env["device"], target, draft)
