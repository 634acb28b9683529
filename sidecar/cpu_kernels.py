"""Faster fp32 Linear layers on CPU: the matmul kernel is chosen by how many tokens a forward carries.

One forward of the 1.5B target over 400 cached positions, ms (`python -m bench.kernels`, 2-core Xeon,
fp32; bench/results/kernels_cpu.md):

    rows x new positions     1x1   1x2   1x3   1x5   8x1   16x1
    default matmul (MKL)     202   232   275   544   605   685
    oneDNN, packed weight    268   368   374   360   404   508

The default kernel is best for one to three tokens (decode steps at batch 1, short verifies) and falls
off a cliff above; oneDNN's packed weights run wider forwards (a verify of gamma+1 = 5 positions, any
batch of several rows) at close to one-step cost. So each Linear keeps both copies of its weight and
dispatches per call; both give the same argmax.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.nn import functional as F

# forwards of up to this many tokens use the default kernel (see the table above)
DEFAULT_KERNEL_MAX_TOKENS = 3


class DispatchLinear(nn.Module):
    """An inference-only Linear with the plain fp32 weight and oneDNN's packed copy of it."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= DEFAULT_KERNEL_MAX_TOKENS * self.in_features:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def use_onednn_linear(model: nn.Module) -> int:
    """Swap every fp32 nn.Linear of ``model`` for a ``DispatchLinear``; returns how many were swapped."""
    if not onednn_available():
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu":
                setattr(parent, name, DispatchLinear(child))
                swapped += 1
    return swapped


def quantize_int8(model: nn.Module) -> nn.Module:
    """Dynamic int8 quantization of every Linear (weights int8, activations quantized per call).

    A draft step streams a quarter of the fp32 weight bytes; measured on the 0.5B draft it runs about
    2.3x faster. Meant for the draft only: the target must stay in the dtype whose output is the reference.
    """
    with warnings.catch_warnings():
        # torch.ao eager quantization is deprecated in favour of torchao, but still the CPU int8 path in torch
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
