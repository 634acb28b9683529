"""How a benchmark says whether an engine's greedy output is HF's: every bench that compares outputs with HF
words it here, by ``sidecar.decoding.divergence``'s rule (the one the identity tests and ``bench.gpu_check`` use).

Each comparison keeps ``identical`` (exact token-list equality) and its ``kind``: identical, a near-tie (the two
tokens' logits within the rounding of the dtype, so the verify forward and HF's 1-token step may round them apart:
allowed, counted) or a mismatch (a bug). A column of comparisons reads "yes", "near-ties 2 of 8 (gaps <= 0.13,
bound 0.4)" or "MISMATCH 1 of 8"; a mismatch makes the bench exit non-zero after it wrote its results.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from sidecar.decoding.divergence import MISMATCH, NEAR_TIE, divergence

IDENTICAL = "identical"


def compare(target: torch.nn.Module, prompt: list[int], reference: list[int], candidate: list[int],
            label: str) -> dict:
    """``candidate`` against HF's ``reference`` output for ``prompt``: exact equality, the kind and, where they
    diverge, the Divergence's fields (position, tokens, gap, top2_gap, bound). ``label`` names the comparison in
    a failure. Against HF's padded batched generate too, the divergence is classified from the target's logits at
    batch 1 (what ``divergence`` computes): the same logits up to the rounding the bound allows for."""
    found = divergence(target, prompt, reference, candidate)
    if found is None:
        return {"label": label, "identical": True, "kind": IDENTICAL}
    return {"label": label, "identical": False, **dataclasses.asdict(found)}


def verdict(comparisons: list[dict]) -> str:
    """The "identical output" cell for these comparisons: yes, near-ties with the largest gap and its bound, or
    how many mismatch."""
    mismatches = sum(c["kind"] == MISMATCH for c in comparisons)
    if mismatches:
        return f"MISMATCH {mismatches} of {len(comparisons)}"
    ties = [c for c in comparisons if c["kind"] == NEAR_TIE]
    if not ties:
        return "yes"
    widest = max(ties, key=lambda c: abs(c["gap"]))
    return (f"near-ties {len(ties)} of {len(comparisons)} (gaps <= {abs(widest['gap']):.2g}, "
            f"bound {widest['bound']:.2g})")


def failures(comparisons: list[dict]) -> list[str]:
    """One line per mismatch: where, which tokens, and how far the gap is above the bound."""
    return [f"{c['label']}: mismatches HF at token {c['position']} (HF {c['reference_token']}, this run "
            f"{c['candidate_token']}, logit gap {c['gap']:.3g} above the near-tie bound {c['bound']:.3g})"
            for c in comparisons if c["kind"] == MISMATCH]


def exit_on_mismatch(comparisons: list[dict]) -> None:
    """Exit non-zero naming every mismatch, so a wrong engine cannot publish a table; near-ties pass. Called
    after the results are written, so the evidence stays on disk."""
    if lines := failures(comparisons):
        sys.exit("outputs mismatch HF beyond a near-tie:\n" + "\n".join(lines))
