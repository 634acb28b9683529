"""Plain batched decoding of one model, rows joining between steps: the sidecar phase and standalone tagging.

A group of rows joins with its own cache, prepared elsewhere (a fresh cache for standalone prompts, or
sidecar snapshots caught up and with the document evicted): it feeds its tokens there (a whole prompt,
or the task's bridge text), chooses its first token, and is copied into free slots of the pool: prefill,
then merge. Every step then decodes one token for every live row; rows leave at end-of-turn or their
token limit. With ``top_logprobs`` a row also gets its tokens' log-probabilities (``sidecar.decoding.logprobs``).
Reads of the device: one per admitted group and one per step.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from sidecar.decoding.logprobs import TokenLogprob, token_logprobs
from sidecar.decoding.randomness import row_key
from sidecar.decoding.sampling import RowSampling, Sampling
from sidecar.runtime.forward import forward, logits_at, prefill
from sidecar.runtime.kv_cache import RowKVCache
from sidecar.runtime.prefill_plan import PrefillPlanner
from sidecar.runtime.slots import SlotPool
from sidecar.runtime.timing import DeviceTimer
from sidecar.runtime.transfers import to_device


@dataclass
class PlainResult:
    token_ids: list[int]
    finish_reason: str  # "eos" | "length"
    feed_seconds: float  # its group's feed (prefill or catch-up), shared by the group
    decode_seconds: float  # the batch's own steps while the row was live (not a main batch stepped alongside)
    kv_bytes: int  # KV bytes the row held when it finished: what its last step read
    logprobs: list[TokenLogprob] | None = None  # one per token id when asked for


@dataclass
class PlainRow:
    """One row to decode: its caller's key, token limit, sampling and logprob request."""

    key: Hashable
    limit: int
    sampling: Sampling = field(default_factory=Sampling)
    draw_key: int = 0  # its random draws' key (``sidecar.decoding.randomness``); 0 for a greedy row
    top_logprobs: int | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    feed_seconds: float = 0.0
    decode_seconds: float = 0.0
    finish: str | None = None


class PlainBatch:
    """Invariant: entry ``i`` of ``rows`` and of ``pending`` and slot ``i`` of ``pool`` hold the same row."""

    def __init__(self, model: PreTrainedModel, max_batch: int, eos: set[int],
                 prefill_plan: PrefillPlanner | None = None) -> None:
        self.model = model
        self.max_batch = max_batch
        self.eos = eos
        self.device = next(model.parameters()).device
        self.prefill_plan = prefill_plan or PrefillPlanner(self.device)
        self.timer = DeviceTimer(self.device)
        self.pool: SlotPool | None = None
        self.rows: list[PlainRow] = []
        self.pending = torch.zeros(0, dtype=torch.long, device=self.device)  # [B] last token, not yet fed
        self.steps = 0
        self.live_row_steps = 0

    @property
    def free(self) -> int:
        return self.max_batch - len(self.rows)

    @property
    def busy(self) -> bool:
        return bool(self.rows)

    def admit(self, cache: RowKVCache, feeds: list[list[int]],
              rows: list[PlainRow]) -> list[tuple[Hashable, PlainResult]]:
        """Feed ``feeds[i]`` into row ``i`` of ``cache``, choose each row's first token, and merge the rows into
        the batch; returns the rows that finished at once. ``cache`` needs room for the feeds."""
        assert len(rows) <= self.free, "admit beyond the batch"
        start = time.perf_counter()
        with torch.inference_mode():
            self.timer.collect()
            plan = self.prefill_plan
            last = prefill(self.model, cache, feeds, plan.budget(), time_forward=lambda padded, real: self.timer(
                lambda seconds: plan.observe(padded, real, seconds)))
            logits = logits_at(self.model, last, torch.zeros(len(rows), 1, dtype=torch.long, device=self.device))
            choice = self._choose(rows, logits[:, 0])
            chosen = choice.tolist()  # the one read of the device per admitted group: it times the feed
            feed_seconds = time.perf_counter() - start
            columns = int(cache.lengths.max()) + max(r.limit for r in rows) + 1
            if self.pool is None:
                self.pool = SlotPool(self.model, self.max_batch, columns)
            self.pool.ensure_capacity(columns)
            self.pool.write(cache)
        for r in rows:
            r.feed_seconds = feed_seconds
            r.logprobs = None if r.top_logprobs is None else []
        self.rows += rows
        self.pending = torch.cat([self.pending, choice])
        self._commit(rows, chosen, logits)
        with torch.inference_mode():
            return self._retire()

    def step(self) -> list[tuple[Hashable, PlainResult]]:
        """One token for every live row; returns the rows that finished, as (key, result)."""
        if not self.rows:
            return []
        start = time.perf_counter()
        with torch.inference_mode():
            cache = self.pool.active
            hidden = forward(self.model, cache, self.pending[:, None])
            cache.commit(1)
            logits = logits_at(self.model, hidden, torch.zeros(len(self.rows), 1, dtype=torch.long,
                                                               device=self.device))
            choice = self._choose(self.rows, logits[:, 0])
            chosen = choice.tolist()  # the one read of the device per step
        seconds = time.perf_counter() - start  # the read waited for the step
        for r in self.rows:
            r.decode_seconds += seconds
        self.steps += 1
        self.live_row_steps += len(self.rows)
        self.pending = choice
        self._commit(self.rows, chosen, logits)
        with torch.inference_mode():
            return self._retire()

    def _choose(self, rows: list[PlainRow], logits: torch.Tensor) -> torch.Tensor:
        sampling = RowSampling([r.sampling for r in rows], [r.draw_key for r in rows], [len(r.tokens) for r in rows],
                               self.device)
        return sampling.choose(logits)

    def _commit(self, rows: list[PlainRow], chosen: list[int], logits: torch.Tensor) -> None:
        wanted = [r.top_logprobs for r in rows if r.top_logprobs is not None]
        entries = None
        if wanted:
            entries = token_logprobs(logits, to_device([[t] for t in chosen], self.device), max(wanted))
        for slot, (r, token) in enumerate(zip(rows, chosen, strict=True)):
            r.tokens.append(token)
            if entries is not None and r.logprobs is not None:
                entry = entries[slot][0]
                r.logprobs.append(TokenLogprob(entry.token_id, entry.logprob, entry.top[: r.top_logprobs]))
            r.finish = "eos" if token in self.eos else "length" if len(r.tokens) >= r.limit else None

    def _retire(self) -> list[tuple[Hashable, PlainResult]]:
        done = [slot for slot, r in enumerate(self.rows) if r.finish is not None]
        if not done:
            return []
        row_bytes = self.pool.active.row_bytes()
        finished = [(r.key, PlainResult(r.tokens, r.finish, r.feed_seconds, r.decode_seconds,
                                        int(row_bytes[slot]), r.logprobs))
                    for slot, r in ((s, self.rows[s]) for s in done)]
        keep = [slot for slot, r in enumerate(self.rows) if r.finish is None]
        order = self.pool.remove(keep)
        self.rows = [self.rows[s] for s in order]
        self.pending = self.pending.index_select(0, to_device(order, self.device)) if order else self.pending[:0]
        return finished


def plain_rows(limits: list[int], sampling: Sampling, seed: int | None, top_logprobs: int | None = None,
               stream: int = 0) -> list[PlainRow]:
    """Rows keyed 0..n-1; row ``i`` of a seeded call draws as seed ``seed + i`` on ``stream``."""
    return [PlainRow(i, limit, sampling, 0 if sampling.greedy else row_key(None if seed is None else seed + i, stream),
                     top_logprobs) for i, limit in enumerate(limits)]


def decode_plain(model: PreTrainedModel, cache: RowKVCache, feeds: list[list[int]], limits: list[int],
                 sampling: Sampling, seed: int | None, eos: set[int],
                 top_logprobs: int | None = None) -> list[PlainResult]:
    """Decode the rows of ``cache`` (fed ``feeds`` first) together until each finishes; results in row order."""
    batch = PlainBatch(model, len(feeds), eos)
    results = dict(batch.admit(cache, feeds, plain_rows(limits, sampling, seed, top_logprobs)))
    while batch.busy:
        results.update(batch.step())
    return [results[i] for i in range(len(feeds))]
