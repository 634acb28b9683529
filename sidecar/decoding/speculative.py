"""Batched speculative decoding: the draft proposes, the target verifies every row in one forward.

Each row keeps its own length in both KV caches (``RowKVCache``), so rows accept different numbers of
tokens, finish independently, leave the batch when done and let waiting rows take their slots
(``sidecar.decoding.batch``). Greedy output is token-identical to the target decoding alone; sampled output
follows the target's distribution (``sidecar.decoding.acceptance``). This module holds the decoder: its public
calls and the two kinds of step, speculative (draft or copy, then verify) and plain.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from sidecar.decoding.acceptance import accept_greedy, accept_sampled, sample_with
from sidecar.decoding.batch import SCHEDULES, DecodeBatch, RowState, stream_through
from sidecar.decoding.controller import GammaController, Source
from sidecar.decoding.logprobs import MAX_TOP_LOGPROBS
from sidecar.decoding.lookup import MIN_NGRAM, lookup_continuation
from sidecar.decoding.randomness import ACCEPT, DRAFT, NEXT
from sidecar.decoding.rows import CancelCheck, DecodeRow, FinishCallback, GenerationOutput, TokenCallback
from sidecar.decoding.sampling import RowSampling, Sampling
from sidecar.errors import InputError
from sidecar.models.pair import ModelPair
from sidecar.progress import ProgressCallback
from sidecar.runtime.forward import TimeForward, forward, last_columns, logits_at, pad_rows
from sidecar.runtime.kv_cache import RowKVCache
from sidecar.runtime.prefill_plan import PrefillPlanner
from sidecar.runtime.transfers import to_device

# Adaptive drafting stops once no row's latest draft token had at least this draft probability: the tokens
# drafted after an unsure one are mostly rejected, and each costs a draft forward and a wider verify.
DRAFT_CONFIDENCE = 0.8


@dataclass
class Step:
    """One decoding step's outcome: on the device for the next forward, and its host copy for the loop."""

    accepted_ids: torch.Tensor  # [B] drafts kept per row
    next_ids: torch.Tensor  # [B] the target's token after them
    drafted_ids: torch.Tensor  # [B, g]
    logits: torch.Tensor  # [B, g + 1, V] the target's, for logprobs
    accepted: list[int]
    next: list[int]
    drafted: list[list[int]]

    @classmethod
    def read(cls, accepted: torch.Tensor, nxt: torch.Tensor, drafted: torch.Tensor, logits: torch.Tensor) -> Step:
        """The step with its host copy, read in one transfer: the loop's one wait per target forward."""
        rows = torch.cat([accepted[:, None], nxt[:, None], drafted], dim=1).tolist()
        return cls(accepted, nxt, drafted, logits, [r[0] for r in rows], [r[1] for r in rows], [r[2:] for r in rows])



@dataclass
class StepPlan:
    """What one speculative step drafts, row by row (slot order)."""

    gamma: int  # verify width: drafts per row in the target's forward (0: a plain step)
    source: Source  # "draft" when the draft model runs for some row, "lookup" when every drafting row copies
    copies: list[list[int]]  # per row, the tokens it copies ([]: its drafts come from the draft model)
    caps: list[int]  # per row, how many drafts it may keep (<= gamma)
    stop_early: bool  # whether drafting may stop once no row is confident

    @property
    def model_rows(self) -> list[bool]:
        return [cap > 0 and not copy for cap, copy in zip(self.caps, self.copies, strict=True)]


class SpeculativeDecoder:
    """Batched speculative decoding of ``pair``.

    ``gamma`` bounds the tokens drafted per step. ``adaptive`` picks each step's gamma from measured costs
    and acceptance (down to plain steps) and stops drafting at ``draft_confidence`` (default
    ``DRAFT_CONFIDENCE``; 0 never stops early); without it every step drafts exactly ``gamma``.
    ``prompt_lookup`` also drafts by copying from each row's own text (``sidecar.decoding.lookup``) when every row
    of the batch has something to copy; in fixed mode it copies when every row has ``gamma`` tokens.

    While a seeded sampled row is in the batch, steps follow a fixed rule instead, row by row: each row
    drafts up to ``gamma`` (fewer near its limit), copying when its own text offers that many, so that its
    tokens depend on nothing but its own prompt and seed.

    A row asking for ``top_logprobs`` gets each token's log-probability under the target and that many
    top alternatives (``sidecar.decoding.logprobs``), read from the logits the prefill, plain step or verify
    forward computed anyway for the position that committed the token.
    """

    def __init__(self, pair: ModelPair, gamma: int = 4, adaptive: bool = True, prompt_lookup: bool = True,
                 draft_confidence: float | None = None) -> None:
        if not isinstance(gamma, int) or gamma < 1:
            raise InputError(f"gamma must be an integer >= 1, got {gamma!r}")
        self.pair = pair
        self.gamma = gamma
        self.adaptive = adaptive
        self.prompt_lookup = prompt_lookup
        self.lookup_min_ngram = MIN_NGRAM
        if draft_confidence is None:
            draft_confidence = DRAFT_CONFIDENCE if adaptive else 0.0
        if not 0 <= draft_confidence <= 1:
            raise InputError(f"draft_confidence must be in [0, 1], got {draft_confidence!r}")
        self.draft_confidence = draft_confidence
        self.target_vocab = pair.target.get_output_embeddings().out_features
        # costs learned in one call carry over to the next: the controller and the planners are per decoder
        self.controller = GammaController(gamma, adaptive)
        self.prefill_plans = {"target": PrefillPlanner(pair.device), "draft": PrefillPlanner(pair.device)}

    def prefill_timing(self, model: str) -> TimeForward:
        """What times each prefill forward of ``model`` for its planner (on a GPU read a step late)."""
        plan, timer = self.prefill_plans[model], self.controller.timer(self.pair.device)
        return lambda padded, real: timer(lambda seconds: plan.observe(padded, real, seconds))

    # -- public API --

    def generate(self, prompt_ids: list[list[int]], max_new_tokens: int | list[int] = 64,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, batch_size: int = 8,
                 stop: list[str] | None = None, on_tokens: TokenCallback | None = None,
                 top_logprobs: int | None = None, cancelled: CancelCheck | None = None,
                 schedule: str = "continuous") -> list[GenerationOutput]:
        limits = [max_new_tokens] * len(prompt_ids) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        rows = [DecodeRow(list(p), m) for p, m in zip(prompt_ids, limits, strict=True)]
        return self.decode(rows, Sampling(temperature, top_p, seed), batch_size, stop, on_tokens,
                           top_logprobs=top_logprobs, cancelled=cancelled, schedule=schedule)

    def decode(self, rows: list[DecodeRow], sampling: Sampling | None = None, batch_size: int = 8,
               stop: list[str] | None = None, on_tokens: TokenCallback | None = None,
               on_finish: FinishCallback | None = None, on_progress: ProgressCallback | None = None,
               top_logprobs: int | None = None, cancelled: CancelCheck | None = None,
               schedule: str = "continuous") -> list[GenerationOutput]:
        """Decode ``rows``, at most ``batch_size`` at a time, outputs in input order. ``sampling``, ``stop``
        and ``top_logprobs``, when given, apply to every row (row ``i`` of a call seeded ``s`` draws as a
        row seeded ``s + i``); otherwise each row's own apply. A row that ``cancelled`` reports between
        two steps leaves at once with what it has (finish reason "cancelled", no ``on_finish``)."""
        rows = self.with_call_settings(rows, sampling, stop, top_logprobs)
        self.validate(rows, batch_size)
        # similar lengths are admitted together, so right-padding wastes little prefill
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].target_prompt))
        outputs: dict[int, GenerationOutput] = {}
        stream = self.stream((rows[i] for i in order), batch_size, schedule, on_tokens=on_tokens,
                             on_finish=on_finish, on_progress=on_progress, cancelled=cancelled,
                             expected_rows=len(rows), indices=order)
        for index, output in stream:
            outputs[index] = output
        return [outputs[i] for i in range(len(rows))]

    def stream(self, rows: Iterable[DecodeRow], max_batch: int = 8, schedule: str = "continuous",
               on_tokens: TokenCallback | None = None, on_finish: FinishCallback | None = None,
               on_progress: ProgressCallback | None = None, cancelled: CancelCheck | None = None,
               expected_rows: int | None = None, indices: list[int] | None = None,
               ) -> Iterator[tuple[int, GenerationOutput]]:
        """Decode rows as they come: (index, output) as each row finishes (``batch.stream_through``)."""
        batch = self.batch(max_batch, schedule, on_tokens=on_tokens, on_finish=on_finish,
                           on_progress=on_progress, cancelled=cancelled, expected_rows=expected_rows)
        return stream_through(batch, rows, indices)

    def batch(self, max_batch: int = 8, schedule: str = "continuous", **callbacks: Any) -> DecodeBatch:
        """An empty running batch to ``add`` rows to and ``step`` (the server's admit-then-step loop)."""
        if max_batch < 1:
            raise InputError(f"batch_size must be >= 1, got {max_batch}")
        if schedule not in SCHEDULES:
            raise InputError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        return DecodeBatch(self, max_batch, schedule, **callbacks)

    @staticmethod
    def with_call_settings(rows: list[DecodeRow], sampling: Sampling | None, stop: list[str] | None,
                           top_logprobs: int | None) -> list[DecodeRow]:
        changes: list[dict] = [{} for _ in rows]
        for i, change in enumerate(changes):
            if sampling is not None:
                seed = None if sampling.seed is None else (sampling.seed + i) & ((1 << 63) - 1)
                change["sampling"] = replace(sampling, seed=seed)
            if stop is not None:
                change["stop"] = stop
            if top_logprobs is not None:
                change["top_logprobs"] = top_logprobs
        return [replace(row, **change) if change else row for row, change in zip(rows, changes, strict=True)]

    def validate(self, rows: list[DecodeRow], batch_size: int, first_index: int = 0) -> None:
        if batch_size < 1:
            raise InputError(f"batch_size must be >= 1, got {batch_size}")
        limit = self.pair.max_context
        vocab = min(len(self.pair.tokenizer), self.target_vocab)
        for i, row in enumerate(rows, start=first_index):
            if row.sampling.temperature < 0 or not 0 < row.sampling.top_p <= 1:
                raise InputError("temperature must be >= 0 and top_p in (0, 1]")
            if row.top_logprobs is not None and not 0 <= row.top_logprobs <= MAX_TOP_LOGPROBS:
                raise InputError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {row.top_logprobs}")
            if row.max_new_tokens < 1:
                raise InputError(f"row {i}: max_new_tokens must be >= 1")
            for name, prompt in (("prompt", row.target_prompt), ("draft prompt", row.draft_prompt)):
                if prompt is None:
                    continue
                if not prompt:
                    raise InputError(f"row {i}: empty {name}; give at least one token")
                if len(prompt) + row.max_new_tokens + self.gamma + 1 > limit:
                    raise InputError(
                        f"row {i}: {name} of {len(prompt)} tokens + {row.max_new_tokens} new tokens exceeds "
                        f"the model context of {limit} tokens; shorten the document"
                    )
                if min(prompt) < 0 or max(prompt) >= vocab:
                    raise InputError(f"row {i}: {name} has token ids outside the vocabulary (0..{vocab - 1})")

    # -- choosing a step --

    def plan(self, rows: list[RowState]) -> StepPlan:
        """The next step for the live ``rows``: the controller's choice for the batch, or, while a seeded row
        is live, the fixed rule row by row (see the class docstring)."""
        gamma_max = self.gamma
        # gamma shrinks only when every row is near its limit: one row's limit must not cost the others
        limit = min(gamma_max, max(max(r.remaining for r in rows) - 1, 0))
        has_draft = [r.has_draft for r in rows]
        if any(r.sampling.seeded for r in rows):
            caps = [min(gamma_max, r.remaining - 1) if r.has_draft else 0 for r in rows]
            copies = [c if cap and len(c) >= cap else [] for c, cap in zip(self._copies(rows, limit), caps,
                                                                          strict=True)]
            model = any(cap and not c for cap, c in zip(caps, copies, strict=True))
            return StepPlan(max(caps, default=0), "draft" if model else "lookup", copies, caps, stop_early=False)
        copied = self._copies(rows, limit)
        every_row_copies = bool(rows) and all(copied)
        max_lookup = min(map(len, copied)) if every_row_copies else 0
        gamma, source = self.controller.choose(len(rows), limit if any(has_draft) else 0, max_lookup)
        if source == "lookup" and gamma:
            return StepPlan(gamma, source, [c[:gamma] for c in copied], [gamma] * len(rows), stop_early=False)
        return StepPlan(gamma, source, [[] for _ in rows], [gamma if d else 0 for d in has_draft],
                        stop_early=self.draft_confidence > 0)

    def _copies(self, rows: list[RowState], limit: int) -> list[list[int]]:
        """Each live row's prompt-lookup continuation (up to ``limit`` tokens; [] where it has none)."""
        if not self.prompt_lookup or limit == 0:
            return [[] for _ in rows]
        copied = [lookup_continuation(r.row.target_prompt + r.tokens, limit, min_ngram=self.lookup_min_ngram)
                  for r in rows]
        # every row is looked up, not only up to the first without a copy: draft_pays prices the draft
        # against copying from how often a row has a copy
        self.controller.observe_copies(sum(map(bool, copied)), len(copied))
        return copied

    # -- the steps --

    def speculative_step(self, target_cache: RowKVCache, draft_cache: RowKVCache | None, rows: list[RowState],
                         pending: torch.Tensor, plan: StepPlan, sampling: RowSampling) -> Step:
        """Draft (from the model or by copying, row by row) then verify every row in one target forward."""
        device = self.pair.device
        model_rows = plan.model_rows
        drafted, draft_probs = None, None
        if any(model_rows):
            assert draft_cache is not None
            draft_start = draft_cache.lengths.copy()
            feed = [[*r.backlog, r.pending] for r in rows]
            drafted, draft_probs = self._draft(draft_cache, feed, plan.gamma, sampling, plan.stop_early)
            for r in rows:
                r.backlog = []
        width = plan.gamma if drafted is None else drafted.shape[1]
        caps = [min(cap, width) for cap in plan.caps]
        copy_rows = [bool(c) for c in plan.copies]
        if any(copy_rows):
            copied = to_device([(c + [0] * width)[:width] for c in plan.copies], device)  # [B, g]
            mask = to_device(copy_rows, device, torch.bool)[:, None]
            drafted = copied if drafted is None else torch.where(mask, copied, drafted)
            if not sampling.all_greedy:
                # a copied token is a draft with all its probability on itself: min(1, p/q) is then p(x)
                one_hot = torch.nn.functional.one_hot(copied, self.target_vocab).float()
                draft_probs = one_hot if draft_probs is None else torch.where(mask[..., None], one_hot, draft_probs)
        assert drafted is not None
        cap_ids = None if all(cap == width for cap in caps) else to_device(caps, device)

        # verify: the target scores pending + the drafts for every row in one forward
        batch = len(rows)
        with self.controller.timer(device)(self.controller.forward_cost("target", batch * (width + 1))):
            verify_ids = torch.cat([pending[:, None], drafted], dim=1)
            hidden = forward(self.pair.target, target_cache, verify_ids)
            index = torch.arange(width + 1, device=device)[None, :].expand(batch, -1)
            target_logits = logits_at(self.pair.target, hidden, index)
            accepted, nxt = accept_greedy(drafted, target_logits, cap_ids)
            if not sampling.all_greedy:
                offsets = torch.arange(width + 1, device=device)
                sampled = accept_sampled(drafted, draft_probs, sampling.probs(target_logits),
                                         sampling.draws(offsets[:width], ACCEPT), sampling.draws(offsets, NEXT),
                                         cap_ids)
                accepted = torch.where(sampling.greedy_mask, accepted, sampled[0])
                nxt = torch.where(sampling.greedy_mask, nxt, sampled[1])
        step = Step.read(accepted, nxt, drafted, target_logits)
        target_cache.commit([a + 1 for a in step.accepted])

        if draft_cache is not None:
            self._catch_up_draft(draft_cache, rows, step, model_rows, copy_rows, width,
                                 None if drafted is None or not any(model_rows) else (draft_start, feed))
        full = [a for a, cap in zip(step.accepted, caps, strict=True) if cap == width]
        if full:
            self.controller.observe_acceptance(full, width, "draft" if any(model_rows) else "lookup")
        return step

    @staticmethod
    def _catch_up_draft(draft_cache: RowKVCache, rows: list[RowState], step: Step, model_rows: list[bool],
                        copy_rows: list[bool], width: int,
                        fed: tuple[np.ndarray, list[list[int]]] | None) -> None:
        """Leave each row's draft cache holding a prefix of its output, the rest in its backlog."""
        if fed is not None:
            start, feed = fed
            # a drafting row keeps pending + its accepted drafts (it never fed its last draft token); any
            # other row keeps what it was fed, and a row without a draft keeps nothing
            keep = [start[s] + (len(feed[s]) + (step.accepted[s] if model_rows[s] else 0) if r.has_draft else 0)
                    for s, r in enumerate(rows)]
            draft_cache.rollback(np.array(keep, dtype=np.int64))
            for s, r in enumerate(rows):
                if not r.has_draft:
                    continue
                if model_rows[s] and step.accepted[s] == width:
                    r.backlog = [step.drafted[s][-1]]
                elif not model_rows[s]:
                    r.backlog = step.drafted[s][: step.accepted[s]]
            return
        for s, r in enumerate(rows):  # the draft saw none of what this step committed but the new token
            if r.has_draft:
                r.backlog += [r.pending, *step.drafted[s][: step.accepted[s]]]

    def _draft(self, draft_cache: RowKVCache, feed: list[list[int]], gamma: int, sampling: RowSampling,
               stop_early: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Up to ``gamma`` draft tokens per row [B, g], and their draft probabilities when a row samples. The
        first forward also feeds what the draft cache lacks. Drafting stops early once no row's latest
        token reached ``draft_confidence``: its successors would mostly be rejected, and each costs a
        draft forward plus a wider verify. That test is the one read of the device per draft forward."""
        pair, device = self.pair, self.pair.device
        batch = len(feed)
        timer = self.controller.timer(device)
        draft_tokens, draft_probs = [], []
        for step in range(gamma):
            if step == 0:
                ids, valid = pad_rows(feed, device)
                index = last_columns(valid, device)
            else:
                ids, valid = draft_tokens[-1][:, None], 1
                index = torch.zeros(batch, 1, dtype=torch.long, device=device)
            with timer(self.controller.forward_cost("draft", batch * ids.shape[1])):
                hidden = forward(pair.draft, draft_cache, ids)
                draft_cache.commit(valid)
                logits = self._align_vocab(logits_at(pair.draft, hidden, index)[:, 0])
                token = logits.argmax(-1)
                if not sampling.all_greedy:
                    probs = sampling.probs(logits)
                    draft_probs.append(probs)
                    offset = torch.full((1,), step, dtype=torch.long, device=device)
                    drawn = sample_with(probs, sampling.draws(offset, DRAFT)[:, 0])
                    token = torch.where(sampling.greedy_mask, token, drawn)
            draft_tokens.append(token)
            if stop_early and step + 1 < gamma:
                # the argmax's probability, without a softmax over the vocabulary
                confidence = torch.exp(logits.max(-1).values - torch.logsumexp(logits, -1))
                if not sampling.all_greedy:
                    confidence = torch.where(sampling.greedy_mask, confidence, probs.gather(1, token[:, None])[:, 0])
                if bool((confidence < self.draft_confidence).all()):
                    break
        return torch.stack(draft_tokens, dim=1), torch.stack(draft_probs, 1) if draft_probs else None

    def plain_step(self, target_cache: RowKVCache, pending: torch.Tensor, sampling: RowSampling) -> Step:
        """One target-only step, chosen when speculation would cost more than it saves at this batch; returns
        what ``speculative_step`` does, with nothing drafted."""
        batch = pending.shape[0]
        device = pending.device
        with self.controller.timer(device)(self.controller.forward_cost("target", batch)):
            hidden = forward(self.pair.target, target_cache, pending[:, None])
            logits = logits_at(self.pair.target, hidden, torch.zeros(batch, 1, dtype=torch.long, device=device))
            nxt = sampling.choose(logits[:, 0])
        target_cache.commit(1)
        zeros = torch.zeros(batch, dtype=torch.long, device=device)
        return Step.read(zeros, nxt, torch.zeros(batch, 0, dtype=torch.long, device=device), logits)

    def _align_vocab(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary: rows the draft lacks get probability 0."""
        extra = self.target_vocab - draft_logits.shape[-1]
        if extra > 0:
            return torch.nn.functional.pad(draft_logits, (0, extra), value=float("-inf"))
        return draft_logits[..., : self.target_vocab]
