"""Grouped-query attention over a masked cache without copying its keys and values.

Qwen2.5 models share each key/value head between several query heads (6 on the offline pair). For a
one-token query transformers' SDPA attention folds the query heads of a group into the query axis; for a
longer query under a mask it copies every cached key and value once per query head (``repeat_kv``). A
verify forward is such a query: gamma+1 tokens per row over the row's whole cache, under the engine's 4D
mask, and the copies cost a large share of it.

Folding works for any query length: query head ``g * groups + r`` attends with key/value head ``g``, so
the ``groups`` heads of a group become ``groups`` blocks of query rows, each block under the same mask
rows. Every score, softmax and weighted sum is the one SDPA computes for that head and query unfolded.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

# the attn_implementation name models load with (``sidecar.models.load_model``)
GROUPED_SDPA = "sidecar_grouped_sdpa"


def grouped_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, with multi-token queries under a mask folded per key/value head."""
    batch, heads, query_len, head_dim = query.shape
    groups = heads // key.shape[1]
    foldable = (groups > 1 and query_len > 1 and attention_mask is not None and attention_mask.dim() == 4
                and attention_mask.shape[1] == 1 and kwargs.get("position_bias") is None
                and kwargs.get("softcap") is None and not kwargs.get("output_attentions", False))
    if not foldable:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    # [B, H, q, D] -> [B, H / groups, groups * q, D]: row r * q + t is head g * groups + r, token t
    folded = query.reshape(batch, key.shape[1], groups * query_len, head_dim)
    mask = attention_mask.expand(batch, 1, query_len, -1).repeat(1, 1, groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)
    return out.reshape(batch, heads, query_len, head_dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_forward)
# the same masks as SDPA, so HF generate on these models (the tests' reference) builds what it always builds
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
