"""Log-probabilities of committed tokens: what a model gave each token it emitted, and its top alternatives.

The reported distribution is the model's own: log-softmax of its raw logits over the whole output
vocabulary at temperature 1, before any temperature or nucleus warping, as OpenAI reports them. Under
greedy decoding the emitted token is therefore the first of the top alternatives; under sampling it may
be any token the warped distribution allowed. Collection is asked for per call (``top_logprobs``); a call
that does not ask computes nothing and syncs nothing extra.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# OpenAI's bound on ``top_logprobs``
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token: its id, its log-probability, and the ``top`` most likely (id, logprob) there,
    most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, top: int) -> list[list[TokenLogprob]]:
    """Entries for ``chosen`` [B, k] under ``logits`` [B, k, V] (position j's logits chose token j), each with
    the ``top`` most likely alternatives; one host transfer for the whole batch."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(-1, chosen[..., None])[..., 0].tolist()
    ids = chosen.tolist()
    if top > 0:
        values, indices = logp.topk(min(top, logp.shape[-1]), dim=-1)
        alternatives = [[tuple(zip(i, v, strict=True)) for i, v in zip(row_i, row_v, strict=True)]
                        for row_i, row_v in zip(indices.tolist(), values.tolist(), strict=True)]
    else:
        alternatives = [[()] * len(row) for row in ids]
    return [[TokenLogprob(t, p, a) for t, p, a in zip(row_t, row_p, row_a, strict=True)]
            for row_t, row_p, row_a in zip(ids, picked, alternatives, strict=True)]
