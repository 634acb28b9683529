"""The prefill planner: it learns the cheapest padded-token budget per forward from timed forwards, explores
within its bound, is pinned to one forward on an accelerator or by the setting, and never changes what a
prefill computes."""

from __future__ import annotations

import math
import random
import time

import pytest
import torch
from decoding import random_prompts

from sidecar.runtime.forward import forward, prefill
from sidecar.runtime.kv_cache import RowKVCache
from sidecar.runtime.prefill_plan import (
    CANDIDATES,
    EXPLORE_TRIES,
    PROBE_EVERY,
    PrefillPlanner,
    SecondsPerToken,
    group_rows,
)

CPU = torch.device("cpu")


def batches(count: int, rows: int = 64, seed: int = 0) -> list[list[int]]:
    """Length-sorted batches of prompt lengths, as the nightly flow builds them."""
    rng = random.Random(seed)
    return [sorted(rng.randint(30, 50) for _ in range(rows)) for _ in range(count)]


def cache_curve(best_log2: float):
    """A CPU-like forward cost: per padded token it is lowest at 2**best_log2 padded tokens and grows on
    either side (fixed costs below, cache misses above)."""
    return lambda padded: padded * 1e-4 * (1 + 0.2 * (math.log2(padded) - best_log2) ** 2)


def parallel_curve(padded: int) -> float:
    """A GPU-like forward cost: a fixed launch cost, then little per token, so per-token cost falls with size."""
    return 5e-3 + 1e-6 * padded


def run(planner: PrefillPlanner, workload: list[list[int]], seconds) -> list[int | None]:
    """Prefill each batch with the planner's budget, timing each forward by ``seconds(padded)``; returns the
    budgets given."""
    given = []
    for lengths in workload:
        budget = planner.budget()
        given.append(budget)
        for start, stop in group_rows(lengths, budget):
            rows = lengths[start:stop]
            padded = len(rows) * max(rows)
            planner.observe(padded, sum(rows), seconds(padded))
    return given


def exploiting(given: list[int | None], after: int = len(CANDIDATES) * EXPLORE_TRIES,
               first: int = 1) -> list[int | None]:
    """The budgets of the prefills numbered ``first`` on that follow prefill ``after`` and are not probes."""
    return [b for i, b in enumerate(given, first) if i > after and i % PROBE_EVERY]


def test_group_rows_packs_consecutive_rows_within_the_budget():
    assert group_rows([10, 20, 5, 40], None) == [(0, 4)]
    assert group_rows([10, 20, 5, 40], 60) == [(0, 3), (3, 4)]  # 3 x 20 = 60 fits, 4 x 40 does not
    assert group_rows([10, 20, 5, 40], 1) == [(0, 1), (1, 2), (2, 3), (3, 4)]  # a row wider than the budget runs alone


def test_a_cpu_with_cache_effects_converges_to_the_mid_sized_budget():
    planner = PrefillPlanner(CPU)
    given = run(planner, batches(64), cache_curve(8))
    assert planner.best() == 256
    assert set(exploiting(given)) == {256}


def test_where_per_token_cost_falls_with_size_it_converges_to_one_forward():
    planner = PrefillPlanner(CPU)
    given = run(planner, batches(64), parallel_curve)
    assert planner.best() is None
    assert set(exploiting(given)) == {None}


def test_exploration_is_bounded_and_probes_keep_going():
    planner = PrefillPlanner(CPU)
    given = run(planner, batches(96), cache_curve(8))
    explored = len(CANDIDATES) * EXPLORE_TRIES
    assert set(given[:explored]) == set(CANDIDATES)  # every candidate was tried at the start
    probes = [b for i, b in enumerate(given, 1) if i > explored and b != 256]
    assert len(probes) <= len(given) // PROBE_EVERY
    assert set(probes) == {128, 512}  # both neighbours of the best keep being re-timed


def test_the_choice_follows_a_drift_in_costs():
    planner = PrefillPlanner(CPU)
    run(planner, batches(40), cache_curve(8))
    assert planner.best() == 256
    given = run(planner, batches(80, seed=1), cache_curve(10))  # e.g. a machine with larger caches
    assert planner.best() == 1024
    assert set(exploiting(given, after=90, first=41)) == {1024}


def test_padding_counts_because_cost_is_per_real_token():
    """Two forwards of the same padded size and time: the one with more padding reads as dearer per token."""
    planner = PrefillPlanner(CPU, candidates=(64, 128, None))
    for _ in range(2):
        planner.observe(padded_tokens=64, real_tokens=64, seconds=1.0)
        planner.observe(padded_tokens=128, real_tokens=64, seconds=1.0)  # half of it padding
    assert planner.rates[64].mean == pytest.approx(1 / 64)
    assert planner.rates[128].mean == pytest.approx(1 / 64)
    planner.observe(padded_tokens=128, real_tokens=128, seconds=1.4)  # packed full, less per real token
    assert planner.rates[128].mean < planner.rates[64].mean


def test_a_forward_is_filed_under_its_own_size():
    planner = PrefillPlanner(CPU, candidates=(64, 128, None))
    assert [planner.size_class(n) for n in (1, 64, 65, 128, 129, 10_000)] == [64, 64, 128, 128, None, None]
    assert PrefillPlanner(CPU, candidates=(64, 128)).size_class(10_000) == 128


def test_a_first_timing_is_replaced_by_the_second_then_blended():
    rate = SecondsPerToken(decay=0.5)
    rate.add(10.0)  # a first forward pays one-off costs
    rate.add(2.0)
    assert rate.mean == 2.0
    rate.add(4.0)
    assert rate.mean == 3.0


@pytest.mark.parametrize("device", ["cuda", "mps"])
def test_an_accelerator_prefills_in_one_forward_unless_told_to_learn(device):
    planner = PrefillPlanner(torch.device(device))
    run(planner, batches(20), cache_curve(8))
    assert {planner.budget() for _ in range(20)} == {None}
    learning = PrefillPlanner(torch.device(device), learn=True)
    assert learning.budget() == CANDIDATES[0]


def test_the_setting_forces_one_forward_on_a_cpu(monkeypatch):
    monkeypatch.setenv("SIDECAR_ONE_PREFILL_FORWARD", "1")
    planner = PrefillPlanner(CPU)
    run(planner, batches(20), cache_curve(8))
    assert {planner.budget() for _ in range(20)} == {None}
    assert PrefillPlanner(CPU, learn=True).budget() is None


def test_one_candidate_pins_the_budget(monkeypatch):
    planner = PrefillPlanner(CPU, candidates=(1,))
    assert {planner.budget() for _ in range(5)} == {1}
    monkeypatch.setattr("sidecar.runtime.prefill_plan.CANDIDATES", (32,))  # how tests pin the budget a decoder uses
    assert PrefillPlanner(CPU).budget() == 32
    with pytest.raises(ValueError):
        PrefillPlanner(CPU, candidates=(0, None))


def test_prefill_feeds_the_forwards_group_rows_plans(tiny, monkeypatch):
    """``group_rows`` is the grouping ``sidecar.runtime.forward.prefill`` runs, so a caller can count padded and
    real tokens per forward from it."""
    prompts = random_prompts(tiny, [9, 17, 4, 20, 12, 30, 2], seed=3)
    shapes = []

    def recording_forward(model, cache, ids, span=None, *args, **kwargs):
        shapes.append(tuple(ids.shape))
        return forward(model, cache, ids, span, *args, **kwargs)

    monkeypatch.setattr("sidecar.runtime.forward.forward", recording_forward)
    lengths = [len(p) for p in prompts]
    for budget in (1, 40, 64, None):
        shapes.clear()
        with torch.inference_mode():
            prefill(tiny.target, RowKVCache(tiny.target, len(prompts), 32), prompts, budget, share_prefix=False)
        assert shapes == [(stop - start, max(lengths[start:stop])) for start, stop in group_rows(lengths, budget)]


def test_budgets_from_the_planner_give_what_one_forward_gives(tiny, monkeypatch):
    """A real prefill timed per forward (``time.perf_counter`` around it, exact on a CPU) under each budget the
    planner gives, exploration included, fills the cache and yields the last-token states of one forward."""
    prompts = random_prompts(tiny, [9, 33, 4, 60, 12, 25, 40, 7, 18, 70, 3, 28], seed=5)
    spans = [[], [(3, 8)], [], [(2, 4), (10, 12)], [], [], [], [], [], [], [], []]
    planner = PrefillPlanner(CPU)

    def timed_forward(model, cache, ids, span=None, *args, **kwargs):
        start = time.perf_counter()
        hidden = forward(model, cache, ids, span, *args, **kwargs)
        planner.observe(ids.numel(), int((ids != 0).sum()), time.perf_counter() - start)  # prompts hold no 0
        return hidden

    def prefilled(budget):
        cache = RowKVCache(tiny.target, len(prompts), 80)
        with torch.inference_mode():
            last = prefill(tiny.target, cache, prompts, budget, spans)
        return cache, last

    whole, whole_last = prefilled(None)
    monkeypatch.setattr("sidecar.runtime.forward.forward", timed_forward)
    used = set()
    for _ in range(len(CANDIDATES) + 2):
        budget = planner.budget()
        used.add(budget)
        cache, last = prefilled(budget)
        assert cache.lengths.tolist() == whole.lengths.tolist()
        assert torch.equal(cache.visible, whole.visible) and torch.equal(cache.span, whole.span)
        for row, n in enumerate(whole.lengths.tolist()):
            for layer in range(whole.layers):
                assert torch.allclose(cache.keys[layer][row, :, :n], whole.keys[layer][row, :, :n], atol=1e-5)
                assert torch.allclose(cache.values[layer][row, :, :n], whole.values[layer][row, :, :n], atol=1e-5)
        assert torch.allclose(last, whole_last, atol=1e-5)
    assert {64, 128, None} <= used  # budgets that split these prompts, and one forward
    assert planner.rates[128].mean is not None and planner.rates[None].mean is None
