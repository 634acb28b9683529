"""The running batch: rows join between steps, decode together, and leave as they finish.

Invariant: entry ``i`` of ``target_rows`` (and of ``pending_ids``) is slot ``i`` of the target pool, and
entry ``i`` of ``draft_rows`` is slot ``i`` of the draft pool. Main rows are in the target pool, and in
the draft pool too while their draft holds their prompt; draft-only rows are in the draft pool alone (the
terms are ``sidecar.decoding.plan``'s). Each pool keeps its live rows in its first slots.

One step, ``SlotBatch.step``: compact → admit → schedule → run → update → compact, in vLLM v1's parts.
- *compact*: finished rows leave and their output goes back to the caller; a finished main row whose draft
  cache is handed on (``DecodeRow.keep_draft``) stays in the draft pool one more step to catch up with its
  output if it must, then goes to ``on_handoff``.
- *admit*: waiting main rows are prefilled into free slots in place (the target, then the draft with its
  hidden spans) and choose their first tokens: SGLang's prefill-then-merge, with the merge free because
  the slots are already the batch's. Waiting draft-only rows join from a snapshot (their feed rides in the
  next draft forward) or are prefilled from a prompt. A first token is chosen by ``_first_tokens`` (main and
  draft-only rows alike) and committed by the update, as a step's tokens are.
- *schedule*: ``StepPlanner.schedule`` (``sidecar.decoding.plan``): the frozen ``StepPlan``, complete: the rows
  in slot order, width and draft source, per-row caps, copies and feeds, draft forwards, and the shapes (batch
  and width buckets) the forwards take.
- *run*: ``StepRunner.run`` (``sidecar.decoding.step``) executes the plan: the draft forwards, the target
  forward, the one read; the ledger charges every forward to its rows.
- *update*: ``StepUpdate.step`` (``sidecar.decoding.update``): tokens committed (cut at end of turn, a stop
  string or the limit), streamed, logprobs, stats (one ``GenerationStats`` record per row) and the trace.

A row with a constraint (``DecodeRow.constraint``, ``DraftRow.constraint``; docs/constraints.md) has a
``RowMatcher``: every token it chooses is chosen from logits masked by it (the admission's first token here,
the step's in ``StepRunner``), and ``StepUpdate.commit`` brings the matcher level with the tokens the row keeps.

The "continuous" schedule admits before every step; "static" only into an empty batch: fixed batches that
run until their last row (and its draft-only rows) finish, the schedule a continuous batch is measured against.

Reads of the device: one per admitted group that chooses first tokens, one per step (``StepRunner``), at
most one per draft forward (drafting's early stop, and a constrained draft-only row's token), one more per
verify while a main row is constrained (its drafts, for the masks).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Protocol, TypeVar

import torch

from sidecar.decoding.constraints import Constraint, token_space
from sidecar.decoding.logprobs import MAX_TOP_LOGPROBS
from sidecar.decoding.matcher import RowMatcher
from sidecar.decoding.plan import StepPlan, StepPlanner
from sidecar.decoding.randomness import draw_key
from sidecar.decoding.rows import (
    CancelCheck,
    DecodeRow,
    DraftHandoff,
    DraftOnlyRow,
    DraftRow,
    GenerationOutput,
    HandoffCallback,
    LiveRow,
    MainRow,
    TokenCallback,
)
from sidecar.decoding.sampling import RowSampling
from sidecar.decoding.stats import GenerationStats
from sidecar.decoding.step import StepRunner, constrain
from sidecar.decoding.stops import TokenStops
from sidecar.decoding.trace import KEPT_EVENTS, BatchTrace, PrefillRecord
from sidecar.decoding.update import FirstTokens, StepUpdate
from sidecar.decoding.vocab_align import align_vocab
from sidecar.errors import InputError
from sidecar.models.pair import ModelPair
from sidecar.progress import DECODE, DRAFT_PREFILL, TARGET_PREFILL, ProgressCallback
from sidecar.runtime.capture import packs
from sidecar.runtime.forward import TimeForward, logits_at, prefill
from sidecar.runtime.ledger import Account, Charge, Ledger
from sidecar.runtime.prefill_plan import PrefillPlanner
from sidecar.runtime.slots import SlotPool, row_columns
from sidecar.runtime.step_counters import counters_of, counting
from sidecar.runtime.transfers import to_device

Item = TypeVar("Item", contravariant=True)
Result = TypeVar("Result", covariant=True)

SCHEDULES = ("continuous", "static")


class RunningBatch(Protocol[Item, Result]):
    """What ``stream_through`` drives: ``SlotBatch`` and ``sidecar.tasks.batch.SidecarBatch``."""

    @property
    def busy(self) -> bool: ...
    def wants_rows(self) -> bool: ...
    def add(self, index: int, item: Item) -> None: ...
    def close(self) -> None: ...
    def step(self) -> list[tuple[int, Result]]: ...


def stream_through(batch: RunningBatch[Item, Result], items: Iterable[Item],
                   indices: list[int] | None = None) -> Iterator[tuple[int, Result]]:
    """Feed ``items`` to ``batch`` as it has room and yield (index, result) as each finishes; an item's index is
    its place in ``items`` (or ``indices[place]``). Items are read only when a slot is free for them, so a
    long or endless stream holds no more than the batch's slots in memory."""
    source = iter(items)
    exhausted, place = False, 0
    while True:
        while not exhausted and batch.wants_rows():
            item = next(source, None)
            if item is None:
                exhausted = True
                batch.close()
                break
            batch.add(place if indices is None else indices[place], item)
            place += 1
        if not batch.busy:
            return
        yield from batch.step()


def check_row(pair: ModelPair, gamma: int, row: DecodeRow, index: object) -> None:
    """Refuse a main row the batch cannot run as given, with a message that says which and why."""
    limit = pair.max_context
    vocab = min(len(pair.tokenizer), pair.target.get_output_embeddings().out_features)
    if row.sampling.temperature < 0 or not 0 < row.sampling.top_p <= 1:
        raise InputError("temperature must be >= 0 and top_p in (0, 1]")
    if row.top_logprobs is not None and not 0 <= row.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InputError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {row.top_logprobs}")
    if row.max_new_tokens < 1:
        raise InputError(f"row {index}: max_new_tokens must be >= 1")
    for name, prompt in (("prompt", row.target_prompt), ("draft prompt", row.draft_prompt)):
        if prompt is None:
            continue
        if not prompt:
            raise InputError(f"row {index}: empty {name}; give at least one token")
        if row_columns(len(prompt), row.max_new_tokens, gamma) > limit:
            raise InputError(f"row {index}: {name} of {len(prompt)} tokens + {row.max_new_tokens} new tokens exceeds "
                             f"the model context of {limit} tokens; shorten the document")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise InputError(f"row {index}: {name} has token ids outside the vocabulary (0..{vocab - 1})")


class SlotBatch:
    """A running batch of main rows (at most ``max_batch``) and draft-only rows (at most ``max_draft_rows``).

    ``on_tokens`` hears every row's committed tokens as they come; ``on_handoff`` receives the draft cache of
    each finished main row that asked to keep it; ``cancelled`` is asked once per step for every row, live or
    waiting; ``on_progress`` hears the main rows' phases (``sidecar.progress``). ``trace_keep`` bounds the
    trace and the ledger's records (None: keep all, for benchmarks).
    """

    def __init__(self, pair: ModelPair, planner: StepPlanner, prefill_plans: dict[str, PrefillPlanner],
                 max_batch: int, schedule: str = "continuous", *, max_draft_rows: int = 0,
                 on_tokens: TokenCallback | None = None, on_handoff: HandoffCallback | None = None,
                 on_progress: ProgressCallback | None = None, cancelled: CancelCheck | None = None,
                 expected_rows: int | None = None, kv_budget_tokens: int | None = None,
                 trace_keep: int | None = KEPT_EVENTS) -> None:
        if max_batch < 0 or max_draft_rows < 0 or max_batch + max_draft_rows < 1:
            raise InputError(f"batch_size must be >= 1, got {max_batch}")
        if schedule not in SCHEDULES:
            raise InputError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        self.pair, self.planner, self.prefill_plans = pair, planner, prefill_plans
        self.controller = planner.controller
        self.device = pair.device
        self.max_batch, self.max_draft_rows, self.schedule = max_batch, max_draft_rows, schedule
        self.on_handoff, self.cancelled = on_handoff, cancelled
        self.progress = on_progress or (lambda phase, done, total: None)
        self.expected_rows, self.kv_budget_tokens = expected_rows, kv_budget_tokens
        self.eos = set(pair.eos_token_ids)
        self.target_vocab = pair.target.get_output_embeddings().out_features
        self.ledger = Ledger(self.controller.timer(self.device), keep=trace_keep)
        self.runner = StepRunner(pair, self.controller, self.ledger, planner.draft_confidence)
        self.trace = BatchTrace(max_batch, keep=trace_keep)
        self.update = StepUpdate(self.eos, self.device, self.trace, on_tokens)
        self.target_pool: SlotPool | None = None
        self.draft_pool: SlotPool | None = None
        self.target_rows: list[MainRow] = []
        self.draft_rows: list[LiveRow] = []
        self.pending_ids = torch.zeros(0, dtype=torch.long, device=self.device)  # [B_t] on the device
        self.waiting_main: deque[MainRow] = deque()
        self.waiting_draft: deque[DraftOnlyRow] = deque()
        self.closed = False  # no row will be added any more: the steps from the last admission on are the drain
        self.admitted = 0
        self.admitted_tokens = 0  # the token limits of every main row admitted
        self.retired_tokens = 0  # ... of every main row that has left
        self._leaving: list[LiveRow] = []  # waiting rows cancelled before they joined

    # -- the caller's side --

    @property
    def busy(self) -> bool:
        return bool(self.target_rows or self.draft_rows or self.waiting_main or self.waiting_draft)

    @property
    def draft_only_rows(self) -> int:
        return sum(isinstance(r, DraftOnlyRow) for r in self.draft_rows)

    def wants_rows(self) -> bool:
        """Whether another waiting main row would be admitted at the next step."""
        if self.schedule == "static":
            return not (self.target_rows or self.draft_rows or self.waiting_draft) and \
                len(self.waiting_main) < self.max_batch
        return len(self.waiting_main) < self.max_batch - len(self.target_rows)

    def wants_draft_rows(self) -> bool:
        """Whether another waiting draft-only row would be admitted at the next step."""
        return len(self.waiting_draft) < self.max_draft_rows - self.draft_only_rows

    def add(self, key: Hashable, row: DecodeRow) -> None:
        """Queue main row ``row`` to join at the next step with a free slot; bad input raises ``InputError``."""
        check_row(self.pair, self.planner.gamma, row, key)
        draws = 0 if row.sampling.greedy else draw_key(row.sampling.seed)
        self.waiting_main.append(MainRow(
            key, row.max_new_tokens, row.sampling, draws, row.top_logprobs, time.perf_counter(),
            stops=TokenStops(self.pair.tokenizer, row.stop) if row.stop else None, request=row,
            hands_on=row.keep_draft, matcher=self._matcher(row.constraint)))

    def add_draft(self, key: Hashable, row: DraftRow) -> None:
        """Queue draft-only row ``row`` to join when a draft slot is free."""
        if not row.feed:
            raise InputError(f"draft row {key}: empty feed; give at least one token")
        self.waiting_draft.append(DraftOnlyRow(
            key, row.max_new_tokens, row.sampling, row.draw_key, row.top_logprobs, time.perf_counter(),
            feed=list(row.feed), phase=row.phase, carried=row.carried, snapshot=row.snapshot,
            matcher=self._matcher(row.constraint)))

    def _matcher(self, constraint: Constraint | None) -> RowMatcher | None:
        """A row's matcher over the target's vocabulary (draft logits are aligned to it) and the batch's end ids."""
        if constraint is None:
            return None
        return RowMatcher(token_space(self.pair.tokenizer, self.target_vocab, sorted(self.eos)), constraint)

    def close(self) -> None:
        """Say that no more main rows will come (it only marks where the final drain begins in ``trace``)."""
        self.closed = True

    def step(self) -> list[tuple[Hashable, GenerationOutput]]:
        """Admit what fits, take one decoding step, and return the rows that finished, as (key, output)."""
        with torch.inference_mode():
            self._cancel()
            finished = self._compact()
            self._admit()
            if self.closed and not self.waiting_main:
                self.trace.mark_drain()
            finished += self._compact()  # rows that finished with their first token
            if self.target_rows or self.draft_rows:
                with counting(counters_of(self.pair)):
                    plan = self.planner.schedule(self.target_rows, self.draft_rows, self._feed, self.target_pool,
                                                 self.draft_pool)
                    self._fit_feeds(plan)
                    result = self.runner.run(plan, self._active(self.target_pool), self._active(self.draft_pool),
                                             self.pending_ids)
                    self.pending_ids = result.next_ids
                    self.update.step(plan, result)
                self._progress_decode()
                finished += self._compact()
        return finished

    # -- compact --

    def _cancel(self) -> None:
        if self.cancelled is None:
            return
        for r in [*self.target_rows, *self.draft_rows]:
            if self.cancelled(r.key):
                if r.finish is None:
                    r.finish = "cancelled"
                elif isinstance(r, MainRow):  # catching up for sidecars nobody waits for
                    r.hands_on = False
        for queue in (self.waiting_main, self.waiting_draft):
            for r in [r for r in queue if self.cancelled(r.key)]:
                queue.remove(r)
                r.finish = "cancelled"
                self._leaving.append(r)

    def _compact(self) -> list[tuple[Hashable, GenerationOutput]]:
        """Retire finished rows from both pools; hand on caught-up draft caches."""
        finished = [(r.key, self._output(r, 0)) for r in self._leaving]
        self._leaving.clear()
        if any(r.finish is not None for r in (*self.target_rows, *self.draft_rows)):
            self.ledger.collect(wait=True)  # a row leaving right after its admission may have timings queued
        if any(r.finish is not None for r in self.target_rows):
            row_bytes = self.target_pool.active.row_bytes()
            for slot, r in enumerate(self.target_rows):
                if r.finish is not None:
                    finished.append((r.key, self._output(r, int(row_bytes[slot]))))
                    self.retired_tokens += r.max_new_tokens
            keep = [slot for slot, r in enumerate(self.target_rows) if r.finish is None]
            order = self.target_pool.remove(keep)
            self.target_rows = [self.target_rows[s] for s in order]
            self.pending_ids = self.pending_ids.index_select(0, to_device(order, self.device)) if order \
                else self.pending_ids[:0]
            self._progress_decode()
        if any(r.finish is not None for r in self.draft_rows):
            cache = self.draft_pool.active
            row_bytes = cache.row_bytes()
            keep = []
            for slot, r in enumerate(self.draft_rows):
                if r.finish is None:
                    keep.append(slot)
                elif isinstance(r, DraftOnlyRow):
                    finished.append((r.key, self._output(r, int(row_bytes[slot]))))
                elif self._hands_on(r, cache, slot):
                    keep.append(slot)  # catching up with its output first
            order = self.draft_pool.remove(keep)
            self.draft_rows = [self.draft_rows[s] for s in order]
        return finished

    def _hands_on(self, r: MainRow, cache, slot: int) -> bool:
        """For a finished main row in the draft pool: hand its cache on if it holds the whole output, and
        say whether the row stays (to catch up first)."""
        if not r.hands_on or r.finish == "cancelled" or self.on_handoff is None:
            return False
        main = self._main_tokens(r)
        prompt = len(r.request.draft_prompt or r.request.target_prompt)
        cache.rollback_row(slot, prompt + len(main))
        if int(cache.lengths[slot]) < prompt + len(main):
            r.catching_up = True
            return True
        self.on_handoff(DraftHandoff(r.key, r.output, cache, slot, r.instruction, r.catch_up))
        return False

    def _main_tokens(self, r: MainRow) -> list[int]:
        """A main row's output as its sidecars continue from it: without its end-of-turn token."""
        return r.tokens[:-1] if r.tokens and r.tokens[-1] in self.eos else r.tokens

    # -- admit --

    def _admit(self) -> None:
        static = self.schedule == "static"
        if not (static and (self.target_rows or self.draft_rows or self.waiting_draft)):
            count = min(self.max_batch - len(self.target_rows), len(self.waiting_main))
            if self.draft_pool is not None:
                count = min(count, self.draft_pool.free)
            if count > 0:
                self._admit_main([self.waiting_main.popleft() for _ in range(count)])
        if static and self.target_rows:
            return
        room = self.max_draft_rows - self.draft_only_rows
        if self.draft_pool is not None:
            room = min(room, self.draft_pool.free)
        count = min(room, len(self.waiting_draft))
        if count > 0:
            group = [self.waiting_draft.popleft() for _ in range(count)]
            snapshots = [r for r in group if r.snapshot is not None]
            prompts = [r for r in group if r.snapshot is None]
            if snapshots:
                self._admit_snapshots(snapshots)
            if prompts:
                self._admit_prompts(prompts)

    def _pool(self, pool: SlotPool | None, model, slots: int, columns: int) -> SlotPool:
        if pool is None:
            pool = SlotPool(model, slots, columns, self.kv_budget_tokens)
        pool.ensure_capacity(columns)
        return pool

    def _prefill_timing(self, model: str, rows: Sequence[LiveRow],
                        hidden: list[list[tuple[int, int]]] | None = None) -> TimeForward:
        """Times each prefill forward of ``model`` over ``rows``, charging it by the ledger's rule (hidden
        spans to their instruction accounts) and telling the prefill planner and the controller."""
        plan = self.prefill_plans[model]

        def timing(first: int, tokens: list[int], padded: int, shared: int, sharers: int) -> AbstractContextManager:
            # a prefix computed once for several rows counts as theirs in equal shares (the ledger's rule)
            charges = [Charge(rows[first + k].account, "prefill", shared / sharers, rows[first + k].phase)
                       for k in range(1, sharers)]
            for i, fed in enumerate(tokens):
                r = rows[first + i]
                spans = [] if hidden is None else hidden[first + i]
                own = fed - sum(e - s for s, e in spans) - (shared - shared / sharers if i == 0 else 0)
                charges.append(Charge(r.account, "prefill", own, r.phase))
                if spans:
                    assert isinstance(r, MainRow)
                    charges += [Charge(a, "prefill", e - s, "instruction")
                                for a, (s, e) in zip(r.instruction, spans, strict=True)]
            real = sum(tokens)

            def heard(seconds: float) -> None:
                plan.observe(padded, real, seconds)
                self.controller.observe_prefill(model, real, seconds)

            return self.ledger.forward(model, "prefill", max(len(tokens), sharers), charges, padded, real, also=heard)

        return timing

    def _admit_main(self, rows: list[MainRow]) -> None:
        pair, gamma = self.pair, self.planner.gamma
        started = time.perf_counter()
        requests = [r.request for r in rows]
        self.target_pool = self._pool(self.target_pool, pair.target, self.max_batch, max(
            row_columns(len(q.target_prompt), q.max_new_tokens, gamma) for q in requests))
        expected = max(self.expected_rows or 0, self.admitted + len(rows))
        self.progress(TARGET_PREFILL, self.admitted, expected)
        for r in rows:
            r.admitted = started
            r.instruction = [Account() for _ in r.request.draft_hidden]
            r.catch_up = [Account() for _ in r.request.draft_hidden]
        last = prefill(pair.target, self.target_pool.admit(len(rows)), [q.target_prompt for q in requests],
                       self.prefill_plans["target"].budget(),
                       on_rows=lambda k: self.progress(TARGET_PREFILL, self.admitted + k, expected),
                       time_forward=self._prefill_timing("target", rows))
        # the admission's one read also completes the target's prefill
        first = self._first_tokens(rows, logits_at(pair.target, last, self._last_column(len(rows)))[:, 0])

        # the draft's prefill is skipped when these rows would decode plainly (a sidecar or a seed needs it; a
        # gamma of 0 decodes plainly throughout, so only a sidecar does)
        draft_prompts = [q.draft_prompt or q.target_prompt for q in requests]
        plain = gamma == 0 or not (any(q.sampling.seeded for q in requests) or self.controller.draft_pays(
            len(self.target_rows) + len(rows), sum(map(len, draft_prompts)), max(q.max_new_tokens for q in requests),
            pair.draft_size_ratio, packed=packs(pair.target)))
        speculate = any(q.keep_draft for q in requests) or not plain
        if speculate:
            self.draft_pool = self._pool(self.draft_pool, pair.draft, self.max_batch + self.max_draft_rows, max(
                row_columns(len(p), q.max_new_tokens, gamma) for p, q in zip(draft_prompts, requests, strict=True)))
            self.progress(DRAFT_PREFILL, self.admitted, expected)
            hidden = [q.draft_hidden for q in requests]
            prefill(pair.draft, self.draft_pool.admit(len(rows)), draft_prompts, self.prefill_plans["draft"].budget(),
                    hidden, on_rows=lambda k: self.progress(DRAFT_PREFILL, self.admitted + k, expected),
                    time_forward=self._prefill_timing("draft", rows, hidden))
            for r in rows:
                r.has_draft = True
            self.draft_rows += rows
        self.trace.add(PrefillRecord(len(rows), [len(q.target_prompt) for q in requests],
                                     [len(p) for p in draft_prompts] if speculate else []))
        live = len(self.target_rows) + len(rows)
        now = time.perf_counter()
        for r in rows:
            r.stats = GenerationStats(prompt_tokens=len(r.request.target_prompt), target_forwards=1,
                                      drafted_per_position=[0] * self.planner.widest,
                                      accepted_per_position=[0] * self.planner.widest,
                                      prefill_seconds=now - started, batch_size=live)
            r.logprobs = None if r.top_logprobs is None else []
            r.decoding_from = now
        self.target_rows += rows
        self.pending_ids = torch.cat([self.pending_ids, first.ids])
        self.admitted += len(rows)
        self.admitted_tokens += sum(q.max_new_tokens for q in requests)
        self.update.first(rows, first)
        self._progress_decode()

    def _admit_snapshots(self, rows: list[DraftOnlyRow]) -> None:
        """Draft-only rows that continue from a snapshot: written into free draft slots; their feed rides in
        the next step's first draft forward, which chooses their first token."""
        columns = max(row_columns(r.snapshot.length + len(r.feed), r.max_new_tokens, self.planner.gamma) for r in rows)
        self.draft_pool = self._pool(self.draft_pool, self.pair.draft, self.max_batch + self.max_draft_rows, columns)
        started = time.perf_counter()
        self.draft_pool.write([r.snapshot for r in rows])
        live = self.draft_only_rows + len(rows)
        for r in rows:
            r.admitted = r.decoding_from = started
            r.stats = GenerationStats(prompt_tokens=r.snapshot.length + len(r.feed), batch_size=live)
            r.logprobs = None if r.top_logprobs is None else []
            r.snapshot = None  # the pool holds it now
        self.draft_rows += rows

    def _admit_prompts(self, rows: list[DraftOnlyRow]) -> None:
        """Draft-only rows from a whole prompt (a standalone tagger's): prefilled into free draft slots,
        each choosing its first token."""
        columns = max(row_columns(len(r.feed), r.max_new_tokens, self.planner.gamma) for r in rows)
        self.draft_pool = self._pool(self.draft_pool, self.pair.draft, self.max_batch + self.max_draft_rows, columns)
        started = time.perf_counter()
        for r in rows:
            r.admitted = started
        last = prefill(self.pair.draft, self.draft_pool.admit(len(rows)), [r.feed for r in rows],
                       self.prefill_plans["draft"].budget(), time_forward=self._prefill_timing("draft", rows))
        logits = logits_at(self.pair.draft, last, self._last_column(len(rows)))[:, 0]
        first = self._first_tokens(rows, align_vocab(logits, self.target_vocab))
        live = self.draft_only_rows + len(rows)
        now = time.perf_counter()
        for r in rows:
            r.stats = GenerationStats(prompt_tokens=len(r.feed), prefill_seconds=now - started, batch_size=live)
            r.logprobs = None if r.top_logprobs is None else []
            r.decoding_from = now
            r.feed = []
        self.draft_rows += rows
        self.update.first(rows, first)

    def _last_column(self, rows: int) -> torch.Tensor:
        """Index [B, 1] of a prefill's last column: ``prefill`` returns each row's last hidden state alone."""
        return torch.zeros(rows, 1, dtype=torch.long, device=self.device)

    def _first_tokens(self, rows: Sequence[LiveRow], logits: torch.Tensor) -> FirstTokens:
        """Admitted ``rows``' first tokens from their prefill's last logits [B, V], within each row's constraint
        and by its sampling: the admission's one read."""
        constrain(logits, [r.matcher for r in rows])
        ids = RowSampling.of(rows, self.device).choose(logits)
        tokens = ids.tolist()
        self.ledger.collect()
        return FirstTokens(ids, tokens, logits)

    # -- schedule --

    def _feed(self, slot: int, r: LiveRow) -> list[int]:
        """What the first draft forward feeds draft row ``r`` in ``slot`` (``sidecar.decoding.plan``): the
        scheduler asks it of every draft row."""
        if isinstance(r, DraftOnlyRow):
            return r.feed or [r.pending_token]
        if r.catching_up:
            prompt = len(r.request.draft_prompt or r.request.target_prompt)
            return self._main_tokens(r)[int(self.draft_pool.active.lengths[slot]) - prompt:]
        return [*r.backlog, r.pending_token]

    def _progress_decode(self) -> None:
        # a finished row's unused limit counts as done, so the phase ends at its total
        done = self.retired_tokens + sum(r.max_new_tokens if r.finish else len(r.tokens) for r in self.target_rows)
        self.progress(DECODE, done, max(self.admitted_tokens, done))

    def _output(self, r: LiveRow, kv_bytes: int) -> GenerationOutput:
        now = time.perf_counter()
        st = r.stats
        st.new_tokens = len(r.tokens)
        st.kv_bytes = kv_bytes
        st.decode_seconds = now - r.decoding_from if r.decoding_from else 0.0
        st.wall_seconds = now - r.admitted if r.admitted else 0.0
        st.queue_seconds = (r.admitted or now) - r.added
        account = r.account
        if isinstance(r, DraftOnlyRow):
            account = Account()
            account.add(r.carried)
            account.add(r.account)
        st.take(account)
        text = self.pair.tokenizer.decode(r.tokens, skip_special_tokens=True)
        output = GenerationOutput(list(r.tokens), text, r.finish or "length", st,
                                  None if r.logprobs is None else list(r.logprobs))
        if isinstance(r, MainRow):
            r.output = output
        return output

    def _fit_feeds(self, plan: StepPlan) -> None:
        """The first draft forward pads every row's feed to the widest; a joining sidecar's bridge may be wider
        than the ``gamma + 1`` columns each row keeps free past its tokens (``row_columns``), so the draft pool
        must hold its longest row plus that width."""
        if self.draft_pool is None or not plan.feeds or not self.draft_pool.live:
            return
        widest = max(len(feed) for feed in plan.feeds)
        self.draft_pool.ensure_capacity(int(self.draft_pool.active.lengths.max()) + widest)

    @staticmethod
    def _active(pool: SlotPool | None):
        return None if pool is None else pool.active
