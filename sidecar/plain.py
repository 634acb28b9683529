"""Plain batched decoding of one model over a ``RowKVCache``: the sidecar phase and standalone tagging.

Each row first feeds its own list of tokens (a whole prompt for a fresh cache, or the tokens a
sidecar row's cache still lacks plus the task's bridge text), then decodes one token per step until
end-of-turn or its token limit. Rows leave the batch as they finish. With ``top_logprobs`` each result
also carries the model's log-probability of each token it emitted (``sidecar.logprobs``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from sidecar.acceptance import sample, warp
from sidecar.kv_cache import RowKVCache, compaction_order
from sidecar.logprobs import TokenLogprob, token_logprobs
from sidecar.speculative import Sampling, forward, logits_at, prefill, prefill_budget
from sidecar.transfers import to_device


@dataclass
class PlainResult:
    token_ids: list[int]
    finish_reason: str  # "eos" | "length"
    feed_seconds: float  # the first forward: prefill or catch-up, shared by the batch
    decode_seconds: float
    kv_bytes: int  # KV bytes the row held when it finished: what its last step read
    logprobs: list[TokenLogprob] | None = None  # one per token id when asked for


def decode_plain(model: PreTrainedModel, cache: RowKVCache, feeds: list[list[int]], limits: list[int],
                 sampling: Sampling, generator: torch.Generator | None, eos: set[int],
                 top_logprobs: int | None = None) -> list[PlainResult]:
    device = cache.device
    start = time.perf_counter()
    results: list[PlainResult | None] = [None] * len(feeds)
    tokens: list[list[int]] = [[] for _ in feeds]
    logprobs: list[list[TokenLogprob]] | None = None if top_logprobs is None else [[] for _ in feeds]
    live = list(range(len(feeds)))
    with torch.inference_mode():
        last = prefill(model, cache, feeds, prefill_budget(device))
        logits = logits_at(model, last, torch.zeros(len(feeds), 1, dtype=torch.long, device=device))[:, 0]
        feed_seconds = None
        while True:
            choice = logits.argmax(-1) if sampling.greedy else sample(
                warp(logits, sampling.temperature, sampling.top_p), generator)
            chosen = choice.tolist()  # the one read of the device per forward
            if feed_seconds is None:  # the read waited for the feed
                feed_seconds = time.perf_counter() - start
            if logprobs is not None and top_logprobs is not None:
                entries = token_logprobs(logits[:, None], choice[:, None], top_logprobs)
                for slot, row in enumerate(live):
                    logprobs[row].append(entries[slot][0])
            keep = []
            for slot, (row, token) in enumerate(zip(live, chosen, strict=True)):
                tokens[row].append(token)
                reason = "eos" if token in eos else "length" if len(tokens[row]) >= limits[row] else None
                if reason is None:
                    keep.append(slot)
                else:
                    results[row] = PlainResult(tokens[row], reason, feed_seconds,
                                               time.perf_counter() - start - feed_seconds,
                                               int(cache.row_bytes()[slot]),
                                               None if logprobs is None else logprobs[row])
            if not keep:
                break
            if len(keep) < len(live):
                order = compaction_order(keep)
                cache.select_rows(order)
                choice = choice.index_select(0, to_device(order, device))
                live = [live[s] for s in order]
            hidden = forward(model, cache, choice[:, None])
            cache.commit(1)
            logits = logits_at(model, hidden, torch.zeros(len(live), 1, dtype=torch.long, device=device))[:, 0]
    return [r for r in results if r is not None]
