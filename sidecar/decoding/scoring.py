"""Prompt log-probabilities: what a model gives each token of a prompt after the tokens before it.

Scoring a text's likelihood needs no decoding: one prefill forward over the prompt, without a cache, then
log-softmax in float32 of the logits at every position but the last, as ``sidecar.decoding.logprobs``
reports a committed token's (the model's raw temperature-1 distribution). The first token has no entry:
nothing comes before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from sidecar.errors import InputError

# positions whose logits exist at once: [1024, vocab] in float32 is 620 MB at Qwen's 151,936 tokens, where a
# whole 32k-token prompt's would be 20 GB
LOGIT_CHUNK = 1024


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token after the first: its id, its log-probability there, its ``rank`` (1 + the tokens the
    model found more likely) and the ``top`` most likely (id, logprob), most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


def prompt_logprobs(model: PreTrainedModel, token_ids: list[int], top: int) -> list[PromptLogprob]:
    """Entries for ``token_ids[1:]`` under ``model`` with ``top`` alternatives each, from one forward."""
    vocab = model.get_output_embeddings().out_features
    if token_ids and max(token_ids) >= min(vocab, model.get_input_embeddings().num_embeddings):
        raise InputError(f"token id {max(token_ids)} is outside the model's vocabulary of {vocab} tokens")
    top = min(top, vocab)
    entries: list[PromptLogprob] = []
    with torch.inference_mode():
        ids = torch.tensor([token_ids], dtype=torch.long, device=model.device)
        hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state[0, :-1]
        head = model.get_output_embeddings()
        for start in range(0, hidden.shape[0], LOGIT_CHUNK):
            logp = torch.log_softmax(head(hidden[start : start + LOGIT_CHUNK]).float(), dim=-1)
            chosen = ids[0, 1 + start : 1 + start + logp.shape[0], None]
            picked = logp.gather(-1, chosen)
            rank = (logp > picked).sum(-1, keepdim=True) + 1
            values, indices = logp.topk(top, dim=-1)
            # ids, ranks and float32 logprobs all fit a float64 exactly: one tensor, one transfer
            packed = torch.cat([chosen.double(), picked.double(), rank.double(), indices.double(), values.double()],
                               -1).tolist()
            entries += [PromptLogprob(int(row[0]), row[1], int(row[2]),
                                      tuple(zip(map(int, row[3 : 3 + top]), row[3 + top :], strict=True)))
                        for row in packed]
    return entries
