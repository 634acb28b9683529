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

# tokens a nucleus is first looked for among: a sampled row's nucleus almost always lies in its most likely few
# hundred, and ranking them costs a small fraction of sorting the vocabulary (151,936 on Qwen2.5)
NUCLEUS_CANDIDATES = 512


def nucleus_candidates(probs: torch.Tensor, top_p: float | torch.Tensor,
                       whole: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens each row's nucleus is looked for among, most likely first: on a CPU the NUCLEUS_CANDIDATES
    most likely where they reach every filtered row's ``top_p``, else (and on an accelerator, where the
    check would wait for the device, and a sort is cheap) the whole vocabulary sorted."""
    if probs.device.type == "cpu":
        ranked, order = probs.topk(min(NUCLEUS_CANDIDATES, probs.shape[-1]), dim=-1)
        if bool(((ranked.sum(-1, keepdim=True) >= top_p) | whole).all()):
            return ranked, order
    return probs.sort(dim=-1, descending=True)


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
    whole = torch.as_tensor(top_p, device=probs.device) >= 1.0  # rows that keep every token
    ranked, order = nucleus_candidates(probs, top_p, whole)  # [..., k] descending, and their token ids
    # keep the smallest prefix whose mass reaches top_p (the token that crosses it is kept)
    drop = ranked.cumsum(-1) - ranked >= top_p
    # and never less than the most likely token: a top_p that is 0 in float32 (1e-300) would drop every token
    drop[..., 0] = False
    filtered = torch.zeros_like(probs).scatter_(-1, order, ranked.masked_fill(drop, 0.0))
    return torch.where(whole, probs, filtered / filtered.sum(-1, keepdim=True))


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
