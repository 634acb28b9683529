"""The running batch of the sidecar engine: each request's main output by speculative decoding, then each of
its sidecar tasks by the draft alone, continuing from the main row's own draft cache.

Both kinds of row live in one ``SlotBatch`` (``sidecar.decoding.batch``): a request's main row, and once
its main output is final and its draft cache has caught up with it (``DraftHandoff``), one draft-only row
per task, which joins from a view of that cache (``sidecar.tasks.requests.sidecar_view``: the task's
instruction shown, the document evicted unless the task attends to it) and feeds the task's bridge in the
next draft forward. Sidecar rows ride in the same draft forwards as the main rows' proposals. A request's
result is complete when its last sidecar output is; ``on_main`` hears its main output as soon as that is final
(a server streams its finish then).

Keys in the slot batch: a request's main row is its index; its sidecar rows are (index, task name).
The "static" schedule is the baseline: a fixed batch of main rows runs to its end, then its sidecar rows
run, then the next batch.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from sidecar.decoding.randomness import draw_key
from sidecar.decoding.rows import (
    CancelCheck,
    DecodeRow,
    DraftHandoff,
    DraftRow,
    GenerationOutput,
    TokenCallback,
)
from sidecar.decoding.sampling import Sampling
from sidecar.decoding.stats import GenerationStats
from sidecar.decoding.trace import KEPT_EVENTS
from sidecar.progress import SIDECAR_TASKS, ProgressCallback
from sidecar.runtime.ledger import Account
from sidecar.tasks.prompts import SpannedPrompt
from sidecar.tasks.requests import RequestBuilder, before_stop, sidecar_view
from sidecar.tasks.rows import DocumentResult, SidecarOutput, SidecarRequest
from sidecar.tasks.task import SidecarTask

if TYPE_CHECKING:
    from sidecar.decoding.decoder import SpeculativeDecoder


@dataclass
class _Pending:
    """A request in the batch: its compound prompt, and once its main output is final, its partial result."""

    request: SidecarRequest | None  # None for a plain row (a chat prompt, no sidecars)
    compound: SpannedPrompt | None
    result: DocumentResult | None = None
    missing: set[str] | None = None
    instruction: dict[str, Account] | None = None


# (a request's index, its main output): called as soon as the main output is final, its sidecars still to come
MainCallback = Callable[[int, GenerationOutput], None]


class SidecarBatch:
    def __init__(self, builder: RequestBuilder, decoder: SpeculativeDecoder, max_batch: int,
                 schedule: str = "continuous", on_tokens: TokenCallback | None = None,
                 on_progress: ProgressCallback | None = None, cancelled: CancelCheck | None = None,
                 expected: int | None = None, trace_keep: int | None = KEPT_EVENTS,
                 on_main: MainCallback | None = None) -> None:
        self.builder = builder
        self.pair = builder.pair
        self.on_tokens, self.cancelled = on_tokens, cancelled
        self.on_main = on_main
        self.progress = on_progress or (lambda phase, done, total: None)
        self.slots = decoder.batch(max_batch, schedule, max_draft_rows=max_batch, on_tokens=self._tokens,
                                   on_handoff=self._handoff, on_progress=on_progress,
                                   cancelled=None if cancelled is None else self._cancelled, expected_rows=expected,
                                   trace_keep=trace_keep)
        self.requests: dict[int, _Pending] = {}
        self.sidecar_rows = 0
        self.sidecar_done = 0

    # -- the caller's side --

    @property
    def busy(self) -> bool:
        return self.slots.busy

    @property
    def trace(self):
        return self.slots.trace

    @property
    def ledger(self):
        return self.slots.ledger

    def wants_rows(self) -> bool:
        return self.slots.wants_rows()

    def add(self, index: int, request: SidecarRequest) -> None:
        """Queue ``request`` (its decoding fields set, or the defaults apply); bad input raises ``InputError``."""
        row = self.builder.decode_row(index, request)
        self.slots.add(index, row)
        self.requests[index] = _Pending(request, self.builder.prompts(request)[1])

    def add_row(self, index: int, row: DecodeRow) -> None:
        """Queue a plain row (a chat prompt, no sidecars) to decode in the same batch."""
        self.slots.add(index, replace(row, keep_draft=False))
        self.requests[index] = _Pending(None, None)

    def close(self) -> None:
        self.slots.close()

    def step(self) -> list[tuple[int, DocumentResult]]:
        """One step of the slot batch; returns the requests completed by it, as (index, result)."""
        done: list[tuple[int, DocumentResult]] = []
        for key, output in self.slots.step():
            done += self._sidecar_done(key, output) if isinstance(key, tuple) else self._main_done(key, output)
        if self.cancelled is not None:  # a client gone while its sidecars run (or wait) ends them now
            for index in [i for i, p in self.requests.items() if p.result is not None and self.cancelled(i)]:
                done += self._finish(index, cancel=True)
        return done

    # -- callbacks of the slot batch --

    def _tokens(self, key: Hashable, ids: list[int], logprobs) -> None:
        if self.on_tokens is not None and not isinstance(key, tuple):  # callers stream main outputs
            self.on_tokens(key, ids, logprobs)

    def _cancelled(self, key: Hashable) -> bool:
        index = key[0] if isinstance(key, tuple) else key
        return index not in self.requests or self.cancelled(index)  # a request already answered waits for nothing

    def _handoff(self, handoff: DraftHandoff) -> None:
        """Start one sidecar row per task from the finished main row's draft cache."""
        pending = self.requests.get(handoff.index)
        if pending is None or pending.request is None:
            return
        request, compound = pending.request, pending.compound
        main = handoff.output.token_ids
        main = main[:-1] if main and main[-1] in self.pair.eos_token_ids else main
        if handoff.output.finish_reason == "stop" and request.stop:  # the sidecars see no stop string
            main = main[: before_stop(self.pair.tokenizer, main, request.stop)]
        sampling = request.sidecar_sampling or request.sampling or Sampling()
        pending.instruction = {}
        for number, task in enumerate(request.sidecars):
            columns, shown = sidecar_view(compound, task, main)
            feed = self.builder.bridge(task)
            if not feed:  # the first token needs a feed: the last kept token moves from the cache to it
                last = columns.pop()
                feed = [main[-1] if last >= len(compound.token_ids) else compound.token_ids[last]]
            snapshot = handoff.cache.snapshot(handoff.slot, columns)
            snapshot.visible[shown] = True
            draws = 0 if sampling.greedy else draw_key(sampling.seed, 1 + number)
            self.slots.add_draft((handoff.index, task.name), DraftRow(
                feed, task.max_new_tokens, draws, snapshot, sampling, request.top_logprobs,
                carried=handoff.catch_up[number], phase="sidecar", constraint=task.constraint))
            pending.instruction[task.name] = handoff.instruction[number]
            self.sidecar_rows += 1
        self.progress(SIDECAR_TASKS, self.sidecar_done, self.sidecar_rows)

    # -- results --

    def _main_done(self, index: int, main: GenerationOutput) -> list[tuple[int, DocumentResult]]:
        pending = self.requests[index]
        if self.on_main is not None:  # before its sidecars, which decode for steps yet
            self.on_main(index, main)
        result = DocumentResult(main, {})
        if main.finish_reason == "cancelled" or pending.request is None or not pending.request.sidecars:
            del self.requests[index]
            return [(index, result)]
        pending.result, pending.missing = result, {t.name for t in pending.request.sidecars}
        return []

    def _sidecar_done(self, key: tuple[int, str], output: GenerationOutput) -> list[tuple[int, DocumentResult]]:
        index, name = key
        pending = self.requests.get(index)
        if pending is None:  # its request ended already (its client left)
            return []
        task = next(t for t in pending.request.sidecars if t.name == name)
        pending.result.sidecars[name] = sidecar_output(task, output, pending.instruction[name])
        pending.missing.discard(name)
        self.sidecar_done += 1
        self.progress(SIDECAR_TASKS, self.sidecar_done, self.sidecar_rows)
        return [] if pending.missing else self._finish(index)

    def _finish(self, index: int, cancel: bool = False) -> list[tuple[int, DocumentResult]]:
        """The request's result, its missing sidecars (when ``cancel``) ended as cancelled and empty."""
        pending = self.requests.pop(index)
        for task in pending.request.sidecars:
            if task.name in pending.missing and cancel:
                empty = GenerationOutput([], "", "cancelled", GenerationStats())
                pending.result.sidecars[task.name] = sidecar_output(task, empty)
        return [(index, pending.result)]


def sidecar_output(task: SidecarTask, out: GenerationOutput,
                   instruction: Account | None = None) -> SidecarOutput:
    """A draft-only row's output as the task's output: parsed, with the row's own stats record, which takes the
    task's instruction line (its hidden span's account; none for a standalone row)."""
    parsed, error = task.parse(out.text)
    if instruction is not None:
        out.stats.charge_instruction(instruction)
    out.stats.attended_document = task.attend_document
    return SidecarOutput(task.name, out.text, out.token_ids, parsed, error, out.finish_reason, out.stats,
                         out.logprobs)
