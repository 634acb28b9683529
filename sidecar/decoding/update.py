"""A step's update: what the rows make of the runner's result (``sidecar.decoding.step.StepResult``), and of an
admission's first tokens.

Per target row: its counters (``GenerationStats``: drafts, acceptance by position, forwards), the backlog its
draft cache lacks, and its committed tokens: accepted drafts then the target's own. Per draft-only row: its
draft forwards and the tokens they chose. Every row's tokens are committed the same way (``StepUpdate.commit``):
cut at end of turn, a stop string or the row's limit, its constraint's matcher brought level with what it keeps,
its logprobs kept, the caller told. The step's ``StepRecord`` goes to the batch's trace.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sidecar.decoding.logprobs import TokenLogprob, token_logprobs
from sidecar.decoding.plan import StepPlan
from sidecar.decoding.rows import DraftOnlyRow, LiveRow, MainRow, TokenCallback
from sidecar.decoding.step import StepResult
from sidecar.decoding.trace import BatchTrace, StepRecord
from sidecar.runtime.transfers import to_device


@dataclass(frozen=True)
class FirstTokens:
    """An admitted group's first tokens: on the device [B], read [B], and the logits [B, V] they came from."""

    ids: torch.Tensor
    tokens: list[int]
    logits: torch.Tensor


class StepUpdate:
    """Applies steps' results and first tokens to a batch's rows; ``eos``: the ids that end a turn."""

    def __init__(self, eos: set[int], device: torch.device, trace: BatchTrace,
                 on_tokens: TokenCallback | None) -> None:
        self.eos, self.device, self.trace, self.on_tokens = eos, device, trace, on_tokens

    def first(self, rows: Sequence[LiveRow], first: FirstTokens) -> None:
        """Commit admitted ``rows``' first tokens as a step's are, once their stats exist."""
        self.commit(rows, [[t] for t in first.tokens], self.logprobs(rows, first.logits[:, None], first.ids[:, None]))

    def step(self, plan: StepPlan, result: StepResult) -> None:
        """Apply the step ``plan`` ran: counters, backlogs, committed tokens and logprobs, and the trace."""
        width, forwards = result.width, result.draft_forwards
        model_rows = plan.model_rows
        appended, copied = [], []  # copied: whether the row verified a prompt-lookup copy this step
        for t, r in enumerate(plan.target_rows):
            cap, accepted = min(plan.caps[t], width), result.accepted_counts[t]
            copied.append(bool(plan.copies[t] and cap))
            drafted = result.drafted[t]
            st = r.stats
            st.target_forwards += 1
            st.drafted += cap
            if copied[t]:
                st.lookup_drafted += cap
            elif model_rows[t]:
                st.draft_forwards += forwards
            for k in range(cap):
                st.drafted_per_position[k] += 1
            if r.has_draft:  # what the draft cache lacks now, before the new pending token
                if not forwards:
                    r.backlog += [r.pending_token, *drafted[:accepted]]
                elif model_rows[t]:
                    r.backlog = [drafted[-1]] if accepted == forwards else []
                else:
                    r.backlog = drafted[:accepted]
            appended.append([*drafted[:accepted], result.next_tokens[t]])
        entries = None
        if any(r.top_logprobs is not None for r in plan.target_rows):
            entries = self.logprobs(plan.target_rows, result.target_logits, result.committed_ids)
        before = [len(r.tokens) for r in plan.target_rows]
        self.commit(plan.target_rows, appended, entries)
        for t, r in enumerate(plan.target_rows):
            # the drafts the row kept: the target may accept drafts past an end of turn, a stop or the limit
            # (a copy runs on into the chat template), which the row cuts
            accepted = min(result.accepted_counts[t], len(r.tokens) - before[t])
            r.stats.accepted += accepted
            if copied[t]:
                r.stats.lookup_accepted += accepted
            for k in range(accepted):
                r.stats.accepted_per_position[k] += 1

        only = [(slot, r) for slot, r in enumerate(plan.draft_rows) if isinstance(r, DraftOnlyRow)]
        for _, r in only:
            r.stats.draft_forwards += forwards
            r.feed = []
        if only:
            rows = [r for _, r in only]
            entries = None
            if any(r.top_logprobs is not None for r in rows) and result.draft_logits:
                index = to_device([slot for slot, _ in only], self.device)
                logits = torch.stack(result.draft_logits, 1).index_select(0, index)
                chosen = to_device([result.draft_tokens[slot] for slot, _ in only], self.device)
                entries = self.logprobs(rows, logits, chosen)
            self.commit(rows, [result.draft_tokens[slot] for slot, _ in only], entries)
        feed = max(map(len, plan.feeds)) if plan.feeds and forwards else 0
        riders = len(plan.draft_rows) - sum(isinstance(r, MainRow) and r.finish is None for r in plan.draft_rows)
        self.trace.add(StepRecord(len(plan.target_rows), width, forwards, feed, riders, plan.source,
                                  plan.verify_shape(width) if plan.target_rows else None, plan.draft_shape,
                                  plan.next_draft_shape if forwards > 1 else None, plan.chained_forwards,
                                  plan.feed_chunks if forwards else 0))

    @staticmethod
    def logprobs(rows: Sequence[LiveRow], logits: torch.Tensor,
                 chosen: torch.Tensor) -> list[list[TokenLogprob]] | None:
        """Each row's entries for the tokens ``chosen`` [B, k] from ``logits`` [B, k, V]; None when no row
        asks for logprobs."""
        wanted = [r.top_logprobs for r in rows if r.top_logprobs is not None]
        if not wanted:
            return None
        entries = token_logprobs(logits, chosen, max(wanted))
        # a row asking for fewer alternatives than the batch's most keeps its first ones
        return [[TokenLogprob(e.token_id, e.logprob, e.top[: r.top_logprobs or 0]) for e in row_entries]
                for r, row_entries in zip(rows, entries, strict=True)]

    def commit(self, rows: Sequence[LiveRow], appended: list[list[int]],
               entries: list[list[TokenLogprob]] | None) -> None:
        """Add each live row's committed tokens, cut at end of turn, a stop string or its token limit; with
        ``entries`` (aligned with ``appended``) their logprobs go along."""
        now = time.perf_counter()
        for i, r in enumerate(rows):
            if r.finish is not None:
                continue
            r.pending_token = appended[i][-1]
            cut = appended[i][: r.remaining]
            reason = "length" if len(cut) >= r.remaining else None
            for k, token in enumerate(cut):
                if token in self.eos:
                    cut, reason = cut[: k + 1], "eos"
                    break
            if r.stops is not None and reason != "eos":
                k = r.stops.first(cut)
                if k is not None:
                    cut, reason = cut[: k + 1], "stop"
            if not r.tokens and cut:
                r.stats.first_token_seconds = now - r.added
            r.tokens.extend(cut)
            r.finish = reason
            if r.matcher is not None and reason is None:
                # level with the kept tokens: a main row's committed ones, a draft-only row's last (its matcher
                # took the others in the draft forwards). A cut row finishes, and its matcher is not asked again.
                for token in r.tokens[len(r.matcher.tokens):]:
                    r.matcher.accept(token)
            cut_entries = None
            if entries is not None and r.logprobs is not None:
                cut_entries = entries[i][: len(cut)]
                r.logprobs.extend(cut_entries)
            if self.on_tokens is not None and cut:
                self.on_tokens(r.key, cut, cut_entries)
