"""`python -m bench.tagging_cost --quick`: the ledger's attribution adds up, and its verdict follows from its lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import common, tagging_cost
from study.cost import load_catalog


def test_the_quick_tagging_cost_benchmark_adds_up_and_its_verdict_follows_from_its_lines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    result = tagging_cost.main(["--quick", "--allow-dirty"])
    # the summaries are the same with and without a sidecar; the rows' lines and the ledger agree
    assert result["checks"] == {"same_summaries": True, "sidecar_lines_match_ledger": True,
                                "charged_equals_measured": True}
    runs, measured = result["runs"], result["measured"]
    assert runs["sidecar"]["tag_tokens"] > 0 and runs["standalone"]["tag_tokens"] > 0
    assert runs["plain"]["tag_tokens"] == 0 and "sidecar" not in runs["plain"]["by_phase"]
    # the verdict is the ratio of the two modes' lines per tag token, as printed
    per_token = {mode: sum(runs[mode]["lines"].values()) / runs[mode]["tag_tokens"]
                 for mode in ("sidecar", "standalone")}
    assert measured["sidecar_s_per_tag_token"] == pytest.approx(per_token["sidecar"], rel=0.01)
    assert measured["standalone_s_per_tag_token"] == pytest.approx(per_token["standalone"], rel=0.01)
    assert measured["saving"] == pytest.approx(1 - per_token["sidecar"] / per_token["standalone"], rel=0.02)
    # whole: the sidecar run's forwards less the mean of the plain runs on both sides of it, per tag token;
    # the two plain runs' difference is its noise floor
    plain_s = (runs["plain"]["device_s"] + runs["plain_before"]["device_s"]) / 2
    whole = (runs["sidecar"]["device_s"] - plain_s) / runs["sidecar"]["tag_tokens"]
    assert measured["whole_sidecar_s_per_tag_token"] == pytest.approx(whole)
    noise = abs(runs["plain"]["device_s"] - runs["plain_before"]["device_s"]) / runs["sidecar"]["tag_tokens"]
    assert measured["whole_noise_s_per_tag_token"] == pytest.approx(noise)
    # the census counts every forward the ledger timed, and its tokens are the ones charged
    for run in runs.values():
        census = run["census"].values()
        assert sum(c["seconds"] for c in census) == pytest.approx(run["device_s"])
        assert sum(c["forwards"] for c in census) > 0
    plain_census, sidecar_census = runs["plain"]["census"], runs["sidecar"]["census"]
    assert sidecar_census["draft decode"]["tokens"]["sidecar"] > 0
    assert "sidecar" not in plain_census["draft decode"]["tokens"]
    assert {row["gpu"] for row in result["gpu_projection"]} == {g.name for g in load_catalog().values()}
    saved = json.loads((tmp_path / "tagging_cost_cpu_tiny_quick.json").read_text())
    assert saved["measured"] == measured
    markdown = (tmp_path / "tagging_cost_cpu_tiny_quick.md").read_text()
    assert f"{abs(measured['saving']):.0%} {'cheaper' if measured['saving'] >= 0 else 'dearer'}" in markdown
