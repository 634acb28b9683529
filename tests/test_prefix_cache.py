"""Prompt scoring over a prefix cache (``sidecar.decoding.prefix_cache``): a prompt sharing its leading tokens
with one scored before forwards only its new tokens, and scores as a whole forward does, on the tiny pair."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from sidecar.decoding.prefix_cache import PrefixCache
from sidecar.decoding.scoring import PromptLogprob, prompt_logprobs

SUMMARY = ("Rate these tags for the summary. Summary: The city council approved a new budget on Tuesday after a "
           "long debate about schools and roads. Tags:")
TAGS = [" #budget #city", " #schools #vote #council", " #weather"]


class Forwarded:
    """The tokens ``model``'s forwards embed, counted by a hook on its input embeddings."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.tokens = 0
        self.handle = model.get_input_embeddings().register_forward_hook(self._count)

    def _count(self, module, args, output) -> None:
        self.tokens += args[0].numel()


@pytest.fixture
def forwarded(tiny) -> Iterator[Forwarded]:
    counter = Forwarded(tiny.target)
    yield counter
    counter.handle.remove()


def ids(tiny, text: str) -> list[int]:
    return tiny.tokenizer.encode(text, add_special_tokens=False)


def assert_close(got: list[PromptLogprob], want: list[PromptLogprob]) -> None:
    """Equal to float rounding: logprobs within 1e-4, token, rank and top ids the same."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g.token_id, g.rank, [t for t, _ in g.top]) == (w.token_id, w.rank, [t for t, _ in w.top])
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert [lp for _, lp in g.top] == pytest.approx([lp for _, lp in w.top], abs=1e-4)


def test_a_prompt_sharing_a_prefix_forwards_only_its_new_tokens(tiny, forwarded: Forwarded) -> None:
    first, second = (ids(tiny, SUMMARY + tags) for tags in TAGS[:2])
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert shared >= 20
    cache = PrefixCache()
    prompt_logprobs(tiny.target, first, 2, cache)
    assert forwarded.tokens == len(first)
    scored = prompt_logprobs(tiny.target, second, 2, cache)
    # the last shared token runs again: its logits score the first new one
    assert forwarded.tokens - len(first) == len(second) - shared + 1
    assert (cache.hits, cache.misses, cache.reused_tokens) == (1, 1, shared - 1)
    assert_close(scored, prompt_logprobs(tiny.target, second, 2))


def test_a_prompt_scored_again_or_inside_a_cached_one_forwards_nothing(tiny, forwarded: Forwarded) -> None:
    prompt = ids(tiny, SUMMARY + TAGS[1])
    cache = PrefixCache()
    stored = prompt_logprobs(tiny.target, prompt, 3, cache)
    before = forwarded.tokens
    assert prompt_logprobs(tiny.target, prompt, 3, cache) == stored  # exactly: the server answers alike twice
    inside = prompt_logprobs(tiny.target, prompt[:-4], 1, cache)
    assert forwarded.tokens == before
    assert inside == [PromptLogprob(e.token_id, e.logprob, e.rank, e.top[:1]) for e in stored[:-4]]
    assert_close(inside, prompt_logprobs(tiny.target, prompt[:-4], 1))


def test_a_prompt_sharing_too_little_runs_whole(tiny, forwarded: Forwarded) -> None:
    first = ids(tiny, SUMMARY + TAGS[0])
    other = first[:10] + ids(tiny, " and then something else entirely happened in the town")
    cache = PrefixCache(min_prefix=16)
    prompt_logprobs(tiny.target, first, 0, cache)
    before = forwarded.tokens
    scored = prompt_logprobs(tiny.target, other, 0, cache)
    assert forwarded.tokens - before == len(other) and (cache.hits, cache.misses) == (0, 2)
    assert scored == prompt_logprobs(tiny.target, other, 0)


def test_more_alternatives_than_cached_are_computed_fewer_are_cut(tiny, forwarded: Forwarded) -> None:
    prompts = [ids(tiny, SUMMARY + tags) for tags in TAGS]
    cache = PrefixCache()
    prompt_logprobs(tiny.target, prompts[0], 0, cache)
    before = forwarded.tokens
    wider = prompt_logprobs(tiny.target, prompts[1], 3, cache)  # the cached entries have no alternatives
    assert forwarded.tokens - before == len(prompts[1]) and all(len(e.top) == 3 for e in wider)
    assert_close(wider, prompt_logprobs(tiny.target, prompts[1], 3))
    before = forwarded.tokens
    narrower = prompt_logprobs(tiny.target, prompts[2], 1, cache)  # from the entries with 3
    assert forwarded.tokens - before < len(prompts[2])
    assert_close(narrower, prompt_logprobs(tiny.target, prompts[2], 1))


def test_the_cache_keeps_its_bounds_least_recent_out_first(tiny, forwarded: Forwarded) -> None:
    prompts = [ids(tiny, f"Story {n}: " + SUMMARY) for n in range(3)]  # no two share 16 tokens
    cache = PrefixCache(max_entries=2)
    for prompt in prompts:
        prompt_logprobs(tiny.target, prompt, 0, cache)
    assert len(cache) == 2
    before = forwarded.tokens
    prompt_logprobs(tiny.target, prompts[2], 0, cache)  # kept
    assert forwarded.tokens == before
    prompt_logprobs(tiny.target, prompts[0], 0, cache)  # dropped: runs whole
    assert forwarded.tokens - before == len(prompts[0])
    one = PrefixCache(max_bytes=cache.bytes // 4)  # less than one entry's keys and values (two are held)
    prompt_logprobs(tiny.target, prompts[0], 0, one)
    assert len(one) == 0 and one.bytes == 0


def test_a_prompt_extending_a_cached_one_replaces_it(tiny) -> None:
    prompt = ids(tiny, SUMMARY + TAGS[1])
    cache = PrefixCache()
    prompt_logprobs(tiny.target, prompt[:-5], 0, cache)
    prompt_logprobs(tiny.target, prompt, 0, cache)
    assert len(cache) == 1


def test_cached_keys_and_values_are_never_written(tiny) -> None:
    first, second = (ids(tiny, SUMMARY + tags) for tags in TAGS[:2])
    cache = PrefixCache()
    prompt_logprobs(tiny.target, first, 0, cache)
    [entry] = cache._entries.values()
    copies = [(k.clone(), v.clone()) for k, v in entry.keys_values]
    prompt_logprobs(tiny.target, second, 0, cache)
    assert all(torch.equal(k, ck) and torch.equal(v, cv)
               for (k, v), (ck, cv) in zip(entry.keys_values, copies, strict=True))


def test_another_model_clears_the_cache(tiny) -> None:
    prompt = ids(tiny, SUMMARY + TAGS[0])
    cache = PrefixCache()
    prompt_logprobs(tiny.target, prompt, 0, cache)
    drafted = prompt_logprobs(tiny.draft, prompt, 0, cache)  # not the target's entries
    assert len(cache) == 1 and cache.hits == 0
    assert drafted == prompt_logprobs(tiny.draft, prompt, 0)


@pytest.mark.parametrize(("bounds", "field"), [({"max_bytes": 0}, "max_bytes"), ({"max_entries": 0}, "max_entries"),
                                               ({"min_prefix": 1}, "min_prefix"), ({"max_tokens": 8}, "max_tokens")])
def test_bounds_that_could_cache_nothing_are_refused_naming_the_field(bounds: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        PrefixCache(**bounds)
