"""Faster fp32 Linear layers on CPU through oneDNN.

With PyTorch's default fp32 CPU matmul, a forward over a few tokens (a speculative verify of gamma+1
positions) costs several times a one-token step, which erases the gain of speculation. oneDNN's packed
weights run small-M matmuls close to the cost of a matrix-vector product and give the same argmax.
"""

from __future__ import annotations

import torch
from torch import nn


class OneDNNLinear(nn.Module):
    """An inference-only Linear holding only oneDNN's packed copy of the weight (no second fp32 copy)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def use_onednn_linear(model: nn.Module) -> int:
    """Swap every fp32 nn.Linear of ``model`` for a oneDNN one; returns how many were swapped."""
    if not onednn_available():
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu":
                setattr(parent, name, OneDNNLinear(child))
                swapped += 1
    return swapped
