"""The trace replay (study/cost/replay.py) prices each event of a hand-made trace as the forwards it stands for."""

from __future__ import annotations

import pytest

from sidecar.decoding.trace import BatchTrace, PrefillRecord, StepRecord
from study.cost import Peaks, load_catalog
from study.cost.facts import ModelFacts
from study.cost.replay import SidecarWork, replay
from study.cost.workload import QWEN2_5_1_5B, QWEN2_5_7B


def facts(parameters: int) -> ModelFacts:
    """Bytes a forward moves = 2 x parameters + rows x (context + tokens): one byte of KV per token."""
    return ModelFacts(model_type="qwen2", parameters=parameters, embedding_parameters=0, tied_embeddings=True,
                      kv_bytes_per_token=1, dtype_bytes=2, layers=1, attention_width=1,
                      layer_matmul_parameters=parameters, lm_head_parameters=1)


# one byte per second and FLOPs for free: every forward costs exactly its bytes
BANDWIDTH_BOUND = Peaks(bandwidth_bytes_s=1.0, flops_s=1e30)


def test_each_event_is_priced_as_the_forwards_it_stands_for() -> None:
    target, draft = facts(100), facts(10)  # 200 and 20 weight bytes per forward
    trace = BatchTrace(max_batch=2, events=[
        PrefillRecord(rows=2, target_tokens=[3, 5], draft_tokens=[4, 6]),
        StepRecord(live=2, width=3, draft_forwards=2, draft_feed=2),
        StepRecord(live=1, width=0, draft_forwards=0, draft_feed=0),
    ])
    sidecars = SidecarWork(steps=[2, 0, 1], admissions=[[3, 1]], context=5)
    time = replay(trace, target, draft, BANDWIDTH_BOUND, target_context=10, draft_context=8, sidecars=sidecars)
    # prefill: one forward per model over the group padded to its longest prompt
    assert time.prefill_s == pytest.approx((200 + 2 * 5) + (20 + 2 * 6))
    # step 1: draft feeds 2 tokens at context 8, then 1 token at context 9; target verifies 4 tokens per row
    # step 2: a plain step, one target token for the one live row
    assert time.decode_s == pytest.approx((20 + 2 * (8 + 2)) + (20 + 2 * (9 + 1)) + (200 + 2 * (10 + 4))
                                          + (200 + 1 * (10 + 1)))
    # sidecar steps of 2 and 1 live rows (an empty one costs nothing), and the sidecar group joining, which
    # feeds up to 3 tokens per row onto 5 cached ones
    assert time.sidecar_s == pytest.approx((20 + 2 * 6) + (20 + 1 * 6) + (20 + 2 * (5 + 3)))
    assert time.seconds == pytest.approx(time.prefill_s + time.decode_s + time.sidecar_s)
    assert time.steps == 2
    assert time.forwards == {"target_prefill": 1, "draft_prefill": 1, "target": 2, "draft": 2, "sidecar": 3}


def test_a_group_without_the_draft_prefills_the_target_only() -> None:
    trace = BatchTrace(max_batch=4, events=[PrefillRecord(rows=3, target_tokens=[7, 2, 4], draft_tokens=[])])
    time = replay(trace, facts(100), facts(10), BANDWIDTH_BOUND, target_context=0, draft_context=0)
    assert time.prefill_s == pytest.approx(200 + 3 * 7)
    assert time.decode_s == time.sidecar_s == 0


def test_full_steps_cost_less_than_as_many_row_steps_half_empty_on_a_gpu() -> None:
    """The point of continuous batching: a GPU step costs about the same at 4 or 8 live rows."""
    h100 = load_catalog()["H100 SXM"]
    step = dict(width=4, draft_forwards=4, draft_feed=1)
    full = BatchTrace(8, [StepRecord(live=8, **step) for _ in range(4)])
    half = BatchTrace(8, [StepRecord(live=4, **step) for _ in range(8)])
    cost = [replay(t, QWEN2_5_7B, QWEN2_5_1_5B, h100, target_context=600, draft_context=620).seconds
            for t in (full, half)]
    assert cost[0] < 0.6 * cost[1]
