"""`python -m bench.continuous --quick` runs its whole path on the tiny pair: both schedules, HF plain, the replay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import common
from bench.continuous import main
from study.cost import load_catalog


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    return tmp_path


def test_the_quick_benchmark_compares_both_schedules_and_hf_on_identical_outputs(results: Path) -> None:
    # a test is no result: it runs on whatever tree it finds
    payload = main(["--quick", "--allow-dirty", "--articles", "6"])  # max batch 4: a second group joins either way
    assert payload["identity"] == {"main_static_vs_continuous": True, "sidecar_static_vs_continuous": True,
                                   "main_vs_hf_plain": True, "main_vs_hf_plain_verdict": "yes"}
    assert [c["kind"] for c in payload["divergences_from_hf_plain"]] == ["identical"] * 6
    runs = {r["schedule"]: r for r in payload["runs"]}
    assert set(runs) == {"continuous", "static", "hf_plain_batched"}
    for name in ("continuous", "static"):
        run = runs[name]
        assert 0 < run["occupancy"] <= 1 and 0 < run["occupancy_with_drain"] <= 1
        assert run["main_tokens"] == runs["hf_plain_batched"]["main_tokens"] and run["sidecar_tokens"] > 0
        assert 0 < run["prefill_s"] < run["wall_s"] and 0 < run["steps_s"] <= run["decode_s"]
    assert runs["static"]["prefill_groups"] == 2  # 6 requests, fixed batches of 4
    assert set(payload["ratios"]) >= {"decode_continuous_over_static", "e2e_continuous_over_static",
                                      "e2e_continuous_over_hf_plain", "decode_static_over_hf_plain"}
    gpus = payload["gpu_projection"]
    assert [g["gpu"] for g in gpus] == list(load_catalog())
    assert all(g["static_tps"] > 0 and g["continuous_tps"] > 0 for g in gpus)
    assert payload["host_floor"].startswith("captured (CUDA graphs)")  # each projected forward pays it
    written = json.loads((results / "continuous_cpu_tiny_quick.json").read_text())
    assert written["identity"] == payload["identity"]
    assert "Projection, not a measurement" in (results / "continuous_cpu_tiny_quick.md").read_text()
