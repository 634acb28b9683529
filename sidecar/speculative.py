"""Batched speculative decoding: the draft proposes, the target verifies every row in one forward.

Each row keeps its own length in both KV caches (``RowKVCache``), so rows accept different numbers of
tokens, finish independently and leave the batch when done. Greedy output is token-identical to the
target decoding alone; sampled output follows the target's distribution (``sidecar.acceptance``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from transformers import PreTrainedModel

from sidecar.acceptance import accept_greedy, accept_sampled, sample, warp
from sidecar.errors import InputError
from sidecar.gamma import GammaController, Source, fixed_step
from sidecar.kv_cache import RowKVCache, compaction_order
from sidecar.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, token_logprobs
from sidecar.lookup import MIN_NGRAM, lookup_continuation
from sidecar.models import ModelPair
from sidecar.progress import DECODE, DRAFT_PREFILL, TARGET_PREFILL, ProgressCallback
from sidecar.settings import Settings
from sidecar.stops import TokenStops
from sidecar.transfers import to_device

# (row index, tokens just committed, their logprob entries when asked for, else None)
TokenCallback = Callable[[int, list[int], list[TokenLogprob] | None], None]
# (row index) -> whether nobody waits for the row any more; asked once per decoding step, on the host
CancelCheck = Callable[[int], bool]


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    drafted: int = 0  # by the draft model and by prompt lookup
    accepted: int = 0
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    target_forwards: int = 0  # the prefill counts as one: it yields the first token
    draft_forwards: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    # Rows of one batch share forwards, so these are the batch's wall-clock phases up to this row's end. The
    # loop does not wait for the draft's prefill, so on a GPU part of it may show in decode_seconds.
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    wall_seconds: float = 0.0
    batch_size: int = 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    def as_dict(self) -> dict:
        return asdict(self) | {"acceptance_rate": self.acceptance_rate,
                               "tokens_per_target_forward": self.tokens_per_target_forward}


@dataclass
class GenerationOutput:
    token_ids: list[int]
    text: str
    finish_reason: str  # "eos" | "stop" | "length" | "cancelled"
    stats: GenerationStats
    # one entry per token id, from the target's logits (``sidecar.logprobs``); None unless asked for
    logprobs: list[TokenLogprob] | None = None


@dataclass
class DecodeRow:
    """One request as the decoding loop sees it; the draft may see a longer prompt than the target."""

    target_prompt: list[int]
    max_new_tokens: int
    draft_prompt: list[int] | None = None
    # (start, end) column ranges of the draft prompt hidden from the draft during decoding
    draft_hidden: list[tuple[int, int]] = field(default_factory=list)


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


# Dividing float32 logits by a temperature near 1e-38 overflows to inf and sampling gets NaN; far above that,
# at 1e-5, logits 0.001 apart already differ by a factor of e^100, so lower temperatures are decoded greedily.
MIN_SAMPLING_TEMPERATURE = 1e-5
# Adaptive drafting stops once no row's latest draft token had at least this draft probability: the tokens
# drafted after an unsure one are mostly rejected, and each costs a draft forward and a wider verify.
DRAFT_CONFIDENCE = 0.8


@dataclass
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE


# Called when a row finishes, before it leaves the batch (a cancelled row leaves without it): (row index,
# output, draft cache, slot of the row in that cache). The draft cache holds the draft prompt plus a prefix
# of the row's new tokens; the sidecar engine continues from there.
FinishCallback = Callable[[int, GenerationOutput, RowKVCache, int], None]


def forward(model: PreTrainedModel, cache: RowKVCache, input_ids: torch.Tensor,
            query_span: torch.Tensor | None = None) -> torch.Tensor:
    """Run the decoder stack on ``input_ids`` [B, q] over ``cache``; returns hidden states [B, q, H]."""
    positions, mask = cache.prepare(input_ids.shape[1], model.dtype, query_span)
    # A target with more embedding rows than its draft can emit ids the draft cannot embed; the draft
    # only proposes, so feeding it a stand-in id there costs acceptance, never correctness.
    vocab = model.get_input_embeddings().num_embeddings
    input_ids = torch.where(input_ids < vocab, input_ids, 0)
    out = model.base_model(input_ids=input_ids, position_ids=positions, attention_mask=mask, cache=cache,
                           use_cache=True)
    return out.last_hidden_state


def logits_at(model: PreTrainedModel, hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Logits [B, k, V] at per-row positions ``index`` [B, k]: only those rows reach the LM head."""
    picked = hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))
    return model.get_output_embeddings()(picked).float()


def pad_rows(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """Right-pad token lists into [B, q] on ``device``; returns (ids, valid lengths on the host)."""
    lengths = [len(r) for r in rows]
    ids = np.zeros((len(rows), max(lengths)), dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    return to_device(ids, device), lengths


def last_columns(lengths: list[int], device: torch.device) -> torch.Tensor:
    """Index [B, 1] of each row's last valid column, for ``logits_at`` or a gather."""
    return to_device([[n - 1] for n in lengths], device)


# A CPU runs a forward's rows one after another, and a forward over many long padded rows costs more per
# token than the same rows fed one at a time, by more than the padding explains. Short feeds (a few
# catch-up tokens per row) still share a forward, which reads the weights once for all.
CPU_PREFILL_TOKENS = 256


def prefill_budget(device: torch.device) -> int | None:
    """Padded tokens per prefill forward: ``CPU_PREFILL_TOKENS`` on a CPU, unbounded (None: one forward for
    all rows) on an accelerator, which runs a batch's rows in parallel, or wherever
    ``SIDECAR_ONE_PREFILL_FORWARD`` is set (so that CPU tests run the accelerator's path too)."""
    return CPU_PREFILL_TOKENS if device.type == "cpu" and not Settings().one_prefill_forward else None


def shared_prefix_length(rows: list[list[int]], hidden_spans: list[list[tuple[int, int]]] | None) -> int:
    """How many leading tokens every row has in common, short of a hidden span and of each row's last token."""
    limit = min(len(r) for r in rows) - 1  # every row keeps a token of its own: its last state is needed
    if hidden_spans is not None:
        limit = min([limit, *(start for spans in hidden_spans for start, _ in spans)])
    first = rows[0]
    shared = 0
    while shared < limit and all(r[shared] == first[shared] for r in rows):
        shared += 1
    return shared


def prefill(model: PreTrainedModel, cache: RowKVCache, rows: list[list[int]], budget: int | None,
            hidden_spans: list[list[tuple[int, int]]] | None = None, share_prefix: bool = True,
            on_rows: Callable[[int], None] | None = None) -> torch.Tensor:
    """Feed ``rows[i]`` into row ``i`` of ``cache`` and commit it; returns each row's hidden state at its
    last token [B, 1, H]. Consecutive rows share a forward while its padded size stays within ``budget``
    tokens (one row at least; None: all rows). ``hidden_spans[i]`` lists row ``i``'s hidden spans as
    (start, stop) token ranges (``DecodeRow.draft_hidden``). ``on_rows(k)`` hears after each forward that
    the first ``k`` rows are in.

    Into an empty cache, a prefix all rows share (the chat template's system turn: 14 tokens of ~330 on a
    news prompt) is computed once, with the first row, and copied to the others (``share_prefix``).
    """
    can_share = share_prefix and len(rows) > 1 and int(cache.lengths.max()) == 0
    shared = shared_prefix_length(rows, hidden_spans) if can_share else 0
    if shared:
        last = [prefill(model, cache.rows_view(0, 1), rows[:1], budget,
                        None if hidden_spans is None else hidden_spans[:1])]
        if on_rows is not None:
            on_rows(1)
        cache.copy_prefix(0, shared)
        rest = cache.rows_view(1, len(rows))
        rest_spans = None if hidden_spans is None else [
            [(start - shared, stop - shared) for start, stop in spans] for spans in hidden_spans[1:]]
        last.append(prefill(model, rest, [r[shared:] for r in rows[1:]], budget, rest_spans, share_prefix=False,
                            on_rows=None if on_rows is None else lambda k: on_rows(1 + k)))
        return torch.cat(last)
    device = cache.device
    last: list[torch.Tensor] = []
    start = 0
    while start < len(rows):
        stop, width = start + 1, len(rows[start])
        while stop < len(rows) and (budget is None or (stop + 1 - start) * max(width, len(rows[stop])) <= budget):
            width = max(width, len(rows[stop]))
            stop += 1
        part = cache if (start, stop) == (0, len(rows)) else cache.rows_view(start, stop)
        ids, lengths = pad_rows(rows[start:stop], device)
        span_ids = None
        if hidden_spans is not None:
            spans = np.full(tuple(ids.shape), -1, dtype=np.int64)
            for i, row_spans in enumerate(hidden_spans[start:stop]):
                for span_id, (s, e) in enumerate(row_spans):
                    spans[i, s:e] = span_id
            span_ids = to_device(spans, device)
        hidden = forward(model, part, ids, span_ids)
        part.commit(lengths)
        index = last_columns(lengths, device)[:, :, None].expand(-1, 1, hidden.shape[-1])
        last.append(hidden.gather(1, index))
        if on_rows is not None:
            on_rows(stop)
        start = stop
    return torch.cat(last)


class SpeculativeDecoder:
    """Batched speculative decoding of ``pair``.

    ``gamma`` bounds the tokens drafted per step. ``adaptive`` picks each step's gamma from measured costs
    and acceptance (down to plain steps) and stops drafting at ``draft_confidence`` (default
    ``DRAFT_CONFIDENCE``; 0 never stops early); without it every step drafts exactly ``gamma``.
    ``prompt_lookup`` also drafts by copying from each row's own text (``sidecar.lookup``) when every row
    of the batch has something to copy; in fixed mode it copies when every row has ``gamma`` tokens.

    ``top_logprobs`` (None: off) makes every output carry each token's log-probability under the target
    and that many top alternatives (``sidecar.logprobs``), read from the logits the prefill, plain step or
    verify forward computed anyway for the position that committed the token.
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
        # costs learned in one call carry over to the next: the controller is per decoder
        self.controller = GammaController(gamma, adaptive)

    # -- public API --

    def generate(self, prompt_ids: list[list[int]], max_new_tokens: int | list[int] = 64,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, batch_size: int = 8,
                 stop: list[str] | None = None, on_tokens: TokenCallback | None = None,
                 top_logprobs: int | None = None, cancelled: CancelCheck | None = None) -> list[GenerationOutput]:
        limits = [max_new_tokens] * len(prompt_ids) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        rows = [DecodeRow(list(p), m) for p, m in zip(prompt_ids, limits, strict=True)]
        return self.decode(rows, Sampling(temperature, top_p, seed), batch_size, stop, on_tokens,
                           top_logprobs=top_logprobs, cancelled=cancelled)

    def decode(self, rows: list[DecodeRow], sampling: Sampling, batch_size: int = 8, stop: list[str] | None = None,
               on_tokens: TokenCallback | None = None, on_finish: FinishCallback | None = None,
               on_progress: ProgressCallback | None = None, top_logprobs: int | None = None,
               cancelled: CancelCheck | None = None) -> list[GenerationOutput]:
        """Decode ``rows`` in chunks of ``batch_size``; a row that ``cancelled`` reports between two steps
        leaves its batch at once with what it has (finish reason "cancelled", no ``on_finish``), and the
        other rows go on as if it had finished."""
        self.validate(rows, sampling, batch_size)
        if top_logprobs is not None and not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise InputError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {top_logprobs}")
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=self.pair.device).manual_seed(sampling.seed)
        # similar lengths share a batch so right-padding wastes little prefill
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].target_prompt))
        outputs: list[GenerationOutput | None] = [None] * len(rows)
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            for index, output in zip(chunk, self._decode_batch([rows[i] for i in chunk], chunk, sampling,
                                                               generator, stop, on_tokens, on_finish,
                                                               on_progress, top_logprobs, cancelled),
                                     strict=True):
                outputs[index] = output
        return [o for o in outputs if o is not None]

    def validate(self, rows: list[DecodeRow], sampling: Sampling, batch_size: int) -> None:
        if batch_size < 1:
            raise InputError(f"batch_size must be >= 1, got {batch_size}")
        if sampling.temperature < 0 or not 0 < sampling.top_p <= 1:
            raise InputError("temperature must be >= 0 and top_p in (0, 1]")
        limit = self.pair.max_context
        vocab = min(len(self.pair.tokenizer), self.target_vocab)
        for i, row in enumerate(rows):
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

    # -- the loop --

    def _decode_batch(self, rows: list[DecodeRow], indices: list[int], sampling: Sampling,
                      generator: torch.Generator | None, stop: list[str] | None, on_tokens: TokenCallback | None,
                      on_finish: FinishCallback | None, on_progress: ProgressCallback | None = None,
                      top_logprobs: int | None = None, cancelled: CancelCheck | None = None,
                      ) -> list[GenerationOutput]:
        """The loop. It reads the device once per target forward (``Step``: accepted counts, next tokens and
        drafts in one transfer) and, when drafting may stop early, once per draft forward; everything else
        it decides from host copies, so a GPU never waits on a per-row or per-length read."""
        pair, device = self.pair, self.pair.device
        t_start = time.perf_counter()
        n = len(rows)
        draft_prompts = [r.draft_prompt or r.target_prompt for r in rows]
        gamma_max = self.gamma
        longest = max(len(r.target_prompt) for r in rows), max(len(p) for p in draft_prompts)
        max_new = max(r.max_new_tokens for r in rows)
        margin = max_new + 2 * gamma_max + 4
        target_cache = RowKVCache(pair.target, n, longest[0] + margin)
        draft_cache: RowKVCache | None = None
        timer = self.controller.timer(device)

        with torch.inference_mode():
            # prefill the target; its last prompt position yields the first new token
            budget = prefill_budget(device)
            report = on_progress or (lambda phase, done, total: None)
            report(TARGET_PREFILL, 0, n)
            last = prefill(pair.target, target_cache, [r.target_prompt for r in rows], budget,
                           on_rows=lambda k: report(TARGET_PREFILL, k, n))
            first_logits = logits_at(pair.target, last, torch.zeros(n, 1, dtype=torch.long, device=device))[:, 0]
            first = self._choose(first_logits, sampling, generator)
            pending_tokens = first.tolist()  # waits for the prefill, so the clock below has timed it
            self.controller.observe_prefill("target", sum(len(r.target_prompt) for r in rows),
                                            time.perf_counter() - t_start)

            # the draft's prefill is skipped when this batch will decode plainly (a sidecar needs it anyway)
            speculate = (on_finish is not None or sampling.seed is not None
                         or self.controller.draft_pays(n, sum(map(len, draft_prompts)), max_new,
                                                       pair.draft_size_ratio))
            if speculate:
                draft_cache = RowKVCache(pair.draft, n, longest[1] + margin)
                report(DRAFT_PREFILL, 0, n)
                draft_tokens = sum(map(len, draft_prompts))
                with timer(lambda seconds: self.controller.observe_prefill("draft", draft_tokens, seconds)):
                    prefill(pair.draft, draft_cache, draft_prompts, budget, [r.draft_hidden for r in rows],
                            on_rows=lambda k: report(DRAFT_PREFILL, k, n))
            prefill_seconds = time.perf_counter() - t_start

            stats = [GenerationStats(prompt_tokens=len(r.target_prompt), target_forwards=1,
                                     drafted_per_position=[0] * gamma_max, accepted_per_position=[0] * gamma_max,
                                     prefill_seconds=prefill_seconds, batch_size=n) for r in rows]
            new_tokens: list[list[int]] = [[] for _ in rows]
            logprobs: list[list[TokenLogprob]] | None = None if top_logprobs is None else [[] for _ in rows]
            # tokens committed to the output that the draft cache does not hold yet (per live row)
            draft_backlog: list[list[int]] = [[] for _ in rows]
            finish: list[str | None] = [None] * n
            # per row: where its text reaches a stop string, decoding only what each step added
            stops = [TokenStops(pair.tokenizer, stop) for _ in rows] if stop else None
            live = list(range(n))  # slot i of the caches holds row live[i]
            # [B] last committed token, not yet in the target cache; pending_tokens is its host copy
            pending = first
            entries = None if top_logprobs is None else token_logprobs(first_logits[:, None], first[:, None],
                                                                         top_logprobs)
            self._append(live, [[t] for t in pending_tokens], new_tokens, rows, finish, stops, indices, on_tokens,
                         entries, logprobs)
            budget_tokens = sum(r.max_new_tokens for r in rows)
            report(DECODE, sum(map(len, new_tokens)), budget_tokens)
            t_decode = time.perf_counter()

            while True:
                if cancelled is not None:
                    for row in live:
                        if finish[row] is None and cancelled(indices[row]):
                            finish[row] = "cancelled"
                done = [slot for slot, row in enumerate(live) if finish[row] is not None]
                if done:
                    for slot in done:
                        row = live[slot]
                        stats[row].decode_seconds = time.perf_counter() - t_decode
                        stats[row].wall_seconds = time.perf_counter() - t_start
                        if on_finish is not None and finish[row] != "cancelled":
                            on_finish(indices[row], self._output(new_tokens[row], finish[row], stats[row],
                                                                 None if logprobs is None else logprobs[row]),
                                      draft_cache, slot)
                    keep = [s for s in range(len(live)) if finish[live[s]] is None]
                    # a finished row's unused limit counts as done, so the phase ends at its total
                    report(DECODE, budget_tokens - sum(rows[r].max_new_tokens - len(new_tokens[r])
                                                       for r in (live[s] for s in keep)), budget_tokens)
                    if not keep:
                        break
                    order = compaction_order(keep)
                    target_cache.select_rows(order)
                    if draft_cache is not None:
                        draft_cache.select_rows(order)
                    pending = pending.index_select(0, to_device(order, device))
                    pending_tokens = [pending_tokens[s] for s in order]
                    live = [live[s] for s in order]

                # gamma shrinks only when every row is near its limit: one row's limit must not cost the others
                remaining = max(rows[r].max_new_tokens - len(new_tokens[r]) for r in live)
                limit = min(gamma_max, max(remaining - 1, 0))
                copied = self._copies(rows, live, new_tokens, limit)
                max_lookup = min(map(len, copied)) if copied else 0
                if sampling.seed is not None:
                    # a seeded run keeps a fixed rule, not timings, so that its random draws are reproducible
                    gamma, source = fixed_step(limit, max_lookup, draft_running=speculate)
                else:
                    gamma, source = self.controller.choose(len(live), limit if speculate else 0, max_lookup)
                if gamma == 0:
                    step = self._plain_step(target_cache, pending, sampling, generator)
                    if speculate:  # the draft did not see the token the target consumed
                        for slot, row in enumerate(live):
                            draft_backlog[row].append(pending_tokens[slot])
                else:
                    step = self._speculative_step(target_cache, draft_cache, live, pending, pending_tokens,
                                                  draft_backlog, gamma, source, copied, sampling, generator)
                pending, pending_tokens = step.next_ids, step.next
                width = step.drafted_ids.shape[1]
                for slot, row in enumerate(live):
                    st = stats[row]
                    st.target_forwards += 1
                    st.drafted += width
                    st.accepted += step.accepted[slot]
                    if source == "lookup":
                        st.lookup_drafted += width
                        st.lookup_accepted += step.accepted[slot]
                    else:
                        st.draft_forwards += width
                    for k in range(width):
                        st.drafted_per_position[k] += 1
                        st.accepted_per_position[k] += int(k < step.accepted[slot])
                appended = [[*step.drafted[s][: step.accepted[s]], step.next[s]] for s in range(len(live))]
                entries = None
                if top_logprobs is not None:
                    # the committed tokens: accepted drafts, then the target's own token at the first rejection
                    chosen = torch.cat([step.drafted_ids, step.next_ids[:, None]], 1).scatter(
                        1, step.accepted_ids[:, None], step.next_ids[:, None])
                    entries = token_logprobs(step.logits, chosen, top_logprobs)
                self._append(live, appended, new_tokens, rows, finish, stops, indices, on_tokens, entries, logprobs)
                report(DECODE, budget_tokens - sum(rows[r].max_new_tokens - len(new_tokens[r]) for r in live),
                       budget_tokens)
        return [self._output(new_tokens[i], finish[i], stats[i], None if logprobs is None else logprobs[i])
                for i in range(n)]

    def _speculative_step(self, target_cache: RowKVCache, draft_cache: RowKVCache | None, live: list[int],
                          pending: torch.Tensor, pending_tokens: list[int], draft_backlog: list[list[int]],
                          gamma: int, source: Source, copied: list[list[int]], sampling: Sampling,
                          generator: torch.Generator | None) -> Step:
        """Draft (or copy) then verify."""
        device = self.pair.device
        timer = self.controller.timer(device)
        if source == "lookup":
            drafted = to_device([c[:gamma] for c in copied], device)
            # a copied token is a draft with all its probability on itself: min(1, p/q) is then p(x)
            draft_probs = None if sampling.greedy else torch.nn.functional.one_hot(
                drafted, self.target_vocab).float()
        else:
            assert draft_cache is not None
            draft_start = draft_cache.lengths.copy()
            feed = [draft_backlog[row] + [pending_tokens[slot]] for slot, row in enumerate(live)]
            drafted, draft_probs = self._draft(draft_cache, feed, gamma, sampling, generator)
            for row in live:
                draft_backlog[row] = []
        width = drafted.shape[1]

        # verify: the target scores pending + the drafts for every row in one forward
        batch = len(live)
        with timer(self.controller.forward_cost("target", batch * (width + 1))):
            verify_ids = torch.cat([pending[:, None], drafted], dim=1)
            hidden = forward(self.pair.target, target_cache, verify_ids)
            index = torch.arange(width + 1, device=device)[None, :].expand(batch, -1)
            target_logits = logits_at(self.pair.target, hidden, index)
            if sampling.greedy:
                accepted, nxt = accept_greedy(drafted, target_logits)
            else:
                target_probs = warp(target_logits, sampling.temperature, sampling.top_p)
                accepted, nxt = accept_sampled(drafted, draft_probs, target_probs, generator)
        step = Step.read(accepted, nxt, drafted, target_logits)
        target_cache.commit([a + 1 for a in step.accepted])

        if source == "draft":
            # roll the draft back to pending + accepted drafts; it never fed its last draft token
            draft_cache.rollback(draft_start + np.array([len(f) for f in feed]) + np.array(step.accepted))
            for slot, row in enumerate(live):
                if step.accepted[slot] == width:
                    draft_backlog[row] = [step.drafted[slot][-1]]
        elif draft_cache is not None:  # the draft saw none of what this step committed but the new token
            for slot, row in enumerate(live):
                draft_backlog[row] += [pending_tokens[slot], *step.drafted[slot][: step.accepted[slot]]]
        self.controller.observe_acceptance(step.accepted, width, source)
        return step

    def _draft(self, draft_cache: RowKVCache, feed: list[list[int]], gamma: int, sampling: Sampling,
               generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Up to ``gamma`` draft tokens per row [B, g], and their draft probabilities when sampling. The
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
                if sampling.greedy:
                    token = logits.argmax(-1)
                else:
                    probs = warp(logits, sampling.temperature, sampling.top_p)
                    draft_probs.append(probs)
                    token = sample(probs, generator)
            draft_tokens.append(token)
            if self.draft_confidence > 0 and step + 1 < gamma:
                if sampling.greedy:  # the argmax's probability, without a softmax over the vocabulary
                    confidence = torch.exp(logits.max(-1).values - torch.logsumexp(logits, -1))
                else:
                    confidence = probs.gather(1, token[:, None])[:, 0]
                if bool((confidence < self.draft_confidence).all()):
                    break
        return torch.stack(draft_tokens, dim=1), torch.stack(draft_probs, 1) if draft_probs else None

    def _copies(self, rows: list[DecodeRow], live: list[int], new_tokens: list[list[int]],
                limit: int) -> list[list[int]]:
        """Each live row's prompt-lookup continuation (up to ``limit`` tokens), or [] unless every row has one:
        a batch verifies one width, and a row without a copy would need the draft model anyway."""
        if not self.prompt_lookup or limit == 0:
            return []
        copied = [lookup_continuation(rows[row].target_prompt + new_tokens[row], limit,
                                      min_ngram=self.lookup_min_ngram) for row in live]
        # every row is looked up, not only up to the first without a copy: draft_pays prices the draft
        # against copying from how often a row has a copy
        self.controller.observe_copies(sum(map(bool, copied)), len(copied))
        return copied if all(copied) else []

    def _plain_step(self, target_cache: RowKVCache, pending: torch.Tensor, sampling: Sampling,
                    generator: torch.Generator | None) -> Step:
        """One target-only step, chosen when speculation would cost more than it saves at this batch; returns
        what ``_speculative_step`` does, with nothing drafted."""
        batch = pending.shape[0]
        device = pending.device
        with self.controller.timer(device)(self.controller.forward_cost("target", batch)):
            hidden = forward(self.pair.target, target_cache, pending[:, None])
            logits = logits_at(self.pair.target, hidden, torch.zeros(batch, 1, dtype=torch.long, device=device))
            nxt = self._choose(logits[:, 0], sampling, generator)
        target_cache.commit(1)
        zeros = torch.zeros(batch, dtype=torch.long, device=device)
        return Step.read(zeros, nxt, torch.zeros(batch, 0, dtype=torch.long, device=device), logits)

    # -- helpers --

    def _align_vocab(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary: rows the draft lacks get probability 0."""
        extra = self.target_vocab - draft_logits.shape[-1]
        if extra > 0:
            return torch.nn.functional.pad(draft_logits, (0, extra), value=float("-inf"))
        return draft_logits[..., : self.target_vocab]

    def _choose(self, logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
        if sampling.greedy:
            return logits.argmax(-1)
        return sample(warp(logits, sampling.temperature, sampling.top_p), generator)

    def _append(self, live: list[int], appended: list[list[int]], new_tokens: list[list[int]],
                rows: list[DecodeRow], finish: list[str | None], stops: list[TokenStops] | None, indices: list[int],
                on_tokens: TokenCallback | None, entries: list[list[TokenLogprob]] | None = None,
                logprobs: list[list[TokenLogprob]] | None = None) -> None:
        """Add each row's committed tokens, cut at EOS, a stop string or the row's length limit; with
        ``entries`` (per slot, aligned with ``appended``) their logprobs go to ``logprobs`` alike."""
        eos = set(self.pair.eos_token_ids)
        for slot, row in enumerate(live):
            have = new_tokens[row]
            limit = rows[row].max_new_tokens
            cut = appended[slot][: limit - len(have)]
            reason = "length" if len(have) + len(cut) >= limit else None
            for k, token in enumerate(cut):
                if token in eos:
                    cut, reason = cut[: k + 1], "eos"
                    break
            if stops is not None and reason != "eos":
                k = stops[row].first(cut)
                if k is not None:
                    cut, reason = cut[: k + 1], "stop"
            have.extend(cut)
            finish[row] = reason
            cut_entries = None
            if entries is not None and logprobs is not None:
                cut_entries = entries[slot][: len(cut)]
                logprobs[row].extend(cut_entries)
            if on_tokens is not None and cut:
                on_tokens(indices[row], cut, cut_entries)

    def _output(self, tokens: list[int], reason: str | None, stats: GenerationStats,
                logprobs: list[TokenLogprob] | None = None) -> GenerationOutput:
        text = self.pair.tokenizer.decode(tokens, skip_special_tokens=True)
        stats.new_tokens = len(tokens)
        return GenerationOutput(list(tokens), text, reason or "length", stats,
                                None if logprobs is None else list(logprobs))
