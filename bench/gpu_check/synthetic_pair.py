"""A random-initialised target and draft of Qwen2.5's published shapes whose greedy outputs are known: the pair
the capture-mode part times (``capture_modes``), since a lent GPU has no network to fetch real weights.

Two random models agree on almost no token, so speculation between them would measure a draft that is always
rejected. Here each model's next token depends on its current token only, by a table the weights encode:

* every attention and MLP output projection is zero, so the residual stream stays the current token's
  embedding (every forward still reads every weight and runs every kernel: a forward's time depends on its
  shapes, not its values);
* the LM head's row for token ``next[t]`` is the embedding of ``t``, so after the final RMSNorm the largest logit
  is ``next[t]``'s (a random embedding is far closer to itself than to any other row at these widths).

The target's table walks every ordinary token of the tokenizer once, in a random order, then EOS: a prompt
ending ``new_tokens`` steps before EOS yields exactly ``new_tokens`` tokens and EOS, every step at full width.
The draft's table is the target's on a share ``agreement`` of the tokens and a different token on the rest, so
its per-token acceptance is about ``agreement``.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from bench.gpu_check.step_costs import build_model
from sidecar.models.pair import ModelPair
from sidecar.models.tiny import tiny_tokenizer

# a draft of Qwen2.5-1.5B's quality for Qwen2.5-7B accepts about this share of greedy tokens
AGREEMENT = 0.8


def set_next_token(model: PreTrainedModel, next_of: torch.Tensor) -> None:
    """Make ``model`` predict ``next_of[t]`` after token ``t`` for every ``t < len(next_of)``."""
    base = model.base_model
    with torch.no_grad():
        for layer in base.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = base.embed_tokens.weight
        head = model.get_output_embeddings().weight
        tokens = torch.arange(len(next_of), device=embed.device)
        head[next_of.to(embed.device)] = embed[tokens]


def next_tables(vocab: int, eos: int, specials: int, agreement: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(target's, draft's) next-token tables over ``vocab`` ids: the target's walks the ordinary ids (from
    ``specials`` on) in a random order and ends at ``eos``; the draft's differs on a share 1 - ``agreement``."""
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(vocab - specials, generator=generator) + specials
    target = torch.arange(vocab)  # specials other than EOS map to themselves: no prompt reaches them
    target[order[:-1]] = order[1:]
    target[order[-1]] = eos
    target[eos] = order[0]
    draft = target.clone()
    differ = order[torch.rand(len(order), generator=generator) >= agreement]
    if len(differ) > 1:  # those tokens' targets, rotated among them: each differs, and none is lost
        draft[differ] = target[differ.roll(1)]
    return target, draft


def synthetic_pair(name: str, target_config: dict, draft_config: dict, device: torch.device, dtype: torch.dtype,
                   agreement: float = AGREEMENT) -> ModelPair:
    """The pair of those configs (untied LM heads, so that each can hold its table) with the tiny tokenizer."""
    tokenizer = tiny_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    vocab = min(len(tokenizer), target_config["vocab_size"], draft_config["vocab_size"])
    target_next, draft_next = next_tables(vocab, eos, max(tokenizer.all_special_ids) + 1, agreement)
    target = build_model(target_config | {"tie_word_embeddings": False}, device, dtype)
    draft = build_model(draft_config | {"tie_word_embeddings": False}, device, dtype)
    set_next_token(target, target_next)
    set_next_token(draft, draft_next)
    pair = ModelPair(name, target, draft, tokenizer, device, dtype, [eos])
    pair.target_next, pair.draft_next = target_next, draft_next  # what the outputs follow
    return pair


def prompt_for(pair: ModelPair, length: int, new_tokens: int) -> list[int]:
    """A prompt of ``length`` ordinary tokens after which the target writes ``new_tokens`` tokens, then EOS."""
    table = pair.target_next
    eos = pair.eos_token_ids[0]
    walk = [eos]
    for _ in range(new_tokens + 1):  # back from EOS along the table
        walk.append(int((table == walk[-1]).nonzero()[0]))
    start = walk[-1]
    ordinary = torch.arange(max(pair.tokenizer.all_special_ids) + 1, len(table))
    filler = ordinary[torch.randint(len(ordinary), (length - 1,), generator=torch.Generator().manual_seed(1))]
    return [*filler.tolist(), start]
