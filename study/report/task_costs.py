"""The cost verdict per sidecar task: device seconds per output token of each task, sidecar against standalone.

A run with several sidecar tasks decodes each from one main output; ``sidecar_outputs`` keeps each task's own
tokens and its share of the device-time ledger (prefill, decode and, in a sidecar mode, its masked
instruction's share of the main row's draft prefill). Per task this compares the sidecar's seconds per token of
that task with the standalone tagger's, in the task's own words ("headline tokens", not "tag tokens"). A task
without ledger seconds in one of the two modes gets no verdict, and says why.

    rows = Database.task_costs(run_id)     # task, mode, outputs, new_tokens, device_s
    verdicts = task_verdicts(rows)         # list[TaskCost], by task
    task_costs_markdown(verdicts)          # a markdown section for the report
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TaskCost:
    """One task's cost in each mode: device seconds per token of its output, and the sidecar's saving."""

    task: str
    sidecar_ms_per_token: float | None
    standalone_ms_per_token: float | None
    sidecar_tokens: int
    standalone_tokens: int

    @property
    def saving_pct(self) -> float | None:
        """1 - sidecar / standalone seconds per token, in percent; None without both."""
        if self.sidecar_ms_per_token is None or not self.standalone_ms_per_token:
            return None
        return 100 * (1 - self.sidecar_ms_per_token / self.standalone_ms_per_token)

    def line(self) -> str:
        """The verdict in one sentence, in the task's own words."""
        unit = f"{self.task} token"
        if self.saving_pct is None:
            missing = [mode for mode, ms in (("sidecar", self.sidecar_ms_per_token),
                                             ("standalone", self.standalone_ms_per_token)) if ms is None]
            return f"{self.task}: no verdict, no ledger seconds per {unit} in {' and '.join(missing)}"
        cheaper = "saves" if self.saving_pct >= 0 else "costs"
        return (f"{self.task}: the sidecar {cheaper} {abs(self.saving_pct):.1f}% per {unit} "
                f"({self.sidecar_ms_per_token:.3f} vs {self.standalone_ms_per_token:.3f} ms per {unit})")


def _ms_per_token(row: Mapping[str, Any] | None) -> float | None:
    if row is None or row.get("device_s") is None or not row.get("new_tokens"):
        return None
    return 1000 * row["device_s"] / row["new_tokens"]


def task_verdicts(rows: Sequence[Mapping[str, Any]]) -> list[TaskCost]:
    """One :class:`TaskCost` per task of ``rows`` (``Database.task_costs``), by task name; the sidecar mode is
    the evicted one (``sidecar``)."""
    by_key = {(row["task"], row["mode"]): row for row in rows}
    verdicts = []
    for task in sorted({row["task"] for row in rows}):
        sidecar, standalone = by_key.get((task, "sidecar")), by_key.get((task, "standalone"))
        verdicts.append(TaskCost(task, _ms_per_token(sidecar), _ms_per_token(standalone),
                                 int((sidecar or {}).get("new_tokens") or 0),
                                 int((standalone or {}).get("new_tokens") or 0)))
    return verdicts


def task_costs_markdown(verdicts: Sequence[TaskCost]) -> str:
    """The per-task section of the report; empty without tasks."""
    if not verdicts:
        return ""
    lines = ["## Cost per sidecar task", "",
             "Device seconds the ledger charged to each task's own output tokens (sidecar: prefill, decode and "
             "its instruction line; standalone: prefill and decode), per token of that task.", "",
             "| task | sidecar ms per token | standalone ms per token | tokens (sidecar / standalone) | verdict |",
             "|---|---:|---:|---:|---|"]
    for v in verdicts:
        def ms(value: float | None) -> str:
            return "n/a" if value is None else f"{value:.3f}"

        lines.append(f"| {v.task} | {ms(v.sidecar_ms_per_token)} | {ms(v.standalone_ms_per_token)} | "
                     f"{v.sidecar_tokens} / {v.standalone_tokens} | {v.line()} |")
    return "\n".join(lines) + "\n"
