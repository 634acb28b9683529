"""The GPU check's step costs (bench/gpu_check/step_costs.py) time a row per setting on the engine's forward, and
the cost model (study/cost/step_costs.py) loads the table it writes in place of the roofline."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch

from bench.gpu_check import step_costs as part
from bench.gpu_check.deadline import Deadline
from bench.gpu_check.main import main
from bench.gpu_check.parts import errors
from sidecar.runtime.capture import runner_of
from sidecar.runtime.ledger import ForwardRecord
from study.cost import CostInputError, StepCosts, load_catalog, load_step_costs
from study.cost.replay import replay
from study.cost.workload import QWEN2_5_1_5B, QWEN2_5_7B

QUICK_TINY_CPU = ["--pair", "tiny", "--device", "cpu", "--quick", "--allow-dirty", "--capture-check", "off"]


def test_the_check_writes_a_row_per_setting_and_the_cost_model_reads_those_numbers(bench_results, monkeypatch) -> None:
    monkeypatch.setattr("bench.gpu_check.parts.PARTS", [])  # the pair's parts have their own tests
    payload = main([*QUICK_TINY_CPU, "--dtype", "bf16", "--gamma", "2", "--step-cost-batches", "1,3",
                    "--step-cost-context", "8"])
    assert errors(payload) == []
    steps = payload["step_costs"]
    assert (steps["scale"], steps["context"], steps["dtype"]) == ("small", 8, "bfloat16")
    want = {(m, "draft", None, b) for m in ("7b", "1.5b") for b in (1, 3)}
    want |= {(m, "verify", g, b) for m in ("7b", "1.5b") for g in (0, 1, 2) for b in (1, 3)}
    assert {(r["model"], r["kind"], r["gamma"], r["batch"]) for r in steps["rows"]} == want
    assert all(r["ms"] > 0 for r in steps["rows"])
    table = Path(steps["table"])
    assert table == bench_results / "gpu_check_cpu_tiny_quick_step_costs.json"
    written = json.loads(table.read_text())
    assert written["environment"]["torch"] == torch.__version__ and written["rows"] == steps["rows"]
    costs = load_step_costs(table)
    for r in steps["rows"]:
        assert costs.seconds(r["model"], r["kind"], r["tokens"], r["batch"]) == pytest.approx(r["ms"] / 1000)
    assert written["capture"] == "eager"  # the forwards' mode, named (``test_the_timed_forwards_are_our_stacks``)
    assert costs.source.startswith(f"measured on {written['environment']['device']} (bfloat16, eager forwards, 8 "
                                   "tokens of context")
    assert "small shapes" in costs.source
    md = (bench_results / "gpu_check_cpu_tiny_quick.md").read_text()
    assert "| model | batch | draft step | verify γ=0 | verify γ=1 | verify γ=2 |" in md
    assert "| 7b | 1 | " in md and "| 1.5b | 3 | " in md


def test_the_timed_forwards_are_our_stacks_in_the_mode_the_table_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every timed forward ran through our decoder stack in eager mode (its runner counted it), not Hugging Face's
    forward, whose host time per layer the cost model would otherwise price as the engine's."""
    built = []

    def kept(config, device, dtype):
        built.append(real(config, device, dtype))
        return built[-1]

    real = part.build_model
    monkeypatch.setattr(part, "build_model", kept)
    monkeypatch.setattr(part, "MODELS", {"1.5b": part.MODELS["1.5b"]})
    result = part.step_costs("small", [1, 2], 1, 8, torch.device("cpu"), torch.float32, Deadline.after(120))
    [model] = built
    runner = runner_of(model)
    assert result["capture"] == runner.mode == "eager"
    # the cache's fill (one forward per row group) and each timed setting's warm-up and repeats
    settings = len(result["rows"])
    assert runner.counters.forwards == 1 + settings * (part.WARMUP + part.REPEATS)


def test_a_slow_forward_shows_in_its_own_row(monkeypatch: pytest.MonkeyPatch) -> None:
    real = part.forward

    def slow_verify_of_three_at_batch_two(model, cache, ids, *rest):
        if ids.shape[1] == 3 and cache.batch_size == 2:
            time.sleep(0.5)
        return real(model, cache, ids, *rest)

    monkeypatch.setattr(part, "forward", slow_verify_of_three_at_batch_two)
    monkeypatch.setattr(part, "MODELS", {"7b": part.MODELS["7b"]})
    result = part.step_costs("small", [1, 2], 2, 8, torch.device("cpu"), torch.float32, Deadline.after(120))
    ms = {(r["kind"], r["gamma"], r["batch"]): r["ms"] for r in result["rows"]}
    assert ms.pop(("verify", 2, 2)) >= 500
    assert len(ms) == 7 and max(ms.values()) < 500


def test_a_model_out_of_device_memory_is_skipped_and_says_so_while_the_other_runs(monkeypatch) -> None:
    real = part.build_model

    def seven_b_does_not_fit(config, device, dtype):
        if not config["tie_word_embeddings"]:  # the 7B: of the two, it alone unties its LM head
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.02 GiB")
        return real(config, device, dtype)

    monkeypatch.setattr(part, "build_model", seven_b_does_not_fit)
    result = part.step_costs("small", [1], 0, 8, torch.device("cpu"), torch.float32, Deadline.after(120))
    assert result["skipped_models"] == {"7b": "skipped: out of memory (CUDA out of memory. Tried to allocate 1.02 GiB)"}
    assert {(r["model"], r["kind"]) for r in result["rows"]} == {("1.5b", "draft"), ("1.5b", "verify")}


def test_a_spent_deadline_skips_the_models_and_says_so() -> None:
    result = part.step_costs("small", [1], 0, 8, torch.device("cpu"), torch.float32, Deadline.after(0))
    assert result["rows"] == [] and result["skipped_models"] == {"7b": "skipped: deadline reached",
                                                                 "1.5b": "skipped: deadline reached"}


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
    assert costs.source == "measured on NVIDIA H200 (bfloat16, hf forwards, 512 tokens of context)"  # no mode: hf
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


@pytest.mark.parametrize(("field", "value", "message"), [
    ("batch", 1.9, "row 0 batch must be an integer, got 1.9"),  # read as int, it was a batch of 1
    ("batch", 1.2, "row 0 batch must be an integer, got 1.2"),
    ("batch", 8.0, "row 0 batch must be an integer, got 8.0"),
    ("batch", "8", "row 0 batch must be an integer, got '8'"),
    ("batch", 0, "row 0 batch must be an integer of at least 1, got 0"),
    ("tokens", 4.5, "row 0 tokens must be an integer, got 4.5"),
    ("ms", float("nan"), "row 0 ms must be a finite number, got nan"),
    ("ms", float("inf"), "row 0 ms must be a finite number, got inf"),
    ("ms", -1.0, "row 0 ms must be positive, got -1.0"),
    ("ms", "20", "row 0 ms must be a number, got '20'"),
])
def test_a_step_cost_field_that_is_not_finite_in_range_or_an_integer_is_refused_naming_it(
        tmp_path: Path, field: str, value: object, message: str) -> None:
    bad = row("7b", "verify", 5, 8, 20.0) | {field: value}
    with pytest.raises(CostInputError, match=re.escape(f"steps.json: {message}")):
        load_step_costs(table(tmp_path, [bad, row("7b", "verify", 5, 16, 30.0)]))


@pytest.mark.parametrize("context", [512.5, float("inf"), "512"])
def test_the_tables_context_is_an_integer(tmp_path: Path, context: object) -> None:
    with pytest.raises(CostInputError, match=r"steps\.json: context must be"):
        load_step_costs(table(tmp_path, [row("7b", "verify", 5, 8, 20.0)], context=context))
