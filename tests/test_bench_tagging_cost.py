"""`python -m bench.tagging_cost --quick`: the ledger's attribution adds up, and its verdict follows from its lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import common, tagging_cost
from sidecar.runtime.ledger import ForwardRecord
from study.cost import load_catalog, load_host_floors, load_step_costs
from tests.host_overhead_results import host_result


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


def test_measured_step_costs_price_one_more_projection_row_on_the_gpu_they_were_measured_on(
        tmp_path: Path) -> None:
    table = tmp_path / "steps.json"
    table.write_text(json.dumps({"environment": {"device": "NVIDIA H200"}, "dtype": "bfloat16", "context": 512,
                                 "rows": [{"model": "1.5b", "kind": "draft", "gamma": None, "tokens": 1, "batch": 4,
                                           "ms": 2.0}]}))
    steps = load_step_costs(table)
    # a sidecar run of one draft decode step for 4 tag rows, and a standalone run of the same
    tagging = [ForwardRecord("draft", "decode", 4, 4, 400, {"sidecar": 4}, 0.0, step=1)]
    sidecar = {"_forwards": tagging, "tag_tokens": 4}
    standalone = {"_forwards": [ForwardRecord("draft", "decode", 4, 4, 400, {"standalone": 4}, 0.0, step=1)],
                  "tag_tokens": 4}
    plain = {"_forwards": [], "tag_tokens": 0}
    catalog = load_catalog()
    rows = tagging_cost.projection(sidecar, plain, standalone, catalog, steps)
    assert [r["gpu"] for r in rows] == [*(g.name for g in catalog.values()), "H200"]
    roofline, measured = rows[-2], rows[-1]
    assert roofline["priced_by"] == "roofline" and measured["priced_by"].startswith("measured on NVIDIA H200")
    assert measured["sidecar_ms"] == pytest.approx(2.0 / 4) and measured["standalone_ms"] == pytest.approx(2.0 / 4)
    assert roofline["sidecar_ms"] != pytest.approx(measured["sidecar_ms"])
    # with a host floor each roofline-priced forward pays it (its own 0.1 ms and 0.3 ms of step work, a plain step's:
    # one forward a step); a forward priced from measured costs pays the step's work only (its own was timed)
    host = load_host_floors(host_result(tmp_path / "h.json", cudagraph_ms=0.1, outside_graphs_ms=0.2,
                                        plain_outside_ms={1: 0.3})).of("captured")
    floored = tagging_cost.projection(sidecar, plain, standalone, catalog, steps, host)
    assert floored[-2]["priced_by"] == "roofline + captured host floor"
    assert floored[-2]["sidecar_ms"] == pytest.approx(roofline["sidecar_ms"] + 0.4 / 4)
    assert floored[-1]["sidecar_ms"] == pytest.approx(measured["sidecar_ms"] + 0.3 / 4)


def test_a_step_cost_table_that_cannot_be_used_stops_the_benchmark_before_it_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    table = tmp_path / "steps.json"
    table.write_text(json.dumps({"environment": {"device": "Some Laptop GPU"}, "dtype": "bfloat16", "context": 512,
                                 "rows": [{"model": "1.5b", "kind": "draft", "tokens": 1, "batch": 4, "ms": 2.0}]}))
    with pytest.raises(SystemExit) as exit_:
        tagging_cost.main(["--quick", "--allow-dirty", "--step-costs", str(table)])
    assert exit_.value.code == 2
    assert "measured on 'Some Laptop GPU', which is not in the GPU catalog" in capsys.readouterr().err
