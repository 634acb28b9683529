"""What a task's output tokens are called in the report and the demo."""

from __future__ import annotations

import pytest

from vocab.task_nouns import token_noun, tokens_noun


@pytest.mark.parametrize(("task", "noun"), [
    ("hashtags", "tag"), ("headline", "headline"), ("topic", "topic"), ("entities", "entity"),
    ("key_points", "key point"), ("Named-Entities", "named entity"), ("status", "status"), ("analysis", "analysis"),
])
def test_a_tasks_tokens_are_named_after_it(task: str, noun: str) -> None:
    assert token_noun(task) == noun


def test_several_tasks_tokens_together_are_output_tokens_and_none_are_tag_tokens() -> None:
    assert tokens_noun(["headline"]) == "headline"
    assert tokens_noun(["hashtags", "headline"]) == "output"
    assert tokens_noun([]) == "tag"
