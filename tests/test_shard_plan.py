"""Shard planning: balanced by tokens, every document once, the same plan for the same input."""

from __future__ import annotations

import random

import pytest

from pipeline import plan_shards, token_counts
from storage import Document


def docs_of(n: int) -> list[Document]:
    return [Document(f"d{i:03d}", "x" * (i + 1), i) for i in range(n)]


def test_largest_first_onto_the_lightest_shard() -> None:
    docs = docs_of(6)
    shards = plan_shards(docs, 2, [10, 9, 8, 7, 6, 5])
    # 10 -> 0, 9 -> 1, 8 -> 1 (9 < 10), 7 -> 0 (10 < 17), 6 -> 0 (17 = 17: the lower index), 5 -> 1
    assert [[d.doc_id for d in s.docs] for s in shards] == [["d000", "d003", "d004"], ["d001", "d002", "d005"]]
    assert [s.tokens for s in shards] == [23, 22]
    assert [s.index for s in shards] == [0, 1]


def test_every_document_lands_once_and_keeps_its_input_order_within_its_shard() -> None:
    docs = docs_of(200)
    tokens = [random.Random(i).randint(1, 5000) for i in range(len(docs))]
    shards = plan_shards(docs, 7, tokens)
    placed = [d.doc_id for s in shards for d in s.docs]
    assert sorted(placed) == [d.doc_id for d in docs]
    for shard in shards:
        assert [d.row_index for d in shard.docs] == sorted(d.row_index for d in shard.docs)
    loads = [s.tokens for s in shards]
    assert sum(loads) == sum(tokens)
    # the greedy bound: the heaviest shard exceeds the lightest by at most the largest document
    assert max(loads) - min(loads) <= max(tokens)


def test_the_same_input_gives_the_same_plan_and_ties_keep_input_order() -> None:
    docs = docs_of(9)
    equal = [5] * 9
    first = plan_shards(docs, 3, equal)
    assert first == plan_shards(list(docs), 3, list(equal))
    # equal tokens: round robin in input order
    assert [[d.row_index for d in s.docs] for s in first] == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]


def test_fewer_documents_than_shards_gives_no_empty_shard() -> None:
    shards = plan_shards(docs_of(2), 5, [3, 4])
    assert [(s.index, [d.doc_id for d in s.docs]) for s in shards] == [(0, ["d001"]), (1, ["d000"])]
    assert plan_shards([], 3, []) == []


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one shard"):
        plan_shards(docs_of(1), 0, [1])
    with pytest.raises(ValueError, match="token counts"):
        plan_shards(docs_of(2), 2, [1])


def test_token_counts_come_from_the_tokenizer(tiny) -> None:
    docs = [Document("a", "The city council approved a new budget.", 0), Document("b", "Prices rose.", 1)]
    counts = token_counts(tiny.tokenizer, docs)
    assert counts == [len(tiny.tokenizer(d.text, add_special_tokens=False).input_ids) for d in docs]
    assert counts[0] > counts[1] > 0
