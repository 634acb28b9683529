"""The speculative acceptance rule: which drafted tokens the target keeps, and what it adds.

Greedy: keep the longest prefix of draft tokens equal to the target's argmax, then add the target's
argmax at the first mismatch (or after the last draft token). Sampling: keep draft token x with
probability min(1, p(x)/q(x)); at the first rejection sample from normalize(max(0, p - q)); if every
draft token was kept, sample a bonus token from p. Either way the output follows the target exactly.

Terms: ``g`` is the verify width (drafts per row in the forward); ``caps[b]`` <= g is how many of them
row ``b`` may keep (a row that drafted fewer, or none, in a wider batch); the token after a row's kept
drafts is its *next* token. Random draws come in as uniforms, so the caller decides whose they are.
"""

from __future__ import annotations

import torch


def warp(logits: torch.Tensor, temperature: float | torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Probabilities after temperature and nucleus (top-p) filtering, over the last dimension; the nucleus
    always holds at least the most likely token. Tensor parameters are per row: [B] for logits [B, ..., V]."""
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.reshape(-1, *[1] * (logits.dim() - 1))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if isinstance(top_p, float | int) and top_p >= 1.0:
        return probs
    if isinstance(top_p, torch.Tensor):
        top_p = top_p.reshape(-1, *[1] * (logits.dim() - 1))
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # keep the smallest prefix whose mass reaches top_p (the token that crosses it is kept)
    drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
    # and never less than the most likely token: a top_p that is 0 in float32 (1e-300) would drop every token
    drop[..., 0] = False
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    filtered = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return filtered / filtered.sum(-1, keepdim=True)


def sample_with(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw [B] from probs [B, V] with uniforms u [B] in [0, 1); never a zero-probability token."""
    cdf = probs.double().cumsum(-1)
    target = (u.double() * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_max(probs.shape[-1] - 1)


def _keepable(gamma: int, caps: torch.Tensor | None, device: torch.device) -> torch.Tensor | bool:
    return True if caps is None else torch.arange(gamma, device=device)[None, :] < caps[:, None]


def accept_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor,
                  caps: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_tokens [B, g], target_logits [B, g+1, V] -> (accepted_len [B], next_token [B])."""
    target_choice = target_logits.argmax(-1)
    gamma = draft_tokens.shape[1]
    matches = (draft_tokens == target_choice[:, :gamma]) & _keepable(gamma, caps, draft_tokens.device)
    accepted_len = matches.long().cumprod(dim=1).sum(dim=1)
    next_token = target_choice.gather(1, accepted_len[:, None]).squeeze(1)
    return accepted_len, next_token


def accept_sampled(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                   u_accept: torch.Tensor, u_next: torch.Tensor,
                   caps: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_tokens [B, g], draft_probs [B, g, V], target_probs [B, g+1, V] (same V), uniforms u_accept
    [B, g] for the tests and u_next [B, g+1] for the next token at each position -> (accepted_len, next)."""
    batch, gamma = draft_tokens.shape
    p_draft = target_probs[:, :gamma].gather(-1, draft_tokens[..., None]).squeeze(-1)
    q_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    keep = (u_accept * q_draft < p_draft) & _keepable(gamma, caps, draft_tokens.device)  # u < p/q, no division
    accepted_len = keep.long().cumprod(dim=1).sum(dim=1)

    rows = torch.arange(batch, device=draft_tokens.device)
    p_next = target_probs[rows, accepted_len]
    q_padded = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)
    q_next = q_padded[rows, accepted_len]
    if caps is not None:  # a row that kept all it could keep draws its bonus token from p
        q_next = torch.where((accepted_len < caps)[:, None], q_next, 0.0)
    residual = (p_next - q_next).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    # residual mass is 0 only when p == q exactly, where the rejection had probability 0: sample p
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_next)
    next_token = sample_with(residual, u_next.gather(1, accepted_len[:, None])[:, 0])
    return accepted_len, next_token
