"""One-row eager forwards run at the cheapest width that holds them, where narrower products are slower
(sidecar/runtime/padding.py): a padded forward computes what the unpadded one does, writes its padding only to
the trash column, and decoding through padded forwards is the target's greedy output; the widths are measured
for reduced precision on a CPU only, once per shape."""

from __future__ import annotations

import pytest
import torch
from decoding import random_prompts, target_alone

from sidecar import SpeculativeDecoder
from sidecar.models.tiny import tiny_pair
from sidecar.runtime import padding
from sidecar.runtime.capture import attach
from sidecar.runtime.forward import forward, prefill
from sidecar.runtime.kv_cache import RowKVCache
from sidecar.runtime.padding import PaddedWidths


@pytest.mark.parametrize(("width", "padded"), [(1, 2), (1, 5), (2, 4)])
def test_a_padded_forward_computes_the_unpadded_one_and_writes_padding_to_the_trash_column(tiny, width,
                                                                                          padded) -> None:
    model = tiny.target
    runner = attach(model, "eager")
    prompt = random_prompts(tiny, [9], seed=4)[0]
    tokens = torch.tensor([random_prompts(tiny, [width], seed=5)[0]])
    results = []
    try:
        for widths in (PaddedWidths(), PaddedWidths((padded,) * width)):
            runner.pad_to = widths
            cache = RowKVCache(model, 1, 16)
            prefill(model, cache, [prompt], None)
            with torch.inference_mode():
                hidden = forward(model, cache, tokens)
            results.append((hidden, [k.clone() for k in cache.keys], cache.visible.clone(), cache.span.clone()))
    finally:
        runner.pad_to = PaddedWidths()
    (plain, keys, visible, span), (wide, wide_keys, wide_visible, wide_span) = results
    assert wide.shape == plain.shape == (1, width, model.config.hidden_size)
    torch.testing.assert_close(wide, plain)
    real = len(prompt) + width  # the prompt and the new tokens; the trash column is the last
    for key, wide_key in zip(keys, wide_keys, strict=True):
        torch.testing.assert_close(wide_key[:, :, :real], key[:, :, :real])
        assert not torch.equal(wide_key[:, :, -1], key[:, :, -1])  # the padding columns went to the trash
        assert torch.equal(wide_key[:, :, real:-1], key[:, :, real:-1])
    assert torch.equal(wide_visible[:, :-1], visible[:, :-1]) and torch.equal(wide_span[:, :-1], span[:, :-1])


def test_decoding_through_padded_forwards_is_the_targets_greedy_output(tiny) -> None:
    runners = [attach(model, "eager") for model in (tiny.target, tiny.draft)]
    try:
        for runner in runners:
            runner.pad_to = PaddedWidths((4, 4, 4, 4, 6, 6))
        decoder = SpeculativeDecoder(tiny, gamma=3, adaptive=False, prompt_lookup=False)
        for prompt in random_prompts(tiny, [5, 11], seed=7):
            out = decoder.generate([prompt], max_new_tokens=12)[0]
            assert out.token_ids == target_alone(tiny, prompt, 12)
        assert out.stats.draft_forwards > 0
    finally:
        for runner in runners:
            runner.pad_to = PaddedWidths()


def test_the_controller_times_and_prices_a_one_row_forward_at_the_width_it_runs_at(tiny) -> None:
    runners = [attach(model, "eager") for model in (tiny.target, tiny.draft)]
    try:
        decoder = SpeculativeDecoder(tiny, gamma=3, adaptive=True)
        for runner in runners:  # set after the decoder is made: the controller reads the runners' widths per call
            runner.pad_to = PaddedWidths((5, 5, 5, 5, 5, 6))
        controller = decoder.controller
        assert [controller.runs_at("target", 1, w) for w in (1, 4, 6, 7)] == [5, 5, 6, 7]
        assert controller.runs_at("draft", 2, 2) == 2  # several rows never pad
        for prompt in random_prompts(tiny, [5, 11], seed=7):
            out = decoder.generate([prompt], max_new_tokens=12)[0]
            assert out.token_ids == target_alone(tiny, prompt, 12)
        assert controller.costs["target"].means and min(controller.costs["target"].means) >= 5
        assert min(controller.costs["draft"].means) >= 5
    finally:
        for runner in runners:
            runner.pad_to = PaddedWidths()


def test_each_width_pads_to_the_cheapest_wider_one_only_where_it_is_measured_faster() -> None:
    # ms of products of 1-8 rows, as the packed bf16 target's forwards of 1-8 columns were on an AMD EPYC
    widths = PaddedWidths.choose([169, 181, 153, 141, 144, 147, 173, 178])
    assert [widths.of(w) for w in range(1, 10)] == [4, 4, 4, 4, 5, 6, 7, 8, 9]
    # within the margin a width stays as it is
    assert PaddedWidths.choose([100, 100 * (1 - padding.PADDING_MARGIN / 2)]).widths == (1, 2)
    assert PaddedWidths().of(1) == 1


def test_widths_are_timed_for_reduced_precision_on_a_cpu_only_and_once_per_shape() -> None:
    calls: list[int] = []

    def forward(width: int):
        return lambda: calls.append(width)

    cpu = torch.device("cpu")
    assert padding.padded_widths(cpu, torch.float32, "fp32", forward).widths == ()  # fp32: never timed
    assert padding.padded_widths(torch.device("meta"), torch.bfloat16, "meta", forward).widths == ()
    assert not calls
    key = ("a shape", object())  # a key no other test times
    first = padding.padded_widths(cpu, torch.bfloat16, key, forward)
    # every width, once untimed and then ROUNDS times, in turn
    assert calls == list(range(1, padding.MAX_WIDTH + 1)) * (padding.ROUNDS + 1)
    assert padding.padded_widths(cpu, torch.bfloat16, key, forward).widths == first.widths
    assert len(calls) == padding.MAX_WIDTH * (padding.ROUNDS + 1)  # the second asked the first's timings
    assert len(first.widths) == padding.MAX_WIDTH and all(w <= first.widths[w - 1] for w in range(1, 9))


def test_an_eager_runner_times_its_own_one_row_forwards_for_its_widths() -> None:
    pair = tiny_pair(dtype=torch.bfloat16)
    timed = len(padding._TIMED)
    runner = attach(pair.target, "eager")
    widths = runner.pad_to.widths
    assert len(widths) == padding.MAX_WIDTH and all(w <= widths[w - 1] for w in range(1, 9))
    assert len(padding._TIMED) <= timed + 1  # one timing per shape: the draft has the target's
    attach(pair.draft, "eager")
    assert len(padding._TIMED) <= timed + 1
    # a forward timed for them computes what a decode forward does, over a scratch cache
    forward_of = runner._one_row_forwards(pair.target)
    assert forward_of(3)().shape == (1, 3, pair.target.config.hidden_size)
