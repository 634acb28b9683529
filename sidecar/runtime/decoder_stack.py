"""Our own forward of a Qwen2/Llama-style decoder stack: a function of device tensors alone.

Hugging Face's forward spends host time on every call, per layer, whatever the width: keyword plumbing,
output records, the cache interface, the mask helpers, RoPE computed anew. On a GPU at decode widths that
host time is the forward's cost (28 layers for Qwen2.5-1.5B and -7B alike), so the draft would cost what the
target costs. This forward keeps only the arithmetic:

* RoPE as one table of cos/sin rows per position, computed once at load by the model's own rotary module
  (so every rope variant transformers knows comes out the same) and gathered by position;
* the attention mask built on the device from the cache's device state (lengths, visible columns, hidden
  spans), never on the host, over the cache's whole capacity, so its shape does not change from step to step;
* keys and values scattered into the cache's buffers in place and attended with SDPA over the shared
  key/value heads (``enable_gqa``);
* the model's own Linear modules (plain, oneDNN-packed or int8) and norm weights, so nothing is copied.

Every shape comes from the inputs' shapes, every branch from the config: ``torch.compile(fullgraph=True)``
traces it whole, and on CUDA the compiled forward can be captured as a graph
(``sidecar.runtime.capture``).

Padding: query column ``j`` of row ``b`` is real when ``j < valid[b]``. A padded column, and every column of a
padded row (``valid`` 0), writes its key and value into the cache's trash column (the last one, which no
real query attends), so padding a batch or a query up to a bucket never touches a row's real columns.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

# the architectures whose decoder layers this forward reproduces (pre-norm RMSNorm, rotary attention with
# optional q/k/v biases, SwiGLU MLP): Hugging Face's forward stays the path for any other
SUPPORTED = frozenset({"qwen2", "llama"})


def supports(model: PreTrainedModel) -> bool:
    config = model.config.get_text_config()
    return (config.model_type in SUPPORTED and getattr(config, "hidden_act", "silu") == "silu"
            and not getattr(config, "use_sliding_window", False))


# the columns of ``rows`` [B, 3], one forward's per-row state, copied to the device in one transfer
LENGTH, OFFSET, VALID = 0, 1, 2


class DecoderStack(nn.Module):
    """The decoder stack of ``model`` (a ``*ForCausalLM``) as one function of device tensors and the cache's
    buffers; returns the final-norm hidden states [B, q, H]. Holds references to the model's modules only.

    A forward's inputs (B rows, q query columns, C cache columns, the trash column last):
        ids         [B, q] token ids
        rows        [B, 3] per row: filled columns before this forward (the write pointer), the rotary
                    position of column 0 (it grows when columns are evicted), real query columns (the rest
                    are padding)
        query_span  [B, q] hidden-span id of each new token (-1: an ordinary token)
        keys, values  per layer [B, kv_heads, C, D]; visible [B, C] and span [B, C]: the cache's buffers,
                    written in place
        attend      None (every column: one shape for all steps) or a host int: attend only to the first
                    ``attend`` columns (eager mode, where a shape may change and a shorter one costs less)
    """

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        base = model.base_model
        config = model.config.get_text_config()
        self.embed = base.embed_tokens
        self.layers = base.layers
        self.norm = base.norm
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scale = self.head_dim ** -0.5
        self.eps = float(config.rms_norm_eps)
        self.vocab = self.embed.num_embeddings
        param = next(model.parameters())
        positions = torch.arange(config.max_position_embeddings, device=param.device)[None]
        with torch.no_grad():  # [1, P, D] each, in the model's dtype, exactly as the model's rotary module gives
            cos, sin = base.rotary_emb(torch.empty(0, dtype=param.dtype, device=param.device), positions)
        self.register_buffer("cos", cos[0], persistent=False)  # [P, D]
        self.register_buffer("sin", sin[0], persistent=False)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Hugging Face's RMSNorm: normalised in fp32, the weight applied in the input's dtype (one fused op
        in fp32, where the two are the same)."""
        if x.dtype == torch.float32:
            return torch.nn.functional.rms_norm(x, weight.shape, weight, self.eps)
        return weight * torch.nn.functional.rms_norm(x.float(), weight.shape, eps=self.eps).to(x.dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on [B, h, q, D] with cos/sin [B, 1, q, D]."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def forward(self, ids: torch.Tensor, rows: torch.Tensor, query_span: torch.Tensor, keys: list[torch.Tensor],
                values: list[torch.Tensor], visible: torch.Tensor, span: torch.Tensor,
                attend: int | None = None) -> torch.Tensor:
        batch, width = ids.shape
        trash = keys[0].shape[2] - 1
        step = torch.arange(width, device=ids.device)
        real = step[None, :] < rows[:, VALID, None]  # [B, q]
        write = torch.where(real, rows[:, LENGTH, None] + step[None, :], trash)  # [B, q]
        positions = (write + rows[:, OFFSET, None]).clamp(0, self.cos.shape[0] - 1)
        query_span = torch.where(real, query_span, -1)
        columns = trash + 1 if attend is None else attend

        # the cache's mask state takes the new columns, then the mask [B, 1, q, C] (True: attend)
        span.scatter_(1, write, query_span)
        visible.scatter_(1, write, query_span < 0)
        cols = torch.arange(columns, device=write.device)
        causal = cols[None, None, :] <= write[:, :, None]  # a real query never reaches the trash column
        seen = span[:, None, :columns]
        same_span = (seen == query_span[:, :, None]) & (query_span[:, :, None] >= 0)
        allowed = (causal & (visible[:, None, :columns] | same_span))[:, None]  # [B, 1, q, columns]

        cos = self.cos[positions][:, None]  # [B, 1, q, D]
        sin = self.sin[positions][:, None]
        # a target with more embedding rows than its draft can emit ids the draft cannot embed; the draft only
        # proposes, so a stand-in id there costs acceptance, never correctness
        ids = torch.where(ids < self.vocab, ids, 0)
        hidden = self.embed(ids)  # [B, q, H]
        index = write[:, None, :, None].expand(batch, self.kv_heads, width, self.head_dim)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = self.rms_norm(hidden, layer.input_layernorm.weight)
            q = attn.q_proj(x).view(batch, width, self.heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(batch, width, self.kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(batch, width, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
            keys[i].scatter_(2, index, k)
            values[i].scatter_(2, index, v)
            out = torch.nn.functional.scaled_dot_product_attention(
                q, keys[i][:, :, :columns], values[i][:, :, :columns], attn_mask=allowed, scale=self.scale,
                enable_gqa=self.heads != self.kv_heads)
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(batch, width, self.heads * self.head_dim))
            mlp = layer.mlp
            x = self.rms_norm(hidden, layer.post_attention_layernorm.weight)
            hidden = hidden + mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        return self.rms_norm(hidden, self.norm.weight)
