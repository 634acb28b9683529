"""What a running batch did, step by step: the record a schedule is judged by.

Each decoding step records how many main rows were live, its verify width, its draft forwards and the
other rows riding in them, and the shapes its forwards ran at (the plan's: ``sidecar.decoding.plan``); each
admission records the rows it prefilled and their prompt tokens. Slot
occupancy, the share of slot-steps that did useful work, comes from it. The forwards themselves, with
their device time, are the ledger's (``sidecar.runtime.ledger``), which ``study.cost.replay`` prices
through the roofline. ``drain_from`` marks the step after which no row was waiting any more: the final
drain, where any schedule runs short of rows.

A trace keeps the latest ``keep`` events (every one with ``keep=None``, as the benchmarks ask), so a
long-lived server's batch stays the same size.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from sidecar.runtime.capture import ForwardShape

# events a batch keeps unless told otherwise
KEPT_EVENTS = 4096


@dataclass(frozen=True)
class StepRecord:
    live: int  # main rows in the step's target forward
    width: int  # drafts per row in the verify forward (0: a plain step)
    draft_forwards: int  # forwards of the draft model (0: copied drafts or a plain step, and nothing riding)
    draft_feed: int  # widest feed of the first draft forward
    riders: int = 0  # draft rows that are no live main row: catching up, sidecar or standalone
    source: str = "draft"  # where the verified drafts came from: "draft" (the model) or "lookup" (copies)
    target_shape: ForwardShape | None = None  # the target forward's (None: none ran)
    draft_shape: ForwardShape | None = None  # the first draft forward's (None: none ran)
    next_draft_shape: ForwardShape | None = None  # each later draft forward's, or their chain's
    chained_forwards: int = 0  # the later draft forwards that ran as one chain (``sidecar.decoding.draft_chain``)
    feed_chunks: int = 0  # forwards the first draft forward's feeds took at ``draft_shape`` (>1: a chunked wide feed)


@dataclass(frozen=True)
class PrefillRecord:
    rows: int
    target_tokens: list[int]  # prompt lengths
    draft_tokens: list[int]  # draft prompt lengths ([] when the group decodes without the draft)


@dataclass
class BatchTrace:
    max_batch: int
    keep: int | None = KEPT_EVENTS
    events: deque[StepRecord | PrefillRecord] = field(init=False)
    steps_recorded: int = 0
    drain_from: int | None = None  # the number of steps recorded before the final drain began

    def __post_init__(self) -> None:
        self.events = deque(maxlen=self.keep)

    def add(self, event: StepRecord | PrefillRecord) -> None:
        self.events.append(event)
        self.steps_recorded += isinstance(event, StepRecord)

    @property
    def steps(self) -> list[StepRecord]:
        return [e for e in self.events if isinstance(e, StepRecord)]

    @property
    def prefills(self) -> list[PrefillRecord]:
        return [e for e in self.events if isinstance(e, PrefillRecord)]

    def mark_drain(self) -> None:
        if self.drain_from is None:
            self.drain_from = self.steps_recorded

    def occupancy(self, include_drain: bool = False) -> float:
        """Live main rows per slot over the kept decoding steps (before the final drain unless
        ``include_drain``)."""
        steps = self.steps
        if not include_drain and self.drain_from is not None:
            steps = steps[: max(self.drain_from - (self.steps_recorded - len(steps)), 0)]
        return sum(s.live for s in steps) / (len(steps) * self.max_batch) if steps and self.max_batch else 0.0
