"""Faster Linear layers on CPU: every weight in oneDNN's packed layout, laid out for 8 rows.

oneDNN reorders a Linear weight into blocks sized for an expected number of input rows (tokens). Laid
out for 8 rows, a verify of gamma+1 positions or a decode step of a batch of rows can stream the weights
about once (`python -m bench.kernels [--dtype bf16]` times the layouts side by side). fp32 layers always pack;
bf16 ones where oneDNN has bf16 kernels and they are timed faster on the machine
(``sidecar.models.dtype_choice.packs``).

The module keeps only the packed weight. The plain one stays memory-mapped from the checkpoint (transformers
maps the file), is not read again after packing, and so is page cache the kernel can drop; RSS still
counts its pages while the file is mapped.
Argmax agrees with the default matmul (the engine's greedy identity tests run through these layers).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from sidecar.matmul import PACKED_ROWS, pack, packed_linear


class OneDNNLinear(nn.Module):
    """An inference-only Linear (fp32 or bf16) whose weight lives in oneDNN's packed layout only."""

    def __init__(self, linear: nn.Linear, packed_rows: int = PACKED_ROWS) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_rows = packed_rows
        self.bias = linear.bias
        self.register_buffer("packed", pack(linear.weight.detach(), packed_rows), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed_rows={self.packed_rows}"


def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN has packed Linear kernels for ``dtype`` on this CPU (fp32 or bf16)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def use_onednn_linear(model: nn.Module, packed_rows: int = PACKED_ROWS) -> int:
    """Swap every fp32 or bf16 CPU nn.Linear of ``model`` for a ``OneDNNLinear`` (where oneDNN has kernels for its
    dtype); returns how many were swapped."""
    if not onednn_available():
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is nn.Linear and child.weight.device.type == "cpu"
                    and onednn_available(child.weight.dtype)):
                setattr(parent, name, OneDNNLinear(child, packed_rows))
                swapped += 1
    return swapped


def onednn_layers(model: nn.Module) -> int:
    """How many of ``model``'s layers are ``OneDNNLinear``."""
    return sum(isinstance(m, OneDNNLinear) for m in model.modules())


def unpack_onednn_linear(model: nn.Module) -> int:
    """Swap every ``OneDNNLinear`` of ``model`` back for an nn.Linear holding the same weight in the plain layout
    (exactly: ``to_dense`` undoes the reorder); returns how many. Inductor cannot lower a packed weight that is
    a module buffer rather than a graph constant, so a compiled forward needs the plain ones; the packed one is
    freed as the plain one is made, layer by layer."""
    unpacked = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, OneDNNLinear):
                linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                   device="meta")
                linear.weight = nn.Parameter(child.packed.to_dense(), requires_grad=False)
                linear.bias = child.bias
                setattr(parent, name, linear)
                unpacked += 1
    return unpacked


def quantize_int8(model: nn.Module) -> nn.Module:
    """Dynamic int8 quantization of every Linear (weights int8, activations quantized per call).

    A draft step streams a quarter of the fp32 weight bytes, so it runs faster. Meant for the draft only:
    the target must stay in the dtype whose output is the reference.
    """
    with warnings.catch_warnings():
        # torch.ao eager quantization is deprecated in favour of torchao, but still the CPU int8 path in torch
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
