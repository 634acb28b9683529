"""Teacher-forced analysis: what acceptance a draft should get on a given output, from one forward each.

Used by the benchmarks and tests to check that batching loses no acceptance and to compare prompts.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from sidecar.models.pair import ModelPair
from sidecar.runtime.forward import forward, logits_at
from sidecar.runtime.kv_cache import RowKVCache


def scored_logits(model: PreTrainedModel, prompt: list[int], output: list[int],
                  hidden: tuple[int, int] | None = None) -> torch.Tensor:
    """Logits predicting each output token given prompt + the output before it, optionally with one
    prompt span hidden from later tokens (as the draft sees a sidecar instruction while drafting)."""
    cache = RowKVCache(model, 1, len(prompt) + len(output) + 1)
    ids = torch.tensor([prompt + output], device=model.device)
    span = torch.full_like(ids, -1)
    if hidden:
        span[0, hidden[0] : hidden[1]] = 0
    with torch.inference_mode():
        h = forward(model, cache, ids, span)
        index = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1, device=model.device)[None]
        return logits_at(model, h, index)[0]


def alpha(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean over positions of sum_v min(p_v, q_v), both cut to their common vocabulary."""
    vocab = min(p_logits.shape[-1], q_logits.shape[-1])
    p = torch.softmax(p_logits[..., :vocab].float(), -1)
    q = torch.softmax(q_logits[..., :vocab].float(), -1)
    return torch.minimum(p, q).sum(-1).mean().item()


def predicted_target_forwards(pair: ModelPair, prompt: list[int], output: list[int], gamma: int, limit: int) -> int:
    """Target forwards greedy speculation with a fixed gamma needs to produce ``output``.

    One draft forward over prompt + output gives the draft's argmax after every true prefix; a round
    accepts the run of them that matches the output, plus the target's own token. gamma shrinks near the
    token limit exactly as in the decoder. The prefill counts as the first forward.
    """
    predictions = scored_logits(pair.draft, prompt, output).argmax(-1).tolist()  # predictions[j] ~ output[j]
    forwards, produced = 1, 1
    while produced < len(output):
        g = min(gamma, max(limit - produced - 1, 0))
        run = 0
        while run < g and produced + run < len(output) and predictions[produced + run] == output[produced + run]:
            run += 1
        produced += run + 1
        forwards += 1
    return forwards
