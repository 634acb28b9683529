"""Nucleus (top-p) filtering looks for each row's nucleus among its most likely tokens first, and ranks the
whole vocabulary only where they fall short: the distribution is the one a full sort gives."""

from __future__ import annotations

import pytest
import torch

from sidecar.decoding.acceptance import NUCLEUS_CANDIDATES, nucleus_candidates, warp

VOCAB = 151_936  # Qwen2.5's


def warp_by_full_sort(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The rule written plainly: sort everything, keep the prefix whose mass reaches top_p; top_p 1 keeps all."""
    shape = (-1, *[1] * (logits.dim() - 1))
    probs = torch.softmax(logits.float() / temperature.reshape(shape), dim=-1)
    ranked, order = probs.sort(dim=-1, descending=True)
    drop = ranked.cumsum(-1) - ranked >= top_p.reshape(shape)
    drop[..., 0] = False
    kept = torch.zeros_like(probs).scatter_(-1, order, ranked.masked_fill(drop, 0.0))
    return torch.where(top_p.reshape(shape) >= 1.0, probs, kept / kept.sum(-1, keepdim=True))


def logits_like_a_model(rows: int, width: int, spike: float, seed: int) -> torch.Tensor:
    """[rows, width, VOCAB]: a long tail, and 8 tokens ``spike`` above it at each position (0: flat)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, width, VOCAB, generator=g)
    likely = torch.randint(0, VOCAB, (rows, width, 8), generator=g)
    return logits.scatter_add_(-1, likely, torch.rand(rows, width, 8, generator=g) * spike + spike)


@pytest.mark.parametrize(("spike", "candidates_suffice"), [(12.0, True), (0.0, False)])
def test_the_nucleus_is_the_one_a_full_sort_gives(spike: float, candidates_suffice: bool) -> None:
    """Peaked logits: the nucleus lies among the candidates, which are all that is ranked. Flat ones: it
    reaches past them and the whole vocabulary is ranked. Greedy and unfiltered rows (top_p 1) sit beside
    filtered ones, as in a mixed batch."""
    logits = logits_like_a_model(6, 5, spike, seed=1)
    temperature = torch.tensor([1.0, 0.8, 1.0, 0.7, 1.2, 1.0])
    top_p = torch.tensor([1.0, 0.9, 0.95, 0.5, 0.99, 1.0])
    probs = torch.softmax(logits / temperature.reshape(-1, 1, 1), dim=-1)
    ranked, _ = nucleus_candidates(probs, top_p.reshape(-1, 1, 1), top_p.reshape(-1, 1, 1) >= 1.0)
    assert (ranked.shape[-1] == NUCLEUS_CANDIDATES) == candidates_suffice
    ours, plain = warp(logits, temperature, top_p), warp_by_full_sort(logits, temperature, top_p)
    assert torch.allclose(ours, plain, atol=1e-7)
    kept = (ours > 0).sum(-1)
    assert (kept[top_p < 1] < VOCAB).all() and (kept[top_p >= 1] == VOCAB).all()


def test_a_row_of_top_p_1_keeps_its_whole_distribution_beside_a_filtered_row() -> None:
    logits = logits_like_a_model(2, 1, 12.0, seed=2)
    out = warp(logits, 1.0, torch.tensor([1.0, 0.5]))
    assert torch.equal(out[0], torch.softmax(logits[0], dim=-1))
    assert (out[1] > 0).sum() < NUCLEUS_CANDIDATES
