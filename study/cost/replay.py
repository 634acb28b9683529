"""A running batch's trace replayed through the roofline: what the same steps would cost on another device.

Each event of a ``sidecar.decoding.trace.BatchTrace`` becomes the forwards the engine ran for it, each priced by
``roofline.forward_seconds``:

- an admission (``PrefillRecord``): one target forward over the group's prompts padded to the longest, as
  an accelerator prefills a group, and one such draft forward when the group drafts;
- a decoding step (``StepRecord``) with B live rows, verify width w and d draft forwards: the first draft
  forward feeds ``draft_feed`` tokens per row (backlog and pending token), the other d - 1 one token each,
  then one target forward feeds w + 1 tokens per row with logits at each (w = 0: a plain step, one token);
- the sidecar rows (``SidecarWork``): one draft forward of one token per live row per sidecar step, and
  per admitted group one draft forward of its longest feed (catch-up and bridge).

Every draft forward of a step is priced over all B rows, and the KV context of a row is a mean the caller
gives per model (prompt plus half its output, say): FLOPs and bytes are linear in the context, so the
mean is exact for one forward and an estimate across a run. Pure arithmetic: a projection, not a timing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sidecar.decoding.trace import BatchTrace, PrefillRecord, StepRecord
from study.cost.facts import ModelFacts
from study.cost.roofline import Device, forward_seconds


@dataclass(frozen=True)
class SidecarWork:
    """The draft-only sidecar rows of a run: live rows per sidecar step, each admitted group's feeds per row,
    and the mean KV context of a sidecar row."""

    steps: Sequence[int] = ()
    admissions: Sequence[Sequence[int]] = ()
    context: float = 0.0


@dataclass(frozen=True)
class ReplayTime:
    """Projected seconds of a trace: admissions' prefills, the main decoding steps, and the sidecar rows (their
    joins and their steps)."""

    prefill_s: float
    decode_s: float
    sidecar_s: float
    steps: int = 0
    forwards: dict[str, int] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s + self.sidecar_s


def _prefill(facts: ModelFacts, device: Device, tokens: Sequence[int]) -> float:
    return forward_seconds(facts, device, len(tokens), max(tokens), 0) if tokens else 0.0


def step_seconds(step: StepRecord, target: ModelFacts, draft: ModelFacts, device: Device, target_context: float,
                 draft_context: float) -> float:
    """The roofline time of one decoding step: its draft forwards, then the target's verify (or plain) forward."""
    seconds = 0.0
    for k in range(step.draft_forwards):
        feed = max(step.draft_feed, 1) if k == 0 else 1
        seconds += forward_seconds(draft, device, step.live, feed, draft_context + k)
    fed = step.width + 1
    return seconds + forward_seconds(target, device, step.live, fed, target_context, logits=fed)


def replay(trace: BatchTrace, target: ModelFacts, draft: ModelFacts, device: Device, target_context: float,
           draft_context: float, sidecars: SidecarWork | None = None) -> ReplayTime:
    """Price every event of ``trace`` (and ``sidecars``) on ``device`` for models of sizes ``target``/``draft``."""
    prefill = decode = 0.0
    forwards = {"target_prefill": 0, "draft_prefill": 0, "target": 0, "draft": 0, "sidecar": 0}
    for event in trace.events:
        if isinstance(event, PrefillRecord):
            prefill += _prefill(target, device, event.target_tokens) + _prefill(draft, device, event.draft_tokens)
            forwards["target_prefill"] += 1
            forwards["draft_prefill"] += bool(event.draft_tokens)
        elif isinstance(event, StepRecord):
            decode += step_seconds(event, target, draft, device, target_context, draft_context)
            forwards["target"] += 1
            forwards["draft"] += event.draft_forwards
    sidecar = 0.0
    if sidecars is not None:
        for live in sidecars.steps:
            if live:
                sidecar += forward_seconds(draft, device, live, 1, sidecars.context)
                forwards["sidecar"] += 1
        for feeds in sidecars.admissions:
            if feeds:
                sidecar += forward_seconds(draft, device, len(feeds), max(max(feeds), 1), sidecars.context)
                forwards["sidecar"] += 1
    return ReplayTime(prefill, decode, sidecar, len(trace.steps), forwards)
