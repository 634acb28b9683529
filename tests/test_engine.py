"""The speculative engine on the tiny random pair: losslessness, masks, rollback, bad input."""

from __future__ import annotations

import random
import types

import numpy as np
import pytest
import torch
from decoding import assert_speculated, random_prompts, second_token_distances, target_alone
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from sidecar import InputError, PairError, SpeculativeDecoder
from sidecar.decoding.acceptance import accept_greedy, accept_sampled
from sidecar.decoding.batch import stream_through
from sidecar.decoding.rows import DecodeRow
from sidecar.models.attention import GROUPED_SDPA, grouped_sdpa_forward
from sidecar.models.pair import check_tokenizers
from sidecar.models.tiny import tiny_pair, tiny_tokenizer
from sidecar.runtime.capture import forward_module
from sidecar.runtime.forward import forward, logits_at, prefill, shared_prefix_length
from sidecar.runtime.kv_cache import RowKVCache, compaction_order
from sidecar.runtime.prefill_plan import PrefillPlanner
from study.analysis import predicted_target_forwards


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_is_token_identical_to_target_alone(tiny, batch_size, adaptive, prefill_forwards):
    prompts = random_prompts(tiny, [5, 17, 9, 30, 12, 3, 25, 8, 40, 2, 14], seed=batch_size)
    decoder = SpeculativeDecoder(tiny, gamma=4, adaptive=adaptive)
    outputs = decoder.generate(prompts, max_new_tokens=40, batch_size=batch_size)
    # adaptive may rightly settle on prompt lookup alone (tiny drafts cost as much as targets, lookup nothing),
    # whose drafts from random prompts are accepted by chance: at batch 1 it drafted 77-80 tokens, one of them
    # by the draft model, and 0-2 were accepted from run to run. It drafts, so it did not fall back to plain.
    assert_speculated(outputs, accepts=not adaptive)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == target_alone(tiny, prompt, 40)
        assert out.finish_reason in {"eos", "length"}


@pytest.mark.parametrize("adaptive", [False, True])
def test_gamma_zero_decodes_plainly_and_never_prefills_the_draft(tiny, adaptive, prefill_forwards):
    """gamma 0: plain decoding through the engine (rows joining and leaving a batch of 3), one target forward per
    token, equal to the target alone; without a sidecar the draft model is never prefilled nor run."""
    prompts = random_prompts(tiny, [5, 17, 9, 30, 12], seed=3)
    decoder = SpeculativeDecoder(tiny, gamma=0, adaptive=adaptive)
    batch = decoder.batch(3)
    outputs = dict(stream_through(batch, [DecodeRow(p, 20) for p in prompts], range(len(prompts))))
    for i, prompt in enumerate(prompts):
        assert outputs[i].token_ids == target_alone(tiny, prompt, 20)
        assert (outputs[i].stats.target_forwards, outputs[i].stats.drafted, outputs[i].stats.draft_forwards) == (
            20, 0, 0)
    assert batch.draft_pool is None, "the draft was prefilled"
    assert set(decoder.controller.decisions) == {(0, "draft")}


def test_gamma_zero_sidecars_decode_as_with_speculation(tiny):
    """gamma 0 with sidecar tasks: the main output decodes plainly, and the draft, prefilled for the sidecars,
    catches up on the whole output once it is final; main and sidecar outputs equal those of gamma 4."""
    from sidecar import HASHTAGS, SidecarEngine, SidecarRequest

    requests = [SidecarRequest(doc, sidecars=[HASHTAGS]) for doc in
                ("The council approved a new budget on Tuesday.", "Rain fell on the city all week.")]

    def run(gamma: int) -> list:
        return SidecarEngine(tiny, gamma=gamma).run(requests, max_new_tokens=12)

    plain, speculative = run(0), run(4)
    assert all(r.main.stats.drafted == 0 for r in plain)
    assert [(r.main.token_ids, r.sidecars["hashtags"].token_ids) for r in plain] == [
        (r.main.token_ids, r.sidecars["hashtags"].token_ids) for r in speculative]
    assert all(r.sidecars["hashtags"].stats.new_tokens > 0 for r in plain)


def test_a_vanishing_temperature_decodes_greedily(tiny):
    # logits / 1e-300 overflow float32 to inf and sampling would get NaN
    prompts = random_prompts(tiny, [7, 19], seed=5)
    decoder = SpeculativeDecoder(tiny, gamma=4, adaptive=False)
    outputs = decoder.generate(prompts, max_new_tokens=12, temperature=1e-300, seed=1)
    assert_speculated(outputs)
    assert [o.token_ids for o in outputs] == [target_alone(tiny, p, 12) for p in prompts]


def test_greedy_identity_with_gamma_sweep_and_per_row_limits(tiny, prefill_forwards):
    prompts = random_prompts(tiny, [6, 19, 11, 4], seed=7)
    limits = [1, 7, 33, 20]
    for gamma in (1, 2, 6):
        outputs = SpeculativeDecoder(tiny, gamma=gamma, adaptive=False).generate(prompts, limits, batch_size=4)
        assert_speculated(outputs)
        for prompt, limit, out in zip(prompts, limits, outputs, strict=True):
            assert out.token_ids == target_alone(tiny, prompt, limit)
            assert len(out.token_ids) <= limit


def test_batching_loses_no_acceptance(tiny):
    """At batch 8 each row needs exactly the target forwards teacher forcing predicts for its output."""
    prompts = random_prompts(tiny, [5, 17, 9, 30, 12, 3, 25, 8], seed=11)
    outputs = SpeculativeDecoder(tiny, gamma=4, adaptive=False).generate(prompts, max_new_tokens=30, batch_size=8)
    assert_speculated(outputs)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.stats.target_forwards == predicted_target_forwards(tiny, prompt, out.token_ids, 4, 30)


def test_draft_with_smaller_vocabulary_than_target(tiny):
    # the tiny target has 16 more embedding rows than the tokenizer/draft, like Qwen2.5-7B vs 1.5B
    assert tiny.target.config.vocab_size > tiny.draft.config.vocab_size
    pair = tiny_pair(draft_extra_vocab=8)  # and a draft larger than the tokenizer
    prompts = random_prompts(pair, [9, 13])
    outputs = SpeculativeDecoder(pair, gamma=3, adaptive=False).generate(prompts, max_new_tokens=24)
    assert_speculated(outputs)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == target_alone(pair, prompt, 24)


def test_stats_are_consistent(tiny):
    prompts = random_prompts(tiny, [10, 20])
    outputs = SpeculativeDecoder(tiny, gamma=4, adaptive=False).generate(prompts, max_new_tokens=30)
    for out in outputs:
        st = out.stats
        assert st.new_tokens == len(out.token_ids)
        assert st.drafted == sum(st.drafted_per_position) == st.draft_forwards + st.lookup_drafted
        assert st.lookup_accepted <= st.lookup_drafted
        assert st.drafted <= 4 * (st.target_forwards - 1)  # gamma shrinks near the row's token limit
        assert st.accepted == sum(st.accepted_per_position) <= st.drafted
        # acceptance per position can only fall: position k+1 is reached only when k was accepted
        assert all(a >= b for a, b in zip(st.accepted_per_position, st.accepted_per_position[1:], strict=False))
        assert st.new_tokens <= st.accepted + st.target_forwards
        assert st.prefill_seconds > 0 and st.wall_seconds >= st.decode_seconds


def test_drafts_accepted_past_the_end_of_turn_are_not_counted(tiny, monkeypatch):
    """A copy can run past the row's end-of-turn token (a summary's copy of the chat template's "<|im_end|>\\n"),
    and the target may accept what follows it; the row keeps nothing after it, and its counters count only the
    drafts it kept. Here every copy is the target's own text, so each step but the last keeps its 4 copies and
    the target's token: accepted = new tokens - steps (the prefill yields the first token)."""
    prompts = [random_prompts(tiny, [5, 9], seed=1)[1], random_prompts(tiny, [5], seed=3)[0]]
    continued = {}
    for prompt in prompts:
        expected = target_alone(tiny, prompt, 60)
        assert expected[-1] in tiny.eos_token_ids and (len(expected) - 1) % 5 in (1, 2, 3), "pick other prompts"
        after = target_alone(tiny, prompt + expected, 4)  # the target's greedy tokens past its end of turn
        continued[tuple(prompt)] = (expected, expected + after + [3] * 8)

    def copy(context, max_tokens, **_):
        prompt = next(p for p in continued if tuple(context[: len(p)]) == p)
        done = len(context) - len(prompt)
        return continued[prompt][1][done : done + max_tokens]

    monkeypatch.setattr("sidecar.decoding.plan.lookup_continuation", copy)
    outputs = SpeculativeDecoder(tiny, gamma=4, adaptive=False).generate(prompts, max_new_tokens=60, batch_size=1)
    for prompt, out in zip(prompts, outputs, strict=True):
        st = out.stats
        assert out.token_ids == continued[tuple(prompt)][0] and out.finish_reason == "eos"
        assert st.lookup_drafted == st.drafted == 4 * (st.target_forwards - 1)
        steps = st.target_forwards - 1
        assert st.accepted == st.lookup_accepted == sum(st.accepted_per_position) == st.new_tokens - steps


def test_stop_strings_cut_the_output(tiny):
    prompt = random_prompts(tiny, [12])[0]
    full = SpeculativeDecoder(tiny, gamma=3).generate([prompt], max_new_tokens=30)[0]
    stop_text = tiny.tokenizer.decode(full.token_ids[5:7])
    assert stop_text.strip()
    out = SpeculativeDecoder(tiny, gamma=3).generate([prompt], max_new_tokens=30, stop=[stop_text])[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert stop_text in tiny.tokenizer.decode(out.token_ids)
    assert len(out.token_ids) <= 7


def test_streaming_callback_sees_every_token_once(tiny):
    prompts = random_prompts(tiny, [8, 15, 3])
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    outputs = SpeculativeDecoder(tiny, gamma=4).generate(prompts, max_new_tokens=25,
                                                         on_tokens=lambda i, ids, _: seen[i].extend(ids))
    assert [seen[i] for i in range(3)] == [o.token_ids for o in outputs]


def test_handbuilt_causal_mask_reproduces_native_logits(tiny):
    prompts = random_prompts(tiny, [23, 9, 16])
    for model in (tiny.target, tiny.draft):
        cache = RowKVCache(model, len(prompts), 64)
        width = max(map(len, prompts))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
        with torch.inference_mode():
            hidden = forward(model, cache, ids)
            ours = logits_at(model, hidden, torch.arange(width)[None].expand(len(prompts), -1))
            for i, p in enumerate(prompts):
                native = model(torch.tensor([p])).logits[0].float()
                assert (ours[i, : len(p)] - native).abs().max().item() < 1e-4


def grouped_attention_inputs(query_len: int, kv_len: int, seed: int):
    """Query [4, 6, q, 16] over key/value [4, 2, kv, 16] (groups of 3), and a random mask of each kind."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(4, 6, query_len, 16, generator=g)
    key, value = torch.randn(2, 4, 2, kv_len, 16, generator=g)
    allowed = torch.rand(4, 1, query_len, kv_len, generator=g) < 0.7
    allowed[..., 0] = True
    additive = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    return query, key, value, (allowed, additive)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("query_len", [1, 2, 5])
def test_grouped_attention_equals_sdpa_over_copied_key_value_heads(query_len, fused, monkeypatch):
    """Attending to shared key/value heads in place, in one fused call or one call per position in the group,
    computes what SDPA computes after repeat_kv."""
    monkeypatch.setattr("sidecar.models.attention.fused_grouped_kernel", lambda *inputs: fused)
    module = types.SimpleNamespace(num_key_value_groups=3, is_causal=True)
    for kv_len in (query_len, 37):
        query, key, value, masks = grouped_attention_inputs(query_len, kv_len, seed=query_len)
        for mask in masks:
            ours, _ = grouped_sdpa_forward(module, query, key, value, mask, scaling=0.25)
            reference, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
            assert ours.shape == reference.shape == (4, query_len, 6, 16)
            assert (ours - reference).abs().max().item() < 1e-5


@pytest.mark.parametrize("fused", [True, False])
def test_grouped_attention_hands_sdpa_the_mask_itself(fused, monkeypatch):
    """The [B, 1, q, kv] mask reaches SDPA as it is, broadcast over the heads: no copy per head of a group
    (for a 7B prefill at batch 64 and 2,000 tokens that copy was 3.6 GB per layer)."""
    monkeypatch.setattr("sidecar.models.attention.fused_grouped_kernel", lambda *inputs: fused)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    seen = []

    def recording_sdpa(query, key, value, attn_mask=None, **kwargs):
        seen.append((attn_mask, key))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    module = types.SimpleNamespace(num_key_value_groups=3, is_causal=True)
    query, key, value, masks = grouped_attention_inputs(5, 37, seed=1)
    for mask in masks:
        seen.clear()
        grouped_sdpa_forward(module, query, key, value, mask, scaling=0.25)
        assert seen
        for passed, passed_key in seen:
            assert passed.shape == mask.shape
            assert passed.untyped_storage().data_ptr() == mask.untyped_storage().data_ptr()
            assert passed.untyped_storage().nbytes() == mask.numel() * mask.element_size()
            assert passed_key.untyped_storage().data_ptr() == key.untyped_storage().data_ptr()


def test_models_attend_through_grouped_attention(tiny):
    assert tiny.target.config._attn_implementation == GROUPED_SDPA
    assert tiny.target.config.num_attention_heads > tiny.target.config.num_key_value_heads


@pytest.mark.parametrize("budget", [1, 40, 60])
def test_prefill_in_row_groups_matches_one_forward(tiny, budget):
    """Rows fed alone (budget 1) or in groups fill the cache and give last-token states as one forward does,
    hidden spans included; later forwards over the whole batch then agree too."""
    prompts = random_prompts(tiny, [9, 17, 4, 20, 12], seed=3)
    spans = [[], [(3, 8)], [], [(2, 4), (10, 12)], []]
    caches, lasts, steps = [], [], []
    for group_budget in (None, budget):
        cache = RowKVCache(tiny.target, len(prompts), 32)
        with torch.inference_mode():
            lasts.append(prefill(tiny.target, cache, prompts, group_budget, spans))
            steps.append(forward(tiny.target, cache, torch.tensor([[5], [6], [7], [8], [9]])))
        caches.append(cache)
    whole, grouped = caches
    assert whole.lengths.tolist() == [9, 17, 4, 20, 12]
    assert grouped.lengths.tolist() == whole.lengths.tolist()
    assert torch.equal(grouped.visible, whole.visible) and torch.equal(grouped.span, whole.span)
    for row, n in enumerate(whole.lengths.tolist()):
        for layer in range(whole.layers):
            assert torch.allclose(grouped.keys[layer][row, :, :n], whole.keys[layer][row, :, :n], atol=1e-5)
            assert torch.allclose(grouped.values[layer][row, :, :n], whole.values[layer][row, :, :n], atol=1e-5)
    assert torch.allclose(lasts[1], lasts[0], atol=1e-5)
    assert torch.allclose(steps[1], steps[0], atol=1e-5)


@pytest.mark.parametrize("budget", [None, 1])
def test_shared_prompt_prefix_is_computed_once_and_copied(tiny, budget, monkeypatch):
    """Rows that start alike get the first row's prefix columns, and the same cache and last states as
    rows fed whole; a hidden span ends the shared prefix."""
    prefix = random_prompts(tiny, [7], seed=5)[0]
    prompts = [prefix + tail for tail in random_prompts(tiny, [5, 12, 1, 8], seed=6)]
    spans = [[], [(9, 11)], [], [(6, 8)]]
    fed_tokens = []

    def counting_forward(model, cache, ids, span=None, *args, **kwargs):
        fed_tokens[-1] += ids.numel()
        return forward(model, cache, ids, span, *args, **kwargs)

    monkeypatch.setattr("sidecar.runtime.forward.forward", counting_forward)
    results = []
    for share in (False, True):
        cache = RowKVCache(tiny.target, len(prompts), 32)
        fed_tokens.append(0)
        with torch.inference_mode():
            last = prefill(tiny.target, cache, prompts, budget, spans, share_prefix=share)
        results.append((cache, last))
    (whole, whole_last), (shared, shared_last) = results
    assert shared.lengths.tolist() == whole.lengths.tolist() == [12, 19, 8, 15]
    assert torch.equal(shared.visible, whole.visible) and torch.equal(shared.span, whole.span)
    for row, n in enumerate(whole.lengths.tolist()):
        for layer in range(whole.layers):
            assert torch.allclose(shared.keys[layer][row, :, :n], whole.keys[layer][row, :, :n], atol=1e-5)
            assert torch.allclose(shared.values[layer][row, :, :n], whole.values[layer][row, :, :n], atol=1e-5)
    assert torch.allclose(shared_last, whole_last, atol=1e-5)
    # the span at column 6 of the last row caps the shared prefix at 6 of the 7 common tokens
    assert shared_prefix_length(prompts, spans) == 6 and shared_prefix_length(prompts, None) == 7
    if budget == 1:  # rows fed alone: no padding, so exactly the 3 other rows' shared tokens are saved
        assert fed_tokens == [sum(map(len, prompts)), sum(map(len, prompts)) - 3 * 6]


def test_greedy_identity_with_shared_prompt_prefixes(tiny, prefill_forwards):
    prefix = random_prompts(tiny, [9], seed=8)[0]
    prompts = [prefix + tail for tail in random_prompts(tiny, [3, 14, 1, 6], seed=9)]
    outputs = SpeculativeDecoder(tiny, gamma=3, adaptive=False).generate(prompts, max_new_tokens=20, batch_size=4)
    assert_speculated(outputs)
    assert [o.token_ids for o in outputs] == [target_alone(tiny, p, 20) for p in prompts]


def test_greedy_identity_with_every_row_prefilled_alone(tiny, monkeypatch):
    monkeypatch.setattr("sidecar.runtime.prefill_plan.CANDIDATES", (1,))
    prompts = random_prompts(tiny, [5, 17, 9, 30, 12], seed=21)
    outputs = SpeculativeDecoder(tiny, gamma=4, adaptive=False).generate(prompts, max_new_tokens=24, batch_size=5)
    assert_speculated(outputs)
    assert [o.token_ids for o in outputs] == [target_alone(tiny, p, 24) for p in prompts]


@pytest.mark.parametrize("one_forward", [False, True])
def test_one_prefill_forward_is_forced_by_the_setting(tiny, monkeypatch, one_forward):
    """``SIDECAR_ONE_PREFILL_FORWARD`` makes a CPU prefill a batch in one forward, as an accelerator does;
    without it the rows go in groups of the planner's budget (pinned here to 256 padded tokens)."""
    if one_forward:
        monkeypatch.setenv("SIDECAR_ONE_PREFILL_FORWARD", "1")
    else:
        monkeypatch.delenv("SIDECAR_ONE_PREFILL_FORWARD", raising=False)
    prompts = random_prompts(tiny, [40] * 8, seed=4)  # 320 padded tokens: two groups on a CPU
    calls = []
    handle = forward_module(tiny.target).register_forward_hook(lambda module, args, kwargs, out: calls.append(1),
                                                          with_kwargs=True)
    try:
        cache = RowKVCache(tiny.target, len(prompts), 48)
        with torch.inference_mode():
            prefill(tiny.target, cache, prompts, PrefillPlanner(tiny.device, candidates=(256,)).budget())
    finally:
        handle.remove()
    assert len(calls) == (1 if one_forward else 2)


def test_rolled_back_row_leaves_other_rows_unchanged(tiny):
    model = tiny.target
    prompts = random_prompts(tiny, [10, 14], seed=3)
    follow = torch.tensor([[5, 6], [7, 8]])

    def next_logits(garbage_row: int | None):
        cache = RowKVCache(model, 2, 64)
        ids = torch.zeros(2, 14, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
        with torch.inference_mode():
            forward(model, cache, ids)
            cache.commit(torch.tensor([10, 14]))
            if garbage_row is not None:  # speculate 5 tokens on one row, then reject them all
                garbage = torch.randint(3, 500, (2, 5))
                forward(model, cache, garbage)
                accepted = torch.tensor([5, 5])
                accepted[garbage_row] = 0
                cache.commit(accepted)
                cache.rollback(torch.tensor([10, 14]) + accepted)
            if garbage_row is not None:
                other = 1 - garbage_row
                cache.move_rows([garbage_row])
                cache = cache.rows_view(0, 1)
                hidden = forward(model, cache, follow[[garbage_row]])
                return logits_at(model, hidden, torch.tensor([[1]]))[0, 0], other
            hidden = forward(model, cache, follow)
            return logits_at(model, hidden, torch.tensor([[1], [1]]))[:, 0], None

    clean, _ = next_logits(None)
    for row in (0, 1):
        after, _ = next_logits(row)
        assert (after - clean[row]).abs().max().item() < 1e-4


@pytest.mark.parametrize("keep", [[0, 2, 5], [1, 2, 3, 4, 5], [3], [0, 1, 2]])
def test_compaction_moves_only_rows_beyond_the_kept_slots(keep):
    order = compaction_order(keep)
    assert sorted(order) == keep
    assert all(slot == source for slot, source in enumerate(order) if source < len(keep))


def filled_cache(tiny, rows: int, capacity: int) -> RowKVCache:
    """A cache whose rows differ in every buffer: random keys/values, lengths, offsets, hidden columns, spans."""
    cache = RowKVCache(tiny.target, rows, capacity)
    for buffer in (*cache.keys, *cache.values):
        buffer.normal_()
    cache.lengths[:] = np.arange(rows) + 3
    cache.position_offset[:] = np.arange(rows) * 10
    cache.visible[:, 2] = torch.arange(rows) % 2 == 0
    cache.span[:, 1] = torch.arange(rows)
    return cache


def cache_state(cache: RowKVCache) -> list[torch.Tensor]:
    return [torch.as_tensor(t).clone() for t in (*cache.keys, *cache.values, cache.lengths, cache.position_offset,
                                                 cache.visible, cache.span)]


@pytest.mark.parametrize("rows", [compaction_order([0, 2, 5]), [5, 0, 2], [1, 0]])
def test_move_rows_equals_picking_rows_in_order(tiny, rows):
    """In the compaction order or any other, slot i ends up holding old row rows[i]; later slots are untouched."""
    cache = filled_cache(tiny, 6, 16)
    before = cache_state(cache)
    cache.move_rows(rows)
    kept = len(rows)
    for old, new in zip(before, cache_state(cache), strict=True):
        assert torch.equal(new[:kept], old[rows])
        assert torch.equal(new[kept:], old[kept:])


def test_copy_into_gives_the_target_rows_the_filled_columns(tiny):
    source = filled_cache(tiny, 3, 16)
    target = RowKVCache(tiny.target, 5, 24)
    source.copy_into(target.rows_view(1, 4))
    filled = int(source.lengths.max())
    buffers = 2 * source.layers  # the keys and values
    for old, new in zip(cache_state(source)[:buffers], cache_state(target)[:buffers], strict=True):
        assert torch.equal(new[1:4, :, :filled], old[:, :, :filled])
        assert not new[1:4, :, filled:].any() and not new[[0, 4]].any()  # nothing past the filled columns
    assert target.lengths.tolist() == [0, 3, 4, 5, 0] and target.position_offset.tolist() == [0, 0, 10, 20, 0]
    assert torch.equal(target.visible[1:4, :filled], source.visible[:, :filled])
    assert torch.equal(target.span[1:4, :filled], source.span[:, :filled])
    assert bool(target.visible[:, filled:].all()) and bool((target.span[:, filled:] == -1).all())


def test_acceptance_rule_greedy():
    logits = torch.full((3, 4, 10), -5.0)
    choice = torch.tensor([[1, 2, 3, 4], [1, 9, 3, 4], [7, 2, 3, 4]])
    logits.scatter_(2, choice[..., None], 5.0)
    drafted = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    accepted, nxt = accept_greedy(drafted, logits)
    assert accepted.tolist() == [3, 1, 0]
    assert nxt.tolist() == [4, 9, 7]


@pytest.mark.parametrize("gamma", [1, 3])
def test_acceptance_rule_sampled_follows_target_exactly(gamma):
    """The first emitted token is distributed as the target's p, whatever the draft's q.

    A wrong rule (accepting every draft token, or resampling from p instead of the residual) fails here.
    """
    vocab, rows = 6, 200_000
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(gamma + 1, vocab, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(gamma, vocab, generator=g) * 2, -1)
    draft_probs = q.expand(rows, -1, -1).contiguous()
    target_probs = p.expand(rows, -1, -1).contiguous()
    drafted = torch.multinomial(q, rows, replacement=True, generator=g).T.contiguous()  # [rows, gamma]
    u_accept, u_next = torch.rand(rows, gamma, generator=g), torch.rand(rows, gamma + 1, generator=g)
    accepted, nxt = accept_sampled(drafted, draft_probs, target_probs, u_accept, u_next)
    first = torch.where(accepted > 0, drafted[:, 0], nxt)
    empirical = torch.bincount(first, minlength=vocab).float() / rows
    assert (empirical - p[0]).abs().sum().item() / 2 < 0.01
    # the naive rule "accept what the draft proposed" follows q, not p
    naive = torch.bincount(drafted[:, 0], minlength=vocab).float() / rows
    assert (naive - p[0]).abs().sum().item() / 2 > 0.05


@pytest.mark.parametrize("copying", [False, True])
def test_sampled_engine_follows_target_distribution(copying, monkeypatch, prefill_forwards):
    """End to end: the second new token goes through draft + acceptance; its law must be the target's.

    ``copying``: every draft is a copied token (prompt lookup, forced here), whose draft law is one-hot.
    """
    if copying:
        monkeypatch.setattr("sidecar.decoding.plan.lookup_continuation", lambda context, k, **_: [5] * k)
    pair = tiny_pair(draft_noise=0.5, seed=1)  # a draft that disagrees often
    prompt = random_prompts(pair, [7], seed=5)[0]
    temperature = 1.5
    with torch.inference_mode():
        p1 = torch.softmax(pair.target(torch.tensor([prompt])).logits[0, -1].float() / temperature, -1)
        firsts = torch.arange(p1.shape[0])
        batch = torch.cat([torch.tensor(prompt).expand(len(firsts), -1), firsts[:, None]], 1)
        p2_given_1 = torch.softmax(pair.target(batch).logits[:, -1].float() / temperature, -1)
        exact = (p1[:, None] * p2_given_1).sum(0)
        # what "accept every draft token" would produce: the draft's law for the second token
        q2_given_1 = torch.softmax(pair.draft(batch.clamp(max=pair.draft.config.vocab_size - 1)).logits[:, -1].float()
                                   / temperature, -1)
        naive = torch.nn.functional.pad((p1[:, None] * q2_given_1).sum(0), (0, exact.shape[0] - q2_given_1.shape[1]))
    n = 3000
    # a seeded row copies whenever its own text offers a copy: without copying, lookup is off
    decoder = SpeculativeDecoder(pair, gamma=2, adaptive=False, prompt_lookup=copying)
    outs = decoder.generate([prompt] * n, max_new_tokens=3, temperature=temperature, seed=11, batch_size=1000)
    assert sum(o.stats.drafted for o in outs) > 0
    assert (sum(o.stats.lookup_drafted for o in outs) > 0) == copying
    tv_engine, tv_reference = second_token_distances(outs, exact)
    assert tv_engine < 1.5 * tv_reference + 0.02
    # the check has power: the draft's own distribution is far from the target's, and so is always token 5
    if copying:
        naive = torch.nn.functional.one_hot(torch.tensor(5), exact.shape[0]).float()
    assert (naive - exact).abs().sum().item() / 2 > tv_engine + 0.05


def test_seeded_sampling_is_reproducible(tiny):
    prompts = random_prompts(tiny, [8, 12])
    dec = SpeculativeDecoder(tiny, gamma=3)
    a = dec.generate(prompts, max_new_tokens=20, temperature=0.8, top_p=0.9, seed=42)
    b = SpeculativeDecoder(tiny, gamma=3).generate(prompts, max_new_tokens=20, temperature=0.8, top_p=0.9, seed=42)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_bad_input_is_a_clear_error(tiny):
    dec = SpeculativeDecoder(tiny, gamma=2)
    with pytest.raises(InputError, match="empty prompt"):
        dec.generate([[]], max_new_tokens=4)
    with pytest.raises(InputError, match="exceeds the model context"):
        dec.generate([[5] * (tiny.max_context + 1)], max_new_tokens=4)
    for gamma in (-1, True, 2.0):
        with pytest.raises(InputError, match="gamma"):
            SpeculativeDecoder(tiny, gamma=gamma)
    with pytest.raises(InputError, match="outside the vocabulary"):
        dec.generate([[10**7]], max_new_tokens=4)
    with pytest.raises(InputError, match="max_new_tokens"):
        dec.generate([[5, 6]], max_new_tokens=0)


def test_mismatched_tokenizers_are_refused():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    other = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(PairError, match="tokenizers differ"):
        check_tokenizers(tiny_tokenizer(), PreTrainedTokenizerFast(tokenizer_object=other))


def learned_controller(decoder: SpeculativeDecoder, draft_step_s: float, draft_prefill_s_per_token: float) -> None:
    """Give the decoder's controller measured-looking costs: target steps of 0.1 s + 0.01 s per token."""
    controller = decoder.controller
    for tokens in (1, 2, 4, 8, 16, 40):
        controller.costs["target"].add(tokens, 0.1 + 0.01 * tokens)
    controller.costs["draft"].add(1, draft_step_s)
    controller.observe_prefill("draft", 100, 100 * draft_prefill_s_per_token)
    draft = controller.acceptance["draft"]
    draft.accepted, draft.drafted = 8.0, 10.0  # alpha 0.8


def test_draft_prefill_is_skipped_when_speculation_cannot_repay_it(tiny, monkeypatch):
    prompts = random_prompts(tiny, [12, 30, 7, 21], seed=3)
    draft_calls = []
    handle = forward_module(tiny.draft).register_forward_hook(lambda *_: draft_calls.append(1))
    try:
        expensive = SpeculativeDecoder(tiny, gamma=4)
        learned_controller(expensive, draft_step_s=0.5, draft_prefill_s_per_token=1.0)
        outputs = expensive.generate(prompts, max_new_tokens=16, batch_size=4)
        assert draft_calls == [] and sum(o.stats.draft_forwards for o in outputs) == 0
        for prompt, out in zip(prompts, outputs, strict=True):
            assert out.token_ids == target_alone(tiny, prompt, 16)

        cheap = SpeculativeDecoder(tiny, gamma=4)
        learned_controller(cheap, draft_step_s=0.001, draft_prefill_s_per_token=1e-5)
        # the controller keeps learning from real timings during the batch; the prefill decision is what
        # this checks, so the draft must have run at least its prefill
        cheap.generate(prompts, max_new_tokens=16, batch_size=4)
        assert draft_calls
    finally:
        handle.remove()


def test_cost_fit_remembers_wide_forwards_after_many_plain_steps():
    from sidecar.decoding.controller import LinearCost

    cost = LinearCost()
    for tokens in (1, 3, 5):
        cost.add(tokens, 0.2 + 0.02 * tokens)
    for _ in range(100):  # the controller settled on plain decoding: only one-token steps are timed now
        cost.add(1, 0.22)
    assert cost.predict(40) == pytest.approx(0.2 + 0.02 * 40, rel=0.01)


def test_cost_fit_replaces_a_size_s_first_timing():
    from sidecar.decoding.controller import LinearCost

    cost = LinearCost(decay=0.7)
    cost.add(1, 0.2)
    cost.add(5, 0.9)  # the first 5-token forward builds its kernels
    cost.add(5, 0.3)
    assert cost.means[5.0] == pytest.approx(0.3)
    cost.add(5, 0.4)  # from the third timing on, timings are blended
    assert cost.means[5.0] == pytest.approx(0.7 * 0.3 + 0.3 * 0.4)
    assert cost.predict(3) == pytest.approx(0.2 + (0.33 - 0.2) / 2)


def test_draft_pays_prices_the_draft_prefill():
    from sidecar.decoding.controller import GammaController

    controller = GammaController(4)
    assert controller.draft_pays(8, 4000, 64, 0.3), "nothing measured yet: explore"
    for tokens in (8, 16, 40):
        controller.costs["target"].add(tokens, 0.5 + 0.02 * tokens)
    controller.costs["draft"].add(8, 0.05)
    controller.acceptance["draft"].accepted, controller.acceptance["draft"].drafted = 9.0, 10.0
    controller.observe_prefill("target", 4000, 80.0)  # 20 ms per prompt token
    # decode gain over 64 tokens is a few seconds; a draft prefill priced at 0.3 x 80 s cannot repay it
    assert not controller.draft_pays(8, 4000, 64, 0.3)
    # with 2000 new tokens to decode, the same prefill is repaid
    assert controller.draft_pays(8, 4000, 2000, 0.3)
    # once the draft's own prefill was timed, that rate replaces the prior
    controller.observe_prefill("draft", 4000, 0.4)
    assert controller.draft_pays(8, 4000, 64, 0.3)
    # plain: 64 steps of 0.66 s = 42 s; speculating: 23.4 s of decoding plus the draft's prefill. A forecast
    # that saves only ~7% is not worth the certain prefill; one that saves ~20% is.
    controller.observe_prefill("draft", 4000, 16.0)
    assert not controller.draft_pays(8, 4000, 64, 0.3)
    controller.observe_prefill("draft", 4000, 10.0)
    assert controller.draft_pays(8, 4000, 64, 0.3)


def test_draft_pays_forecasts_from_a_target_fit_of_one_size():
    """Batch-1 steps whose one-row forwards all run padded to one width leave the target's fit one size: a batch
    of 8 then must not prefill the draft just to learn costs (it cost that batch a fifth of its time, for a draft
    its steps never chose, where nearly every row had a copy)."""
    from sidecar.decoding.controller import GammaController

    controller = GammaController(4)
    controller.costs["target"].add(5, 0.095)  # every batch-1 step ran at the padded width 5
    controller.costs["draft"].add(1, 0.037)
    controller.acceptance["draft"].accepted, controller.acceptance["draft"].drafted = 9.0, 10.0
    controller.acceptance["lookup"].accepted, controller.acceptance["lookup"].drafted = 8.0, 10.0
    controller.observe_prefill("target", 341, 2.4)
    controller.observe_prefill("draft", 341, 0.75)
    for _ in range(20):
        controller.observe_copies(1, 1)
    assert not controller.explored(8, 4)
    assert not controller.draft_pays(8, 2567, 64, 0.35, packed=True)
    # no copy seen, and a long decode: the draft's forecast gain repays its prefill
    controller.row_copy_share = None
    assert controller.draft_pays(8, 2567, 5000, 0.35, packed=True)


def test_draft_pays_counts_copying_as_the_alternative():
    from sidecar.decoding.controller import GammaController

    controller = GammaController(4)
    for tokens in (8, 16, 40):
        controller.costs["target"].add(tokens, 0.5 + 0.02 * tokens)
    controller.costs["draft"].add(8, 0.05)
    for source in ("draft", "lookup"):
        controller.acceptance[source].accepted, controller.acceptance[source].drafted = 9.0, 10.0
    controller.observe_prefill("target", 4000, 80.0)
    controller.observe_prefill("draft", 4000, 10.0)
    assert controller.draft_pays(8, 4000, 2000, 0.3), "no copy seen: the draft repays its prefill"
    # every row always has a copy, accepted as well as the draft's tokens and without draft forwards: the
    # draft model would never be chosen, so its prefill is never repaid
    for _ in range(20):
        controller.observe_copies(8, 8)
    assert not controller.draft_pays(8, 4000, 2000, 0.3)
    # rows with a copy half the time: a step copies for the rows that have one. Where the verify runs every row
    # at the copy's width those steps gain little, and the draft pays again; where only real tokens cost (an
    # eager stack packs them) they beat the draft's prefill
    for _ in range(60):
        controller.observe_copies(4, 8)
    assert controller.row_copy_share == pytest.approx(0.5, abs=0.01)
    assert controller.draft_pays(8, 4000, 2000, 0.3, packed=False)
    assert not controller.draft_pays(8, 4000, 2000, 0.3, packed=True)
    # at batch 1 half the steps copy: a dearer draft prefill that plain decoding alone would repay (64 tokens
    # in 33 s plain, 12.5 s with the draft) is not repaid by the draft's gain on the other half of the steps
    controller.observe_prefill("draft", 4000, 40.0)
    assert not controller.draft_pays(1, 500, 64, 0.3)
    controller.row_copy_share = None
    assert controller.draft_pays(1, 500, 64, 0.3)


def test_int8_draft_keeps_output_identical():
    from sidecar import load_pair

    pair = load_pair("tiny", draft_int8=True)
    prompts = random_prompts(pair, [9, 15, 4])
    outputs = SpeculativeDecoder(pair, gamma=3, adaptive=False).generate(prompts, max_new_tokens=20, batch_size=3)
    assert_speculated(outputs)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == target_alone(pair, prompt, 20)


def test_an_int8_draft_in_a_pair_that_is_not_fp32_is_one_clear_error():
    """torch's dynamic int8 Linear takes float32 activations: a bf16 pair with an int8 draft would load and
    then fail at its first draft forward."""
    from sidecar import load_pair

    with pytest.raises(PairError, match=r"draft_int8 needs fp32 .* loads in bf16 \(argument dtype=bf16\)"):
        load_pair("tiny", dtype="bf16", draft_int8=True)


def test_sidecar_engine_skips_the_draft_only_without_sidecar_tasks(tiny):
    from sidecar import HASHTAGS, SidecarEngine, SidecarRequest

    engine = SidecarEngine(tiny, gamma=4)
    learned_controller(engine.decoder, draft_step_s=0.5, draft_prefill_s_per_token=1.0)
    doc = "The council approved a new budget on Tuesday."
    bare = engine.run([SidecarRequest(doc)], max_new_tokens=8)[0]
    assert bare.main.stats.draft_forwards == 0
    # a sidecar task needs the draft's cache, so the draft prefills even when speculation does not pay
    with_tags = engine.run([SidecarRequest(doc, sidecars=[HASHTAGS])], max_new_tokens=8)[0]
    assert with_tags.main.token_ids == bare.main.token_ids
    assert with_tags.sidecars["hashtags"].stats.new_tokens > 0


def reference_copier(pair, prompts, max_new_tokens, seed=0, miss=0.3, corrupt=0.35):
    """A stand-in for prompt lookup that copies the target's own greedy continuation. A share ``miss`` of the
    time (by default about a third) it finds nothing, so that draft-model steps (which must first catch up on
    the copied tokens) come between copied ones; a share ``corrupt`` (by default half of the others) of the
    copies have a token corrupted, so that copies are accepted in full, in part and not at all."""
    expected = {tuple(p): target_alone(pair, p, max_new_tokens) for p in prompts}
    rng = random.Random(seed)

    def copy(context, max_tokens, **_):
        prompt = next(p for p in expected if tuple(context[: len(p)]) == p)
        done = len(context) - len(prompt)
        guess = expected[prompt][done : done + max_tokens]
        roll = rng.random()
        if roll < miss:
            return []
        if guess and roll < miss + corrupt:
            guess[rng.randrange(len(guess))] = 3
        return guess

    return expected, copy


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("adaptive", [False, True])
def test_copied_drafts_keep_greedy_output_identical(tiny, monkeypatch, batch_size, adaptive, prefill_forwards):
    prompts = random_prompts(tiny, [6, 15, 9, 22, 4], seed=11)
    expected, copy = reference_copier(tiny, prompts, 30)
    monkeypatch.setattr("sidecar.decoding.plan.lookup_continuation", copy)
    outputs = SpeculativeDecoder(tiny, gamma=4, adaptive=adaptive).generate(prompts, max_new_tokens=30,
                                                                            batch_size=batch_size)
    assert_speculated(outputs)
    assert 0 < sum(o.stats.lookup_accepted for o in outputs) < sum(o.stats.lookup_drafted for o in outputs)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == expected[tuple(prompt)]


def test_copied_drafts_leave_the_sidecar_continuation_unchanged(tiny, monkeypatch):
    """Copied steps skip the draft model; the draft catches up before it drafts again or writes tags."""
    from sidecar import HASHTAGS, SidecarEngine, SidecarRequest

    requests = [SidecarRequest(doc, sidecars=[HASHTAGS]) for doc in
                ("The council approved a new budget on Tuesday.", "Rain is expected over the weekend in the north.")]
    engine = SidecarEngine(tiny, gamma=3, adaptive=False)
    engine.decoder.prompt_lookup = False
    reference = engine.run(requests, max_new_tokens=20)
    prompts = [engine.prompts(r)[0].token_ids for r in requests]
    _, copy = reference_copier(tiny, prompts, 20)
    monkeypatch.setattr("sidecar.decoding.plan.lookup_continuation", copy)
    engine.decoder.prompt_lookup = True
    copied = engine.run(requests, max_new_tokens=20)
    assert sum(r.main.stats.lookup_drafted for r in copied) > 0
    for want, got in zip(reference, copied, strict=True):
        assert got.main.token_ids == want.main.token_ids
        assert {k: s.token_ids for k, s in got.sidecars.items()} == {k: s.token_ids for k, s in want.sidecars.items()}


def copying_controller(decoder: SpeculativeDecoder) -> None:
    """``learned_controller`` with copies that look nearly always accepted: the draft model does not pay its
    prefill, and the costs (0.1 s a step + 0.01 s per token) make the longest copy the best step."""
    learned_controller(decoder, draft_step_s=0.5, draft_prefill_s_per_token=1.0)
    lookup = decoder.controller.acceptance["lookup"]
    lookup.accepted, lookup.drafted = 9.5, 10.0


def lookup_widths(decoder: SpeculativeDecoder) -> list[int]:
    return [width for width, source in decoder.controller.decisions if source == "lookup"]


@pytest.mark.parametrize("batch_size", [1, 3])
def test_an_adaptive_step_copies_more_than_gamma_and_keeps_greedy_output_identical(tiny, monkeypatch, batch_size):
    """A copy costs no draft forward, so the adaptive controller may copy up to ``max_copy`` (10 here) tokens
    where gamma bounds the draft model's (4): copies rejected at every position of a long verify still leave the
    output the target's own."""
    prompts = random_prompts(tiny, [6, 15, 9, 22, 4], seed=11)
    expected, copy = reference_copier(tiny, prompts, 40, miss=0.0, corrupt=0.5)
    monkeypatch.setattr("sidecar.decoding.plan.lookup_continuation", copy)
    decoder = SpeculativeDecoder(tiny, gamma=4, max_copy=10)
    copying_controller(decoder)
    outputs = decoder.generate(prompts, max_new_tokens=40, batch_size=batch_size)
    assert max(lookup_widths(decoder)) > 4, lookup_widths(decoder)
    assert 0 < sum(o.stats.lookup_accepted for o in outputs) < sum(o.stats.lookup_drafted for o in outputs)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == expected[tuple(prompt)]
        st = out.stats  # copied tokens count by position past gamma too
        assert st.drafted == sum(st.drafted_per_position) == st.lookup_drafted and len(st.drafted_per_position) == 10


def test_a_long_copy_stops_where_a_row_near_its_limit_has_no_more_columns(tiny, monkeypatch):
    """A verify writes its width + 1 columns past every row's cached tokens, and a row keeps gamma + 1 columns
    free past its last token (``row_columns``): with a row 2 tokens from its limit, a copy stops at 2 + gamma
    + 1 = 7 tokens, where 10 would write 3 columns past the row's cache (both rows need 64 columns, the pool's
    whole capacity) while the other row still has 50 tokens to go."""
    prompts = random_prompts(tiny, [56, 8], seed=5)
    limits = [3, 51]  # 56 + 3 + 5 = 8 + 51 + 5 = 64 columns
    expected, copy = reference_copier(tiny, prompts, 51, miss=0.0, corrupt=0.0)
    monkeypatch.setattr("sidecar.decoding.plan.lookup_continuation", copy)
    decoder = SpeculativeDecoder(tiny, gamma=4, max_copy=10)
    copying_controller(decoder)
    outputs = decoder.generate(prompts, max_new_tokens=limits, batch_size=2)
    assert lookup_widths(decoder)[0] == 7
    for prompt, limit, out in zip(prompts, limits, outputs, strict=True):
        assert out.token_ids == expected[tuple(prompt)][:limit]


def test_controller_copies_past_gamma_where_a_wide_verify_pays():
    from sidecar.decoding.controller import GammaController

    controller = GammaController(4, max_copy=10)
    for tokens in (1, 2, 4, 8, 16, 40):
        controller.costs["target"].add(tokens, 0.1 + 0.01 * tokens)
    controller.costs["draft"].add(1, 0.05)
    controller.acceptance["lookup"].accepted, controller.acceptance["lookup"].drafted = 9.5, 10.0
    assert controller.choose(1, max_gamma=4, max_lookup=10) == (10, "lookup")
    assert controller.choose(1, max_gamma=4, max_lookup=6) == (6, "lookup")
    # the widths the target can take (compiled: 1 .. gamma and those padding to the longest copy's verify)
    static = [1, 2, 3, 4, 8, 9, 10]
    assert controller.choose(1, max_gamma=4, max_lookup=9, copy_widths=static) == (9, "lookup")
    assert controller.choose(1, max_gamma=4, max_lookup=7, copy_widths=static) == (4, "lookup")
    # copies that are rarely accepted: a wide verify does not pay, whatever its bound
    controller.acceptance["lookup"].accepted = 2.0
    assert controller.choose(1, max_gamma=0, max_lookup=10) in {(0, "draft"), (1, "lookup")}


def test_fixed_gamma_copies_exactly_gamma_and_max_copy_is_checked(tiny, monkeypatch):
    """A fixed gamma copies gamma tokens, as the teacher-forced prediction assumes, however long the copy on
    offer; ``max_copy`` is the adaptive mode's, and a bad one is a clear error naming it."""
    prompts = random_prompts(tiny, [6, 15], seed=2)
    expected, copy = reference_copier(tiny, prompts, 30, miss=0.0, corrupt=0.5)
    monkeypatch.setattr("sidecar.decoding.plan.lookup_continuation", copy)
    decoder = SpeculativeDecoder(tiny, gamma=3, adaptive=False, max_copy=3)
    outputs = decoder.generate(prompts, max_new_tokens=30, batch_size=2)
    assert decoder.planner.max_copy == 3 and set(lookup_widths(decoder)) <= {1, 2, 3}  # fewer near the limit
    assert lookup_widths(decoder).count(3) >= 3
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == expected[tuple(prompt)] and len(out.stats.drafted_per_position) == 3
    with pytest.raises(InputError, match=r"max_copy=5 needs adaptive=True"):
        SpeculativeDecoder(tiny, gamma=3, adaptive=False, max_copy=5)
    for bad in (0, -1, 2.5, "4", True):
        with pytest.raises(InputError, match="max_copy must be an integer >= 1"):
            SpeculativeDecoder(tiny, gamma=3, max_copy=bad)
    assert SpeculativeDecoder(tiny, gamma=3, max_copy=2).planner.widest == 3


@pytest.mark.parametrize("confidence, widths", [(0.0, {4}), (1.0, {1})])
def test_drafting_stops_when_the_draft_is_unsure(tiny, confidence, widths):
    prompts = random_prompts(tiny, [10, 20, 7], seed=4)
    decoder = SpeculativeDecoder(tiny, gamma=4, adaptive=False, prompt_lookup=False, draft_confidence=confidence)
    outputs = decoder.generate(prompts, max_new_tokens=20, batch_size=3)
    assert_speculated(outputs)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == target_alone(tiny, prompt, 20)
        reached = [k + 1 for k, n in enumerate(out.stats.drafted_per_position) if n]
        # no draft token is ever certain (probability 1), so a confidence of 1 stops after one token
        assert max(reached) in widths


def test_lookup_copies_what_followed_the_latest_longest_match():
    from sidecar.decoding.lookup import lookup_continuation

    assert lookup_continuation([1, 2, 3, 9, 1, 2, 3, 8, 5, 2, 3], 2) == [8, 5]  # latest occurrence of (2, 3)
    assert lookup_continuation([7, 2, 3, 4, 1, 2, 3, 6, 9, 1, 2, 3], 3) == [6, 9, 1]  # (1, 2, 3) beats (2, 3)
    assert lookup_continuation([5, 6, 7, 5, 6], 4) == [7, 5, 6]
    assert lookup_continuation([1, 2, 3, 4], 3) == []
    assert lookup_continuation([4, 4], 2) == [4]
    assert lookup_continuation([4, 5, 4], 2, min_ngram=2) == []  # (5, 4) occurs once
    # 65536 = 0x00010000 and 1 = 0x00000001: their bytes line up with a match straddling two tokens
    assert lookup_continuation([65536, 1, 0, 256, 9, 1, 0], 1) == [256]


def test_controller_probes_copying_after_a_run_of_steps_without_one():
    from sidecar.decoding.controller import LOOKUP_PROBE_EVERY, GammaController

    controller = GammaController(4)
    for tokens in (1, 2, 3, 5):
        controller.costs["target"].add(tokens, 0.1 + 0.05 * tokens)
    controller.costs["draft"].add(1, 0.05)
    lookup = controller.acceptance["lookup"]
    lookup.accepted, lookup.drafted = 0.0, 10.0  # every copy so far was rejected: plain looks best
    choices = [controller.choose(1, max_gamma=0, max_lookup=2) for _ in range(3 * (LOOKUP_PROBE_EVERY + 1))]
    probes = [i for i, choice in enumerate(choices) if choice == (2, "lookup")]  # all two copyable tokens
    assert probes == [LOOKUP_PROBE_EVERY, 2 * LOOKUP_PROBE_EVERY + 1, 3 * LOOKUP_PROBE_EVERY + 2]
    assert all(choice == (0, "draft") for i, choice in enumerate(choices) if i not in probes)
    # nothing to copy: nothing to probe
    assert {controller.choose(1, max_gamma=0, max_lookup=0) for _ in range(20)} == {(0, "draft")}

    # a draft model that looks better than copying does not rule copying out either
    controller.costs["draft"].add(1, 0.001)
    controller.acceptance["draft"].accepted, controller.acceptance["draft"].drafted = 9.0, 10.0
    controller.steps_without_copy = 0
    choices = [controller.choose(1, max_gamma=4, max_lookup=2) for _ in range(2 * (LOOKUP_PROBE_EVERY + 1))]
    assert [i for i, choice in enumerate(choices) if choice[1] == "lookup"] == [LOOKUP_PROBE_EVERY,
                                                                              2 * LOOKUP_PROBE_EVERY + 1]
    assert all(choice == (4, "draft") for choice in choices if choice[1] == "draft")


# -- logprobs --


def target_log_softmax(pair, prompt, new_tokens):
    """The target's log-softmax at each new token's position, by one plain forward over prompt + output."""
    with torch.no_grad():
        logits = pair.target(torch.tensor([prompt + new_tokens])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1 : len(prompt) - 1 + len(new_tokens)]


@pytest.mark.parametrize("steps", ["draft", "lookup", "plain"])
def test_logprobs_are_the_targets_log_softmax_at_each_committed_token(tiny, monkeypatch, steps):
    prompts = random_prompts(tiny, [6, 15, 9, 22], seed=13)
    decoder = SpeculativeDecoder(tiny, gamma=4, adaptive=steps == "plain", prompt_lookup=steps == "lookup")
    if steps == "lookup":
        monkeypatch.setattr("sidecar.decoding.plan.lookup_continuation", reference_copier(tiny, prompts, 24)[1])
    if steps == "plain":
        learned_controller(decoder, draft_step_s=0.5, draft_prefill_s_per_token=1.0)
    plain = decoder.generate(prompts, max_new_tokens=24, batch_size=3)
    outputs = decoder.generate(prompts, max_new_tokens=24, batch_size=3, top_logprobs=5)
    if steps == "plain":
        assert sum(o.stats.drafted for o in outputs) == 0
    else:
        assert sum(o.stats.lookup_accepted if steps == "lookup" else o.stats.accepted for o in outputs) > 0
    for prompt, without, out in zip(prompts, plain, outputs, strict=True):
        assert without.logprobs is None and out.token_ids == without.token_ids
        assert [e.token_id for e in out.logprobs] == out.token_ids
        reference = target_log_softmax(tiny, prompt, out.token_ids)
        for entry, row in zip(out.logprobs, reference, strict=True):
            assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-4)
            assert len(entry.top) == 5 and entry.top[0][0] == entry.token_id  # greedy: the argmax leads
            assert [p for _, p in entry.top] == sorted((p for _, p in entry.top), reverse=True)
            want = row.topk(5)
            assert [p for _, p in entry.top] == pytest.approx(want.values.tolist(), abs=1e-4)


def test_sampled_logprobs_leave_the_seeded_output_unchanged(tiny):
    prompts = random_prompts(tiny, [8, 12], seed=2)
    kwargs = dict(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=7)
    plain = SpeculativeDecoder(tiny, gamma=3).generate(prompts, **kwargs)
    outputs = SpeculativeDecoder(tiny, gamma=3).generate(prompts, **kwargs, top_logprobs=0)
    for prompt, without, out in zip(prompts, plain, outputs, strict=True):
        assert out.token_ids == without.token_ids
        reference = target_log_softmax(tiny, prompt, out.token_ids)
        # the raw temperature-1 distribution, whatever the sampling warp was
        assert [e.logprob for e in out.logprobs] == pytest.approx(
            [row[t].item() for row, t in zip(reference, out.token_ids, strict=True)], abs=1e-4)
        assert all(e.top == () for e in out.logprobs)


def test_streamed_logprobs_are_the_outputs(tiny):
    prompts = random_prompts(tiny, [8, 15, 3])
    seen: dict[int, list] = {0: [], 1: [], 2: []}
    outputs = SpeculativeDecoder(tiny, gamma=4).generate(
        prompts, max_new_tokens=25, top_logprobs=1, on_tokens=lambda i, ids, entries: seen[i].extend(entries))
    assert [seen[i] for i in range(3)] == [o.logprobs for o in outputs]


def test_draft_only_logprobs_are_the_drafts_log_softmax(tiny):
    from sidecar.decoding.rows import DraftRow

    prompts = random_prompts(tiny, [5, 11], seed=9)
    batch = SpeculativeDecoder(tiny).batch(0, max_draft_rows=2)
    for i, prompt in enumerate(prompts):
        batch.add_draft(i, DraftRow(prompt, 12, draw_key=0, top_logprobs=2, phase="standalone"))
    done = {}
    while batch.busy:
        done.update(batch.step())
    outs = [done[i] for i in range(len(prompts))]
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            logits = tiny.draft(torch.tensor([prompt + out.token_ids])).logits[0].float()
        reference = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
        assert [e.token_id for e in out.logprobs] == out.token_ids
        for entry, row in zip(out.logprobs, reference, strict=True):
            assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-4)
            assert entry.top[0][0] == entry.token_id and len(entry.top) == 2


def test_top_logprobs_outside_openais_bound_is_refused(tiny):
    with pytest.raises(InputError, match="top_logprobs"):
        SpeculativeDecoder(tiny).generate([[5, 6]], max_new_tokens=2, top_logprobs=21)


def test_no_forward_is_priced_below_the_models_prefill_per_token():
    """Timed at batch 1 only, a CPU's decode forwards look flat in their width (memory-bound), and a verify of 40
    tokens at batch 8 would look as cheap as one token; the prefill's rate per token says what it costs at least."""
    from sidecar.decoding.controller import GammaController

    def controller(prefill_rate: float | None) -> GammaController:
        c = GammaController(4)
        for tokens in (1, 2, 3, 5):
            c.costs["target"].add(tokens, 0.2 + 0.002 * tokens)
        c.costs["draft"].add(1, 0.01)
        c.acceptance["draft"].accepted, c.acceptance["draft"].drafted = 8.0, 10.0
        if prefill_rate is not None:
            c.observe_prefill("target", 340, 340 * prefill_rate)
            c.observe_prefill("target", 340, 340 * prefill_rate * 3)  # a slower prefill does not lift the floor
        return c

    floored = controller(0.02)
    assert floored.forward_seconds("target", 8, 40) == pytest.approx(0.8)
    assert floored.forward_seconds("target", 8, 2) == pytest.approx(0.204)  # the fit, above the floor
    assert floored.prefill_seconds_per_token["target"] == pytest.approx(0.06)  # the latest, for draft_pays
    # batch 1: the floor binds nowhere, the choice is the fit's
    assert floored.choose(1, max_gamma=4) == controller(None).choose(1, max_gamma=4) == (4, "draft")
    # batch 8: without the floor a 40-token verify looks free and the controller drafts 4; with it, less
    assert controller(None).choose(8, max_gamma=4) == (4, "draft")
    assert floored.choose(8, max_gamma=4)[0] < 4


def test_a_padded_one_row_forward_is_timed_and_priced_at_its_padded_width():
    """Where a one-row forward of 1-5 columns runs padded to 5 (``sidecar.runtime.padding``), its near-equal
    timings at 1, 3 and 5 tokens are one size: a verify of 4 costs what a plain step costs, so the longest copy
    wins, where a fit over the raw widths reads the noise as a slope and copies less."""
    from sidecar.decoding.controller import GammaController

    def controller(padded: bool) -> GammaController:
        c = GammaController(4)
        if padded:
            c.decode_tokens = {m: lambda rows, tokens: max(tokens, 5) if rows == 1 else tokens
                               for m in ("target", "draft")}
        for tokens, seconds in ((1, 0.125), (3, 0.128), (5, 0.140)):
            c.forward_cost("target", 1, tokens)(seconds)
        c.acceptance["lookup"].accepted, c.acceptance["lookup"].drafted = 3.0, 10.0  # alpha 0.3
        return c

    padded, raw = controller(True), controller(False)
    assert list(padded.costs["target"].means) == [5.0]
    assert padded.forward_seconds("target", 1, 1) == padded.forward_seconds("target", 1, 5)
    assert padded.choose(1, max_gamma=0, max_lookup=4) == (4, "lookup")
    assert raw.choose(1, max_gamma=0, max_lookup=4) == (2, "lookup")
    # one size is all a one-row step of up to 4 drafts runs at: exploring needs no second; at batch 2 it does
    fresh, unpadded = GammaController(4), GammaController(4)
    fresh.decode_tokens = padded.decode_tokens
    for c in (fresh, unpadded):
        c.forward_cost("draft", 1, 1)(0.05)
        c.forward_cost("target", 1, 5)(0.13)
        c.acceptance["draft"].accepted, c.acceptance["draft"].drafted = 9.0, 10.0
    assert fresh.explored(1, 4) and not fresh.explored(1, 5) and not fresh.explored(2, 4)
    # narrower widths between may run narrower (as timed, ``PaddedWidths``): the plain step and the widest
    # still run at the size timed, and the rest is the fit's to price
    fresh.decode_tokens = {"target": lambda rows, w: (5, 5, 3, 4, 5)[w - 1] if rows == 1 and w <= 5 else w}
    assert fresh.explored(1, 4)
    assert fresh.choose(1, max_gamma=4) == (4, "draft")  # chosen by its rates
    assert unpadded.choose(1, max_gamma=4) == (0, "draft")  # a plain step, to time a second size


def test_rows_of_a_batch_copy_unequal_lengths_where_only_real_tokens_cost():
    from sidecar.decoding.controller import GammaController

    controller = GammaController(4)
    for tokens in (1, 4, 8, 20):
        controller.costs["target"].add(tokens, 0.1 + 0.01 * tokens)
    controller.acceptance["lookup"].accepted, controller.acceptance["lookup"].drafted = 8.0, 10.0  # alpha 0.8
    # one row of four has a copy: verifying it costs 4 tokens more where the forward packs its real tokens,
    # and 16 more where every row runs the copy's width
    assert controller.choose(4, max_gamma=0, copy_lengths=[4, 0, 0, 0], packed=True) == (4, "lookup")
    assert controller.choose(4, max_gamma=0, copy_lengths=[4, 0, 0, 0], packed=False) == (0, "draft")
    # a fixed gamma copies only what every row has
    fixed = GammaController(4, adaptive=False)
    assert fixed.choose(4, max_gamma=4, max_lookup=0, copy_lengths=[4, 0, 0, 0], packed=True) == (4, "draft")


def test_a_step_copies_for_the_rows_that_have_a_copy_and_output_stays_the_targets(tiny, monkeypatch):
    from sidecar.decoding.plan import StepPlanner

    prompts = random_prompts(tiny, [6, 15, 9, 22], seed=11)
    expected, copy = reference_copier(tiny, prompts, 30, miss=0.5)
    monkeypatch.setattr("sidecar.decoding.plan.lookup_continuation", copy)
    plans = []
    schedule = StepPlanner.schedule
    monkeypatch.setattr(StepPlanner, "schedule", lambda self, *a: plans.append(schedule(self, *a)) or plans[-1])
    decoder = SpeculativeDecoder(tiny, gamma=4, adaptive=True)
    outputs = decoder.generate(prompts, max_new_tokens=30, batch_size=4)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == expected[tuple(prompt)]
    ragged = [p for p in plans if p.source == "lookup" and p.width and 0 in p.caps]
    assert ragged, "no step copied for some rows only"
    for plan in ragged:  # a row copies what it has up to the width, and one without a copy keeps no draft
        assert all(cap == len(c) <= plan.width for cap, c in zip(plan.caps, plan.copies, strict=True))
    for out in outputs:
        st = out.stats
        assert st.drafted == sum(st.drafted_per_position) and st.lookup_accepted <= st.lookup_drafted
