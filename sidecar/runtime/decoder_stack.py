"""Our own forward of a Qwen2/Llama-style decoder stack: a function of device tensors alone.

Hugging Face's forward spends host time on every call, per layer, whatever the width: keyword plumbing,
output records, the cache interface, the mask helpers, RoPE computed anew. On a GPU at decode widths that
host time is the forward's cost (28 layers for Qwen2.5-1.5B and -7B alike), so the draft would cost what the
target costs. This forward keeps only the arithmetic:

* RoPE as one table of cos/sin rows per position, computed once at load by the model's own rotary module
  (so every rope variant transformers knows comes out the same) and gathered by position;
* the attention mask built on the device from the cache's device state (lengths, visible columns, hidden
  spans), never on the host, over the cache's whole capacity, so its shape does not change from step to step;
* keys and values scattered into the cache's buffers in place and attended with SDPA, the query heads that
  share a key/value head folded into its query rows ([B, kv_heads, G * q, D], G = heads / kv_heads): each key
  and value head is then read once, by one product of G * q rows. A CPU's SDPA over the query heads as they
  are (``enable_gqa``) is several times slower at one query column (docs/design.md); the grouped layout
  computes the same products;
* the model's own weights, so nothing is copied: a layer's q, k and v projections as one ``F.linear`` call, and
  its gate and up projections as another, over weights stacked once whose rows the model's own layers now view
  (``sidecar.runtime.fused_weights``); a oneDNN-packed or int8 Linear (``sidecar.models.cpu_kernels``) is called
  as its module. A one-token forward is host time per op: a layer runs 29 aten ops.

Every shape comes from the inputs' shapes, every branch from the config: ``torch.compile(fullgraph=True)``
traces it whole, and on CUDA the compiled forward can be captured as a graph
(``sidecar.runtime.capture``).

Padding: query column ``j`` of row ``b`` is real when ``j < valid[b]``. A padded column, and every column of a
padded row (``valid`` 0), writes its key and value into the cache's trash column (the last one, which no
real query attends), so padding a batch or a query up to a bucket never touches a row's real columns.

Packing (eager only: ``packed``): where rows have fewer real columns than the query's width (a verify whose rows
copy different lengths, a prefill of prompts of different lengths), the projections and the MLP run over the
real tokens alone, [T, H] for T = sum(valid), and only attention sees the padded [B, q] layout. On a CPU a
projection costs per token, so the padding costs nothing there; a GPU's static shapes keep the padded layout,
where the columns cost next to nothing at decode widths.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedModel

from sidecar.runtime.fused_weights import fuse, plain

# the architectures whose decoder layers this forward reproduces (pre-norm RMSNorm, rotary attention with
# optional q/k/v biases, SwiGLU MLP): Hugging Face's forward stays the path for any other
SUPPORTED = frozenset({"qwen2", "llama"})


def supports(model: PreTrainedModel) -> bool:
    config = model.config.get_text_config()
    return (config.model_type in SUPPORTED and getattr(config, "hidden_act", "silu") == "silu"
            and not getattr(config, "use_sliding_window", False))


# the columns of ``rows`` [B, 3], one forward's per-row state, copied to the device in one transfer
LENGTH, OFFSET, VALID = 0, 1, 2


def real_columns(valid: Sequence[int] | np.ndarray, width: int) -> np.ndarray:
    """The flat indices (b * width + j) of the real columns of a [B, width] query whose row b has ``valid[b]``
    real columns, in order: a packed forward's ``packed``."""
    columns = np.arange(width)
    rows = np.arange(len(valid))[:, None] * width + columns[None, :]
    return rows[columns[None, :] < np.asarray(valid)[:, None]]


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
        packed      None, or [T] the flat indices (b * q + j) of the real columns, in order: the projections and
                    the MLP run over those T tokens only (eager mode); the hidden states of padded columns are 0
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
        half = self.head_dim // 2
        # [P, 2D]: cos, then sin with its first half negated, so that RoPE is x * cos + roll(x) * sin: Hugging
        # Face's rotate_half negates those x instead, the same products
        self.register_buffer("rope", torch.cat((cos[0], -sin[0, :, :half], sin[0, :, half:]), -1), persistent=False)
        self.plan = [self._layer_plan(layer) for layer in self.layers]

    @staticmethod
    def _layer_plan(layer: nn.Module) -> tuple:
        """One layer's weights as this forward calls them: (input norm weight, qkv, o, post-attention norm
        weight, gate_up, down). A projection is a callable of the normed input: ``F.linear`` over the weights
        of plain Linear modules (q, k, v stacked in one weight, gate and up in another: ``fused_weights``),
        else the module itself (a oneDNN-packed or int8 one); qkv and gate_up are a tuple of three (two) where
        they could not be stacked. Calling ``F.linear`` directly skips a module call's host time per Linear."""
        attn, mlp = layer.self_attn, layer.mlp

        def projection(weights: tuple[torch.Tensor, torch.Tensor | None] | None, *modules: nn.Module):
            if weights is None:
                return modules if len(modules) > 1 else modules[0]
            # parameters, so that a compiled region treats them as static (CUDA graphs read them in place)
            weight, bias = (t if t is None or isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)
                            for t in weights)
            return partial(nn.functional.linear, weight=weight, bias=bias)

        def single(linear: nn.Module):
            return projection((linear.weight, linear.bias) if plain(linear) else None, linear)

        return (layer.input_layernorm.weight,
                projection(fuse((attn.q_proj, attn.k_proj, attn.v_proj)), attn.q_proj, attn.k_proj, attn.v_proj),
                single(attn.o_proj), layer.post_attention_layernorm.weight,
                projection(fuse((mlp.gate_proj, mlp.up_proj)), mlp.gate_proj, mlp.up_proj), single(mlp.down_proj))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Hugging Face's RMSNorm: normalised in fp32, the weight applied in the input's dtype (one fused op
        in fp32, where the two are the same)."""
        if x.dtype == torch.float32:
            return torch.nn.functional.rms_norm(x, weight.shape, weight, self.eps)
        return weight * torch.nn.functional.rms_norm(x.float(), weight.shape, eps=self.eps).to(x.dtype)

    def forward(self, ids: torch.Tensor, rows: torch.Tensor, query_span: torch.Tensor, keys: list[torch.Tensor],
                values: list[torch.Tensor], visible: torch.Tensor, span: torch.Tensor,
                attend: int | None = None, packed: torch.Tensor | None = None) -> torch.Tensor:
        batch, width = ids.shape

        def padded(x: torch.Tensor) -> torch.Tensor:
            """[T, F] real tokens (or [B, q, F]) -> [B, q, F], padded columns 0."""
            if packed is None:
                return x
            return x.new_zeros(batch * width, x.shape[-1]).index_copy_(0, packed, x).view(batch, width, -1)

        def real_tokens(x: torch.Tensor) -> torch.Tensor:
            """[B, q, F] -> [T, F] (as it is without packing)."""
            return x if packed is None else x.reshape(batch * width, -1).index_select(0, packed)

        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        half, rotary = head_dim // 2, heads + kv_heads
        trash = keys[0].shape[2] - 1
        step = torch.arange(width, device=ids.device)
        real = step[None, :] < rows[:, VALID, None]  # [B, q]
        write = torch.where(real, rows[:, LENGTH, None] + step[None, :], trash)  # [B, q]
        positions = (write + rows[:, OFFSET, None]).clamp(0, self.rope.shape[0] - 1)
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
        groups = heads // kv_heads  # the query heads of one key/value head attend as its G * q query rows
        allowed = allowed[:, :, None].expand(batch, 1, groups, width, columns).reshape(batch, 1, -1, columns)

        cos, sin = torch.nn.functional.embedding(positions, self.rope)[:, None].chunk(2, -1)  # [B, 1, q, D] each
        # a target with more embedding rows than its draft can emit ids the draft cannot embed; the draft only
        # proposes, so a stand-in id there costs acceptance, never correctness
        ids = torch.where(ids < self.vocab, ids, 0)
        hidden = self.embed(real_tokens(ids[..., None])[..., 0])  # [B, q, H], or [T, H] packed
        index = write[:, None, :, None].expand(batch, kv_heads, width, head_dim)
        for i, (attn_norm, qkv, o_proj, mlp_norm, gate_up, down_proj) in enumerate(self.plan):
            x = self.rms_norm(hidden, attn_norm)
            if isinstance(qkv, tuple):  # three modules
                q, k, v = [padded(proj(x)).view(batch, width, -1, head_dim).transpose(1, 2) for proj in qkv]
                q = q * cos + q.roll(half, -1) * sin
                k = k * cos + k.roll(half, -1) * sin
            else:  # one Linear: [B, heads + 2 kv_heads, q, D], RoPE on the query and key heads at once
                projected = padded(qkv(x)).view(batch, width, -1, head_dim).transpose(1, 2)
                rope = projected[:, :rotary]
                q, k = (rope * cos + rope.roll(half, -1) * sin).split((heads, kv_heads), 1)
                v = projected[:, rotary:]
            keys[i].scatter_(2, index, k)
            values[i].scatter_(2, index, v)
            out = torch.nn.functional.scaled_dot_product_attention(  # [B, kv_heads, G * q, D]
                q.reshape(batch, kv_heads, groups * width, head_dim), keys[i][:, :, :columns],
                values[i][:, :, :columns], attn_mask=allowed, scale=self.scale)
            out = out.view(batch, heads, width, head_dim).transpose(1, 2).reshape(batch, width, heads * head_dim)
            hidden = hidden + o_proj(real_tokens(out))
            x = self.rms_norm(hidden, mlp_norm)
            gate, up = [proj(x) for proj in gate_up] if isinstance(gate_up, tuple) else gate_up(x).chunk(2, -1)
            hidden = hidden + down_proj(torch.nn.functional.silu(gate) * up)
        return padded(self.rms_norm(hidden, self.norm.weight))
