"""Helpers the decoding tests share: random prompts for the tiny pair and the target's own greedy output."""

from __future__ import annotations

import torch


def random_prompts(pair, lengths, seed=0):
    """Random token ids from 3 up (never 0, so a 0 in a padded forward is padding)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, len(pair.tokenizer), (n,), generator=g).tolist() for n in lengths]


def target_alone(pair, prompt, max_new_tokens):
    """The target's greedy continuation by HF ``generate``, ending at its first end-of-turn token."""
    out = pair.target.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                               eos_token_id=pair.eos_token_ids, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    for k, token in enumerate(tokens):
        if token in pair.eos_token_ids:
            return tokens[: k + 1]
    return tokens


def second_token_distances(outputs, exact: torch.Tensor) -> tuple[float, float]:
    """(total variation between the outputs' second tokens and ``exact``, that of as many exact draws): the
    engine's distance must be of the size sampling noise alone gives."""
    second = torch.tensor([o.token_ids[1] for o in outputs if len(o.token_ids) > 1])
    empirical = torch.bincount(second, minlength=exact.shape[0]).float() / len(second)
    reference = torch.multinomial(exact, len(second), replacement=True, generator=torch.Generator().manual_seed(3))
    noise = torch.bincount(reference, minlength=exact.shape[0]).float() / len(second)
    return (empirical - exact).abs().sum().item() / 2, float((noise - exact).abs().sum()) / 2
