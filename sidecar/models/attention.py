"""Grouped-query attention over a masked cache, copying neither the keys and values nor the mask.

Qwen2.5 models share each key/value head between several query heads (6 on the offline pair). For a
one-token query transformers' SDPA attention folds the query heads of a group into the query axis; for a
longer query under a mask it copies every cached key and value once per query head (``repeat_kv``). A
verify forward is such a query: gamma+1 tokens per row over the row's whole cache, under the engine's 4D
mask, and the copies cost a large share of it. Folding the heads into the query axis for such a query
would need the mask once per head of a group (its rows repeat with the query tokens, which no stride can
express): 3.6 GB per layer for a 7B prefill at batch 64 and 2,000 tokens in bf16.

Instead SDPA gets the query heads as they are, the key/value heads as they are, and the mask [B, 1, q, kv],
which it broadcasts over the heads:

* with ``enable_gqa`` where a fused kernel reads each query head's key/value head in place: the CPU's
  flash kernel, and on CUDA the memory-efficient or cuDNN kernel when it takes these inputs;
* else one call per position in the group: query heads ``r, r + groups, ...`` against the key/value
  heads, each call shaped as plain multi-head attention, which every fused kernel takes with a mask.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

# the attn_implementation name models load with (``sidecar.models.loading.load_model``)
GROUPED_SDPA = "sidecar_grouped_sdpa"


def fused_grouped_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether SDPA with ``enable_gqa`` runs a fused kernel that reads each key/value head in place (else it
    falls back to a math kernel that repeats them per query head)."""
    if query.device.type == "cpu":
        return True  # the flash kernel for CPUs indexes its key/value head from the query head
    if query.device.type != "cuda":
        return False
    params = torch.backends.cuda.SDPAParams(query, key, value, mask, 0.0, False, True)
    return torch.backends.cuda.can_use_efficient_attention(params) or torch.backends.cuda.can_use_cudnn_attention(
        params)


def grouped_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, with multi-token queries under a mask attending to the shared key/value
    heads in place; returns [B, q, H, D] as transformers' does."""
    batch, heads, query_len, head_dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    grouped = (groups > 1 and query_len > 1 and attention_mask is not None and attention_mask.dim() == 4
               and attention_mask.shape[1] == 1 and kwargs.get("position_bias") is None
               and kwargs.get("softcap") is None and not kwargs.get("output_attentions", False))
    if not grouped:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    attend = torch.nn.functional.scaled_dot_product_attention
    if fused_grouped_kernel(query, key, value, attention_mask):
        out = attend(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
    else:
        # query head g * groups + r uses key/value head g: position r of every group at once
        by_position = query.view(batch, kv_heads, groups, query_len, head_dim)
        out = torch.empty_like(by_position)
        for r in range(groups):
            out[:, :, r] = attend(by_position[:, :, r], key, value, attn_mask=attention_mask, dropout_p=dropout,
                                  scale=scaling)
        out = out.view(batch, heads, query_len, head_dim)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_forward)
# the same masks as SDPA, so HF generate on these models (the tests' reference) builds what it always builds
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
