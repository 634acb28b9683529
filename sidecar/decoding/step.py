"""One decoding step's forwards: draft forwards over the draft pool, then one target forward over the target
pool, then one read of the device (``StepRunner.run``). The terms are ``sidecar.decoding.plan``'s.

    draft forward k (k < draft_forwards), over every draft row:
        k = 0 feeds each row its feed, k > 0 the token it chose at k - 1; compiled modes: a feed wider than
              the widths warm-up compiled runs in the plan's ``feed_chunks`` forwards, each row's first token
              from the chunk its feed ends in
        a main row drafting from the model proposes its token (draws of purpose DRAFT);
        a draft-only row commits it (draws of purpose NEXT: it is the row's output), within its constraint
        drafting may stop early once no drafting row is confident (one read per forward; eager mode only)
        compiled modes: forwards 1 .. n as one call of a compiled chain (``sidecar.decoding.draft_chain``)
    target forward over every target row:
        width > 0: verify [pending, drafts] and accept (``sidecar.decoding.acceptance``) on logits masked
                   by each constrained row's state after 0..width of its drafts
        width = 0: a plain step from the pending token, its logits masked
    read: accepted counts, next tokens, drafts and the draft-only rows' tokens, in one transfer

The plan is the scheduler's, complete and frozen: the runner reads its rows, widths, caps, copies and feeds
and changes none of them. Each forward runs at the shape the plan names for it (``StepPlan.target_shape``,
``draft_shape``, ``next_draft_shape``), passed down to the model's runner (``sidecar.runtime.capture``), which
pads to it and refuses a shape that is not a bucket of its mode; it chooses none itself.
Every forward runs inside the device-time ledger (``sidecar.runtime.ledger``), charged to the rows in it.
Caches are committed here: the target's by accepted count, the draft's rolled back to what each row keeps
(``StepRunner.draft_keep``). What the rows make of the result is the update's (``sidecar.decoding.update``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sidecar.decoding.acceptance import accept_greedy, accept_sampled, sample_with
from sidecar.decoding.controller import GammaController
from sidecar.decoding.draft_chain import run_chain
from sidecar.decoding.matcher import RowMatcher, allocate_bitmask, apply_bitmask, fill_bitmask
from sidecar.decoding.plan import StepPlan
from sidecar.decoding.randomness import ACCEPT, DRAFT, NEXT
from sidecar.decoding.rows import DraftOnlyRow, LiveRow, MainRow
from sidecar.decoding.sampling import RowSampling
from sidecar.decoding.vocab_align import align_vocab
from sidecar.models.pair import ModelPair
from sidecar.runtime.capture import packs, runner_of
from sidecar.runtime.forward import forward, last_columns, logits_at, logits_of_real_columns, pad_rows
from sidecar.runtime.kv_cache import RowKVCache
from sidecar.runtime.ledger import Charge, Ledger
from sidecar.runtime.transfers import to_device, to_host


@dataclass
class StepResult:
    """What a step decided, on the host, with the device tensors the update and the next step use."""

    width: int  # drafts per target row that the verify saw (drafting may have stopped before the plan's)
    draft_forwards: int
    accepted_counts: list[int]  # per target row: drafts kept
    next_tokens: list[int]  # per target row: the target's token after them
    drafted: list[list[int]]  # per target row [width]
    draft_tokens: list[list[int]]  # per draft row: the token each draft forward chose
    next_ids: torch.Tensor  # [B_t] the new pending tokens, on the device
    committed_ids: torch.Tensor | None  # [B_t, width + 1] each target row's committed tokens, padded
    target_logits: torch.Tensor | None  # [B_t, width + 1, V] the target's, for logprobs
    draft_logits: list[torch.Tensor]  # per draft forward [B_d, V], for the draft-only rows' logprobs


def constrain(logits: torch.Tensor, matchers: list[RowMatcher | None]) -> None:
    """Refuse in ``logits`` [B, V], in place, what each constrained row may not choose next (None: a free
    row); a batch without a constrained row is left alone at no cost."""
    bitmask = fill_bitmask(matchers, logits.shape[-1])  # [B, W] on the host, or None
    if bitmask is not None:
        apply_bitmask(logits, bitmask)


def draft_charges(rows: Sequence[LiveRow], widths: list[int], first: bool) -> list[Charge]:
    """What each draft row is charged for ``widths[i]`` tokens in a draft forward (the ledger's rule): a
    catching-up row's tokens go to its sidecars (sidecar-mode work, shared equally), a joining draft-only
    row's feed in the ``first`` forward is its prefill."""
    charges = []
    for r, tokens in zip(rows, widths, strict=True):
        if isinstance(r, MainRow) and r.catching_up:
            share = tokens / max(len(r.catch_up), 1)
            charges += [Charge(a, "prefill", share, "sidecar") for a in r.catch_up] or [
                Charge(r.account, "decode", tokens, "main")]
        elif isinstance(r, DraftOnlyRow):
            charges.append(Charge(r.account, "prefill" if first and r.feed else "decode", tokens, r.phase))
        else:
            charges.append(Charge(r.account, "decode", tokens, "main"))
    return charges


class StepRunner:
    """Runs steps of one pair: its forwards, acceptance, and the step's one read."""

    def __init__(self, pair: ModelPair, controller: GammaController, ledger: Ledger, draft_confidence: float) -> None:
        self.pair = pair
        self.controller = controller
        self.ledger = ledger
        self.draft_confidence = draft_confidence
        self.target_vocab = pair.target.get_output_embeddings().out_features

    def run(self, plan: StepPlan, target_cache: RowKVCache | None, draft_cache: RowKVCache | None,
            pending_ids: torch.Tensor) -> StepResult:
        """Execute ``plan`` on the pools' caches (its rows in slot order); ``pending_ids`` [B_t] are the target
        rows' pending tokens, on the device."""
        device = self.pair.device
        self.ledger.begin_step()
        target_rows, draft_rows, drafting = plan.target_rows, plan.draft_rows, plan.drafting
        # draft forwards: [B_d, n] tokens, [B_d, n, V] draft probabilities when a drafting row samples
        draft_ids = torch.zeros(len(draft_rows), 0, dtype=torch.long, device=device)
        draft_probs, draft_logits, draft_start = None, [], None
        if plan.draft_forwards:
            assert draft_cache is not None
            draft_start = draft_cache.lengths.copy()
            draft_ids, draft_probs, draft_logits = self._draft(draft_cache, draft_rows, plan, drafting)
        width = plan.width if plan.source == "lookup" or not any(drafting) else min(plan.width, draft_ids.shape[1])

        next_ids = pending_ids[:0]
        accepted = committed = target_logits = drafted_t = None
        if target_rows:
            assert target_cache is not None
            drafted_t, probs_t = self._target_drafts(plan, draft_ids, draft_probs, width, len(target_rows))
            if width:
                accepted, next_ids, target_logits = self._verify(target_cache, target_rows, plan, pending_ids,
                                                                 drafted_t, probs_t, width)
            else:
                next_ids, target_logits = self._plain(target_cache, target_rows, plan, pending_ids)
                accepted = torch.zeros_like(next_ids)
            # the committed tokens: accepted drafts, then the target's own token at the first rejection
            committed = torch.cat([drafted_t, next_ids[:, None]], 1).scatter(1, accepted[:, None], next_ids[:, None])

        # the step's one read: [B_t] accepted, [B_t] next, [B_t, width] drafts, [B_d, n] draft-only tokens
        parts = [draft_ids.flatten()]
        if target_rows:
            parts = [accepted, next_ids, drafted_t.flatten(), *parts]
        flat = to_host(torch.cat(parts))
        self.ledger.collect()
        b_t, n = len(target_rows), draft_ids.shape[1]
        accepted_counts, next_tokens = flat[:b_t], flat[b_t : 2 * b_t]
        drafts = flat[2 * b_t : 2 * b_t + b_t * width]
        tokens = flat[2 * b_t + b_t * width :]
        result = StepResult(width, n, accepted_counts, next_tokens,
                            [drafts[i * width : (i + 1) * width] for i in range(b_t)],
                            [tokens[i * n : (i + 1) * n] for i in range(len(draft_rows))], next_ids, committed,
                            target_logits, draft_logits)
        if target_rows:
            target_cache.commit([a + 1 for a in accepted_counts])
            full = [a for a, cap in zip(accepted_counts, plan.caps, strict=True) if min(cap, width) == width]
            if full and width:
                self.controller.observe_acceptance(full, width, "draft" if any(plan.model_rows) else "lookup")
        if draft_start is not None:
            draft_cache.rollback(self.draft_keep(plan, draft_start, result))
        return result

    # -- the draft forwards --

    def _draft(self, cache: RowKVCache, rows: Sequence[LiveRow], plan: StepPlan,
               drafting: Sequence[bool]) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
        """Up to ``plan.draft_forwards`` draft forwards over every draft row: tokens [B_d, n], the drafting
        rows' probabilities [B_d, n, V] when some row samples, and per forward the logits [B_d, V] when a
        draft-only row asks for logprobs.

        Where the plan chains them (``StepPlan.chained_forwards``), forwards 1 .. n run as one compiled call
        (``sidecar.decoding.draft_chain``) after forward 0: no read between them, the cache committed once.
        A constrained draft-only row chooses from masked logits; its matcher accepts each token but the last,
        which the next forward's mask needs (read with the early stop's check, one read per forward, and only
        while a constrained row is in the pool); ``StepUpdate.commit`` brings it level with what the row keeps.
        Main rows propose freely: the verify masks the target."""
        device, batch = self.pair.device, len(rows)
        only = [isinstance(r, DraftOnlyRow) for r in rows]
        matchers = [r.matcher if o else None for o, r in zip(only, rows, strict=True)]
        constrained = [b for b, m in enumerate(matchers) if m is not None]
        constrained_ids = to_device(constrained, device) if constrained else None
        sampling = RowSampling.of(rows, device)
        only_mask = to_device(only, device, torch.bool) if any(only) and not sampling.all_greedy else None
        drafting_mask = to_device(drafting, device, torch.bool) if plan.stop_early and any(drafting) else None
        keep_logits = any(o and r.top_logprobs is not None for o, r in zip(only, rows, strict=True))
        tokens, probs, logits_kept = [], [], []
        for k in range(plan.draft_forwards):
            if k == 1 and plan.chained_forwards:  # the rest as one compiled call (``sidecar.decoding.draft_chain``)
                charges = draft_charges(rows, [1] * batch, first=False)
                context = int(cache.lengths.sum()) + sum(c.tokens for c in charges)
                with self.ledger.forward("draft", "decode", batch, charges, batch, context,
                                         also=self.controller.forward_cost("draft", batch, batch),
                                         forwards=plan.chained_forwards):
                    chained, chained_probs = run_chain(
                        runner_of(self.pair.draft), cache, tokens[-1], plan.chained_forwards, sampling, only,
                        self.target_vocab, plan.next_draft_shape)
                tokens += chained.unbind(1)
                probs += [] if chained_probs is None else chained_probs.unbind(1)
                break
            carried = None  # [B_d, 1, H]: each row's state at its last fed token, from the feed's earlier chunks
            if k == 0:
                carried, ends, column = self._feed_chunks(cache, rows, plan)
                ids, valid = pad_rows(plan.feed_chunk(plan.feed_chunks - 1), device)
                index = last_columns(valid, device) if carried is None else column
                charges = [c for c in draft_charges(rows, valid, first=True) if c.tokens or plan.feed_chunks == 1]
            else:
                ids, valid = tokens[-1][:, None], 1
                index = torch.zeros(batch, 1, dtype=torch.long, device=device)
                charges = draft_charges(rows, [1] * batch, first=False)
            context = int(cache.lengths.sum()) + sum(c.tokens for c in charges)
            with self.ledger.forward("draft", "decode", batch, charges, ids.numel(), context,
                                     also=self.controller.forward_cost("draft", batch, ids.numel())):
                hidden = forward(self.pair.draft, cache, ids, valid=None if k else valid,
                                 shape=plan.next_draft_shape if k else plan.draft_shape)
                cache.commit(valid)
                if carried is not None:  # a row whose feed ended in an earlier chunk takes its state from there
                    last = hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))
                    hidden, index = torch.where(ends[:, None, None], last, carried), torch.zeros_like(index)
                logits = align_vocab(logits_at(self.pair.draft, hidden, index)[:, 0], self.target_vocab)  # [B_d, V]
                constrain(logits, matchers)
                token = logits.argmax(-1)
                if not sampling.all_greedy:
                    p = sampling.probs(logits)
                    probs.append(p)
                    offset = torch.full((1,), k, dtype=torch.long, device=device)
                    u = sampling.draws(offset, DRAFT)[:, 0]
                    if only_mask is not None:
                        u = torch.where(only_mask, sampling.draws(offset, NEXT)[:, 0], u)
                    token = torch.where(sampling.greedy_mask, token, sample_with(p, u))
            tokens.append(token)
            if keep_logits:
                logits_kept.append(logits)
            if k + 1 == plan.draft_forwards:
                break
            stop = None  # [1]: whether drafting stops here (None: it cannot stop early)
            if drafting_mask is not None:
                # the argmax's probability, without a softmax over the vocabulary; only drafting rows count
                confidence = torch.exp(logits.max(-1).values - torch.logsumexp(logits, -1))
                if not sampling.all_greedy:
                    chosen = probs[-1].gather(1, token[:, None])[:, 0]
                    confidence = torch.where(sampling.greedy_mask, confidence, chosen)
                stop = ((confidence < self.draft_confidence) | ~drafting_mask).all()[None].long()
            if constrained_ids is not None:  # [constrained rows' tokens, stop?] in one read
                read = torch.cat([token.index_select(0, constrained_ids), *([] if stop is None else [stop])])
                values = to_host(read)
                for b, chosen_token in zip(constrained, values[: len(constrained)], strict=True):
                    if not matchers[b].ended:  # an ended row allows only its end ids, cut by the update
                        matchers[b].accept(chosen_token)
                if stop is not None and values[-1]:
                    break
            elif stop is not None and to_host(stop)[0]:
                break
        return torch.stack(tokens, 1), torch.stack(probs, 1) if probs else None, logits_kept

    def _feed_chunks(self, cache: RowKVCache, rows: Sequence[LiveRow],
                     plan: StepPlan) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Run the feeds' chunks but the last (``StepPlan.feed_chunks``; none where the feeds take one forward),
        each a draft forward at ``plan.draft_shape``, committed. Returns (each row's hidden state at its last fed
        token [B_d, 1, H], from the chunk its feed ended in; whether its feed ends in the last chunk [B_d]; the
        column it ends at there [B_d, 1], 0 for a row whose feed ended before), or Nones without chunks."""
        if plan.feed_chunks == 1:
            return None, None, None
        device, batch, width = self.pair.device, len(rows), plan.draft_shape.width
        chunk_of = to_device([(len(feed) - 1) // width for feed in plan.feeds], device)  # [B_d]
        column = to_device([[(len(feed) - 1) % width] for feed in plan.feeds], device)  # [B_d, 1]
        carried = None
        for chunk in range(plan.feed_chunks - 1):
            ids, valid = pad_rows(plan.feed_chunk(chunk), device)
            charges = [c for c in draft_charges(rows, valid, first=True) if c.tokens]
            context = int(cache.lengths.sum()) + sum(c.tokens for c in charges)
            with self.ledger.forward("draft", "decode", batch, charges, ids.numel(), context,
                                     also=self.controller.forward_cost("draft", batch, ids.numel())):
                hidden = forward(self.pair.draft, cache, ids, valid=valid, shape=plan.draft_shape)
                cache.commit(valid)
                last = hidden.gather(1, column[..., None].expand(-1, -1, hidden.shape[-1]))  # [B_d, 1, H]
                carried = last if carried is None else torch.where((chunk_of == chunk)[:, None, None], last, carried)
        ends = chunk_of == plan.feed_chunks - 1  # [B_d]
        return carried, ends, torch.where(ends[:, None], column, 0)

    def _target_drafts(self, plan: StepPlan, draft_ids: torch.Tensor, draft_probs: torch.Tensor | None, width: int,
                       rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each target row's drafts [B_t, width] (from its draft row, or copied; zeros where it has none) and
        their draft probabilities [B_t, width, V] when some row samples."""
        device = self.pair.device
        drafted = torch.zeros(rows, width, dtype=torch.long, device=device)
        probs = None
        model_rows = plan.model_rows
        if width and any(model_rows) and draft_ids.shape[1]:
            slots = [s if m and s >= 0 else 0 for s, m in zip(plan.draft_slot, model_rows, strict=True)]
            index = to_device(slots, device)
            drafted = draft_ids.index_select(0, index)[:, :width]
            if draft_probs is not None:
                probs = draft_probs.index_select(0, index)[:, :width]
        copy_rows = [bool(c) for c in plan.copies]
        if width and any(copy_rows):
            copied = to_device([[*c, *[0] * width][:width] for c in plan.copies], device)  # [B_t, width]
            mask = to_device(copy_rows, device, torch.bool)[:, None]
            drafted = torch.where(mask, copied, drafted)
            if draft_probs is not None or probs is not None:
                # a copied token is a draft with all its probability on itself: min(1, p/q) is then p(x)
                one_hot = torch.nn.functional.one_hot(copied, self.target_vocab).float()
                probs = one_hot if probs is None else torch.where(mask[..., None], one_hot, probs)
        return drafted, probs

    # -- the target forward --

    def _verify(self, cache: RowKVCache, rows: Sequence[MainRow], plan: StepPlan, pending_ids: torch.Tensor,
                drafted: torch.Tensor, draft_probs: torch.Tensor | None,
                width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Score [pending, drafts] for every target row in one forward and accept: (accepted counts [B_t],
        next tokens [B_t], the target's logits [B_t, width + 1, V])."""
        device, batch = self.pair.device, len(rows)
        caps = [min(cap, width) for cap in plan.caps]
        cap_ids = None if all(cap == width for cap in caps) else to_device(caps, device)
        sampling = RowSampling.of(rows, device)
        # a row verifies its pending token and the drafts it may keep; the columns past them are padding (an
        # eager stack computes only real tokens: ``sidecar.runtime.decoder_stack``, packing)
        valid = [cap + 1 for cap in caps]
        computed = sum(valid) if packs(self.pair.target) else batch * (width + 1)
        charges = [Charge(r.account, "decode", columns, "main") for r, columns in zip(rows, valid, strict=True)]
        context = int(cache.lengths.sum()) + sum(valid)
        with self.ledger.forward("target", "decode", batch, charges, computed, context,
                                 also=self.controller.forward_cost("target", batch, computed)):
            hidden = forward(self.pair.target, cache, torch.cat([pending_ids[:, None], drafted], dim=1),
                             valid=None if cap_ids is None else valid, shape=plan.verify_shape(width))
            if cap_ids is None:
                index = torch.arange(width + 1, device=device)[None, :].expand(batch, -1)
                logits = logits_at(self.pair.target, hidden, index)  # [B_t, width + 1, V]
            else:  # the LM head over each row's real columns only (0 past them)
                logits = logits_of_real_columns(self.pair.target, hidden, valid)
            self._constrain_verify(rows, drafted, logits)
            accepted, nxt = accept_greedy(drafted, logits, cap_ids)
            if not sampling.all_greedy:
                if draft_probs is None:  # every sampled row copies or keeps no draft: a one-hot stands in
                    draft_probs = torch.nn.functional.one_hot(drafted, self.target_vocab).float()
                offsets = torch.arange(width + 1, device=device)
                sampled = accept_sampled(drafted, draft_probs, sampling.probs(logits), sampling.draws(offsets[:width],
                                         ACCEPT), sampling.draws(offsets, NEXT), cap_ids)
                accepted = torch.where(sampling.greedy_mask, accepted, sampled[0])
                nxt = torch.where(sampling.greedy_mask, nxt, sampled[1])
        return accepted, nxt, logits

    def _plain(self, cache: RowKVCache, rows: Sequence[MainRow], plan: StepPlan,
               pending_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One target-only step: (next tokens [B_t], the target's logits [B_t, 1, V])."""
        device, batch = self.pair.device, len(rows)
        sampling = RowSampling.of(rows, device)
        charges = [Charge(r.account, "decode", 1, "main") for r in rows]
        with self.ledger.forward("target", "decode", batch, charges, batch, int(cache.lengths.sum()) + batch,
                                 also=self.controller.forward_cost("target", batch, batch)):
            hidden = forward(self.pair.target, cache, pending_ids[:, None], shape=plan.target_shape)
            logits = logits_at(self.pair.target, hidden, torch.zeros(batch, 1, dtype=torch.long, device=device))
            constrain(logits[:, 0], [r.matcher for r in rows])
            nxt = sampling.choose(logits[:, 0])
        return nxt, logits

    def _constrain_verify(self, rows: Sequence[MainRow], drafted: torch.Tensor, logits: torch.Tensor) -> None:
        """Mask a constrained row's position j in ``logits`` [B_t, width + 1, V] by its state after its first
        j drafts (``RowMatcher.draft_masks``): the target's masked choice is then target-only decoding's
        under the same prefix, and a draft the constraint refuses is rejected. The drafts [B_t, width] are
        read to the host for it (one read, only when some target row is constrained)."""
        if all(r.matcher is None for r in rows):
            return
        batch, positions = logits.shape[:2]
        masks = allocate_bitmask(batch * positions, logits.shape[-1]).view(batch, positions, -1)  # [B_t, width + 1, W]
        for r, drafts, mask in zip(rows, to_host(drafted), masks, strict=True):
            if r.matcher is not None:
                r.matcher.draft_masks(drafts, mask)
        apply_bitmask(logits, masks)

    # -- after the read --

    @staticmethod
    def draft_keep(plan: StepPlan, start: np.ndarray, result: StepResult) -> np.ndarray:
        """Columns each draft row keeps: what it was fed, a drafting row also its accepted drafts, a
        draft-only row also the tokens it chose but the last (which is pending)."""
        accepted = {id(r): (a, m)
                    for r, a, m in zip(plan.target_rows, result.accepted_counts, plan.model_rows, strict=True)}
        keep = start.copy()
        for slot, r in enumerate(plan.draft_rows):
            fed = len(plan.feeds[slot])
            if isinstance(r, DraftOnlyRow):
                keep[slot] += fed + result.draft_forwards - 1
            else:
                count, model = accepted.get(id(r), (0, False))
                keep[slot] += fed + (min(count, result.draft_forwards - 1) if model else 0)
        return keep

