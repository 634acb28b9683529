"""`python -m bench.scale_out --quick` runs its sharded nightly runs to completion, stores every (document, mode)
once in each, and writes results whose parts add up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import common

# four shard processes, each importing torch, transformers and Prefect
pytestmark = [pytest.mark.slow, pytest.mark.servers]


def test_the_quick_scale_out_benchmark_stores_every_document_once_per_mode_and_accounts_for_its_wall_time(
        prefect_api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the module sets up a Prefect home of its own when imported: the test's settings come back afterwards
    monkeypatch.setenv("PREFECT_HOME", prefect_api["PREFECT_HOME"])
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    from bench import scale_out

    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    payload = scale_out.main(["--quick", "--allow-dirty"])  # a test is no result: it runs on whatever tree it finds
    args = payload["args"]
    par, cost = payload["parallelism"], payload["overhead"]
    runs = par["one_worker"] + par["two_workers"]
    assert [(r["workers"], r["shards"]) for r in runs] == [(1, 2)] * args["repeats"] + [(2, 2)] * args["repeats"]
    for run in runs:
        assert run["status"] == "completed" and run["every_doc_mode_once"], run["name"]
        assert run["usable_documents"] == run["done"] == run["documents"] == args["documents"]
        assert run["outputs"] == len(scale_out.MODES) * args["documents"]
        assert run["threads_per_worker"] == 1 and run["attempts"] == run["shards"] and run["parts"] >= run["shards"]
        assert sorted(s["shard"] for s in run["per_shard"]) == list(range(run["shards"]))
        assert sum(s["docs"] for s in run["per_shard"]) == run["documents"]
        assert all(s["status"] == "completed" and s["model_s"] > 0 and s["process_start_s"] > 0 and s["exit_s"] > 0
                   for s in run["per_shard"])
        assert run["docs_per_s"] == pytest.approx(run["documents"] / run["wall_s"])
    fastest = min(r["wall_s"] for r in par["one_worker"]) / min(r["wall_s"] for r in par["two_workers"])
    assert par["speedup"] == pytest.approx(fastest) and par["meets_goal"] == (fastest >= scale_out.PARALLEL_GOAL)

    # --quick takes the overhead from its one-worker run; its parts add up to that run's wall time
    assert cost["run"]["name"] == par["one_worker"][0]["name"]
    parts = ("model_s", "input_s", "process_start_s", "shard_prefect_s", "part_files_s", "parent_duckdb_s",
             "parent_rest_s")
    assert sum(cost[p] for p in parts) == pytest.approx(cost["wall_s"])
    assert cost["model_s"] == pytest.approx(sum(s["model_s"] for s in cost["run"]["per_shard"]))
    assert all(cost[p] >= 0 for p in parts[:-1])
    # the overhead is counted whole: everything but the models, shard start-up and model load included
    assert cost["overhead_s"] == pytest.approx(cost["wall_s"] - cost["model_s"])
    assert cost["overhead_pct"] == pytest.approx(100 * cost["overhead_s"] / cost["model_s"])
    startup_s = cost["process_start_s"] + cost["input_s"]
    assert cost["startup_pct"] == pytest.approx(100 * startup_s / cost["model_s"]) and startup_s > 0
    assert cost["startup_pct"] + cost["after_startup_pct"] == pytest.approx(cost["overhead_pct"])

    saved = json.loads((tmp_path / "results" / "scale_out_quick.json").read_text())
    assert saved["command"] == "python -m bench.scale_out --quick" and saved["parallelism"]["speedup"] == par["speedup"]
    assert saved["overhead"]["overhead_pct"] == cost["overhead_pct"]
    table = (tmp_path / "results" / "scale_out_quick.md").read_text()
    assert "**Real parallelism**" in table and "**Overhead**" in table
    assert f"Everything but the models came to {cost['overhead_pct']:.1f}% of model time" in table
    assert "shard start-up and model load counted" in table
    assert table.strip().splitlines()[-1].startswith("Measured on commit")
