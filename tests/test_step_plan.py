"""The scheduler's ``StepPlan`` (``sidecar.decoding.plan``): frozen once made, and complete: the rows in slot
order, the per-row choices and the shapes its forwards take."""

from __future__ import annotations

import dataclasses

import pytest

from sidecar.decoding.decoder import SpeculativeDecoder
from sidecar.decoding.plan import (
    ForwardShape,
    StepPlan,
    copy_widths,
    feed_chunking,
    feed_widths,
    forward_shape,
    verify_widths,
)
from sidecar.decoding.rows import DecodeRow
from sidecar.models.tiny import tiny_pair
from sidecar.runtime.capture import attach, runner_of
from sidecar.runtime.slots import SlotPool
from tests.decoding import random_prompts


def test_a_step_plan_is_frozen_and_holds_everything_the_runner_reads(tiny):
    batch = SpeculativeDecoder(tiny, gamma=3, adaptive=False).batch(max_batch=4)
    for key, prompt in enumerate(random_prompts(tiny, [5, 9, 14], seed=3)):
        batch.add(key, DecodeRow(prompt, 12))
    batch.step()  # admits the rows and runs a step: the draft holds their prompts now
    plan = batch.planner.schedule(batch.target_rows, batch.draft_rows, batch._feed, batch.target_pool,
                                  batch.draft_pool)
    rows = len(batch.target_rows)
    assert plan.target_rows == tuple(batch.target_rows) and plan.draft_rows == tuple(batch.draft_rows)
    assert plan.width == 3 and plan.draft_forwards == 3
    assert len(plan.caps) == len(plan.copies) == len(plan.draft_slot) == rows
    assert len(plan.feeds) == len(plan.drafting) == len(batch.draft_rows)
    # eager forwards take the step's real shapes: the verify [pending, 3 drafts], the widest feed
    assert plan.target_shape == ForwardShape(rows, rows, 4)
    assert plan.draft_shape == ForwardShape(len(batch.draft_rows), len(batch.draft_rows), max(map(len, plan.feeds)))
    assert plan.next_draft_shape == ForwardShape(len(batch.draft_rows), len(batch.draft_rows), 1)
    # the verify runs the planned shape; only eager drafting that stops early narrows it, to its real width
    assert plan.verify_shape(3) == plan.target_shape
    assert dataclasses.replace(plan, stop_early=True).verify_shape(1) == ForwardShape(rows, rows, 2)

    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.width = 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.draft_forwards = 1
    for per_row in (plan.caps, plan.copies, plan.feeds, plan.drafting, plan.draft_slot, plan.target_rows,
                    *plan.copies, *plan.feeds):
        assert isinstance(per_row, tuple)  # nothing in a plan can be changed in place either


@pytest.mark.parametrize(("mode", "shapes"), [
    ("eager", [ForwardShape(3, 3, 4), ForwardShape(5, 5, 9), ForwardShape(12, 12, 1)]),
    # compiled: capture's buckets, the batch at most the pool's slots
    ("compile", [ForwardShape(3, 4, 4), ForwardShape(5, 8, 16), ForwardShape(12, 12, 1)]),
])
def test_a_forwards_shape_is_captures_bucket_when_its_runner_compiles(mode, shapes):
    pair = tiny_pair(layers=1)
    before = runner_of(pair.target)
    attach(pair.target, mode)  # compiles nothing until a forward runs
    try:
        pool = SlotPool(pair.target, 12, 64)
        assert [forward_shape(pool, s.rows, w) for s, w in zip(shapes, (4, 9, 1), strict=True)] == shapes
    finally:
        attach(pair.target, before.mode if before is not None else "hf")


def test_a_compiled_draft_feed_takes_a_warmed_width_and_a_wider_one_runs_in_chunks():
    """Where the draft compiles, a first draft feed takes only the widths warm-up compiles (1, 2, gamma + 3, as
    ``width_bucket`` pads it): 3 .. gamma + 3 columns pad to gamma + 3, wider run as chunks of it, each row's
    tokens left-aligned by feed position (token p in chunk p // F, column p % F). Eager: one forward, real width."""
    assert feed_widths(3) == {1, 2, 6} and feed_widths(1) == {1, 2, 4} and feed_widths(6) == {1, 2, 16}
    assert [feed_chunking(n, 3, static=True) for n in (1, 2, 3, 6, 7, 12, 13)] == [
        (1, 1), (2, 1), (6, 1), (6, 1), (6, 2), (6, 2), (6, 3)]
    assert [feed_chunking(n, 3, static=False) for n in (1, 3, 13)] == [(1, 1), (3, 1), (13, 1)]
    feeds = (tuple(range(1, 14)), (20, 21), (30,) * 7)
    plan = StepPlan(0, "draft", (), (), False, feeds=feeds, draft_forwards=1,
                    draft_shape=ForwardShape(3, 4, 6), feed_chunks=3)
    assert [plan.feed_chunk(c) for c in range(3)] == [
        [(1, 2, 3, 4, 5, 6), (20, 21), (30,) * 6], [(7, 8, 9, 10, 11, 12), (), (30,)], [(13,), (), ()]]
    one = dataclasses.replace(plan, draft_shape=ForwardShape(3, 3, 13), feed_chunks=1)
    assert one.feed_chunk(0) == list(feeds)


def test_a_copy_past_gamma_verifies_at_one_more_compiled_width():
    """The target's widths: a plain step, a verify of 1 .. gamma drafts, and of the longest copy; where it
    compiles, a copy past gamma is offered only where its verify pads (``width_bucket``) to the longest copy's,
    so warm-up compiles one shape more per batch bucket. Eager: every copy length at its real width."""
    assert verify_widths(4, 10) == {1, 2, 3, 4, 5, 11}
    assert verify_widths(4, 4) == verify_widths(4, 2) == set(range(1, 6))
    assert copy_widths(4, 10, static=False) == list(range(1, 11))
    assert copy_widths(4, 10, static=True) == [1, 2, 3, 4, 8, 9, 10]  # verifies of 9 .. 11 pad to 16
    assert copy_widths(3, 7, static=True) == [1, 2, 3, 7]  # a verify of 8 is exact
    assert copy_widths(4, 2, static=True) == [1, 2]
