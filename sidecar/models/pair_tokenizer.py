"""A pair's tokenizer without its models: what a sharded run's parent counts tokens with to cut its shards.

The tiny pair's loads no torch (``sidecar.models.tiny_tokenizer``); a real pair's goes through transformers'
``AutoTokenizer``, which imports it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sidecar.models.pair_names import pair_model_ids
from sidecar.models.tiny_tokenizer import tiny_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(name_or_spec: str = "qwen-coder-small") -> PreTrainedTokenizerBase:
    """The tokenizer of a pair (see :func:`sidecar.models.loading.load_pair`), without its models: for counting
    tokens."""
    if name_or_spec == "tiny":
        return tiny_tokenizer()
    target = pair_model_ids(name_or_spec)[0]  # a mistyped name is refused before transformers loads
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target)
