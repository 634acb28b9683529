"""Prompt scoring over a prefix cache (``sidecar.decoding.prefix_cache``): a prompt sharing its leading tokens
with one scored before forwards only its new tokens, and scores as a whole forward does, on the tiny pair."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from sidecar.decoding.prefix_cache import PrefixCache
from sidecar.decoding.scoring import PromptLogprob, prompt_logprobs
from sidecar.models.tiny import tiny_pair
from study.judge.config import JudgeConfig

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


# scorer prompts as the judge's: one summary, then each of several tag sets (``study.judge.likelihood``)
SUMMARIES = [SUMMARY.removeprefix("Rate these tags for the summary. Summary: ").removesuffix(" Tags:"),
             "Officials said the plan would add jobs at the plant in the north of the state.",
             "Prices rose 3.5 percent in 2017 while 1,200 workers lost their jobs at the factory."]
MORE_TAGS = [*TAGS, " #news #politics #economy", " #health #climate", " #sports #technology #jobs"]
# bounds on the tiny pair in bf16 (measured 2026-12-06 on a 2-core Xeon, both models, these 18 prompts each:
# every logprob within 0.059, a tag set's mean within 0.0096 nats per token, 25 of 1,650 ranks moved, each
# where bf16 logits tie or nearly do): a tag set's mean within a quarter of the judge's least likelihood
# margin, so two tag sets' difference stays within half of it
BF16_LOGPROB = 0.1
BF16_TAG_MEAN = JudgeConfig.model_fields["likelihood_floor"].default / 4


def test_in_bf16_a_cached_prefix_scores_within_what_the_judge_tells_apart(tiny) -> None:
    """bf16 rounds the cached and the whole forward differently (other matmul shapes), far more than fp32;
    the difference stays inside ``BF16_LOGPROB`` per token and ``BF16_TAG_MEAN`` over a tag set, below what
    bf16 itself moves a tag set's mean from fp32, and a rank changes only where the whole forward's logprobs
    of the token and another lie within ``BF16_LOGPROB``."""
    pair = tiny_pair(dtype=torch.bfloat16)  # ``tiny``'s weights, rounded to bf16
    worst = worst_mean = bf16_worst = bf16_mean = 0.0
    moved = scored = 0
    for model, fp32 in ((pair.target, tiny.target), (pair.draft, tiny.draft)):
        for summary in SUMMARIES:
            prefix = f"Rate these tags for the summary. Summary: {summary} Tags:"
            start = len(ids(tiny, prefix)) - 1  # the first tag token's entry
            cache = PrefixCache()
            for tags in MORE_TAGS:
                prompt = ids(tiny, prefix + tags)
                entries = prompt_logprobs(model, prompt, 0, cache)
                with torch.inference_mode():
                    whole, exact = (torch.log_softmax(m(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
                                    for m in (model, fp32))
                following = torch.tensor(prompt[1:])[:, None]
                got, want, want_fp32 = (torch.tensor([e.logprob for e in entries]), whole.gather(-1, following)[:, 0],
                                        exact.gather(-1, following)[:, 0])
                worst = max(worst, (got - want).abs().max().item())
                worst_mean = max(worst_mean, (got[start:] - want[start:]).mean().abs().item())
                bf16_worst = max(bf16_worst, (want - want_fp32).abs().max().item())
                bf16_mean = max(bf16_mean, (want[start:] - want_fp32[start:]).mean().abs().item())
                for i, entry in enumerate(entries):
                    rank = int((whole[i] > want[i]).sum()) + 1
                    if entry.rank != rank:
                        moved += 1
                        others = torch.cat([whole[i, : prompt[i + 1]], whole[i, prompt[i + 1] + 1 :]])
                        assert (others - want[i]).abs().min() <= BF16_LOGPROB, (i, entry.rank, rank)
                scored += len(entries)
            assert cache.hits == len(MORE_TAGS) - 1  # the cache was used
    assert worst <= BF16_LOGPROB and worst_mean <= BF16_TAG_MEAN, (worst, worst_mean)
    assert 1e-4 < worst_mean < bf16_mean  # bf16 did round differently, and by less than bf16 itself
    print(f"bf16, cached against whole: max |logprob difference| {worst:.3g}, max |tag-set mean difference| "
          f"{worst_mean:.3g}, {moved} of {scored} ranks moved; bf16 against fp32, whole forwards: {bf16_worst:.3g} "
          f"and {bf16_mean:.3g}")
