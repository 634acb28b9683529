"""Helpers the decoding tests share: random prompts for the tiny pair, the target's own greedy output by HF
``generate`` (the reference the engine must equal), and the check that an output came from speculation."""

from __future__ import annotations

import torch

from sidecar.decoding.matcher import RowMatcher, apply_bitmask, fill_bitmask
from sidecar.decoding.vocab_align import align_vocab
from sidecar.runtime.capture import attach
from sidecar.runtime.forward import forward, prefill
from sidecar.runtime.kv_cache import RowKVCache


def random_prompts(pair, lengths, seed=0):
    """Random token ids from 3 up (never 0, so a 0 in a padded forward is padding)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, len(pair.tokenizer), (n,), generator=g).tolist() for n in lengths]


def target_alone(pair, prompt, max_new_tokens):
    """The target's greedy continuation by HF ``generate``, ending at its first end-of-turn token."""
    return target_alone_scored(pair, prompt, max_new_tokens)[0]


def target_alone_scored(pair, prompt, max_new_tokens) -> tuple[list[int], torch.Tensor]:
    """(the target's greedy continuation by HF ``generate``, ending at its first end-of-turn token; the log
    softmax of the target's logits at each of its tokens, [tokens, vocab], from ``generate``'s own forwards)."""
    out = pair.target.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                               eos_token_id=pair.eos_token_ids, pad_token_id=0, return_dict_in_generate=True,
                               output_logits=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    ends = [k for k, token in enumerate(tokens) if token in pair.eos_token_ids]
    tokens = tokens[: ends[0] + 1] if ends else tokens
    return tokens, torch.log_softmax(torch.cat(out.logits[: len(tokens)]).float(), -1)


def last_logits(model, ids: list[int], positions: int, vocab: int) -> torch.Tensor:
    """The model's logits [positions, vocab] at the last ``positions`` tokens of ``ids`` (whole recompute)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -positions:].float()
    return align_vocab(logits, vocab)


def constrained_greedy(model, space, constraint, prompt: list[int], limit: int) -> list[int]:
    """``model``'s greedy continuation under ``constraint``, by whole recomputes and a mask before each
    choice (no cache, no batch, no speculation): what a constrained row's output must equal (the target's
    for a main row, the draft's for a draft-only row)."""
    matcher, out = RowMatcher(space, constraint), []
    while len(out) < limit and not (out and out[-1] in space.eos_ids):
        logits = last_logits(model, prompt + out, 1, space.vocab_size)
        apply_bitmask(logits, fill_bitmask([matcher], space.vocab_size))
        token = int(logits.argmax(-1))
        matcher.accept(token)
        out.append(token)
    return out


def assert_speculated(outputs, accepts: bool = True) -> None:
    """The outputs came from speculation, not plain decoding: tokens were drafted, some were accepted, and the
    rows got more than one token per target forward (the prefill counts as one). An identity test whose
    decoder never drafts would pass on a decoder whose speculation is broken. ``accepts=False`` asks only
    that tokens were drafted: where the data do not let any be accepted reliably."""
    stats = [o.stats for o in outputs]
    drafted, accepted = sum(s.drafted for s in stats), sum(s.accepted for s in stats)
    tokens, forwards = sum(s.new_tokens for s in stats), sum(s.target_forwards for s in stats)
    assert drafted > 0, "nothing was drafted: the rows were decoded plainly"
    if not accepts:
        return
    assert accepted > 0, f"none of {drafted} drafted tokens was accepted"
    assert tokens > forwards, f"{tokens} tokens in {forwards} target forwards: speculation gained nothing"


def second_token_distances(outputs, exact: torch.Tensor) -> tuple[float, float]:
    """(total variation between the outputs' second tokens and ``exact``, that of as many exact draws): the
    engine's distance must be of the size sampling noise alone gives."""
    second = torch.tensor([o.token_ids[1] for o in outputs if len(o.token_ids) > 1])
    empirical = torch.bincount(second, minlength=exact.shape[0]).float() / len(second)
    reference = torch.multinomial(exact, len(second), replacement=True, generator=torch.Generator().manual_seed(3))
    noise = torch.bincount(reference, minlength=exact.shape[0]).float() / len(second)
    return (empirical - exact).abs().sum().item() / 2, float((noise - exact).abs().sum()) / 2


def hidden_states(pair, mode: str) -> list[torch.Tensor]:
    """Hidden states of a prefill with a hidden span, a padded multi-token forward and a one-token forward, over
    a cache with more rows than the batch, in ``mode`` (``hf``: Hugging Face's forward)."""
    model = pair.target
    attach(model, mode)
    try:
        prompts = random_prompts(pair, [9, 4, 12], seed=1)
        cache = RowKVCache(model, 4, 64)
        view = cache.rows_view(0, 3)
        with torch.inference_mode():
            last = prefill(model, view, prompts, None, hidden_spans=[[(2, 5)], [], [(0, 3)]], share_prefix=False)
            ids = torch.tensor(random_prompts(pair, [3, 3, 3], seed=2))
            wide = forward(model, view, ids, valid=[3, 2, 3])
            view.commit([3, 2, 3])
            one = forward(model, view, ids[:, :1])
        return [last, wide[0], wide[1, :2], wide[2], one]
    finally:
        attach(model, "hf")
