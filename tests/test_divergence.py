"""The one rule for greedy identity in reduced precision (``sidecar.decoding.divergence``): a divergence where the
reference's logits put the two tokens within a few roundings of their magnitude is a near-tie, anything further a
mismatch. The GPU check's identity part uses the same rule (tests/test_gpu_check.py)."""

from __future__ import annotations

import pytest
import torch
from decoding import random_prompts, target_alone

from sidecar.decoding.decoder import SpeculativeDecoder
from sidecar.decoding.divergence import (
    MISMATCH,
    NEAR_TIE,
    classify_divergence,
    divergence,
    first_divergence,
    near_tie_bound,
)


def logits_with(values: dict[int, float], vocab: int = 16, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Logits [vocab] in ``dtype``: ``values`` at their tokens, -10 elsewhere."""
    logits = torch.full((vocab,), -10.0)
    for token, value in values.items():
        logits[token] = value
    return logits.to(dtype)


def test_first_divergence_counts_a_length_difference() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2
    assert first_divergence([1], [1, 2]) == 1


def test_the_bound_is_a_few_roundings_of_the_logits_magnitude() -> None:
    assert near_tie_bound(torch.bfloat16, 20.0) == 4 * 2**-7 * 20
    assert near_tie_bound(torch.bfloat16, -20.0) == near_tie_bound(torch.bfloat16, 20.0)
    assert near_tie_bound(torch.float32, 20.0) == 4 * 2**-23 * 20
    assert near_tie_bound(torch.float16, 0.01) == 4 * 2**-10  # small logits still round at magnitude 1


def test_a_planted_near_tie_is_a_near_tie() -> None:
    # 20 and the bf16 value just below it (20 - 1/8): one rounding apart, the target's top two
    found = classify_divergence(7, logits_with({3: 20.0, 5: 19.875}), 3, 5, torch.bfloat16)
    assert (found.kind, found.position, found.gap, found.top2_gap) == (NEAR_TIE, 7, 0.125, 0.125)
    assert found.bound == near_tie_bound(torch.bfloat16, 20.0)
    # an exact tie, and the candidate ranked first by the reference's own forward: still rounding
    assert classify_divergence(0, logits_with({3: 20.0, 5: 20.0}), 3, 5, torch.bfloat16).kind == NEAR_TIE
    assert classify_divergence(0, logits_with({3: 19.875, 5: 20.0}), 3, 5, torch.bfloat16).kind == NEAR_TIE


def test_a_planted_large_gap_is_a_mismatch() -> None:
    assert classify_divergence(7, logits_with({3: 20.0, 5: 18.0}), 3, 5, torch.bfloat16).kind == MISMATCH
    # a near-tie at the top says nothing about a token further down
    third = classify_divergence(7, logits_with({3: 20.0, 4: 19.875, 5: 15.0}), 3, 5, torch.bfloat16)
    assert third.kind == MISMATCH and third.top2_gap == 0.125 and third.gap == 5.0
    # fp32 rounds 2**16 times finer: bf16's near-tie gap is a mismatch there
    fp32 = classify_divergence(7, logits_with({3: 20.0, 5: 19.875}, dtype=torch.float32), 3, 5, torch.float32)
    assert fp32.kind == MISMATCH
    # one output a prefix of the other: no token to explain it
    ended = classify_divergence(7, logits_with({3: 20.0, 5: 20.0}), 3, None, torch.bfloat16)
    assert ended.kind == MISMATCH and ended.gap == float("inf")


def test_divergence_reads_the_targets_logits_after_the_shared_prefix(tiny) -> None:
    prompt = random_prompts(tiny, [9])[0]
    reference = target_alone(tiny, prompt, 6)
    assert divergence(tiny.target, prompt, reference, list(reference)) is None
    with torch.inference_mode():
        logits = tiny.target(torch.tensor([prompt + reference[:2]])).logits[0, -1]
    runner_up = int(logits.topk(2).indices[1])
    found = divergence(tiny.target, prompt, reference, [*reference[:2], runner_up])
    assert (found.position, found.reference_token, found.candidate_token) == (2, reference[2], runner_up)
    top = logits.topk(2).values
    assert found.gap == pytest.approx(float(top[0] - top[1])) == found.top2_gap
    assert found.kind == MISMATCH  # the tiny pair runs in fp32 here: exact identity


def test_bf16_divergences_from_the_target_alone_are_near_ties() -> None:
    """The engine in bf16 at batch 12 against HF ``generate`` in bf16, one prompt at a time: rounding may flip a
    near-tie (on this suite's Xeon it flips some), never a token the target prefers clearly."""
    from sidecar.models.tiny import tiny_pair

    pair = tiny_pair(torch.device("cpu"), torch.bfloat16)
    prompts = random_prompts(pair, [5, 17, 9, 30, 12, 3, 22, 8, 14, 26, 6, 19], seed=1)
    outputs = SpeculativeDecoder(pair).generate(prompts, max_new_tokens=40, batch_size=len(prompts))
    found = [divergence(pair.target, p, target_alone(pair, p, 40), o.token_ids) for p, o in zip(prompts, outputs,
                                                                                               strict=True)]
    assert [d for d in found if d is not None and d.kind != NEAR_TIE] == []
