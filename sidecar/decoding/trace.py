"""What a running batch did, step by step: the record a schedule is judged by.

Each decoding step records how many rows were live, its verify width and its draft forwards; each
admission records the rows it prefilled and their prompt tokens. Slot occupancy, the share of slot-steps
that did useful work, comes from it, and ``study.cost`` replays it through the roofline to project the
schedule onto a GPU. ``drain_from`` marks the step after which no row was waiting any more: the final
drain, where any schedule runs short of rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepRecord:
    live: int  # rows in the step's forwards
    width: int  # drafts per row in the verify forward (0: a plain step)
    draft_forwards: int  # forwards of the draft model (0: copied drafts or a plain step)
    draft_feed: int  # widest draft feed of the first draft forward (backlog + pending token)


@dataclass(frozen=True)
class PrefillRecord:
    rows: int
    target_tokens: list[int]  # prompt lengths
    draft_tokens: list[int]  # draft prompt lengths ([] when the group decodes without the draft)


@dataclass
class BatchTrace:
    max_batch: int
    events: list[StepRecord | PrefillRecord] = field(default_factory=list)
    drain_from: int | None = None  # index into ``steps`` of the first step of the final drain

    @property
    def steps(self) -> list[StepRecord]:
        return [e for e in self.events if isinstance(e, StepRecord)]

    @property
    def prefills(self) -> list[PrefillRecord]:
        return [e for e in self.events if isinstance(e, PrefillRecord)]

    def mark_drain(self) -> None:
        if self.drain_from is None:
            self.drain_from = len(self.steps)

    def occupancy(self, include_drain: bool = False) -> float:
        """Live rows per slot over the decoding steps (before the final drain unless ``include_drain``)."""
        steps = self.steps
        if not include_drain and self.drain_from is not None:
            steps = steps[: self.drain_from]
        return sum(s.live for s in steps) / (len(steps) * self.max_batch) if steps else 0.0
