"""A run's forwards replayed through the roofline: what the same work would cost on another device.

The engine's device-time ledger (``sidecar.runtime.ledger``) records every forward it ran: which model, how
many rows, how many tokens padded and real, the KV context the rows attend to, and the real tokens by the
phase they were charged to. Each record is priced by ``roofline.forward_seconds`` (logits at every fed
position of a target decode forward, a verify; at one per row otherwise) and its projected seconds are
split among the phases by the ledger's own rule: in proportion to the tokens each had in it. So a projected
row of the cost report means what a measured one does: device seconds charged to a phase. Pure
arithmetic: a projection, not a timing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from sidecar.runtime.ledger import ForwardRecord
from study.cost.facts import ModelFacts
from study.cost.roofline import Device, forward_seconds


@dataclass(frozen=True)
class ReplayTime:
    """Projected seconds of a run: per forward kind (prefill, decode) and per ledger phase (main, sidecar,
    instruction, standalone), and the forwards priced per model."""

    prefill_s: float
    decode_s: float
    by_phase: dict[str, float] = field(default_factory=dict)
    forwards: dict[str, int] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s


def forward_time(record: ForwardRecord, target: ModelFacts, draft: ModelFacts, device: Device) -> float:
    """The roofline time of one recorded forward, for a target and draft of sizes ``target``/``draft``."""
    facts = target if record.model == "target" else draft
    rows = max(record.rows, 1)
    width = max(round(record.padded_tokens / rows), 1)
    logits = width if record.model == "target" and record.kind == "decode" else 1
    return forward_seconds(facts, device, rows, width, record.context / rows, logits=logits)


def replay(records: Iterable[ForwardRecord], target: ModelFacts, draft: ModelFacts, device: Device) -> ReplayTime:
    """Price every forward of ``records`` on ``device`` and charge it to the phases by their tokens."""
    seconds = {"prefill": 0.0, "decode": 0.0}
    by_phase: dict[str, float] = {}
    forwards = {"target": 0, "draft": 0}
    for record in records:
        time = forward_time(record, target, draft, device)
        seconds[record.kind] += time
        forwards[record.model] += 1
        tokens = sum(record.tokens.values())
        for phase, count in record.tokens.items():
            by_phase[phase] = by_phase.get(phase, 0.0) + (time * count / tokens if tokens else 0.0)
    return ReplayTime(seconds["prefill"], seconds["decode"], by_phase, forwards)
