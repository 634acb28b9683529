"""Cutting a run's documents into shards balanced by tokens, the same way for the same input.

Invariant: every document lands in exactly one shard; the cut depends only on the documents' order and
token counts, so a plan is reproducible. Documents go largest first onto the shard with the fewest tokens so
far (ties: the lower index), which keeps the heaviest shard within one document of the mean (the longest
processing time rule); within a shard the documents keep their input order, so its windows form as they
would in one process.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from storage import Document

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Shard:
    """Shard ``index``: its documents in input order and their tokens in all."""

    index: int
    docs: list[Document]
    tokens: int


def token_counts(tokenizer: PreTrainedTokenizerBase, docs: Sequence[Document]) -> list[int]:
    """Each document's text in tokens (no prompt around it: the prompt adds the same to every document)."""
    if not docs:
        return []
    return [len(ids) for ids in tokenizer([d.text for d in docs], add_special_tokens=False)["input_ids"]]


def plan_shards(docs: Sequence[Document], n: int, tokens: Sequence[int]) -> list[Shard]:
    """Cut ``docs`` (with ``tokens[i]`` tokens for ``docs[i]``) into at most ``n`` non-empty shards
    balanced by tokens; shards are numbered 0.. in the order they received their first document."""
    if n < 1:
        raise ValueError(f"a run needs at least one shard, got {n}")
    if len(tokens) != len(docs):
        raise ValueError(f"{len(docs)} documents but {len(tokens)} token counts")
    # (tokens so far, shard index): the lightest shard first, the lower index among equals
    heap = [(0, index) for index in range(min(n, len(docs)))]
    members: list[list[int]] = [[] for _ in heap]
    for position in sorted(range(len(docs)), key=lambda i: (-tokens[i], i)):
        load, index = heapq.heappop(heap)
        members[index].append(position)
        heapq.heappush(heap, (load + tokens[position], index))
    return [Shard(index, [docs[i] for i in sorted(positions)], sum(tokens[i] for i in positions))
            for index, positions in enumerate(members)]
