"""What one step does, decided before any forward runs: the ``StepPlan``, the scheduler's frozen output
(vLLM v1's ``SchedulerOutput`` with its ``SpecDecodeMetadata``), which the runner (``sidecar.decoding.step``)
executes and the update (``sidecar.decoding.update``) reads; nothing changes it after.

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
- *copies*: prompt lookup's drafts (``sidecar.decoding.lookup``), up to ``max_copy`` tokens in the adaptive
  mode, which may exceed gamma: a copy costs no draft forward, only a wider verify (``copy_widths``). In the
  adaptive mode a copy step's rows copy what each has, up to ``width`` (its cap is its copy's length, 0 for a
  row without one); the fixed mode copies only when every row has ``width`` tokens to copy.
- *feed chunks*: where the draft's forwards compile, the feeds take only the widths warm-up compiled
  (``feed_widths``): 1, 2 and F = gamma + 3, the widest backlog a step that ran no draft forward leaves after
  a step that did (the last accepted draft, the old pending token, up to gamma copies, the new pending token);
  a longer copy's backlog runs in chunks, like a bridge's: the draft stays at the widths warm-up compiled.
  A feed of 3 .. F columns pads to F; a wider one (a sidecar's bridge, a finished row catching up, a run of
  plain steps) runs as ``feed_chunks`` forwards of F columns before the draft positions' forwards go on,
  token p of a row's feed in chunk p // F at column p % F (a row whose feed has ended is padding in the later
  chunks). Each row's first draft token comes from the chunk its feed ends in. Eager mode feeds any width in
  one forward, at its real shape.
- *shapes*: the rows, padded batch and query width each forward takes (``ForwardShape``): capture's buckets
  (``sidecar.runtime.capture.decode_shape``: ``batch_bucket``/``width_bucket``) when the model's runner is
  static, the real ones otherwise. They are what runs: the runner passes each forward its plan's shape and the
  model's runner refuses one that is not a bucket of its mode or does not hold the forward
  (``sidecar.runtime.capture.check_shape``); nothing below the plan pads on its own but an eager one-token forward
  where one-row products are measured slow (``sidecar.runtime.padding``), a kernel choice the shape does not show.

Where the draft's forwards compile (``compile``, ``cudagraph``), drafting does not stop early: it runs all
``width`` forwards and the verify sees the full width, and forwards 1 .. width - 1 run as one compiled chain
(``chained_forwards``; ``sidecar.decoding.draft_chain``) where no host decision falls between them. Why, in
the quantities that carry to a GPU: stopping early needs the host to read each forward's confidence before
it launches the next, one sync per draft forward (up to gamma - 1 per step, on top of the step's one read),
and each sync drains the device's queue and leaves it idle while the host decides and launches again; a
chain is one graph launch for gamma - 1 forwards and no sync. The forwards saved by stopping early cost what
a draft forward costs, and the verify's columns saved cost next to nothing at decode widths (the target's
forward streams its weights once whatever its width), while every verify width is another shape to compile
and capture (gamma shapes per batch bucket instead of one). Eager mode keeps the early stop: there every
forward is launched from the host anyway, and a skipped one is saved host time.

``StepPlanner.choose`` makes the target side of a plan (``TargetChoice``): the controller's choice for the
batch (``sidecar.decoding.controller``), prompt lookup's copies (up to ``max_copy`` tokens: gamma in the fixed
mode), and while a seeded sampled row is live a fixed rule row by row (up to gamma tokens, copied or drafted),
so that its tokens depend on nothing but its own prompt and seed.
``StepPlanner.schedule`` completes it with the draft side and the shapes into the ``StepPlan``.

Where the target compiles, a copy longer than gamma verifies at one more width only, ``max_copy`` + 1 (as
``width_bucket`` pads it: at ``max_copy`` 10 a copy of 8 .. 10 tokens verifies at 16 columns): the copies offered
are 1 .. gamma and those whose verify pads to that width (``copy_widths``), so warm-up compiles one shape more per
batch bucket (``verify_widths``), not one per copy length. A copy is mostly as long as ``max_copy`` allows (the text
after a match runs on), so the lengths left out are rarely wanted; and at decode widths a GPU's verify costs nearly
the same whatever its width. Eager forwards take every length at its real width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from sidecar.decoding.controller import GammaController, Source
from sidecar.decoding.draft_chain import chain_applies
from sidecar.decoding.lookup import MIN_NGRAM, lookup_continuation
from sidecar.decoding.rows import LiveRow, MainRow
from sidecar.runtime.capture import ForwardShape, compiles, decode_shape, packs, runner_of, width_bucket

if TYPE_CHECKING:
    from sidecar.runtime.slots import SlotPool

# Adaptive drafting stops once no row's latest draft token had at least this draft probability: the tokens
# drafted after an unsure one are mostly rejected, and each costs a draft forward and a wider verify.
DRAFT_CONFIDENCE = 0.8


@dataclass(frozen=True)
class TargetChoice:
    """The target side of a step. Per target row: ``copies`` (tokens it copies; () where its drafts come from
    the draft model or it has none) and ``caps`` (how many drafts it may keep, <= ``width``)."""

    width: int  # drafts per target row in the verify forward (0: a plain step)
    source: Source  # "draft" when the draft model proposes for some row, "lookup" when every drafting row copies
    copies: tuple[tuple[int, ...], ...]
    caps: tuple[int, ...]
    stop_early: bool  # whether drafting may stop once no drafting row is confident

    @property
    def model_rows(self) -> list[bool]:
        """Per target row: whether its drafts come from the draft model this step."""
        return [cap > 0 and not copy for cap, copy in zip(self.caps, self.copies, strict=True)]


def feed_widths(gamma: int) -> set[int]:
    """The first draft forward's widths where the draft compiles (warm-up's: ``SpeculativeDecoder``): 1 (the
    pending token), 2 (the last accepted draft and the pending token) and F = gamma + 3 (padded as
    ``width_bucket`` says): the backlog of a lookup step that ran no draft forward fits it whole (the last
    accepted draft, the pending token, gamma copies, the new pending token), so copying costs no extra forward;
    a wider feed runs as chunks of F (``feed_chunking``)."""
    return {1, 2, width_bucket(gamma + 3)}


def verify_widths(gamma: int, max_copy: int) -> set[int]:
    """The target's decode widths (warm-up's, where it compiles: ``SpeculativeDecoder``): 1 (a plain step),
    2 .. gamma + 1 (a verify of 1 .. gamma drafts, copied or from the draft model) and ``max_copy`` + 1 (a
    verify of the longest copy, padded as ``width_bucket`` says), the width every longer copy pads to
    (``copy_widths``)."""
    return set(range(1, gamma + 2)) | {max_copy + 1}


def copy_widths(gamma: int, max_copy: int, static: bool) -> list[int]:
    """The copy lengths a lookup step may verify: every one up to ``max_copy`` where the target's forwards run at
    their real shape; where they compile (``static``), 1 .. gamma and those whose verify pads to the width of
    the longest copy's (``verify_widths``), which warm-up compiled."""
    longest = width_bucket(max_copy + 1)
    return [g for g in range(1, max_copy + 1) if not static or g <= gamma or width_bucket(g + 1) == longest]


def feed_chunking(widest: int, gamma: int, static: bool) -> tuple[int, int]:
    """(width, chunks): the first draft forward's query width and how many forwards of it take feeds of at most
    ``widest`` columns. Eager (not ``static``): one forward of ``widest``. Compiled: 1 or 2 as they are, 3 .. F
    (``feed_widths``' widest) padded to F, wider in ceil(widest / F) forwards of F: no feed compiles a shape
    warm-up did not (each would cost a compile, on CUDA a graph, per batch bucket, mid-run); a chunk costs a
    draft forward, and padding columns next to nothing at decode widths on a GPU."""
    if not static or widest <= 2:
        return widest, 1
    chunk = max(feed_widths(gamma))
    return chunk, -(-widest // chunk)


def forward_shape(pool: SlotPool, rows: int, width: int) -> ForwardShape:
    """The shape of a decode forward of ``rows`` rows and ``width`` columns over ``pool``: capture's buckets
    when its model's runner compiles (``StackRunner.static``), the real shape otherwise (``decode_shape``)."""
    return decode_shape(rows, width, pool.max_batch, compiles(pool.model))


@dataclass(frozen=True)
class StepPlan(TargetChoice):
    """One step, complete: the target side (``TargetChoice``), the rows in slot order, and per draft row
    ``feeds`` (the first draft forward's input; () without a draft forward) and ``drafting`` (a main row
    whose proposals this step verifies); for target row ``t``, ``draft_slot[t]`` is its draft row (-1: none).
    ``target_shape`` is the verify's (or the plain step's) at ``width`` (None: no target row; drafting that
    stops early verifies fewer columns: ``verify_shape``), ``draft_shape`` the first draft forward's (None: no
    draft forward; each of its ``feed_chunks`` forwards takes it), ``next_draft_shape`` the later draft
    forwards', one column each, and a chain's (None: at most one draft forward). ``chained_forwards``: how many
    of the draft forwards, all but the first, run as one compiled chain (``sidecar.decoding.draft_chain``).
    ``draft_forwards`` counts draft positions: the first's feed chunks make ``feed_chunks - 1`` forwards more."""

    target_rows: tuple[MainRow, ...] = ()
    draft_rows: tuple[LiveRow, ...] = ()
    draft_forwards: int = 0  # at most: drafting may stop early
    feeds: tuple[tuple[int, ...], ...] = ()
    drafting: tuple[bool, ...] = ()
    draft_slot: tuple[int, ...] = ()
    target_shape: ForwardShape | None = None
    draft_shape: ForwardShape | None = None
    next_draft_shape: ForwardShape | None = None
    chained_forwards: int = 0  # draft forwards after the first run as one compiled call (0: each on its own)
    feed_chunks: int = 1  # forwards the first draft position's feeds take (``feed_chunking``)

    def feed_chunk(self, chunk: int) -> list[tuple[int, ...]]:
        """Each draft row's tokens in feed chunk ``chunk`` (the whole feed where there is one chunk): token p
        of a feed is in chunk p // width, () where the feed ended in an earlier chunk."""
        if self.feed_chunks == 1:
            return list(self.feeds)
        assert self.draft_shape is not None
        width = self.draft_shape.width
        return [feed[chunk * width : (chunk + 1) * width] for feed in self.feeds]

    def verify_shape(self, width: int) -> ForwardShape:
        """The target forward's shape when the verify sees ``width`` drafts: ``target_shape``, or, where drafting
        stopped early (eager shapes only: the planner never lets compiled drafting stop), its real width."""
        assert self.target_shape is not None
        if width == self.width:
            return self.target_shape
        assert self.stop_early and width < self.width, "only drafting that stops early narrows the verify"
        return replace(self.target_shape, width=width + 1)


# (draft slot, draft row) -> what the first draft forward feeds it
FeedOf = Callable[[int, LiveRow], list[int]]


class StepPlanner:
    """The scheduler: each step's ``StepPlan`` (see the module docstring)."""

    def __init__(self, controller: GammaController, gamma: int, prompt_lookup: bool = True,
                 draft_confidence: float = DRAFT_CONFIDENCE) -> None:
        self.controller = controller
        self.gamma = gamma
        self.prompt_lookup = prompt_lookup
        self.lookup_min_ngram = MIN_NGRAM
        # adaptive: a copy step copies for the rows that have a copy (False: only when every row has one, the
        # rule before; benchmarks compare the two)
        self.copy_for_some_rows = True
        self.draft_confidence = draft_confidence

    @property
    def max_copy(self) -> int:
        """The longest copy a step may verify (``copy_widths``): the controller's, which prices each width."""
        return self.controller.max_copy

    @property
    def widest(self) -> int:
        """The most drafts a step verifies per row, copied or drafted (the per-position counters' length)."""
        return max(self.gamma, self.max_copy)

    def schedule(self, target_rows: Sequence[MainRow], draft_rows: Sequence[LiveRow], feed: FeedOf,
                 target_pool: SlotPool | None, draft_pool: SlotPool | None) -> StepPlan:
        """The next step over the live rows, in slot order: the target side, then the draft side (which rows
        draft, each draft row's feed, how many draft forwards), then the shapes of the forwards."""
        riders = sum(not isinstance(r, MainRow) or r.finish is not None for r in draft_rows)
        static_target = target_pool is not None and compiles(target_pool.model)
        packed = target_pool is not None and packs(target_pool.model)  # an eager stack: only real tokens count
        choice = (self.choose(target_rows, riders, static_target, packed) if target_rows
                  else TargetChoice(0, "draft", (), (), False))
        slot_of = {id(r): slot for slot, r in enumerate(draft_rows)}
        drafts = {id(r) for r, model in zip(target_rows, choice.model_rows, strict=True) if model}
        forwards = (choice.width if choice.source == "draft" and drafts else 0) or int(riders > 0)
        feeds = tuple(tuple(feed(slot, r)) for slot, r in enumerate(draft_rows)) if forwards else ()
        # compiled drafting never stops early: see the module docstring
        draft_runner = runner_of(draft_pool.model) if draft_pool is not None else None
        stop_early = choice.stop_early and not (draft_pool is not None and compiles(draft_pool.model))
        chained = forwards - 1 if chain_applies(draft_runner, draft_rows, forwards, stop_early) else 0
        target_shape = draft_shape = next_draft_shape = None
        chunks = 1
        if target_rows:
            assert target_pool is not None
            target_shape = forward_shape(target_pool, len(target_rows), choice.width + 1)
        if forwards:
            assert draft_pool is not None
            width, chunks = feed_chunking(max(map(len, feeds)), self.gamma, compiles(draft_pool.model))
            draft_shape = forward_shape(draft_pool, len(draft_rows), width)
        if forwards > 1:
            next_draft_shape = forward_shape(draft_pool, len(draft_rows), 1)
        return StepPlan(choice.width, choice.source, choice.copies, choice.caps, stop_early,
                        target_rows=tuple(target_rows), draft_rows=tuple(draft_rows), draft_forwards=forwards,
                        feeds=feeds, drafting=tuple(id(r) in drafts for r in draft_rows),
                        draft_slot=tuple(slot_of.get(id(r), -1) for r in target_rows),
                        target_shape=target_shape, draft_shape=draft_shape, next_draft_shape=next_draft_shape,
                        chained_forwards=chained, feed_chunks=chunks)

    def choose(self, rows: Sequence[MainRow], riders: int = 0, static: bool = False,
               packed: bool = False) -> TargetChoice:
        """The target side of the next step for the live main ``rows``; ``riders`` draft rows that are not
        main rows share the draft forwards (the controller prices them in); ``static``: the target's forwards
        compile, and a copy takes only the widths warm-up compiled (``copy_widths``); ``packed``: the target's
        forward computes only the rows' real tokens (``sidecar.runtime.decoder_stack``), so rows that copy less
        cost less."""
        # the width shrinks only when every row is near its limit: one row's limit must not cost the others
        most = max(max((r.remaining for r in rows), default=0) - 1, 0)
        limit = min(self.gamma, most)
        has_draft = [r.has_draft for r in rows]
        if any(r.sampling.seeded for r in rows):
            caps = tuple(min(self.gamma, r.remaining - 1) if r.has_draft else 0 for r in rows)
            copies = tuple(c if cap and len(c) >= cap else () for c, cap in zip(self._copies(rows, limit), caps,
                                                                               strict=True))
            model = any(cap and not c for cap, c in zip(caps, copies, strict=True))
            return TargetChoice(max(caps, default=0), "draft" if model else "lookup", copies, caps, False)
        # A verify writes its width + 1 columns past each row's cached tokens, and a row keeps gamma + 1 free past
        # its last token (``row_columns``): a row with r tokens left holds a verify of r + gamma + 1 drafts
        # (r - 1 of them its own, the rest cut at commit), so a copy longer than gamma stops there.
        room = min((r.remaining for r in rows), default=0) + self.gamma + 1
        copied = self._copies(rows, min(self.max_copy, most, room))
        every_row_copies = bool(rows) and all(copied)
        max_lookup = min(map(len, copied)) if every_row_copies else 0
        # several rows may copy unequal lengths, the rows without a copy verifying only their pending token; an
        # eager stack then computes only the real tokens (``sidecar.runtime.decoder_stack``, packing)
        width, source = self.controller.choose(len(rows), limit if any(has_draft) else 0, max_lookup, riders,
                                               copy_widths(self.gamma, self.max_copy, static),
                                               copy_lengths=[len(c) for c in copied] if self.copy_for_some_rows
                                               else None, packed=packed)
        if source == "lookup" and width:
            copies = tuple(c[:width] for c in copied)
            return TargetChoice(width, source, copies, tuple(map(len, copies)), False)
        return TargetChoice(width, source, ((),) * len(rows), tuple(width if d else 0 for d in has_draft),
                            stop_early=self.draft_confidence > 0)

    def _copies(self, rows: Sequence[MainRow], limit: int) -> list[tuple[int, ...]]:
        """Each live row's prompt-lookup continuation (up to ``limit`` tokens: gamma, or ``max_copy`` where the
        controller chooses; () where it has none)."""
        if not self.prompt_lookup or limit == 0 or not rows:
            return [() for _ in rows]
        copied = [tuple(lookup_continuation(r.request.target_prompt + r.tokens, limit,
                                            min_ngram=self.lookup_min_ngram)) for r in rows]
        # every row is looked up, not only up to the first without a copy: draft_pays prices the draft
        # against copying from how often a row has a copy
        self.controller.observe_copies(sum(map(bool, copied)), len(copied))
        return copied
