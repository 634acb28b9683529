"""KV caches kept across batches (``sidecar.runtime.pools``): the next batch of a shape runs on the buffers of the
one before, emptied, so that compiled and captured forwards keep their addresses; nothing of the previous batch
reaches the next one's outputs."""

from __future__ import annotations

import pytest
import torch

from sidecar.decoding.decoder import SpeculativeDecoder
from sidecar.models.tiny import tiny_pair
from sidecar.runtime.capture import forward_module
from sidecar.runtime.pools import MAX_FREE_SHAPES, give_back, pools_of, release_free, take
from tests.decoding import random_prompts


class Buffers:
    """The key buffers each forward of ``model`` writes, by storage address. Each is held, so that a batch on new
    buffers cannot be handed the old ones' addresses by the allocator."""

    def __init__(self, model) -> None:
        self.seen: dict[int, torch.Tensor] = {}
        forward_module(model).register_forward_pre_hook(self.hook)

    def hook(self, module, args) -> None:
        keys = args[3][0]
        self.seen.setdefault(keys.untyped_storage().data_ptr(), keys)

    def run(self, fn) -> tuple[list[torch.Tensor], object]:
        """(the addresses of the buffers ``fn``'s forwards wrote, what it returned)."""
        self.seen = {}
        out = fn()
        return list(self.seen), out


def poison_free_caches(model) -> None:
    """Fill every free cache of ``model`` with what would change any output that read it."""
    with torch.inference_mode():  # the engine's caches are made in it
        for cache in pools_of(model).free.values():
            for t in (*cache.keys, *cache.values):
                t.normal_(0, 1e3)
            cache.visible.fill_(False)
            cache.span.fill_(7)
            cache.lengths[:] = 5
            cache.position_offset[:] = 9


def test_consecutive_batches_share_their_kv_buffers_and_never_see_the_last_ones():
    pair = tiny_pair(layers=1)
    decoder = SpeculativeDecoder(pair, gamma=2, adaptive=False, capture="eager")
    target = Buffers(pair.target)
    short = random_prompts(pair, [5, 9, 7], seed=1)
    first, outputs = target.run(lambda: decoder.generate(short, max_new_tokens=6, batch_size=2))
    assert len(first) == 1
    again, outputs_again = target.run(lambda: decoder.generate(short, max_new_tokens=6, batch_size=2))
    assert again == first, "the second batch allocated anew"
    assert [o.token_ids for o in outputs_again] == [o.token_ids for o in outputs]

    # a batch needing more columns gets its own cache; the first shape's stays free for the next batch of it
    longer, _ = target.run(lambda: decoder.generate(random_prompts(pair, [90], seed=2), max_new_tokens=6))
    assert first[0] not in longer

    # other prompts on a reused cache whose every number was spoiled decode as on new buffers
    others = random_prompts(pair, [11, 4, 6], seed=3)
    poison_free_caches(pair.target)
    poison_free_caches(pair.draft)
    reused, outputs = target.run(lambda: decoder.generate(others, max_new_tokens=8, batch_size=2))
    assert reused == first
    release_free()
    fresh, reference = target.run(lambda: decoder.generate(others, max_new_tokens=8, batch_size=2))
    assert first[0] not in fresh
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    assert not list(pools_of(pair.target).lent) and not list(pools_of(pair.draft).lent), "a batch kept its cache"


def test_a_lent_cache_is_never_lent_twice():
    pair = tiny_pair(layers=1)
    a = take(pair.target, 2, 64)
    b = take(pair.target, 2, 64)
    assert a is not b
    give_back(pair.target, a)
    with pytest.raises(RuntimeError, match="given back twice"):
        give_back(pair.target, a)
    assert take(pair.target, 2, 64) is a
    give_back(pair.target, b)  # a second free cache of a shape is not kept
    give_back(pair.target, a)
    assert list(pools_of(pair.target).free.values()) == [b]
    assert release_free(pair.target) == b.nbytes() and not pools_of(pair.target).free


def test_free_caches_are_bounded_and_kept_apart_by_inference_mode():
    pair = tiny_pair(layers=1)
    model = pair.target
    caches = [take(model, 1, 64 * (k + 1)) for k in range(MAX_FREE_SHAPES + 1)]
    for cache in caches:
        give_back(model, cache)
    assert list(pools_of(model).free.values()) == caches[1:], "the least recently given back goes first"
    with torch.inference_mode():
        made_in_inference = take(model, 1, 128)
    assert made_in_inference is not caches[1] and made_in_inference.keys[0].is_inference()
    assert take(model, 1, 128) is caches[1]  # outside inference mode: the cache whose tensors it may write
