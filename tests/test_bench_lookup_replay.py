"""`python -m bench.lookup_replay` checks the engine's lookup counters against the replay of its decisions and
counts HF's prompt-lookup forwards, which its rule's replay predicts."""

from __future__ import annotations

from decoding import random_prompts

from bench.lookup_replay import measure


def test_the_engines_counters_and_hfs_forwards_match_their_replays(tiny) -> None:
    prompts = [p * 3 for p in random_prompts(tiny, [5, 9], seed=2)]  # text that repeats: copies to make
    rows, summary, mismatches = measure(tiny, prompts, limit=24, width=4)
    assert mismatches == [] and all(r["replay_matches_counters"] for r in rows if not r["engine_draft_forwards"])
    assert sum(r["engine_lookup_drafted"] for r in rows) > 0
    for r in rows:  # HF decodes the tiny pair in fp32 too: the same output, and its forwards as its rule walks
        assert r["hf_same_output"] and r["hf_target_forwards"] == r["HF rule target_forwards"]
    assert summary[-1]["tokens_per_target_forward"] == summary[-1]["replayed"]
    walks = {row["what"] for row in summary}
    assert {f"{rule}, a copy of 4 at every step boundary" for rule in ("engine rule", "longest-match rule",
                                                                       "best occurrence (foresight)")} <= walks
