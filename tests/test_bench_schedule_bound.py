"""`python -m bench.schedule_bound` times both models' forwards and finds the fastest schedule over HF's output."""

from __future__ import annotations

from decoding import random_prompts

from bench.schedule_bound import measure, summarise


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
    assert row["bound_without_draft_s"] <= min(row["copy_2_every_boundary_s"], row["copy_4_every_boundary_s"])
    assert {s["baseline"] for s in summarise(rows, widest=4, gamma=2)} == {"HF plain generate", "HF lookup generate"}
