"""Where a greedy output first leaves its reference, and whether that is rounding (a near-tie) or a mismatch: the
one rule the identity tests, the GPU check (``bench.gpu_check``) and the benchmarks' "identical output" column
(``bench.identity``) share.

Speculative decoding scores a token in a verify forward of several positions, the reference in a 1-token step
(and at another batch size). Both compute the same logits, but sum the same products in another order and may
pick other kernels, so in reduced precision a logit can land on a neighbouring representable value. Where the
target's two best logits are that close, the two runs can pick different tokens and neither is wrong.

The bound, for logits of magnitude ``|z|`` in a dtype whose machine epsilon is ``eps`` (the distance from 1 to
the next representable number: 2**-7 in bf16, 2**-10 in fp16, 2**-23 in fp32):

* representable values near ``z`` are at most ``eps * |z|`` apart, so rounding a logit moves it by at most half
  of that, and the difference of two logits by at most ``eps * |z|`` in one run;
* the two runs may round in opposite directions: ``2 * eps * |z|``;
* the hidden state that feeds the LM head carries rounding of the same order from the layers below, which moves
  the logits by as much again: ``4 * eps * |z|`` (``ROUNDINGS``).

So a divergence is a near-tie when the reference's logits there put the two tokens at most
``ROUNDINGS * eps * |z|`` apart, ``|z|`` the larger of their two logits' magnitudes (at least 1); anything
further apart is a mismatch, a bug. In bf16 at ``|z| = 20`` that is 0.63; in fp32 it is 1e-5, so fp32 keeps exact
identity in practice. A divergence with no token on one side (one output is a prefix of the other) is a mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROUNDINGS = 4  # how many roundings of a logit's magnitude two runs may differ by (derivation above)
NEAR_TIE = "near-tie"
MISMATCH = "mismatch"


@dataclass(frozen=True)
class Divergence:
    """The first position where a candidate output leaves its reference, and what the reference's logits say."""

    position: int
    reference_token: int | None  # None: the reference ended here
    candidate_token: int | None  # None: the candidate ended here
    gap: float  # the reference token's logit minus the candidate token's (inf without one of them)
    top2_gap: float  # the target's top-1 minus top-2 logit there
    bound: float  # the largest gap rounding explains
    kind: str  # NEAR_TIE or MISMATCH


def first_divergence(reference: list[int], candidate: list[int]) -> int | None:
    """The first position where the token lists differ (a length difference counts), None when equal."""
    for position, (a, b) in enumerate(zip(reference, candidate, strict=False)):
        if a != b:
            return position
    return None if len(reference) == len(candidate) else min(len(reference), len(candidate))


def near_tie_bound(dtype: torch.dtype, magnitude: float) -> float:
    """The largest logit gap that rounding in ``dtype`` explains between two runs, at logits of ``magnitude``."""
    return ROUNDINGS * torch.finfo(dtype).eps * max(abs(magnitude), 1.0)


def classify_divergence(position: int, logits: torch.Tensor, reference_token: int | None,
                        candidate_token: int | None, dtype: torch.dtype) -> Divergence:
    """The divergence at ``position``, classified from the target's ``logits`` [V] there in the reference run,
    computed in ``dtype``."""
    logits = logits.float()
    top = logits.topk(2).values
    top2_gap = float(top[0] - top[1])
    if reference_token is None or candidate_token is None:
        return Divergence(position, reference_token, candidate_token, float("inf"), top2_gap, 0.0, MISMATCH)
    ours, theirs = float(logits[reference_token]), float(logits[candidate_token])
    gap, bound = ours - theirs, near_tie_bound(dtype, max(abs(ours), abs(theirs)))
    return Divergence(position, reference_token, candidate_token, gap, top2_gap, bound,
                      NEAR_TIE if abs(gap) <= bound else MISMATCH)


def divergence(target: torch.nn.Module, prompt: list[int], reference: list[int],
               candidate: list[int]) -> Divergence | None:
    """Where ``candidate`` first leaves ``reference`` (both continuations of ``prompt``), classified from the
    ``target``'s logits after the shared prefix in one forward at batch 1; None when they are identical."""
    position = first_divergence(reference, candidate)
    if position is None:
        return None
    device = next(target.parameters()).device
    with torch.inference_mode():
        logits = target(torch.tensor([prompt + reference[:position]], device=device)).logits[0, -1]
    return classify_divergence(position, logits, reference[position] if position < len(reference) else None,
                               candidate[position] if position < len(candidate) else None, target.dtype)
