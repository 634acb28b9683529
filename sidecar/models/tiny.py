"""The tiny pair: random models from a config, sharing a small BPE tokenizer trained on the fly (tests)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from sidecar.models.attention import GROUPED_SDPA
from sidecar.models.pair import ModelPair, eos_ids
from sidecar.models.tiny_config import TINY_LAYERS, TINY_SHAPE, tiny_config_fields
from sidecar.models.tiny_tokenizer import tiny_tokenizer


def tiny_config(vocab_size: int, layers: int, hidden: int, seed_scale: float = 0.3) -> Qwen2Config:
    return Qwen2Config(**tiny_config_fields(vocab_size, layers, hidden, seed_scale), attn_implementation=GROUPED_SDPA)


def tiny_models(vocab_size: int, draft_vocab_size: int | None = None, draft_noise: float = 0.01,
                seed: int = 0, layers: int = TINY_LAYERS) -> tuple[PreTrainedModel, PreTrainedModel]:
    """A random target and a draft that is the target plus noise, so acceptance is neither 0 nor 1.

    The large initializer range makes next-token distributions peaked, so greedy argmax is far from
    ties and batched/unbatched float differences cannot flip it.
    """
    torch.manual_seed(seed)
    target = Qwen2ForCausalLM(tiny_config(vocab_size, layers=layers, hidden=TINY_SHAPE[0])).eval()
    draft = Qwen2ForCausalLM(tiny_config(draft_vocab_size or vocab_size, layers=layers, hidden=TINY_SHAPE[0])).eval()
    with torch.no_grad():
        for t_param, d_param in zip(target.parameters(), draft.parameters(), strict=True):
            if t_param.shape == d_param.shape:
                d_param.copy_(t_param + draft_noise * t_param.std() * torch.randn_like(t_param))
            else:  # embedding rows differ when vocab sizes differ: share the common rows
                rows = min(t_param.shape[0], d_param.shape[0])
                d_param[:rows].copy_(t_param[:rows])
    for model in (target, draft):
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = None
    return target, draft


def tiny_pair(device: torch.device | None = None, dtype: torch.dtype = torch.float32, draft_noise: float = 0.01,
              draft_extra_vocab: int = 0, seed: int = 0, layers: int = TINY_LAYERS) -> ModelPair:
    """The tiny pair; ``layers=28`` gives Qwen2.5-1.5B's and -7B's depth at a width where compute is about
    zero, so a forward's time is its host cost (``bench.host_overhead``)."""
    tokenizer = tiny_tokenizer()
    vocab = len(tokenizer)
    target, draft = tiny_models(vocab + 16, vocab + draft_extra_vocab, draft_noise=draft_noise, seed=seed,
                                layers=layers)
    device = device or torch.device("cpu")
    target.to(device=device, dtype=dtype)
    draft.to(device=device, dtype=dtype)
    pair = ModelPair("tiny", target, draft, tokenizer, device, dtype, eos_ids(tokenizer, target))
    return pair

