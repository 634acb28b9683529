"""The running batch of the sidecar engine: main outputs by speculative decoding, sidecar outputs by the draft
alone, each request's sidecars starting the step after its main output is final.

Per request the target sees the bare prompt (system, document, main instruction); the draft sees the
compound prompt with every sidecar instruction appended, prefilled once, those instructions hidden while
it drafts the main output. When a row's main output is final, its draft cache holds document and main
output already. For each sidecar task the row's cache is snapshotted: the task's instruction is shown,
the other sidecars' instructions are dropped, and the document's columns are evicted unless the task
attends to it. The snapshots join a second batch, of draft-only rows (``PlainBatch``), stepped once per
main step; a request's result is complete when its last sidecar output is.

The "static" schedule is the baseline: a fixed batch of main rows runs to its end, then its sidecar rows
run, then the next batch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from sidecar.decoding.plain import PlainBatch, PlainResult, PlainRow
from sidecar.decoding.randomness import row_key
from sidecar.decoding.rows import CancelCheck, DecodeRow, GenerationOutput, TokenCallback
from sidecar.decoding.sampling import Sampling
from sidecar.progress import SIDECAR_TASKS, ProgressCallback
from sidecar.runtime.forward import forward, pad_rows
from sidecar.runtime.kv_cache import RowKVCache
from sidecar.tasks.prompts import SpannedPrompt, encode
from sidecar.tasks.rows import DocumentResult, SidecarOutput, SidecarRequest, SidecarRow, SidecarStats
from sidecar.tasks.task import SidecarTask

if TYPE_CHECKING:
    from sidecar.tasks.engine import SidecarEngine


class SidecarBatch:
    def __init__(self, engine: SidecarEngine, max_batch: int, schedule: str = "continuous",
                 on_tokens: TokenCallback | None = None, on_progress: ProgressCallback | None = None,
                 cancelled: CancelCheck | None = None, expected: int | None = None) -> None:
        self.engine = engine
        self.pair = engine.pair
        self.schedule = schedule
        self.cancelled = cancelled
        self.report = on_progress or (lambda phase, done, total: None)
        self.mains = engine.decoder.batch(max_batch, schedule, on_tokens=on_tokens, on_finish=self._on_finish,
                                          on_progress=on_progress, cancelled=cancelled, expected_rows=expected)
        self.sidecars = PlainBatch(self.pair.draft, max_batch, set(self.pair.eos_token_ids),
                                   engine.decoder.prefill_plans["draft"])
        # per index: the request and its compound prompt (None for a plain row)
        self.requests: dict[int, tuple[SidecarRequest, SpannedPrompt] | None] = {}
        self.waiting: deque[SidecarRow] = deque()
        self.partial: dict[int, tuple[DocumentResult, set[str]]] = {}  # results waiting for these sidecars
        # per sidecar row in the batch: (its row, context columns when it joined, live rows once it joined)
        self._joined: dict[tuple[int, str], tuple[SidecarRow, int, int]] = {}
        self.sidecar_rows = 0
        self.sidecar_done = 0

    # -- the caller's side --

    @property
    def busy(self) -> bool:
        return self.mains.busy or bool(self.waiting) or self.sidecars.busy

    @property
    def trace(self):
        return self.mains.trace

    def wants_rows(self) -> bool:
        if self.schedule == "static" and (self.waiting or self.sidecars.busy):
            return False
        return self.mains.wants_rows()

    def add(self, index: int, request: SidecarRequest) -> None:
        """Queue ``request`` (its decoding fields set, or the defaults apply); bad input raises ``InputError``."""
        row = self.engine.decode_row(index, request)
        self.mains.add(index, row)
        self.requests[index] = (request, self.engine.prompts(request)[1])

    def add_row(self, index: int, row: DecodeRow) -> None:
        """Queue a plain row (a chat prompt, no sidecars) to decode in the same main batch."""
        self.mains.add(index, replace(row, keep_draft=False))
        self.requests[index] = None

    def close(self) -> None:
        self.mains.close()

    def step(self) -> list[tuple[int, DocumentResult]]:
        """One step of each batch; returns the requests completed by it, as (index, result)."""
        done: list[tuple[int, DocumentResult]] = []
        # static: a main batch runs to its end, then its sidecar rows, and only then the next main batch
        sidecar_phase = self.schedule == "static" and not self.mains.rows and (self.waiting or self.sidecars.busy)
        if self.mains.busy and not sidecar_phase:
            for index, main in self.mains.step():
                done += self._main_done(index, main)
            if self.schedule == "static":
                return done
        self._admit_sidecars(done)
        for (index, name), out in self.sidecars.step():
            done += self._sidecar_done(index, name, out)
        return done

    # -- main outputs --

    def _on_finish(self, index: int, output: GenerationOutput, cache: RowKVCache, slot: int) -> None:
        """Snapshot the finished row's draft cache once per sidecar task (called before the row leaves)."""
        entry = self.requests[index]
        assert entry is not None, "a plain row keeps no draft"
        request, compound = entry
        eos = set(self.pair.eos_token_ids)
        main = output.token_ids[:-1] if output.token_ids and output.token_ids[-1] in eos else output.token_ids
        covered = min(int(cache.lengths[slot]) - len(compound.token_ids), len(main))
        main_columns = list(range(len(compound.token_ids), len(compound.token_ids) + covered))
        sampling = request.sidecar_sampling or request.sampling or Sampling()
        for number, task in enumerate(request.sidecars):
            # the document stays in the snapshot until the catch-up below has been fed
            keep = ["prefix", "document", "instruction", f"sidecar:{task.name}", "suffix"]
            start = len(compound.columns(*keep[:3]))
            self.waiting.append(SidecarRow(
                index, task, number, sampling, request.top_logprobs,
                cache.snapshot(slot, compound.columns(*keep) + main_columns), main[covered:],
                document=range(len(compound.columns("prefix")), len(compound.columns(*keep[:2]))),
                instruction=range(start, start + len(compound.columns(f"sidecar:{task.name}"))),
                bridge=encode(self.pair.tokenizer, task.bridge)))
            self.sidecar_rows += 1

    def _main_done(self, index: int, main: GenerationOutput) -> list[tuple[int, DocumentResult]]:
        entry = self.requests[index]
        result = DocumentResult(main, {})
        if main.finish_reason == "cancelled" or entry is None or not entry[0].sidecars:
            del self.requests[index]
            return [(index, result)]
        self.partial[index] = (result, {t.name for t in entry[0].sidecars})
        return []

    # -- sidecar outputs --

    def _admit_sidecars(self, done: list[tuple[int, DocumentResult]]) -> None:
        if self.schedule == "static" and self.sidecars.busy:
            return
        group: list[SidecarRow] = []
        while self.waiting and len(group) < self.sidecars.free:
            row = self.waiting.popleft()
            if self.cancelled is not None and self.cancelled(row.request):  # its client has gone
                done += self._sidecar_done(row.request, row.task.name, None)
                continue
            group.append(row)
        if not group:
            return
        extra = max(len(p.catch_up) + len(p.bridge) + p.task.max_new_tokens for p in group) + 1
        cache = sidecar_cache(self.pair.draft, group, extra)
        context = [int(n) for n in cache.lengths]
        self.report(SIDECAR_TASKS, self.sidecar_done, self.sidecar_rows)
        rows = []
        live = len(self.sidecars.rows) + len(group)  # the batch size its rows join, as a main row's stats say
        for p, ctx in zip(group, context, strict=True):
            key = 0 if p.sampling.greedy else row_key(p.sampling.seed, 1 + p.task_number)
            rows.append(PlainRow((p.request, p.task.name), p.task.max_new_tokens, p.sampling, key, p.top_logprobs))
            self._joined[(p.request, p.task.name)] = (p, ctx, live)
        for (index, name), out in self.sidecars.admit(cache, [p.bridge for p in group], rows):
            done += self._sidecar_done(index, name, out)

    def _sidecar_done(self, index: int, name: str, out: PlainResult | None) -> list[tuple[int, DocumentResult]]:
        result, missing = self.partial[index]
        if out is not None:
            p, context, batch = self._joined.pop((index, name))
            result.sidecars[name] = sidecar_output(self.pair.tokenizer, p.task, out, context,
                                                   len(p.catch_up) + len(p.bridge), batch)
        missing.discard(name)
        self.sidecar_done += 1
        self.report(SIDECAR_TASKS, self.sidecar_done, self.sidecar_rows)
        if missing:
            return []
        del self.partial[index], self.requests[index]
        return [(index, result)]


def sidecar_cache(draft, rows: list[SidecarRow], extra: int) -> RowKVCache:
    """The cache a group of sidecar rows joins from: caught up, document evicted, instruction shown.

    The draft cache may lag the main output by a few tokens (how many depends on gamma and the batch);
    they are fed as while drafting, document visible and instruction hidden, so a sidecar's output never
    depends on when its main output happened to finish.
    """
    cache = RowKVCache.from_snapshots(draft, [p.snapshot for p in rows], extra)
    if any(p.catch_up for p in rows):
        with torch.inference_mode():
            ids, _ = pad_rows([p.catch_up or [0] for p in rows], cache.device)
            forward(draft, cache, ids)
            cache.commit([len(p.catch_up) for p in rows])
    if any(not p.task.attend_document for p in rows):
        kept = []
        for row, p in enumerate(rows):
            evicted = range(0) if p.task.attend_document else p.document
            columns = [c for c in range(int(cache.lengths[row])) if c not in evicted]
            kept.append(cache.snapshot(row, columns))
        cache = RowKVCache.from_snapshots(draft, kept, extra)
    for row, p in enumerate(rows):
        shift = 0 if p.task.attend_document else len(p.document)
        cache.visible[row, p.instruction.start - shift : p.instruction.stop - shift] = True
    return cache


def sidecar_output(tokenizer, task: SidecarTask, out: PlainResult, context: int, feed: int,
                   batch: int) -> SidecarOutput:
    text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
    parsed, error = task.parse(text)
    stats = SidecarStats(
        new_tokens=len(out.token_ids), context_tokens=context, feed_tokens=feed, feed_seconds=out.feed_seconds,
        decode_seconds=out.decode_seconds, seconds=out.feed_seconds + out.decode_seconds, kv_bytes=out.kv_bytes,
        attended_document=task.attend_document, batch_size=batch,
    )
    return SidecarOutput(task.name, text, out.token_ids, parsed, error, out.finish_reason, stats, out.logprobs)

