"""The running batch of a speculative decoder: rows join between steps, decode together, leave as they finish.

Invariant: entry ``i`` of ``rows`` and of ``pending``, and slot ``i`` of both slot pools, hold the same
row. A step first admits waiting rows into free slots, prefilling them in place (the target, then the
draft with its hidden spans) and choosing their first tokens: SGLang's prefill-then-merge, with the merge
free because the slots are already the batch's. Then every live row takes one speculative or plain step,
and finished rows leave; their slots take the next admission.

The "continuous" schedule admits before every step; "static" only into an empty batch: fixed batches
that run until their last row finishes, the schedule a continuous batch is measured against.

Reads of the device: one per admitted group (its first tokens, which also times the target's prefill),
one per target forward (``Step.read``), at most one per draft forward (``SpeculativeDecoder._draft``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from sidecar.decoding.logprobs import TokenLogprob, token_logprobs
from sidecar.decoding.randomness import row_key
from sidecar.decoding.rows import (
    CancelCheck,
    DecodeRow,
    FinishCallback,
    GenerationOutput,
    GenerationStats,
    TokenCallback,
)
from sidecar.decoding.sampling import RowSampling
from sidecar.decoding.stops import TokenStops
from sidecar.decoding.trace import BatchTrace, PrefillRecord, StepRecord
from sidecar.progress import DECODE, DRAFT_PREFILL, TARGET_PREFILL, ProgressCallback
from sidecar.runtime.forward import logits_at, prefill
from sidecar.runtime.slots import SlotPool, row_columns
from sidecar.runtime.transfers import to_device

if TYPE_CHECKING:
    from sidecar.decoding.speculative import SpeculativeDecoder

Item = TypeVar("Item", contravariant=True)
Result = TypeVar("Result", covariant=True)

SCHEDULES = ("continuous", "static")


class RunningBatch(Protocol[Item, Result]):
    """What ``stream_through`` drives: ``DecodeBatch`` and ``SidecarBatch``."""

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


@dataclass
class RowState:
    """One live row: its request, what it has output, and what the draft cache still lacks."""

    index: int  # the caller's index of the row
    row: DecodeRow
    key: int  # its random draws' key (``sidecar.decoding.randomness``)
    has_draft: bool  # whether the draft model holds its prompt (else it decodes plainly or by copying)
    stats: GenerationStats
    stops: TokenStops | None
    started: float  # perf_counter when its admission began
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    # committed tokens the draft cache does not hold yet
    backlog: list[int] = field(default_factory=list)
    pending: int = -1  # host copy of the last committed token, not yet in the target cache
    finish: str | None = None
    decoding_from: float = 0.0

    @property
    def sampling(self):
        return self.row.sampling

    @property
    def remaining(self) -> int:
        return self.row.max_new_tokens - len(self.tokens)


class DecodeBatch:
    def __init__(self, decoder: SpeculativeDecoder, max_batch: int, schedule: str = "continuous",
                 on_tokens: TokenCallback | None = None, on_finish: FinishCallback | None = None,
                 on_progress: ProgressCallback | None = None, cancelled: CancelCheck | None = None,
                 expected_rows: int | None = None, kv_budget_tokens: int | None = None) -> None:
        self.decoder = decoder
        self.pair = decoder.pair
        self.device = decoder.pair.device
        self.max_batch = max_batch
        self.schedule = schedule
        self.on_tokens, self.on_finish, self.cancelled = on_tokens, on_finish, cancelled
        self.report = on_progress or (lambda phase, done, total: None)
        self.expected_rows = expected_rows
        self.kv_budget_tokens = kv_budget_tokens
        self.waiting: deque[tuple[int, DecodeRow]] = deque()
        self.rows: list[RowState] = []
        self.pending = torch.zeros(0, dtype=torch.long, device=self.device)  # [B] on the device
        self.target_pool: SlotPool | None = None
        self.draft_pool: SlotPool | None = None
        self.trace = BatchTrace(max_batch)
        self.eos = set(self.pair.eos_token_ids)
        self.admitted = 0
        self.admitted_tokens = 0  # the token limits of every row admitted
        self.closed = False  # no row will be added any more: the steps from the last admission on are the drain
        self.retired_tokens = 0  # ... of every row that has left

    # -- the caller's side --

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.waiting)

    def wants_rows(self) -> bool:
        """Whether another waiting row would be admitted at the next step."""
        if self.schedule == "static":
            return not self.rows and len(self.waiting) < self.max_batch
        return len(self.waiting) < self.max_batch - len(self.rows)

    def add(self, index: int, row: DecodeRow) -> None:
        """Queue ``row`` to join at the next step with a free slot; bad input raises ``InputError``."""
        self.decoder.validate([row], self.max_batch, first_index=index)
        self.waiting.append((index, row))

    def close(self) -> None:
        """Say that no more rows will come (it only marks where the final drain begins in ``trace``)."""
        self.closed = True

    def step(self) -> list[tuple[int, GenerationOutput]]:
        """Admit what fits, take one decoding step, and return the rows that finished, as (index, output)."""
        if self.cancelled is not None:
            for r in self.rows:
                if r.finish is None and self.cancelled(r.index):
                    r.finish = "cancelled"
        with torch.inference_mode():
            finished = self._retire()
            self._admit()
            if self.closed and not self.waiting:
                self.trace.mark_drain()
            finished += self._retire()
            if self.rows:
                self._decode_step()
                finished += self._retire()
        return finished

    # -- admission --

    def _pool(self, pool: SlotPool | None, model, columns: int) -> SlotPool:
        if pool is None:
            pool = SlotPool(model, self.max_batch, columns, self.kv_budget_tokens)
        pool.ensure_capacity(columns)
        return pool

    def _admit(self) -> None:
        if self.schedule == "static" and self.rows:
            return
        count = min(self.max_batch - len(self.rows), len(self.waiting))
        if count == 0:
            return
        group = [self.waiting.popleft() for _ in range(count)]
        rows = [row for _, row in group]
        pair, decoder, device = self.pair, self.decoder, self.device
        gamma = decoder.gamma
        t_start = time.perf_counter()
        self.target_pool = self._pool(self.target_pool, pair.target, max(
            row_columns(len(r.target_prompt), r.max_new_tokens, gamma) for r in rows))
        expected = max(self.expected_rows or 0, self.admitted + count)
        self.report(TARGET_PREFILL, self.admitted, expected)
        last = prefill(pair.target, self.target_pool.admit(count), [r.target_prompt for r in rows],
                       decoder.prefill_plans["target"].budget(),
                       on_rows=lambda k: self.report(TARGET_PREFILL, self.admitted + k, expected),
                       time_forward=decoder.prefill_timing("target"))
        first_logits = logits_at(pair.target, last, torch.zeros(count, 1, dtype=torch.long, device=device))[:, 0]
        keys = [row_key(r.sampling.seed) if not r.sampling.greedy else 0 for r in rows]
        sampling = RowSampling([r.sampling for r in rows], keys, [0] * count, device)
        first = sampling.choose(first_logits)
        first_tokens = first.tolist()  # waits for the prefill, so the clock below has timed it
        target_tokens = sum(len(r.target_prompt) for r in rows)
        decoder.controller.observe_prefill("target", target_tokens, time.perf_counter() - t_start)

        # the draft's prefill is skipped when these rows would decode plainly (a sidecar or a seed needs it)
        draft_prompts = [r.draft_prompt or r.target_prompt for r in rows]
        speculate = (any(r.keep_draft or r.sampling.seeded for r in rows)
                     or decoder.controller.draft_pays(len(self.rows) + count, sum(map(len, draft_prompts)),
                                                      max(r.max_new_tokens for r in rows), pair.draft_size_ratio))
        if speculate or self.draft_pool is not None:
            draft_columns = max(row_columns(len(p), r.max_new_tokens, gamma)
                                for p, r in zip(draft_prompts, rows, strict=True))
            if self.draft_pool is None:  # the rows already live hold no draft: their slots stay empty
                self.draft_pool = self._pool(None, pair.draft, draft_columns)
                self.draft_pool.admit(len(self.rows))
            else:
                self.draft_pool.ensure_capacity(draft_columns)
            draft_view = self.draft_pool.admit(count)
            if speculate:
                self.report(DRAFT_PREFILL, self.admitted, expected)
                draft_tokens = sum(map(len, draft_prompts))
                with decoder.controller.timer(device)(
                        lambda seconds: decoder.controller.observe_prefill("draft", draft_tokens, seconds)):
                    prefill(pair.draft, draft_view, draft_prompts, decoder.prefill_plans["draft"].budget(),
                            [r.draft_hidden for r in rows],
                            on_rows=lambda k: self.report(DRAFT_PREFILL, self.admitted + k, expected),
                            time_forward=decoder.prefill_timing("draft"))
        prefill_seconds = time.perf_counter() - t_start
        self.trace.events.append(PrefillRecord(count, [len(r.target_prompt) for r in rows],
                                               [len(p) for p in draft_prompts] if speculate else []))

        live = len(self.rows) + count
        states = []
        for (index, row), key in zip(group, keys, strict=True):
            stats = GenerationStats(prompt_tokens=len(row.target_prompt), target_forwards=1,
                                    drafted_per_position=[0] * gamma, accepted_per_position=[0] * gamma,
                                    prefill_seconds=prefill_seconds, batch_size=live)
            states.append(RowState(index, row, key, speculate, stats,
                                   TokenStops(pair.tokenizer, row.stop) if row.stop else None, t_start,
                                   logprobs=None if row.top_logprobs is None else [],
                                   decoding_from=time.perf_counter()))
        self.rows += states
        self.pending = torch.cat([self.pending, first])
        self.admitted += count
        self.admitted_tokens += sum(r.max_new_tokens for r in rows)
        entries = self._logprobs(states, first_logits[:, None], first[:, None])
        self._commit(states, [[t] for t in first_tokens], entries)
        self._report_decode()

    # -- one step --

    def _decode_step(self) -> None:
        decoder, rows = self.decoder, self.rows
        plan = decoder.plan(rows)
        sampling = RowSampling([r.sampling for r in rows], [r.key for r in rows], [len(r.tokens) for r in rows],
                               self.device)
        target = self.target_pool.active
        draft = self.draft_pool.active if self.draft_pool is not None else None
        if plan.gamma == 0:
            step = decoder.plain_step(target, self.pending, sampling)
            for r in rows:  # the draft did not see the token the target consumed
                if r.has_draft:
                    r.backlog.append(r.pending)
        else:
            step = decoder.speculative_step(target, draft, rows, self.pending, plan, sampling)
        self.pending = step.next_ids
        width = step.drafted_ids.shape[1]
        model_rows = plan.model_rows if width else [False] * len(rows)
        draft_forwards = 0
        for slot, r in enumerate(rows):
            cap = min(plan.caps[slot], width)
            st = r.stats
            st.target_forwards += 1
            st.drafted += cap
            st.accepted += step.accepted[slot]
            if plan.copies[slot] and cap:
                st.lookup_drafted += cap
                st.lookup_accepted += step.accepted[slot]
            elif model_rows[slot]:
                st.draft_forwards += width
                draft_forwards = width
            for k in range(cap):
                st.drafted_per_position[k] += 1
                st.accepted_per_position[k] += int(k < step.accepted[slot])
        appended = [[*step.drafted[s][: step.accepted[s]], step.next[s]] for s in range(len(rows))]
        entries = None
        if any(r.row.top_logprobs is not None for r in rows):
            # the committed tokens: accepted drafts, then the target's own token at the first rejection
            chosen = torch.cat([step.drafted_ids, step.next_ids[:, None]], 1).scatter(
                1, step.accepted_ids[:, None], step.next_ids[:, None])
            entries = self._logprobs(rows, step.logits, chosen)
        self.trace.events.append(StepRecord(len(rows), width, draft_forwards,
                                            max(len(r.backlog) for r in rows) + 1 if draft_forwards else 0))
        self._commit(rows, appended, entries)
        self._report_decode()

    def _logprobs(self, rows: list[RowState], logits: torch.Tensor,
                  chosen: torch.Tensor) -> list[list[TokenLogprob]] | None:
        wanted = [r.row.top_logprobs for r in rows if r.row.top_logprobs is not None]
        if not wanted:
            return None
        entries = token_logprobs(logits, chosen, max(wanted))
        # a row asking for fewer alternatives than the batch's most keeps its first ones
        return [[TokenLogprob(e.token_id, e.logprob, e.top[: r.row.top_logprobs or 0]) for e in row_entries]
                for r, row_entries in zip(rows, entries, strict=True)]

    def _commit(self, rows: list[RowState], appended: list[list[int]],
                entries: list[list[TokenLogprob]] | None) -> None:
        """Add each row's committed tokens, cut at EOS, a stop string or the row's length limit; with
        ``entries`` (per slot, aligned with ``appended``) their logprobs go along."""
        for slot, r in enumerate(rows):
            r.pending = appended[slot][-1]
            cut = appended[slot][: r.remaining]
            reason = "length" if len(cut) >= r.remaining else None
            for k, token in enumerate(cut):
                if token in self.eos:
                    cut, reason = cut[: k + 1], "eos"
                    break
            if r.stops is not None and reason != "eos":
                k = r.stops.first(cut)
                if k is not None:
                    cut, reason = cut[: k + 1], "stop"
            r.tokens.extend(cut)
            r.finish = reason
            cut_entries = None
            if entries is not None and r.logprobs is not None:
                cut_entries = entries[slot][: len(cut)]
                r.logprobs.extend(cut_entries)
            if self.on_tokens is not None and cut:
                self.on_tokens(r.index, cut, cut_entries)

    # -- leaving --

    def _retire(self) -> list[tuple[int, GenerationOutput]]:
        done = [slot for slot, r in enumerate(self.rows) if r.finish is not None]
        if not done:
            return []
        finished = []
        now = time.perf_counter()
        for slot in done:
            r = self.rows[slot]
            r.stats.decode_seconds = now - r.decoding_from
            r.stats.wall_seconds = now - r.started
            output = self._output(r)
            if self.on_finish is not None and r.row.keep_draft and r.finish != "cancelled":
                self.on_finish(r.index, output, self.draft_pool.active, slot)
            finished.append((r.index, output))
            self.retired_tokens += r.row.max_new_tokens
        keep = [slot for slot, r in enumerate(self.rows) if r.finish is None]
        order = self.target_pool.remove(keep)
        if self.draft_pool is not None:
            self.draft_pool.remove(keep)
        self.rows = [self.rows[s] for s in order]
        self.pending = self.pending.index_select(0, to_device(order, self.device)) if order else self.pending[:0]
        self._report_decode()
        return finished

    def _report_decode(self) -> None:
        # a finished row's unused limit counts as done, so the phase ends at its total
        done = self.retired_tokens + sum(r.row.max_new_tokens if r.finish else len(r.tokens) for r in self.rows)
        self.report(DECODE, done, max(self.admitted_tokens, done))

    def _output(self, r: RowState) -> GenerationOutput:
        text = self.pair.tokenizer.decode(r.tokens, skip_special_tokens=True)
        r.stats.new_tokens = len(r.tokens)
        return GenerationOutput(list(r.tokens), text, r.finish or "length", r.stats,
                                None if r.logprobs is None else list(r.logprobs))
