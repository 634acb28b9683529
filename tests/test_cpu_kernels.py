"""oneDNN's packed Linear layers on a CPU (``sidecar.models.cpu_kernels``) and where a load uses them
(``sidecar.models.dtype_choice.packs``): fp32 wherever oneDNN is, bf16 where it is measured faster."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sidecar.models import dtype_choice
from sidecar.models.cpu_kernels import OneDNNLinear, onednn_available, onednn_layers, use_onednn_linear
from sidecar.models.dtype_choice import PACKING_MARGIN, packs
from sidecar.models.tiny import tiny_pair
from sidecar.runtime.forward import forward
from sidecar.runtime.kv_cache import RowKVCache
from tests.decoding import random_prompts, target_alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_linear_computes_the_plain_product(dtype):
    if not onednn_available(dtype):
        pytest.skip(f"oneDNN has no packed {dtype} Linear here")
    torch.manual_seed(0)
    plain = nn.Linear(256, 384).to(dtype)
    packed = OneDNNLinear(plain)
    for rows in (1, 5, 9, 130):
        x = torch.randn(2, rows, 256, dtype=dtype)
        expected = nn.functional.linear(x.float(), plain.weight.float(), plain.bias.float())
        # both accumulate in fp32; bf16 rounds the output once, and the plain kernel may round differently
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(packed(x).float(), expected, atol=tolerance, rtol=tolerance)


def test_greedy_output_over_packed_bf16_layers_is_the_plain_layers_output():
    if not onednn_available(torch.bfloat16):
        pytest.skip("oneDNN has no packed bf16 Linear here")
    pair = tiny_pair(dtype=torch.bfloat16)
    prompts = random_prompts(pair, [7, 12, 20], seed=3)
    plain = [target_alone(pair, prompt, 24) for prompt in prompts]
    assert use_onednn_linear(pair.target) == onednn_layers(pair.target) > 0
    assert [target_alone(pair, prompt, 24) for prompt in prompts] == plain


def test_fp32_packs_wherever_onednn_is_and_bf16_where_it_times_faster(monkeypatch):
    assert packs(torch.float32, 64, 128) == onednn_available()
    times: list[float] = []
    monkeypatch.setattr(dtype_choice, "ring_seconds", lambda shape, dtype, products: times)
    monkeypatch.setattr(dtype_choice, "onednn_available", lambda dtype=torch.float32: True)
    for plain_s, packed_s, expected in ((1.0, 0.5, True), (1.0, 1.0 - PACKING_MARGIN / 2, False), (1.0, 1.2, False)):
        dtype_choice._packing_pays.cache_clear()
        times[:] = [plain_s / 2, plain_s / 2, packed_s / 2, packed_s / 2]  # rows 1 and 5, plain then packed
        assert packs(torch.bfloat16, 64, 128) is expected
    monkeypatch.setattr(dtype_choice, "onednn_available", lambda dtype=torch.float32: dtype == torch.float32)
    times[:] = []  # not timed: a failed timing would raise on the empty list
    dtype_choice._packing_pays.cache_clear()
    assert packs(torch.bfloat16, 64, 128) is False
    dtype_choice._packing_pays.cache_clear()


def test_a_pairs_forward_outside_inference_mode_records_no_gradient():
    """The pair is inference-only: its parameters want no gradient, so a caller's forward with autograd on records
    none (on the EPYC in bf16 a packed one-token forward took 140x as long while they wanted one)."""
    pair = tiny_pair(dtype=torch.bfloat16)
    if onednn_available(torch.bfloat16):
        use_onednn_linear(pair.target)
    assert not any(p.requires_grad for model in (pair.target, pair.draft) for p in model.parameters())
    cache = RowKVCache(pair.target, 1, 8)
    with torch.enable_grad():
        hidden = forward(pair.target, cache, torch.tensor([[3]]))
    assert hidden.grad_fn is None and not hidden.requires_grad
