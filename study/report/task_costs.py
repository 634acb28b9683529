"""The cost verdict per sidecar task: device seconds per output token of each task, sidecar against standalone.

A run with several sidecar tasks decodes each from one main output; ``sidecar_outputs`` keeps each task's own
tokens and its share of the device-time ledger (prefill, decode and, in a sidecar mode, its masked
instruction's share of the main row's draft prefill). Per task this compares the sidecar's seconds per token of
that task with the standalone draft's, named by the task (``vocab.task_nouns``: "headline tokens", "tag tokens"
for hashtags). A task without ledger seconds in one of the two modes gets no verdict, and says why. The report
prints them under the verdict per GPU type, which counts every task's tokens together.

    rows = Database.task_costs(run_id)     # task, mode, outputs, new_tokens, device_s
    verdicts = task_verdicts(rows)         # list[TaskCost], by task
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from vocab.task_nouns import token_noun


@dataclass(frozen=True)
class TaskCost:
    """One task's cost in each mode: device seconds per token of its output, and the sidecar's saving."""

    task: str
    sidecar_ms_per_token: float | None
    standalone_ms_per_token: float | None
    sidecar_tokens: int
    standalone_tokens: int

    @property
    def noun(self) -> str:
        """What its tokens are called: 'headline' (tokens), 'tag' (tokens) for hashtags."""
        return token_noun(self.task)

    @property
    def saving_pct(self) -> float | None:
        """1 - sidecar / standalone seconds per token, in percent; None without both."""
        if self.sidecar_ms_per_token is None or not self.standalone_ms_per_token:
            return None
        return 100 * (1 - self.sidecar_ms_per_token / self.standalone_ms_per_token)

    @property
    def missing(self) -> list[str]:
        """The modes without ledger seconds for this task: why it has no verdict."""
        return [mode for mode, ms in (("sidecar", self.sidecar_ms_per_token),
                                      ("standalone", self.standalone_ms_per_token)) if ms is None]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"noun": self.noun, "saving_pct": self.saving_pct}


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
