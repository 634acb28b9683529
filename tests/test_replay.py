"""The replay (study/cost/replay.py) prices each recorded forward through the roofline and charges it to the
ledger's phases by the same rule as the measurement."""

from __future__ import annotations

import pytest

from sidecar.runtime.ledger import ForwardRecord
from study.cost import Peaks, load_catalog
from study.cost.facts import ModelFacts
from study.cost.replay import replay
from study.cost.workload import QWEN2_5_1_5B, QWEN2_5_7B


def facts(parameters: int) -> ModelFacts:
    """Bytes a forward moves = 2 x parameters + rows x (context + tokens): one byte of KV per token."""
    return ModelFacts(model_type="qwen2", parameters=parameters, embedding_parameters=0, tied_embeddings=True,
                      kv_bytes_per_token=1, dtype_bytes=2, layers=1, attention_width=1,
                      layer_matmul_parameters=parameters, lm_head_parameters=1)


# one byte per second and FLOPs for free: every forward costs exactly its bytes
BANDWIDTH_BOUND = Peaks(bandwidth_bytes_s=1.0, flops_s=1e30)


def forward(model: str, kind: str, rows: int, padded: int, context: int, **tokens: float) -> ForwardRecord:
    return ForwardRecord(model, kind, rows, padded, context, tokens, seconds=0.0)


def test_each_forward_is_priced_and_split_by_its_phases_tokens() -> None:
    target, draft = facts(100), facts(10)  # 200 and 20 weight bytes per forward
    records = [
        forward("target", "prefill", 2, 10, 8, main=8),  # two prompts padded to 5
        forward("draft", "prefill", 2, 12, 10, main=6, instruction=4),
        forward("draft", "decode", 3, 6, 30, main=4, sidecar=2),  # two main rows feed 2, a sidecar row 2
        forward("target", "decode", 2, 8, 40, main=8),  # a verify of 4 per row
    ]
    time = replay(records, target, draft, BANDWIDTH_BOUND)
    # bytes: weights, then per row its context (the record's sum over rows) and its fed tokens
    prefill = [200 + 8 + 10, 20 + 10 + 12]
    decode = [20 + 30 + 6, 200 + 40 + 8]
    assert time.prefill_s == pytest.approx(sum(prefill)) and time.decode_s == pytest.approx(sum(decode))
    assert time.by_phase["instruction"] == pytest.approx(prefill[1] * 4 / 10)
    assert time.by_phase["sidecar"] == pytest.approx(decode[0] * 2 / 6)
    assert sum(time.by_phase.values()) == pytest.approx(time.seconds)
    assert time.forwards == {"target": 2, "draft": 2}


def test_full_steps_cost_less_than_as_many_row_steps_half_empty_on_a_gpu() -> None:
    """The point of continuous batching: a GPU step costs about the same at 4 or 8 live rows."""
    h100 = load_catalog()["H100 SXM"]

    def step(rows: int) -> list[ForwardRecord]:
        return [forward("draft", "decode", rows, rows, rows * 620, main=rows) for _ in range(4)] + [
            forward("target", "decode", rows, rows * 5, rows * 600, main=rows * 5)]

    full = [r for _ in range(4) for r in step(8)]
    half = [r for _ in range(8) for r in step(4)]
    cost = [replay(records, QWEN2_5_7B, QWEN2_5_1_5B, h100).seconds for records in (full, half)]
    assert cost[0] < 0.6 * cost[1]
