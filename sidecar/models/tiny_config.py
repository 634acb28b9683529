"""The tiny pair's model configs as Qwen2Config's fields, without torch or transformers.

A transformers config class imports torch (seconds); the cost report only counts the tiny draft's parameters and
KV bytes from its shapes (``study.cost.draft_config``), so it reads them here. ``sidecar.models.tiny`` builds its
models from the same fields."""

from __future__ import annotations

from types import SimpleNamespace

from sidecar.models.tiny_tokenizer import tiny_vocab_size

# (hidden size, intermediate size: twice the hidden, ``tiny_config_fields``) of the tiny pair's models
TINY_SHAPE = (64, 128)
TINY_LAYERS = 2


def tiny_config_fields(vocab_size: int, layers: int, hidden: int, seed_scale: float = 0.3) -> dict[str, object]:
    """Qwen2Config's arguments for a tiny model (``attn_implementation`` aside, which names a torch kernel)."""
    return {"vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": hidden * 2,
            "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 4096, "initializer_range": seed_scale, "tie_word_embeddings": False}


def tiny_draft_config() -> SimpleNamespace:
    """The config of ``tiny_pair()``'s draft, with ``model_type``, as the attributes a Qwen2Config has."""
    fields = tiny_config_fields(tiny_vocab_size(), layers=TINY_LAYERS, hidden=TINY_SHAPE[0])
    return SimpleNamespace(model_type="qwen2", **fields)
