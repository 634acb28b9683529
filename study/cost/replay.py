"""A run's forwards replayed through the roofline: what the same work would cost on another device.

The engine's device-time ledger (``sidecar.runtime.ledger``) records every forward it ran: which model, how
many rows, how many tokens padded and real, the KV context the rows attend to, and the real tokens by the
phase they were charged to. Each record is priced by ``roofline.forward_seconds`` (logits at every fed
position of a target decode forward, a verify; at one per row otherwise) and its projected seconds are
split among the phases by the ledger's own rule: in proportion to the tokens each had in it. So a projected
row of the cost report means what a measured one does: device seconds charged to a phase. Pure
arithmetic: a projection, not a timing.

With ``steps`` (``step_costs.load_step_costs``: forwards the GPU check timed) a decode forward the table covers
is priced from it instead: a target's as a verify of its width, a draft's one-token step as a draft step; a
prefill, and what the table lacks, stays on the roofline. ``ReplayTime.source`` says which priced it.

With ``host`` (``host_floor``) every roofline-priced forward also pays that capture mode's host floor: its own
at its model's depth, and the host work around its step, priced once per step (``HostFloor.step_seconds``, at the
step's rows and forwards: a step of one forward pays a plain step's) and shared equally by the step's forwards; a
prefill, or a forward whose record names no step, pays a speculative step's share per forward at its rows. A
forward priced from measured step costs pays no floor of its own (its host cost was in what was timed, the forward
alone) but its share of its step's work all the same: the GPU check timed no step around it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from sidecar.runtime.ledger import ForwardRecord
from study.cost.facts import ModelFacts
from study.cost.host_floor import HostFloor
from study.cost.roofline import Device, forward_seconds
from study.cost.step_costs import StepCosts


@dataclass(frozen=True)
class ReplayTime:
    """Projected seconds of a run: per forward kind (prefill, decode) and per ledger phase (main, sidecar,
    instruction, standalone), and the forwards priced per model."""

    prefill_s: float
    decode_s: float
    by_phase: dict[str, float] = field(default_factory=dict)
    forwards: dict[str, int] = field(default_factory=dict)
    # "roofline", or where the step costs that priced ``measured_forwards`` of them were measured
    source: str = "roofline"
    measured_forwards: int = 0

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s


def measured_key(record: ForwardRecord, steps: StepCosts) -> tuple[str, str, int] | None:
    """The (model, kind, tokens per row) of ``steps`` that prices a recorded forward, or None (the roofline)."""
    width = max(round(record.padded_tokens / max(record.rows, 1)), 1)
    if record.kind != "decode":
        return None
    key = (steps.target, "verify", width) if record.model == "target" else (steps.draft, "draft", width)
    return key if steps.covers(*key) else None


def forward_time(record: ForwardRecord, target: ModelFacts, draft: ModelFacts, device: Device,
                 host: HostFloor | None = None) -> float:
    """The roofline time of one recorded forward, for a target and draft of sizes ``target``/``draft``, plus
    ``host``'s floor of the forward's own (its share of its step's work is ``step_share``'s)."""
    facts = target if record.model == "target" else draft
    rows = max(record.rows, 1)
    width = max(round(record.padded_tokens / rows), 1)
    logits = width if record.model == "target" and record.kind == "decode" else 1
    roofline = forward_seconds(facts, device, rows, width, record.context / rows, logits=logits)
    return roofline if host is None else host.with_own(roofline, facts.layers)


def step_share(record: ForwardRecord, host: HostFloor, shares: dict[int, float]) -> float:
    """The record's share of the host work around its step: its step's (``step_shares``), else, for a prefill or a
    record naming no step, a speculative step's share per forward at its rows."""
    share = shares.get(record.step) if record.kind == "decode" and record.step is not None else None
    return host.step.ms(max(record.rows, 1)) / 1000 if share is None else share


def step_shares(records: list[ForwardRecord], host: HostFloor) -> dict[int, float]:
    """Per decode step the records name, each of its forwards' equal share of the host work around it, at the
    step's rows (its widest forward's) and forwards."""
    steps: dict[int, list[ForwardRecord]] = {}
    for record in records:
        if record.kind == "decode" and record.step is not None:
            steps.setdefault(record.step, []).append(record)
    return {step: host.step_seconds(max(max(r.rows, 1) for r in forwards), len(forwards)) / len(forwards)
            for step, forwards in steps.items()}


def replay(records: Iterable[ForwardRecord], target: ModelFacts, draft: ModelFacts, device: Device,
           steps: StepCosts | None = None, host: HostFloor | None = None) -> ReplayTime:
    """Price every forward of ``records`` on ``device`` (from ``steps`` where they cover it; else the roofline
    plus ``host``'s floor) and charge it to the phases by their tokens."""
    seconds = {"prefill": 0.0, "decode": 0.0}
    by_phase: dict[str, float] = {}
    forwards = {"target": 0, "draft": 0}
    measured = 0
    records = list(records)
    shares = {} if host is None else step_shares(records, host)
    for record in records:
        key = None if steps is None else measured_key(record, steps)
        if key is None:
            time = forward_time(record, target, draft, device, host)
        else:  # its own host cost was timed with it
            time = steps.seconds(*key, max(record.rows, 1))
            measured += 1
        if host is not None:  # the step's work around it, which no timed forward included
            time += step_share(record, host, shares)
        seconds[record.kind] += time
        forwards[record.model] += 1
        tokens = sum(record.tokens.values())
        for phase, count in record.tokens.items():
            by_phase[phase] = by_phase.get(phase, 0.0) + (time * count / tokens if tokens else 0.0)
    roofline = "roofline" if host is None else f"roofline + {host.label}"
    source = roofline if steps is None else f"{steps.source} for decode forwards, {roofline} for the rest"
    return ReplayTime(seconds["prefill"], seconds["decode"], by_phase, forwards, source, measured)
