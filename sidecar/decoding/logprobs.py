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

from sidecar.runtime.transfers import to_host

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
    picked = logp.gather(-1, chosen[..., None])
    top = min(top, logp.shape[-1])
    values, indices = logp.topk(top, dim=-1) if top > 0 else (logp[..., :0], chosen[..., None][..., :0])
    # ids and float32 logprobs both fit a float64 exactly: one tensor, one transfer
    packed = to_host(torch.cat([chosen[..., None].double(), picked.double(), indices.double(), values.double()], -1))
    return [[TokenLogprob(int(entry[0]), entry[1],
                          tuple(zip(map(int, entry[2 : 2 + top]), entry[2 + top :], strict=True)))
             for entry in row] for row in packed]
