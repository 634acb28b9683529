"""One-token forwards padded to two columns where one-row products are slower (sidecar/runtime/padding.py): the
padded forward computes what the unpadded one does, writes its padding only to the trash column, and decoding
through it is the target's greedy output; the choice is measured for reduced precision on a CPU only."""

from __future__ import annotations

import torch
from decoding import random_prompts, target_alone

from sidecar import SpeculativeDecoder
from sidecar.runtime import padding
from sidecar.runtime.capture import attach
from sidecar.runtime.forward import forward, prefill
from sidecar.runtime.kv_cache import RowKVCache


def test_a_padded_one_token_forward_computes_the_unpadded_one_and_writes_padding_to_the_trash_column(tiny) -> None:
    model = tiny.target
    runner = attach(model, "eager")
    prompt = random_prompts(tiny, [9], seed=4)[0]
    token = torch.tensor([[prompt[-1]]])
    results = []
    try:
        for pad in (False, True):
            runner.pad_one_token = pad
            cache = RowKVCache(model, 1, 16)
            prefill(model, cache, [prompt], None)
            with torch.inference_mode():
                hidden = forward(model, cache, token)
            results.append((hidden, [k.clone() for k in cache.keys], cache.visible.clone(), cache.span.clone()))
    finally:
        runner.pad_one_token = False
    (plain, keys, visible, span), (padded, padded_keys, padded_visible, padded_span) = results
    assert padded.shape == plain.shape == (1, 1, model.config.hidden_size)
    torch.testing.assert_close(padded, plain)
    real = len(prompt) + 1  # the prompt and the new token; the trash column is the last
    for key, padded_key in zip(keys, padded_keys, strict=True):
        torch.testing.assert_close(padded_key[:, :, :real], key[:, :, :real])
        assert not torch.equal(padded_key[:, :, -1], key[:, :, -1])  # the padding column went to the trash
        assert torch.equal(padded_key[:, :, real:-1], key[:, :, real:-1])
    assert torch.equal(padded_visible[:, :-1], visible[:, :-1]) and torch.equal(padded_span[:, :-1], span[:, :-1])


def test_decoding_through_padded_forwards_is_the_targets_greedy_output(tiny) -> None:
    runners = [attach(model, "eager") for model in (tiny.target, tiny.draft)]
    try:
        for runner in runners:
            runner.pad_one_token = True
        decoder = SpeculativeDecoder(tiny, gamma=3, adaptive=False, prompt_lookup=False)
        for prompt in random_prompts(tiny, [5, 11], seed=7):
            out = decoder.generate([prompt], max_new_tokens=12)[0]
            assert out.token_ids == target_alone(tiny, prompt, 12)
        assert out.stats.draft_forwards > 0
    finally:
        for runner in runners:
            runner.pad_one_token = False


def test_padding_is_timed_for_reduced_precision_on_a_cpu_only_and_once_per_shape() -> None:
    assert padding.one_row_padding_pays(torch.zeros(64, 32)) is False  # fp32: never timed
    before = padding._padding_pays.cache_info()
    first = padding.one_row_padding_pays(torch.zeros(96, 48, dtype=torch.bfloat16))
    assert padding.one_row_padding_pays(torch.zeros(96, 48, dtype=torch.bfloat16)) is first
    after = padding._padding_pays.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)
