"""The cost model (study/cost/step_costs.py) loads the GPU check's step-cost table in place of the roofline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sidecar.runtime.ledger import ForwardRecord
from study.cost import CostInputError, StepCosts, load_catalog, load_step_costs
from study.cost.replay import replay
from study.cost.workload import QWEN2_5_1_5B, QWEN2_5_7B


def table(tmp_path: Path, rows: list[dict], **extra) -> Path:
    path = tmp_path / "steps.json"
    path.write_text(json.dumps({"environment": {"device": "NVIDIA H200"}, "dtype": "bfloat16", "context": 512,
                                "scale": "full", "rows": rows} | extra))
    return path


def row(model: str, kind: str, tokens: int, batch: int, ms: float) -> dict:
    return {"model": model, "kind": kind, "gamma": None if kind == "draft" else tokens - 1, "tokens": tokens,
            "batch": batch, "ms": ms}


def test_between_and_beyond_the_measured_batches(tmp_path: Path) -> None:
    skipped = {"model": "7b", "kind": "verify", "gamma": 4, "tokens": 5, "batch": 64, "skipped": "deadline"}
    costs = load_step_costs(table(tmp_path, [row("7b", "verify", 5, 8, 20.0), row("7b", "verify", 5, 1, 10.0),
                                             row("7b", "verify", 5, 32, 40.0), skipped]))
    assert costs.source == "measured on NVIDIA H200 (bfloat16, 512 tokens of context)"
    assert costs.seconds("7b", "verify", 5, 8) == pytest.approx(0.020)
    assert costs.seconds("7b", "verify", 5, 20) == pytest.approx(0.030)  # halfway from 8 to 32
    assert costs.seconds("7b", "verify", 5, 64) == pytest.approx(0.080)  # the largest, scaled by the batch
    assert not costs.covers("7b", "verify", 4)
    with pytest.raises(CostInputError, match="no 7b verify of 4 tokens per row"):
        costs.seconds("7b", "verify", 4, 8)


@pytest.mark.parametrize("text", ["not json", '{"rows": []}', json.dumps({"environment": {}, "rows": []})])
def test_a_file_that_is_no_step_cost_table_is_one_clear_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "steps.json"
    path.write_text(text)
    with pytest.raises(CostInputError, match=r"steps\.json: "):
        load_step_costs(path)


def test_replay_prices_the_decode_forwards_the_table_covers_and_names_its_source() -> None:
    costs = StepCosts({("7b", "verify", 5): [(4, 30.0)], ("1.5b", "draft", 1): [(4, 2.0)]}, "measured on X")
    records = [ForwardRecord("target", "decode", 4, 20, 400, {"main": 20}, 0.0),  # a verify of gamma 4
               ForwardRecord("draft", "decode", 4, 4, 400, {"main": 4}, 0.0),
               ForwardRecord("target", "prefill", 4, 400, 400, {"main": 400}, 0.0)]
    gpu = load_catalog()["H200"]
    roofline = replay(records, QWEN2_5_7B, QWEN2_5_1_5B, gpu)
    measured = replay(records, QWEN2_5_7B, QWEN2_5_1_5B, gpu, costs)
    assert measured.decode_s == pytest.approx(0.032) and measured.measured_forwards == 2
    assert measured.prefill_s == roofline.prefill_s and roofline.source == "roofline"
    assert measured.source == "measured on X for decode forwards, roofline for the rest"
