"""Continuous batching on the tiny pair: rows joining a running batch decode exactly as alone.

Greedy rows must equal the target decoding alone; seeded sampled rows must equal the same row decoded
alone, whatever shares their batch and whenever they join; the sampled law must hold for rows that
join mid-batch; and before the final drain a continuous batch keeps every slot busy.
"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from decoding import assert_speculated, random_prompts, second_token_distances, target_alone

from sidecar.decoding.decoder import SpeculativeDecoder
from sidecar.decoding.randomness import ACCEPT, DRAFT, NEXT, draw_key, uniforms
from sidecar.decoding.rows import DecodeRow
from sidecar.decoding.sampling import Sampling
from sidecar.errors import InputError
from sidecar.models.tiny import tiny_pair
from sidecar.runtime.kv_cache import RowKVCache
from sidecar.runtime.slots import SlotPool
from sidecar.tasks.engine import SidecarEngine
from sidecar.tasks.rows import SidecarRequest
from sidecar.tasks.task import HASHTAGS


def arrive_at_random(decoder: SpeculativeDecoder, rows: list[DecodeRow], max_batch: int, seed: int,
                     schedule: str = "continuous"):
    """Decode ``rows`` with each joining after a random number of steps; (outputs, the batch)."""
    rng = random.Random(seed)
    batch = decoder.batch(max_batch, schedule)
    outputs, waiting, joined_mid_batch = {}, list(enumerate(rows)), 0
    while waiting or batch.busy:
        for _ in range(rng.choice([0, 0, 1, 2])):
            if waiting:
                index, row = waiting.pop(0)
                joined_mid_batch += bool(batch.target_rows)
                batch.add(index, row)
        if not waiting:
            batch.close()
        outputs.update(batch.step())
    return [outputs[i] for i in range(len(rows))], batch, joined_mid_batch


@pytest.fixture(scope="module")
def eos_pair():
    """The tiny pair with an end-of-turn token its target emits often, so that rows end by EOS too."""
    pair = tiny_pair()
    counts = np.bincount(np.concatenate([target_alone(pair, p, 30) for p in random_prompts(pair, [6] * 8, 3)]))
    return replace(pair, eos_token_ids=[int(counts.argmax())])


@pytest.mark.parametrize("adaptive", [False, True])
def test_rows_arriving_at_random_decode_as_alone(eos_pair, adaptive, prefill_forwards):
    pair = eos_pair
    rng = random.Random(7)
    prompts = random_prompts(pair, [rng.randint(2, 30) for _ in range(18)], seed=11)
    rows = []
    for i, prompt in enumerate(prompts):
        sampling = Sampling() if i % 3 else Sampling(temperature=0.9, top_p=0.9, seed=100 + i)
        rows.append(DecodeRow(prompt, rng.randint(1, 40), sampling=sampling))
    alone = SpeculativeDecoder(pair, gamma=4, adaptive=adaptive)
    references = [alone.decode([row], batch_size=1)[0] for row in rows]
    # a stop string taken from the middle of two greedy rows' text
    for i in (1, 4):
        text = references[i].text
        if len(text) > 6:
            rows[i].stop = [text[len(text) // 2 : len(text) // 2 + 2]]
            references[i] = alone.decode([rows[i]], batch_size=1)[0]
    decoder = SpeculativeDecoder(pair, gamma=4, adaptive=adaptive)
    outputs, _, joined = arrive_at_random(decoder, rows, max_batch=5, seed=3)
    assert joined > 3, "rows should join a running batch"
    assert_speculated(outputs)
    for row, ref, out in zip(rows, references, outputs, strict=True):
        assert out.token_ids == ref.token_ids
        assert out.finish_reason == ref.finish_reason
        if row.sampling.greedy and not row.stop:
            assert out.token_ids == target_alone(pair, row.target_prompt, row.max_new_tokens)
    reasons = {o.finish_reason for o in outputs}
    assert {"eos", "length", "stop"} <= reasons, reasons


def test_static_and_continuous_schedules_give_the_same_tokens(tiny):
    prompts = random_prompts(tiny, [5, 17, 9, 30, 12, 3, 25, 8, 40, 2, 14], seed=2)
    limits = [3, 40, 12, 25, 6, 33, 18, 2, 40, 9, 27]
    outs = {schedule: SpeculativeDecoder(tiny, gamma=3, adaptive=False).generate(
        prompts, limits, batch_size=4, schedule=schedule) for schedule in ("static", "continuous")}
    assert [o.token_ids for o in outs["static"]] == [o.token_ids for o in outs["continuous"]]
    assert_speculated(outs["static"])
    assert_speculated(outs["continuous"])


def test_a_continuous_batch_keeps_every_slot_busy_until_the_drain(tiny):
    prompts = random_prompts(tiny, [8] * 24, seed=4)
    rows = [DecodeRow(p, limit) for p, limit in zip(prompts, [2, 30, 5, 17] * 6, strict=True)]
    occupancy = {}
    for schedule in ("continuous", "static"):
        decoder = SpeculativeDecoder(tiny, gamma=3, adaptive=False)
        batch = decoder.batch(4, schedule)
        for index, row in enumerate(rows):
            batch.add(index, row)
        batch.close()
        while batch.busy:
            batch.step()
        occupancy[schedule] = batch.trace.occupancy()
        steps = batch.trace.steps
        if schedule == "continuous":
            assert all(s.live == 4 for s in steps[: batch.trace.drain_from]), "a slot sat empty while rows waited"
    assert occupancy["continuous"] == 1.0
    assert occupancy["static"] < 0.8, occupancy


def test_the_stream_reads_rows_only_when_a_slot_is_free(tiny):
    prompts = random_prompts(tiny, [6] * 10, seed=5)
    read = []

    def rows():
        for i, p in enumerate(prompts):
            read.append(i)
            yield DecodeRow(p, 4 + 3 * (i % 3))

    decoder = SpeculativeDecoder(tiny, gamma=3, adaptive=False)
    finished, outputs = [], []
    for index, output in decoder.stream(rows(), max_batch=3):
        finished.append(index)
        outputs.append(output)
        assert len(read) - len(finished) <= 3  # no more rows in memory than slots
        assert output.token_ids == target_alone(tiny, prompts[index], 4 + 3 * (index % 3))
    assert sorted(finished) == list(range(10))
    assert_speculated(outputs)


def test_a_short_request_sent_while_long_ones_run_finishes_first(tiny):
    long_rows = [DecodeRow(p, 60) for p in random_prompts(tiny, [10, 12, 9], seed=6)]
    short = DecodeRow(random_prompts(tiny, [7], seed=8)[0], 3)
    decoder = SpeculativeDecoder(tiny, gamma=3, adaptive=False)
    batch = decoder.batch(4)
    for index, row in enumerate(long_rows):
        batch.add(index, row)
    order = []
    for step in range(200):
        if step == 2:
            batch.add(99, short)
        order += [index for index, _ in batch.step()]
        if not batch.busy:
            break
    assert order[0] == 99


def test_sampled_law_holds_for_rows_joining_mid_batch():
    """The second token of rows that join a batch as others leave follows the target's law."""
    pair = tiny_pair(draft_noise=0.5, seed=1)
    prompt = random_prompts(pair, [7], seed=5)[0]
    temperature = 1.5
    with torch.inference_mode():
        p1 = torch.softmax(pair.target(torch.tensor([prompt])).logits[0, -1].float() / temperature, -1)
        batch = torch.cat([torch.tensor(prompt).expand(p1.shape[0], -1), torch.arange(p1.shape[0])[:, None]], 1)
        p2_given_1 = torch.softmax(pair.target(batch).logits[:, -1].float() / temperature, -1)
        exact = (p1[:, None] * p2_given_1).sum(0)
    n = 2400
    # limits 3..8: rows leave at different steps, and the waiting ones take their slots mid-batch
    rows = [DecodeRow(prompt, 3 + i % 6, sampling=Sampling(temperature, seed=None if i % 2 else i)) for i in range(n)]
    decoder = SpeculativeDecoder(pair, gamma=2, adaptive=False, prompt_lookup=False)
    batch = decoder.batch(400)
    for index, row in enumerate(rows):
        batch.add(index, row)
    batch.close()
    finished = {}
    while batch.busy:
        finished.update(batch.step())
    outs = [finished[i] for i in range(n)]
    assert sum(o.stats.accepted for o in outs) > 0
    assert len(batch.trace.prefills) > 1, "rows should join as others leave"
    tv_engine, tv_reference = second_token_distances(outs, exact)
    assert tv_engine < 1.5 * tv_reference + 0.02


@pytest.mark.parametrize("gamma", [3, 0])  # 0: plain decoding, where a seeded row samples each token itself
def test_a_seeded_row_is_reproducible_whatever_shares_its_batch(tiny, gamma):
    prompt = random_prompts(tiny, [9], seed=9)[0]
    row = DecodeRow(prompt, 30, sampling=Sampling(0.8, 0.95, seed=5))
    alone = SpeculativeDecoder(tiny, gamma=gamma).decode([row], batch_size=1)[0]
    others = [DecodeRow(p, 25, sampling=Sampling(1.0) if i % 2 else Sampling())
              for i, p in enumerate(random_prompts(tiny, [4, 20, 11, 7, 15], seed=10))]
    for seed in (1, 2):
        outputs, _, _ = arrive_at_random(SpeculativeDecoder(tiny, gamma=gamma), [*others[:seed * 2], row, *others],
                                         max_batch=3, seed=seed)
        assert outputs[seed * 2].token_ids == alone.token_ids
        assert gamma or all(o.stats.drafted == 0 for o in outputs)


def test_sidecars_of_a_finished_row_start_before_the_batch_ends(tiny):
    engine = SidecarEngine(tiny, gamma=3, adaptive=False)
    documents = [f"document {i} " * 6 for i in range(3)]
    requests = [SidecarRequest(d, sidecars=[HASHTAGS], max_new_tokens=limit)
                for d, limit in zip(documents, [4, 60, 60], strict=True)]
    batch = engine.batch(3)
    for index, request in enumerate(requests):
        batch.add(index, request)
    batch.close()
    completed_while_long_rows_ran = []
    while batch.busy:
        for index, _ in batch.step():
            completed_while_long_rows_ran.append((index, any(r.finish is None for r in batch.slots.target_rows)))
    assert completed_while_long_rows_ran[0] == (0, True)
    # and the outputs are those of the static schedule, where sidecars wait for their whole batch
    static = engine.run(requests, batch_size=3, schedule="static")
    continuous = engine.run(requests, batch_size=3)
    for a, b in zip(static, continuous, strict=True):
        assert a.main.token_ids == b.main.token_ids
        assert a.sidecars["hashtags"].token_ids == b.sidecars["hashtags"].token_ids


def test_slot_pool_keeps_rows_through_admission_removal_and_growth(tiny):
    pool = SlotPool(tiny.target, 4, 8)
    view = pool.admit(3)
    for layer in range(view.layers):
        view.keys[layer].normal_()
    view.lengths[:] = [3, 5, 7]
    view.position_offset[:] = [0, 10, 20]
    row2 = [k[2, :, :7].clone() for k in pool.cache.keys]
    order = pool.remove([0, 2])
    assert order == [0, 2] and pool.live == 2
    assert pool.active.lengths.tolist() == [3, 7] and pool.active.position_offset.tolist() == [0, 20]
    pool.ensure_capacity(20)
    assert pool.capacity >= 20
    assert all(torch.equal(k[1, :, :7], old) for k, old in zip(pool.cache.keys, row2, strict=True))
    fresh = pool.admit(2)
    assert fresh.lengths.tolist() == [0, 0] and bool(fresh.visible.all())
    budgeted = SlotPool(tiny.target, 4, 8, kv_budget_tokens=64)
    with pytest.raises(InputError, match="KV token budget"):
        budgeted.ensure_capacity(17)


def test_a_cache_written_from_snapshots_attends_as_the_cache_it_came_from(tiny):
    prompts = random_prompts(tiny, [5, 9], seed=12)
    source = RowKVCache(tiny.target, 2, 16)
    pool = SlotPool(tiny.target, 3, 16)
    from sidecar.runtime.forward import forward, prefill
    with torch.inference_mode():
        prefill(tiny.target, source, prompts, None)
        pool.admit(1)
        pool.write([source.snapshot(row, list(range(int(source.lengths[row])))) for row in range(2)])
        step = torch.tensor([[4], [5]])
        a = forward(tiny.target, source, step)
        b = forward(tiny.target, pool.active.rows_view(1, 3), step)
    torch.testing.assert_close(a, b)


def test_counter_based_draws_are_uniform_and_keyed():
    keys = torch.tensor([draw_key(7 + i) for i in range(20000)])
    positions = torch.zeros(20000, 1, dtype=torch.long)
    u = uniforms(keys, positions, NEXT)[:, 0]
    counts = torch.histc(u.float(), 10, 0, 1)
    assert (counts - 2000).abs().max() < 200  # ~4.5 standard deviations
    assert torch.equal(u, uniforms(keys, positions, NEXT)[:, 0])
    others = [uniforms(keys, positions, DRAFT)[:, 0], uniforms(keys, positions, ACCEPT)[:, 0],
              uniforms(keys, positions + 1, NEXT)[:, 0]]
    for other in others:
        assert abs(torch.corrcoef(torch.stack([u, other]))[0, 1]) < 0.05
    assert draw_key(3) == draw_key(3) != draw_key(3, stream=1)
    assert draw_key(None) != draw_key(None)
