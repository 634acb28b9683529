"""Several Linear layers that read the same input as one weight, without a copy of their weights.

A decoder layer's q, k and v projections read the same normed hidden state, and so do its gate and up
projections. At decode widths each Linear call costs its host time (dispatch, a GEMM launch), whatever its
size: one call over their rows stacked does the work of three (two) for the host time of one. The stacked
weight is made once and each layer's own weight (and bias) becomes a view of its rows, so the model holds
the same memory as before and its own forward (Hugging Face's, used for prefill and as the reference) reads
the same numbers; an in-place change of a layer's weight is seen by both.

Only plain ``nn.Linear`` modules are fused (no hooks, no replaced ``forward``): a oneDNN-packed or int8 one
(``sidecar.models.cpu_kernels``) keeps its own kernel and is called as a module. A model moved or cast after
its weights were fused (``model.to``) gets new weights that are no longer views: fuse it again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def plain(linear: nn.Module) -> bool:
    """Whether ``F.linear(x, linear.weight, linear.bias)`` is exactly what calling ``linear`` does."""
    return (type(linear) is nn.Linear and not linear._forward_hooks and not linear._forward_pre_hooks
            and "forward" not in linear.__dict__)


def _stacked_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The tensor of ``tensors`` stacked along dim 0 when they already lie one after another in one storage
    (a model fused before): a view over them, else None."""
    first = tensors[0]
    offset = first.storage_offset()
    for tensor in tensors:
        if (not tensor.is_contiguous() or tensor.storage_offset() != offset
                or tensor.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return None
        offset += tensor.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def _stack(parameters: Sequence[nn.Parameter]) -> torch.Tensor:
    """The parameters' rows stacked in one tensor; each parameter's data becomes a view of its rows."""
    stacked = _stacked_view(parameters)
    if stacked is not None:
        return stacked
    # a plain tensor even when the caller runs in inference mode: the parameters stay usable outside it
    with torch.inference_mode(False), torch.no_grad():
        stacked = torch.cat([p.detach() for p in parameters])
        start = 0
        for parameter in parameters:
            parameter.data = stacked[start:start + parameter.shape[0]]
            start += parameter.shape[0]
    return stacked


def fuse(linears: Sequence[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) of ``linears`` as one Linear whose outputs are theirs side by side, each module's weight
    and bias now views into them; None (nothing changed) unless every module is plain, on one device in one
    dtype, with the same input size, and all or none have a bias."""
    if not all(plain(linear) for linear in linears):
        return None
    weights = [linear.weight for linear in linears]
    biases = [linear.bias for linear in linears]
    first = weights[0]
    if first.device.type == "meta" or any(
            w.dtype != first.dtype or w.device != first.device or w.shape[1:] != first.shape[1:] for w in weights):
        return None
    if any(b is None for b in biases):
        return (_stack(weights), None) if all(b is None for b in biases) else None
    if any(b.dtype != first.dtype for b in biases):
        return None
    return _stack(weights), _stack(biases)
