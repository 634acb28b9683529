"""Prompt log-probabilities: what a model gives each token of a prompt after the tokens before it.

Scoring a text's likelihood needs no decoding: one prefill forward over the prompt, then log-softmax in
float32 of the logits at every position but the last, as ``sidecar.decoding.logprobs`` reports a committed
token's (the model's raw temperature-1 distribution). The first token has no entry: nothing comes before it.

With a ``PrefixCache`` (``sidecar.decoding.prefix_cache``; the server's worker keeps one per model) a prompt
sharing ``k`` leading tokens with a recently scored one takes the entries of tokens ``1 .. k-1`` from it and
forwards only tokens ``k-1 ..`` over the cached keys and values of the first ``k-1`` (the last shared token
runs again: its logits score the first new token); a prompt wholly inside a cached one forwards nothing. The
numbers then equal a whole forward's up to float rounding (other matmul shapes: at most 1.1e-5 on the
logprobs of the real 1.5B/0.5B pair in fp32, judge prompts of ~100 tokens; in bf16 at most 0.06 on the
tiny pair's, 0.01 on a tag set's mean, ``tests/test_prefix_cache.py``), so ranks and top ids may differ
only where two tokens nearly tie; a prompt scored again while cached returns exactly its stored entries.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from sidecar.decoding.prefix_cache import PrefixCache, PrefixEntry
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


def prompt_logprobs(model: PreTrainedModel, token_ids: list[int], top: int,
                    cache: PrefixCache | None = None) -> list[PromptLogprob]:
    """Entries for ``token_ids[1:]`` under ``model`` with ``top`` alternatives each, from one forward over the
    tokens ``cache`` does not already hold (all of them without one)."""
    vocab = model.get_output_embeddings().out_features
    if token_ids and max(token_ids) >= min(vocab, model.get_input_embeddings().num_embeddings):
        raise InputError(f"token id {max(token_ids)} is outside the model's vocabulary of {vocab} tokens")
    top = min(top, vocab)
    if cache is None or not cache.cacheable(token_ids):
        with torch.inference_mode():
            ids = torch.tensor([token_ids], dtype=torch.long, device=model.device)
            hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state[0, :-1]
            return score_hidden(model, hidden, ids[0, 1:], top)
    cache.bind(model)
    found = cache.lookup(token_ids, top)
    if found is not None and found[1] == len(token_ids):  # a prompt the cache holds whole: no forward
        cache.reused_tokens += len(token_ids)
        return [trimmed(e, top) for e in found[0].entries[: len(token_ids) - 1]]
    reused = found[1] - 1 if found is not None else 0
    known = [trimmed(e, top) for e in found[0].entries[: reused]] if found is not None else []
    with torch.inference_mode():
        ids = torch.tensor([token_ids], dtype=torch.long, device=model.device)
        # a fresh cache of copies (DynamicLayer.update concatenates): the stored tensors are never written
        past = DynamicCache(ddp_cache_data=[(k[:, :, :reused], v[:, :, :reused]) for k, v in found[0].keys_values]
                            if reused else None, config=model.config)
        out = model.base_model(input_ids=ids[:, reused:], cache=past, use_cache=True)
        entries = known + score_hidden(model, out.last_hidden_state[0, :-1], ids[0, reused + 1 :], top)
        layers = past.layers  # now over the whole prompt
    cache.reused_tokens += reused
    cache.forwarded_tokens += len(token_ids) - reused
    if all(type(layer) is DynamicLayer for layer in layers):  # whole keys and values: no sliding window
        cache.store(PrefixEntry(tuple(token_ids), tuple((layer.keys, layer.values) for layer in layers),
                                tuple(entries), top))
    return entries


def trimmed(entry: PromptLogprob, top: int) -> PromptLogprob:
    """``entry`` with its ``top`` most likely alternatives (topk's first of more are topk's of fewer)."""
    return entry if len(entry.top) <= top else replace(entry, top=entry.top[:top])


def score_hidden(model: PreTrainedModel, hidden: torch.Tensor, following: torch.Tensor,
                 top: int) -> list[PromptLogprob]:
    """Entries of the ``following`` tokens [n] after the final hidden states [n, d] of the positions before
    them, ``LOGIT_CHUNK`` positions' logits at a time."""
    entries: list[PromptLogprob] = []
    head = model.get_output_embeddings()
    for start in range(0, hidden.shape[0], LOGIT_CHUNK):
        logp = torch.log_softmax(head(hidden[start : start + LOGIT_CHUNK]).float(), dim=-1)
        chosen = following[start : start + logp.shape[0], None]
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
