"""Prompt lookup replayed over a finished output (study/lookup_replay.py): the engine's counters, HF's rule, and
why counting a copy at every position overstates acceptance."""

from __future__ import annotations

import random

import torch
from decoding import random_prompts
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from sidecar import SpeculativeDecoder
from study.lookup_replay import engine_rule, engine_steps, hf_rule, longest_match_rule, per_position, stepped


def test_counting_every_position_weights_the_stretches_that_copy_well():
    """An output that copies 8 tokens of the prompt, then 6 whose copies fail. Per position, the copied stretch
    offers 8 proposals (accepted 4, 4, 4, 4, 3, 2, 1, 0 of 4); the walk at width 4 crosses it in 2 copy steps,
    while the failing stretch costs both a step per token."""
    prompt = [*range(100, 108), 7]
    output = [*range(100, 108), 100, 300, 100, 301, 100, 302]
    forced = per_position(prompt, output, 4)
    assert (forced.copy_steps, forced.drafted, forced.accepted) == (11, 40, 22)
    walked = stepped(prompt, output, 4)
    # at 1: 101..104, all 4 accepted; at 6: 106 107 7 100, 2; at 9: 101..104, none; at 10: no copy; at 11:
    # 300 100 (the latest match runs into the end of the text), none; at 12: no copy; at 13: 301 100, none
    assert (walked.copy_steps, walked.plain_steps, walked.drafted, walked.accepted) == (5, 2, 16, 6)
    assert walked.tokens_per_target_forward == 14 / 8
    assert forced.acceptance == 22 / 40 and walked.acceptance == 6 / 16
    both = walked + stepped(prompt, output[:8], 4)  # a row of 8 tokens: 2 copy steps (4, then the last 2)
    assert (both.target_forwards, both.tokens) == (8 + 3, 14 + 8)  # each row's prefill counts


def test_the_replay_stops_copies_at_the_token_limit_as_the_engine_does():
    prompt, output = [5, 6, 7, 8, 9, 5], [6, 7, 8, 9]
    assert stepped(prompt, output, 4, limit=4).drafted == 2  # at position 1: 4 - 1 - 1 tokens of room
    assert stepped(prompt, output, 4).drafted == 4  # 7 8 9 5


def test_the_longest_match_rule_copies_after_the_occurrence_that_shares_the_most_context():
    # "2 3 4" occurs twice before the end; the engine's rule copies after the later, the longest match after the
    # one that "1 2 3 4" shares
    context = [1, 2, 3, 4, 10, 7, 2, 3, 4, 11, 1, 2, 3, 4]
    assert engine_rule(context, 2) == [11, 1]
    assert longest_match_rule(context, 2) == [10, 7]
    assert longest_match_rule([7, 1, 9, 8, 1, 9, 3, 1, 9], 2) == [3, 1]  # "1 9" twice, alike: the later
    assert longest_match_rule([5, 6, 5, 6], 3) == [5, 6]  # a match may run back to the text's start
    assert longest_match_rule([1, 2, 3], 4) == []  # the last token occurs nowhere before


def test_hf_rule_proposes_what_transformers_proposes():
    rng = random.Random(0)
    for _ in range(200):
        context = [rng.randrange(6) for _ in range(rng.randrange(2, 30))]
        most = rng.randrange(1, 6)
        generator = PromptLookupCandidateGenerator(num_output_tokens=most, max_matching_ngram_size=2,
                                                   max_length=1000)
        candidates, _ = generator.get_candidates(torch.tensor([context]))
        assert hf_rule()(context, most) == candidates[0, len(context):].tolist(), context


def test_replaying_the_engines_decisions_gives_its_lookup_counters(tiny):
    """With the draft model priced out (``learned_controller``), the adaptive engine copies or steps plainly;
    walking its decisions over its output with its own rule gives its counters exactly."""
    from tests.test_engine import learned_controller

    # prompts that repeat themselves, so that copies are proposed, and some accepted, by the tiny target
    prompts = [p * 3 for p in random_prompts(tiny, [5, 9, 4, 12], seed=2)]
    copied = 0
    for prompt in prompts:
        decoder = SpeculativeDecoder(tiny, gamma=4)
        learned_controller(decoder, draft_step_s=0.5, draft_prefill_s_per_token=1.0)
        out = decoder.generate([prompt], max_new_tokens=40)[0]
        st = out.stats
        assert st.draft_forwards == 0
        replay = engine_steps(prompt, out.token_ids, list(decoder.controller.decisions), engine_rule)
        assert (replay.drafted, replay.accepted) == (st.lookup_drafted, st.lookup_accepted)
        assert replay.target_forwards == st.target_forwards
        copied += st.lookup_drafted
    assert copied > 0
