"""`python -m bench.schedule_bound` times both models' forwards and finds the fastest schedule over HF's output."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from decoding import random_prompts

from bench.schedule_bound import StepSeconds, measure, measure_batches, step_seconds, summarise, summarise_batches
from sidecar.decoding.trace import BatchTrace, StepRecord
from sidecar.runtime.ledger import ForwardRecord
from study.schedule_bound import ForwardCosts, fastest_schedule


def test_the_bound_covers_hfs_output_with_the_forwards_it_timed(tiny) -> None:
    prompts = [p * 3 for p in random_prompts(tiny, [5], seed=2)]  # text that repeats: copies to make
    rows = measure(tiny, prompts, limit=12, gamma=2, widest=4, rounds=1)
    row = rows[0]
    assert len(row["target_forward_ms"]) == 5 and row["draft_forward_ms"] > 0 and row["target_prefill_s"] > 0
    at = 1  # the steps it names produce the reference, each keeping no more than its source had right there
    for kind, kept in row["bound_steps"]:
        assert kept <= {"plain": 0, "copy": row["copies"][at], "draft": row["drafts"][at]}[kind]
        at += kept + 1
    assert at >= row["tokens"] and row["bound_s"] <= row["bound_without_draft_s"]
    assert row["bound_without_draft_s"] <= min(row["copy_2_every_boundary_s"], row["copy_4_every_boundary_s"],
                                               row["tree_3_every_boundary_s"], row["tree_4_every_boundary_s"])
    # the engine's own steps priced like the schedules: never below the cheapest schedule of its output (fp32: HF's)
    assert row["engine_same_output"] and row["bound_s"] <= row["engine_priced_s"]
    assert 0 < row["engine_forwards_s"] < row["engine_s"]
    assert row["copy_2_target_forwards"] >= row["tokens"] / 3  # a step of a copy of 2 yields at most 3 tokens
    summary = summarise(rows, widest=4, gamma=2)
    assert {s["baseline"] for s in summary} == {"HF plain generate", "HF lookup generate"}
    assert all(s["tree_3_ratio"] <= s["bound_without_draft_ratio"] for s in summary)


def test_the_batch_bound_covers_each_rows_output_at_its_share_of_the_batchs_forwards(tiny) -> None:
    prompts = [p * 3 for p in random_prompts(tiny, [5, 7, 6], seed=3)]
    rows = measure_batches(tiny, prompts, batch=3, limit=10, gamma=2, widest=3, rounds=1)
    (row,) = rows
    assert row["rows"] == 3 and len(row["target_forward_ms"]) == len(row["one_row_target_forward_ms"]) == 4
    assert row["target_prefill_s"] == min(row["target_prefill_one_forward_s"], row["target_prefill_row_by_row_s"],
                                          row["engine_prefill_s"], row["every_row_prefill_s"])
    share = ForwardCosts(tuple(ms / 3e3 for ms in row["target_forward_ms"]), row["draft_forward_ms"] / 3e3, 0.0,
                         row["draft_prefill_s"] / 3)
    rows_alone = sum(fastest_schedule(c, d, share, 3).seconds for c, d in zip(row["copies"], row["drafts"],
                                                                               strict=True))
    assert row["bound_s"] == pytest.approx(row["target_prefill_s"] + rows_alone)
    assert row["bound_s"] <= row["bound_without_draft_s"] and row["tokens"] >= 3
    assert row["engine_every_row_s"] > 0 and row["every_row_target_forwards"] >= row["tokens"] / 3 / 4
    assert row["engine_prefill_s"] < row["engine_forwards_s"] < row["engine_s"]
    # the steps with every row live, then the drain: the steps after the first row left, each timed
    assert row["engine_full_steps"] >= 1 and row["engine_drain_steps"] < row["engine_target_forwards"]
    assert (row["engine_drain_s"] > 0) == (row["engine_drain_steps"] > 0)
    assert 0 < row["engine_full_s"] + row["engine_drain_s"] < row["engine_forwards_s"]  # the prefill's are apart
    (summary,) = summarise_batches(rows)
    assert summary["goal"] == 1.4 and summary["bound_ratio"] == row["hf_plain_batched_s"] / row["bound_s"]


def test_a_batch_s_steps_split_at_the_first_row_s_end_each_timed_by_its_draft_and_target_forwards() -> None:
    trace = BatchTrace(3, keep=None)
    for live in (3, 3, 2, 1):
        trace.add(StepRecord(live=live, width=1, draft_forwards=0, draft_feed=0))

    def verify(seconds: float) -> ForwardRecord:
        return ForwardRecord("target", "decode", 3, 6, 0, {}, seconds)

    records = [ForwardRecord("target", "prefill", 3, 30, 30, {}, 9.0), verify(1.0),
               ForwardRecord("draft", "decode", 3, 3, 0, {}, 5.0), verify(2.0), verify(0.5), verify(0.25)]
    assert step_seconds(SimpleNamespace(trace=trace, ledger=SimpleNamespace(records=records))) == StepSeconds(
        full_steps=2, full_s=8.0, drain_steps=2, drain_s=0.75)
    with pytest.raises(RuntimeError, match="not one a step"):
        step_seconds(SimpleNamespace(trace=trace, ledger=SimpleNamespace(records=records[:-1])))
