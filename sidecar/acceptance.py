"""The speculative acceptance rule: which drafted tokens the target keeps, and what it adds.

Greedy: keep the longest prefix of draft tokens equal to the target's argmax, then add the target's
argmax at the first mismatch (or after the last draft token). Sampling: keep draft token x with
probability min(1, p(x)/q(x)); at the first rejection sample from normalize(max(0, p - q)); if every
draft token was kept, sample a bonus token from p. Either way the output follows the target exactly.
"""

from __future__ import annotations

import torch


def warp(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Probabilities after temperature and nucleus (top-p) filtering, over the last dimension; the nucleus
    always holds at least the most likely token."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # keep the smallest prefix whose mass reaches top_p (the token that crosses it is kept)
    drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
    # and never less than the most likely token: a top_p that is 0 in float32 (1e-300) would drop every token
    drop[..., 0] = False
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    filtered = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return filtered / filtered.sum(-1, keepdim=True)


def accept_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_tokens [B, g], target_logits [B, g+1, V] -> (accepted_len [B], next_token [B])."""
    target_choice = target_logits.argmax(-1)
    gamma = draft_tokens.shape[1]
    matches = (draft_tokens == target_choice[:, :gamma]).long()
    accepted_len = matches.cumprod(dim=1).sum(dim=1)
    next_token = target_choice.gather(1, accepted_len[:, None]).squeeze(1)
    return accepted_len, next_token


def accept_sampled(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                   generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_tokens [B, g], draft_probs [B, g, V], target_probs [B, g+1, V] (same V) -> (accepted_len, next)."""
    batch, gamma = draft_tokens.shape
    p_draft = target_probs[:, :gamma].gather(-1, draft_tokens[..., None]).squeeze(-1)
    q_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    u = torch.rand(batch, gamma, generator=generator, device=draft_tokens.device)
    keep = u * q_draft < p_draft  # u < p/q without dividing by q
    accepted_len = keep.long().cumprod(dim=1).sum(dim=1)

    rows = torch.arange(batch, device=draft_tokens.device)
    p_next = target_probs[rows, accepted_len]
    q_padded = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)
    residual = (p_next - q_padded[rows, accepted_len]).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    # residual mass is 0 only when p == q exactly, where the rejection had probability 0: sample p
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_next)
    next_token = torch.multinomial(residual, 1, generator=generator).squeeze(1)
    return accepted_len, next_token


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)
