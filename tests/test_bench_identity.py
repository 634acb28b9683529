"""Benchmarks say whether the engine's output is HF's by the divergence rule: yes, near-ties with their gaps, or a
mismatch that fails the bench after its results are written (``bench.identity``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import common, continuous, engine
from bench.identity import compare, exit_on_mismatch, verdict
from sidecar.decoding.divergence import MISMATCH, NEAR_TIE
from sidecar.models.tiny import tiny_pair

PROMPT = [5, 17, 42, 99, 7, 3]


def next_logits(target: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return target(torch.tensor([prompt])).logits[0, -1].float()


def test_equal_outputs_say_yes(tiny) -> None:
    same = compare(tiny.target, PROMPT, [4, 8, 15], [4, 8, 15], "article 0")
    assert same == {"label": "article 0", "identical": True, "kind": "identical"}
    assert verdict([same, same]) == "yes"
    exit_on_mismatch([same])  # passes


def test_a_near_tie_is_reported_with_its_gap_and_does_not_fail() -> None:
    # in bf16, two tokens whose logits are neighbouring representable values: two runs may round them apart
    target = tiny_pair(dtype=torch.bfloat16).target
    logits = next_logits(target, PROMPT)
    values, order = logits.sort()
    steps = values.diff()
    steps[steps == 0] = float("inf")
    nearest = int(steps.argmin())
    best, tie = int(order[nearest + 1]), int(order[nearest])
    same = compare(target, PROMPT, [best, 9], [tie, 9], "article 0, engine, batch 2")
    assert not same["identical"] and same["kind"] == NEAR_TIE and same["position"] == 0
    assert same["gap"] == pytest.approx(float(logits[best] - logits[tie]), abs=1e-6)
    assert abs(same["gap"]) <= same["bound"] and same["top2_gap"] >= 0
    equal = compare(target, PROMPT, [best], [best], "article 1, engine, batch 2")
    assert verdict([same, equal]) == (f"near-ties 1 of 2 (gaps <= {abs(same['gap']):.2g}, "
                                      f"bound {same['bound']:.2g})")
    exit_on_mismatch([same, equal])  # a near-tie passes


def test_a_large_gap_substitution_is_a_mismatch_and_fails(tiny) -> None:
    logits = next_logits(tiny.target, PROMPT)
    best, worst = int(logits.argmax()), int(logits.argmin())
    wrong = compare(tiny.target, PROMPT, [best, 9], [worst, 9], "article 0, engine, batch 1")
    assert wrong["kind"] == MISMATCH and wrong["gap"] > wrong["bound"]
    assert verdict([wrong, compare(tiny.target, PROMPT, [1], [1], "article 1")]) == "MISMATCH 1 of 2"
    with pytest.raises(SystemExit) as failed:
        exit_on_mismatch([wrong])
    assert failed.value.code != 0 and "article 0, engine, batch 1: mismatches HF at token 0" in str(failed.value.code)


def test_the_engine_bench_writes_its_results_then_exits_non_zero_on_a_mismatch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    args = ["--quick", "--pair", "tiny", "--allow-dirty", "--skip-assisted"]
    engine.main(args)  # the engine is HF's output: every comparison says yes, and the bench passes
    written = json.loads((tmp_path / "engine_cpu_tiny_quick.json").read_text())
    assert {r["identity"] for r in written["summary"]} == {"yes"}
    assert written["batch1"][0]["engine_identity"]["kind"] == "identical"
    assert "| yes |" in (tmp_path / "engine_cpu_tiny_quick.md").read_text()

    hf_plain_batched = engine.hf_plain_batched

    def planted(pair, prompts, max_new):  # HF's reference with its first token swapped for the least likely one
        hf = hf_plain_batched(pair, prompts, max_new)
        hf["tokens"][0][0] = int(next_logits(pair.target, prompts[0]).argmin())
        return hf

    monkeypatch.setattr(engine, "hf_plain_batched", planted)
    with pytest.raises(SystemExit) as failed:
        engine.main(args)
    assert failed.value.code != 0 and "article 0, engine, batch 2: mismatches HF at token 0" in failed.value.code
    written = json.loads((tmp_path / "engine_cpu_tiny_quick.json").read_text())  # written before the exit
    assert written["batched"][0]["identity"][0]["kind"] == MISMATCH
    assert "MISMATCH 1 of 2" in (tmp_path / "engine_cpu_tiny_quick.md").read_text()


def test_the_continuous_bench_writes_its_results_then_exits_non_zero_on_a_mismatch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    hf_plain_stream = continuous.hf_plain_stream

    def planted(pair, prompts, max_batch, max_new):  # HF's second summary starts with the least likely token
        hf = hf_plain_stream(pair, prompts, max_batch, max_new)
        hf["_tokens"][1][0] = int(next_logits(pair.target, prompts[1]).argmin())
        return hf

    monkeypatch.setattr(continuous, "hf_plain_stream", planted)
    with pytest.raises(SystemExit) as failed:
        continuous.main(["--quick", "--allow-dirty", "--articles", "2"])
    assert failed.value.code != 0 and "document 1, continuous: mismatches HF at token 0" in failed.value.code
    written = json.loads((tmp_path / "continuous_cpu_tiny_quick.json").read_text())
    assert written["identity"]["main_vs_hf_plain_verdict"] == "MISMATCH 1 of 2"
    assert [c["kind"] for c in written["divergences_from_hf_plain"]] == ["identical", MISMATCH]
