"""Our decoder stack's layer (``sidecar.runtime.decoder_stack``): one Linear call for q, k and v and one for gate
and up over weights the model shares (``sidecar.runtime.fused_weights``), and the same hidden states as Hugging
Face's forward whether the Linear layers are plain (stacked) or oneDNN-packed (called as modules)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from sidecar.models.cpu_kernels import OneDNNLinear, onednn_available, use_onednn_linear
from sidecar.models.tiny import tiny_pair
from sidecar.runtime.decoder_stack import DecoderStack
from sidecar.runtime.fused_weights import fuse
from sidecar.runtime.kv_cache import RowKVCache
from tests.decoding import hidden_states, random_prompts


class LinearRows(TorchFunctionMode):
    """The rows (tokens) of each ``F.linear`` call, whoever makes it (a module or a direct call)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is nn.functional.linear:
            self.rows.append(args[0].numel() // args[0].shape[-1])
        return func(*args, **(kwargs or {}))


def test_a_layer_calls_one_linear_for_q_k_v_and_one_for_gate_up():
    pair = tiny_pair(layers=3)
    stack = DecoderStack(pair.target)
    cache = RowKVCache(pair.target, 1, 64)
    rows = torch.tensor([[0, 0, 1]])
    with torch.inference_mode(), LinearRows() as counted:
        stack(torch.tensor([[5]]), rows, torch.tensor([[-1]]), cache.keys, cache.values, cache.visible, cache.span)
    assert len(counted.rows) == 3 * 4  # qkv, o, gate_up, down


def test_stacked_weights_are_the_models_own_and_change_nothing_it_computes():
    pair = tiny_pair(layers=1)
    model = pair.target
    attn = model.model.layers[0].self_attn
    ids = torch.tensor([random_prompts(pair, [7], seed=3)[0]])
    with torch.inference_mode():
        before = model(ids).logits
    q_rows = attn.q_proj.weight.shape[0]
    weight, bias = fuse((attn.q_proj, attn.k_proj, attn.v_proj))
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, before), "Hugging Face's forward reads the same weights"
    for tensor in (attn.q_proj.weight, attn.v_proj.weight, attn.k_proj.bias):
        assert tensor.untyped_storage().data_ptr() in (weight.untyped_storage().data_ptr(),
                                                       bias.untyped_storage().data_ptr()), "a view, not a copy"
    with torch.no_grad():
        attn.k_proj.weight[0, 0] = 7.0
    assert weight[q_rows, 0] == 7.0, "a change of the model's weight is the stacked weight's"
    again, _ = fuse((attn.q_proj, attn.k_proj, attn.v_proj))
    assert again.data_ptr() == weight.data_ptr() and torch.equal(again, weight), "stacked once"


def test_only_plain_linear_layers_with_matching_biases_are_stacked():
    plain, unbiased = nn.Linear(8, 4), nn.Linear(8, 4, bias=False)
    hooked = nn.Linear(8, 4)
    hooked.register_forward_hook(lambda *_: None)
    for linears in ((plain, unbiased), (plain, hooked), (plain, nn.Linear(8, 4).double())):
        weights = [linear.weight for linear in linears]
        assert fuse(linears) is None
        assert all(linear.weight is w and w._base is None for linear, w in zip(linears, weights, strict=True))
    if onednn_available():
        assert fuse((plain, OneDNNLinear(nn.Linear(8, 4)))) is None


@pytest.mark.parametrize(("dtype", "packed"), [(torch.float32, False), (torch.float32, True),
                                               (torch.bfloat16, True)])
def test_our_stack_equals_hugging_faces_forward_over_plain_and_packed_layers(dtype, packed):
    pair = tiny_pair(layers=2, dtype=dtype)
    if packed:
        if not onednn_available(dtype):
            pytest.skip(f"oneDNN has no packed {dtype} Linear here")
        assert use_onednn_linear(pair.target) == 2 * 7 + 1, "every Linear of both layers and the LM head"
    theirs = hidden_states(pair, "hf")
    # bf16: our stack rounds its fused ops differently from Hugging Face's, by a few units in the last place
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for ours, expected in zip(hidden_states(pair, "eager"), theirs, strict=True):
        torch.testing.assert_close(ours, expected, atol=tolerance, rtol=tolerance)
    assert [t.shape for t in hidden_states(pair, "hf")] == [t.shape for t in theirs]
    for again, expected in zip(hidden_states(pair, "hf"), theirs, strict=True):
        assert torch.equal(again, expected), "stacking the weights left Hugging Face's forward as it was"


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (8, 1), (4, 4)])
def test_grouped_query_attention_equals_hugging_faces_for_any_group_size(heads, kv_heads):
    """Our stack attends with the query heads of each key/value head folded into its query rows; that must be
    Hugging Face's attention for groups of 4 and 8 query heads and for none (the tiny pair's is 2)."""
    import dataclasses

    from transformers import Qwen2ForCausalLM

    from sidecar.models.tiny import tiny_config

    pair = tiny_pair(layers=2)
    config = tiny_config(pair.target.config.vocab_size, layers=2, hidden=pair.target.config.hidden_size)
    config.num_attention_heads, config.num_key_value_heads = heads, kv_heads
    torch.manual_seed(3)
    pair = dataclasses.replace(pair, target=Qwen2ForCausalLM(config).eval())
    theirs = hidden_states(pair, "hf")
    for ours, expected in zip(hidden_states(pair, "eager"), theirs, strict=True):
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_an_eager_forward_with_padded_columns_projects_its_real_tokens_only():
    from sidecar.runtime.capture import attach, packs, runner_of
    from sidecar.runtime.forward import forward

    pair = tiny_pair(layers=2)
    model = pair.target
    prompts = random_prompts(pair, [9, 4, 12], seed=1)
    ids = torch.tensor(random_prompts(pair, [4, 4, 4], seed=2))
    valid = [4, 1, 2]

    def run(pack: bool) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
        attach(model, "eager")
        runner_of(model).pack = pack
        assert packs(model) == pack
        try:
            cache = RowKVCache(model, 3, 64)
            with torch.inference_mode():
                for row, prompt in enumerate(prompts):  # a row at a time: the prefill has no padding
                    forward(model, cache.rows_view(row, row + 1), torch.tensor([prompt]), decode=False)
                cache.commit([len(p) for p in prompts])
                with LinearRows() as calls:
                    hidden = forward(model, cache, ids, valid=valid)
            return hidden, [k.clone() for k in cache.keys], calls.rows
        finally:
            attach(model, "hf")

    packed = run(pack=True)
    plain = run(pack=False)  # the same forward over the padded layout
    assert set(packed[2]) == {sum(valid)} and set(plain[2]) == {3 * 4}
    for b, real in enumerate(valid):
        torch.testing.assert_close(packed[0][b, :real], plain[0][b, :real], atol=1e-5, rtol=1e-5)
        assert torch.all(packed[0][b, real:] == 0)
    for ours, theirs in zip(packed[1], plain[1], strict=True):  # the same keys written, the trash column aside
        torch.testing.assert_close(ours[:, :, :-1], theirs[:, :, :-1], atol=1e-5, rtol=1e-5)


def test_the_lm_head_runs_over_each_rows_real_columns_only():
    from sidecar.runtime.forward import logits_at, logits_of_real_columns

    pair = tiny_pair(layers=2)
    hidden = torch.randn(3, 4, pair.target.config.hidden_size)
    with LinearRows() as calls:
        ragged = logits_of_real_columns(pair.target, hidden, [4, 1, 2])
    assert calls.rows == [7] and ragged.shape == (3, 4, pair.target.config.vocab_size)
    full = logits_at(pair.target, hidden, torch.arange(4)[None].expand(3, -1))
    for b, real in enumerate([4, 1, 2]):
        torch.testing.assert_close(ragged[b, :real], full[b, :real])
        assert torch.all(ragged[b, real:] == 0)
