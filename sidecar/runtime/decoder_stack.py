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
(``sidecar.runtime.capture``). Compiled, two things keep a forward cheap to compile and to run:

* each layer's arithmetic is two nested compile regions (``torch.compiler.nested_compile_region``): its norm,
  projection and RoPE (``layer_qkv``), then its attention, output projection and MLP (``layer_rest``), compiled
  once and called by every layer, so most of a shape's compile does not grow with the depth (28 layers for
  Qwen2.5-1.5B and -7B); the cache's writes stay between the regions, since a region that wrote its inputs
  would get a copy of the whole cache to write (eager, the same functions run without regions);
* the cache is written with ``index_put_``: a ``scatter_`` into an input that is read after it makes inductor copy
  the whole buffer, every layer's keys and values on every forward (eager keeps ``scatter_``, the cheaper call).

``regional`` (``StackRunner`` sets it for a compiled stack of ``capture.REGIONAL_DEPTH`` layers or more) makes the
layers' functions regions; without it they are plain calls.

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
from typing import NamedTuple

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


class Weights(NamedTuple):
    """A Linear's weights, called with ``F.linear``."""

    weight: torch.Tensor
    bias: torch.Tensor | None


def project(x: torch.Tensor, projection: Weights | nn.Module) -> torch.Tensor:
    return (torch.nn.functional.linear(x, projection.weight, projection.bias) if isinstance(projection, Weights)
            else projection(x))


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

    def __init__(self, model: PreTrainedModel, regional: bool = False) -> None:
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
        # [P, D] each: cos, and sin with its first half negated, so that RoPE is x * cos + roll(x) * sin: Hugging
        # Face's rotate_half negates those x instead, the same products
        self.register_buffer("cos", cos[0].contiguous(), persistent=False)
        self.register_buffer("sin", torch.cat((-sin[0, :, :half], sin[0, :, half:]), -1), persistent=False)
        self.plan = [self._layer_plan(layer) for layer in self.layers]
        self.dims = LayerDims(self.heads, self.kv_heads, self.head_dim, self.eps, self.scale)
        self.qkv, self.rest = (regional_qkv, regional_rest) if regional else (layer_qkv, layer_rest)

    @staticmethod
    def _layer_plan(layer: nn.Module) -> tuple:
        """One layer's weights as this forward calls them: (input norm weight, qkv, o, post-attention norm
        weight, gate_up, down). A projection (``project``) is ``Weights`` for ``F.linear`` over plain Linear
        modules' weights (q, k, v stacked in one weight, gate and up in another: ``fused_weights``), else the
        module itself (a oneDNN-packed or int8 one); qkv and gate_up are a list of three (two) modules where they
        could not be stacked. Calling ``F.linear`` directly skips a module call's host time per Linear, and tensors
        (not callables) let one compiled layer serve every layer."""
        attn, mlp = layer.self_attn, layer.mlp

        def projection(weights: tuple[torch.Tensor, torch.Tensor | None] | None, *modules: nn.Module):
            if weights is None:
                return list(modules) if len(modules) > 1 else modules[0]
            # parameters, so that a compiled region treats them as static (CUDA graphs read them in place)
            return Weights(*(t if t is None or isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)
                             for t in weights))

        def single(linear: nn.Module):
            return projection((linear.weight, linear.bias) if plain(linear) else None, linear)

        return (layer.input_layernorm.weight,
                projection(fuse((attn.q_proj, attn.k_proj, attn.v_proj)), attn.q_proj, attn.k_proj, attn.v_proj),
                single(attn.o_proj), layer.post_attention_layernorm.weight,
                projection(fuse((mlp.gate_proj, mlp.up_proj)), mlp.gate_proj, mlp.up_proj), single(mlp.down_proj))

    def forward(self, ids: torch.Tensor, rows: torch.Tensor, query_span: torch.Tensor, keys: list[torch.Tensor],
                values: list[torch.Tensor], visible: torch.Tensor, span: torch.Tensor,
                attend: int | None = None, packed: torch.Tensor | None = None) -> torch.Tensor:
        batch, width = ids.shape
        kv_heads = self.kv_heads
        trash = keys[0].shape[2] - 1
        step = torch.arange(width, device=ids.device)
        real = step[None, :] < rows[:, VALID, None]  # [B, q]
        write = torch.where(real, rows[:, LENGTH, None] + step[None, :], trash)  # [B, q]
        positions = (write + rows[:, OFFSET, None]).clamp(0, self.cos.shape[0] - 1)
        query_span = torch.where(real, query_span, -1)
        columns = trash + 1 if attend is None else attend

        # the cache's mask state takes the new columns, then the mask [B, 1, q, C] (True: attend). Compiled, the
        # cache is written by index_put_: a scatter_ into an input that is read after it makes inductor copy the
        # whole buffer (the keys and values of every layer, on every forward), where index_put_ writes in place;
        # eager, by scatter_, the cheaper call
        compiled = torch.compiler.is_compiling()
        if compiled:
            row = torch.arange(batch, device=ids.device)[:, None]  # [B, 1]
            span.index_put_((row, write), query_span)
            visible.index_put_((row, write), query_span < 0)
        else:
            span.scatter_(1, write, query_span)
            visible.scatter_(1, write, query_span < 0)
        cols = torch.arange(columns, device=write.device)
        causal = cols[None, None, :] <= write[:, :, None]  # a real query never reaches the trash column
        seen = span[:, None, :columns]
        same_span = (seen == query_span[:, :, None]) & (query_span[:, :, None] >= 0)
        allowed = (causal & (visible[:, None, :columns] | same_span))[:, None]  # [B, 1, q, columns]
        groups = self.heads // kv_heads  # the query heads of one key/value head attend as its G * q query rows
        allowed = allowed[:, :, None].expand(batch, 1, groups, width, columns).reshape(batch, 1, -1, columns)

        cos = torch.nn.functional.embedding(positions, self.cos)[:, None]  # [B, 1, q, D]
        sin = torch.nn.functional.embedding(positions, self.sin)[:, None]
        # a target with more embedding rows than its draft can emit ids the draft cannot embed; the draft only
        # proposes, so a stand-in id there costs acceptance, never correctness
        ids = torch.where(ids < self.vocab, ids, 0)
        hidden = self.embed(real_tokens(ids[..., None], packed)[..., 0])  # [B, q, H], or [T, H] packed
        if compiled:  # [B, kv_heads, q] each
            at = (row[:, :, None], torch.arange(kv_heads, device=ids.device)[None, :, None], write[:, None])
        else:
            index = write[:, None, :, None].expand(batch, kv_heads, width, self.head_dim)
        # the cache is written here, between the layer's regions: a compiled region that wrote its inputs would copy
        # the whole cache
        for weights, layer_keys, layer_values in zip(self.plan, keys, values, strict=True):
            # [B, heads + kv_heads, q, D] rotated, [B, heads + 2 kv_heads, q, D] projected
            rotated, projected = self.qkv(hidden, weights[0], weights[1], cos, sin, packed, self.dims)
            new_keys, new_values = rotated[:, self.heads:], projected[:, self.heads + kv_heads:]
            if compiled:
                layer_keys.index_put_(at, new_keys)
                layer_values.index_put_(at, new_values)
            else:
                layer_keys.scatter_(2, index, new_keys)
                layer_values.scatter_(2, index, new_values)
            hidden = self.rest(hidden, rotated, layer_keys, layer_values, allowed, columns, weights[2:], packed,
                               self.dims)
        return padded(rms_norm(hidden, self.norm.weight, self.eps), batch, width, packed)


class LayerDims(NamedTuple):
    """What a decoder layer's arithmetic takes from the config: constants of its compiled region."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scale: float


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm: normalised in fp32, the weight applied in the input's dtype (one fused op in fp32,
    where the two are the same)."""
    if x.dtype == torch.float32:
        return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)
    return weight * torch.nn.functional.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


def padded(x: torch.Tensor, batch: int, width: int, packed: torch.Tensor | None) -> torch.Tensor:
    """[T, F] real tokens (or [B, q, F]) -> [B, q, F], padded columns 0."""
    if packed is None:
        return x
    return x.new_zeros(batch * width, x.shape[-1]).index_copy_(0, packed, x).view(batch, width, -1)


def real_tokens(x: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor:
    """[B, q, F] -> [T, F] (as it is without packing)."""
    return x if packed is None else x.reshape(-1, x.shape[-1]).index_select(0, packed)


def layer_qkv(hidden: torch.Tensor, attn_norm: torch.Tensor, qkv: Weights | nn.Module | list, cos: torch.Tensor,
              sin: torch.Tensor, packed: torch.Tensor | None, dims: LayerDims) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's attention inputs: ``hidden`` [B, q, H] (or [T, H] packed) -> the queries and keys rotated by the
    positions' ``cos`` and ``sin`` rows [B, 1, q, D], [B, heads + kv_heads, q, D], and the projections
    [B, heads + 2 kv_heads, q, D], whose last kv_heads are the values."""
    batch, width = cos.shape[0], cos.shape[2]
    half, rotary = dims.head_dim // 2, dims.heads + dims.kv_heads
    x = rms_norm(hidden, attn_norm, dims.eps)
    if isinstance(qkv, list):  # three modules
        projected = torch.cat([padded(project(x, p), batch, width, packed) for p in qkv], -1)
    else:  # one Linear
        projected = padded(project(x, qkv), batch, width, packed)
    projected = projected.view(batch, width, -1, dims.head_dim).transpose(1, 2)  # [B, heads + 2 kv_heads, q, D]
    rotated = projected[:, :rotary]  # RoPE on the query and key heads at once
    # the values stay in ``projected``: a compiled region's output that views another tensor came out wrong
    return rotated * cos + rotated.roll(half, -1) * sin, projected


def layer_rest(hidden: torch.Tensor, rotated: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               allowed: torch.Tensor, columns: int, weights: tuple, packed: torch.Tensor | None,
               dims: LayerDims) -> torch.Tensor:
    """The rest of a layer once its keys and values are in the cache: attention of ``rotated``'s queries (its first
    ``heads``) over the first ``columns`` of ``keys`` and ``values`` [B, kv_heads, C, D] (read, never written;
    ``allowed`` [B, 1, G * q, columns]), the output projection, the MLP and both residuals: ``hidden`` [B, q, H]
    (or [T, H] packed) -> the same."""
    o_proj, mlp_norm, gate_up, down_proj = weights
    batch, width = rotated.shape[0], rotated.shape[2]
    heads, kv_heads, head_dim = dims.heads, dims.kv_heads, dims.head_dim
    q = rotated[:, :heads].reshape(batch, kv_heads, heads // kv_heads * width, head_dim)
    out = torch.nn.functional.scaled_dot_product_attention(  # [B, kv_heads, G * q, D]
        q, keys[:, :, :columns], values[:, :, :columns], attn_mask=allowed, scale=dims.scale)
    out = out.view(batch, heads, width, head_dim).transpose(1, 2).reshape(batch, width, heads * head_dim)
    hidden = hidden + project(real_tokens(out, packed), o_proj)
    x = rms_norm(hidden, mlp_norm, dims.eps)
    if isinstance(gate_up, list):  # two modules
        gate, up = [project(x, p) for p in gate_up]
    else:
        gate, up = project(x, gate_up).chunk(2, -1)
    return hidden + project(torch.nn.functional.silu(gate) * up, down_proj)


# compiled, every layer runs one region's code, traced and compiled once rather than once per layer (a torch
# without nested regions inlines them all)
_region = getattr(torch.compiler, "nested_compile_region", None)
regional_qkv, regional_rest = (layer_qkv, layer_rest) if _region is None else (_region(layer_qkv), _region(layer_rest))
