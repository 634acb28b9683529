"""What one step does, decided before any forward runs: the ``StepPlan`` (as vLLM's ``SpecDecodeMetadata``).

Terms, per step:
- *target rows*: the live main rows, in target-slot order. The step verifies ``width`` drafts for each
  (``width`` 0: a plain target step).
- *draft rows*: every row in the draft pool, in draft-slot order: main rows whose draft holds their
  prompt, finished main rows catching their draft cache up before it is handed to their sidecars, and
  draft-only rows (sidecars, standalone prompts) that the draft decodes alone.
- *draft forwards*: the draft model's forwards this step, each over all draft rows. Main rows drafting
  from the model use their outputs as proposals; draft-only rows commit them as output; the others only
  feed. So a step runs one draft forward per draft position whatever mix of rows it holds: ``width`` when
  some row drafts from the model, else one when some row rides (catch-up, draft-only), else none.
- the first draft forward feeds each draft row its *feed*: for a main row, what its draft lacks (its
  backlog and pending token); for a catching-up row, the rest of its output; for a draft-only row, its
  pending token, or its join feed (a sidecar's bridge) on its first step.

``StepPlanner`` makes the target side of a plan: the controller's choice for the batch
(``sidecar.decoding.controller``), prompt lookup's copies, and while a seeded sampled row is live a fixed
rule row by row, so that its tokens depend on nothing but its own prompt and seed.
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.decoding.controller import GammaController, Source
from sidecar.decoding.lookup import MIN_NGRAM, lookup_continuation
from sidecar.decoding.rows import MainRow

# Adaptive drafting stops once no row's latest draft token had at least this draft probability: the tokens
# drafted after an unsure one are mostly rejected, and each costs a draft forward and a wider verify.
DRAFT_CONFIDENCE = 0.8


@dataclass
class StepPlan:
    """One step's metadata. Per target row: ``copies`` (tokens it copies; [] where its drafts come from the
    draft model or it has none) and ``caps`` (how many drafts it may keep, <= ``width``). Per draft row:
    ``feeds`` (the first draft forward's input), ``drafting`` (a main row whose proposals this step
    verifies) and, for target row ``t``, ``draft_slot[t]`` (its draft row; -1: none)."""

    width: int  # drafts per target row in the verify forward (0: a plain step)
    source: Source  # "draft" when the draft model proposes for some row, "lookup" when every drafting row copies
    copies: list[list[int]]
    caps: list[int]
    stop_early: bool  # whether drafting may stop once no drafting row is confident
    draft_forwards: int = 0  # at most: drafting may stop early
    feeds: list[list[int]] | None = None
    drafting: list[bool] | None = None
    draft_slot: list[int] | None = None

    @property
    def model_rows(self) -> list[bool]:
        """Per target row: whether its drafts come from the draft model this step."""
        return [cap > 0 and not copy for cap, copy in zip(self.caps, self.copies, strict=True)]


class StepPlanner:
    """Chooses each step's width and draft source for the target rows (see the module docstring)."""

    def __init__(self, controller: GammaController, gamma: int, prompt_lookup: bool = True,
                 draft_confidence: float = DRAFT_CONFIDENCE) -> None:
        self.controller = controller
        self.gamma = gamma
        self.prompt_lookup = prompt_lookup
        self.lookup_min_ngram = MIN_NGRAM
        self.draft_confidence = draft_confidence

    def plan(self, rows: list[MainRow], riders: int = 0) -> StepPlan:
        """The target side of the next step for the live main ``rows``; ``riders`` draft rows that are not
        main rows share the draft forwards (the controller prices them in)."""
        # the width shrinks only when every row is near its limit: one row's limit must not cost the others
        limit = min(self.gamma, max(max((r.remaining for r in rows), default=0) - 1, 0))
        has_draft = [r.has_draft for r in rows]
        if any(r.sampling.seeded for r in rows):
            caps = [min(self.gamma, r.remaining - 1) if r.has_draft else 0 for r in rows]
            copies = [c if cap and len(c) >= cap else [] for c, cap in zip(self._copies(rows, limit), caps,
                                                                          strict=True)]
            model = any(cap and not c for cap, c in zip(caps, copies, strict=True))
            return StepPlan(max(caps, default=0), "draft" if model else "lookup", copies, caps, stop_early=False)
        copied = self._copies(rows, limit)
        every_row_copies = bool(rows) and all(copied)
        max_lookup = min(map(len, copied)) if every_row_copies else 0
        width, source = self.controller.choose(len(rows), limit if any(has_draft) else 0, max_lookup, riders)
        if source == "lookup" and width:
            return StepPlan(width, source, [c[:width] for c in copied], [width] * len(rows), stop_early=False)
        return StepPlan(width, source, [[] for _ in rows], [width if d else 0 for d in has_draft],
                        stop_early=self.draft_confidence > 0)

    def _copies(self, rows: list[MainRow], limit: int) -> list[list[int]]:
        """Each live row's prompt-lookup continuation (up to ``limit`` tokens; [] where it has none)."""
        if not self.prompt_lookup or limit == 0 or not rows:
            return [[] for _ in rows]
        copied = [lookup_continuation(r.request.target_prompt + r.tokens, limit, min_ngram=self.lookup_min_ngram)
                  for r in rows]
        # every row is looked up, not only up to the first without a copy: draft_pays prices the draft
        # against copying from how often a row has a copy
        self.controller.observe_copies(sum(map(bool, copied)), len(copied))
        return copied
