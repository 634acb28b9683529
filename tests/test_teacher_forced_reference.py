"""The real pair's teacher-forced reference (tests/real_pair_identity.py), on the tiny pair in fp32: it is HF
``generate``'s greedy output where the candidate is, and it leaves a candidate that is not, at the first token
that is not the target's pick, or where the candidate ends early without an end-of-sequence token."""

from __future__ import annotations

import pytest
import torch

from bench.identity import compare
from sidecar.decoding.divergence import MISMATCH
from tests.real_pair_identity import Identity, greedy_references, teacher_forced_reference

LIMIT = 12


def test_the_teacher_forced_reference_is_greedy_decoding_and_catches_a_wrong_or_early_ending_output(tiny) -> None:
    prompt = [5, 17, 42, 8, 99, 23]
    greedy = greedy_references(tiny, [prompt], [LIMIT])[0]
    assert teacher_forced_reference(tiny, prompt, greedy, LIMIT) == greedy
    # a token that is not the target's pick: the reference keeps the prefix and takes the pick there
    wrong = [*greedy[:4], (greedy[4] + 1) % len(tiny.tokenizer), *greedy[5:]]
    assert teacher_forced_reference(tiny, prompt, wrong, LIMIT) == greedy[:5]
    # ending before the limit without an end-of-sequence token: the reference goes one token further
    assert len(greedy) == LIMIT and not set(greedy[:8]) & set(tiny.eos_token_ids)
    assert teacher_forced_reference(tiny, prompt, greedy[:7], LIMIT) == greedy[:8]
    identity = Identity(tiny)
    # classified from the teacher-forced forward's logits, as compare classifies it from a forward of its own
    outcome = identity.check("wrong", prompt, wrong, LIMIT)
    assert outcome["kind"] == MISMATCH and outcome["position"] == 4
    assert_same_outcome(outcome, compare(tiny.target, prompt, greedy[:5], wrong, "wrong") | {"tokens": LIMIT})
    early = identity.check("early", prompt, greedy[:7], LIMIT)
    assert_same_outcome(early, compare(tiny.target, prompt, greedy[:8], greedy[:7], "early") | {"tokens": 7})
    assert identity.check("greedy", prompt, greedy, LIMIT)["identical"]
    # the three outputs were forwarded on the prompt's keys and values, computed once and left as they were
    assert list(identity.prompts) == [tuple(prompt)] and identity.prompts[tuple(prompt)][0].get_seq_length() == len(
        prompt)
    assert identity.exact and tiny.dtype == torch.float32


def assert_same_outcome(outcome: dict, expected: dict) -> None:
    """The same outcome, its gaps within fp32's rounding of forwards of other widths (the reference forwards the
    prompt, then the output; compare both at once)."""
    floats = {k for k, v in expected.items() if isinstance(v, float)}
    assert {k: outcome[k] for k in floats} == pytest.approx({k: expected[k] for k in floats}, rel=1e-5, abs=1e-5)
    assert {k: v for k, v in outcome.items() if k not in floats} == {
        k: v for k, v in expected.items() if k not in floats}
