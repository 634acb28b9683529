"""Benchmark results say where they come from, and `make bench` splices their tables into docs/benchmarks.md."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

common = pytest.importorskip("bench.common")
run_all = pytest.importorskip("bench.run_all")


def test_every_benchmark_has_its_markers_in_the_benchmarks_page() -> None:
    text = run_all.TABLES.read_text()
    for key, _, _ in run_all.BENCHMARKS:
        assert text.count(f"<!-- bench:{key} -->") == 1 and text.count(f"<!-- /bench:{key} -->") == 1, key


def test_splice_replaces_only_its_own_table(tmp_path: Path) -> None:
    page = tmp_path / "benchmarks.md"
    shutil.copy(run_all.TABLES, page)
    before = page.read_text()
    table = "| a |\n|---|\n| 1 |\n\nMeasured on commit `abc`, 2026-01-01 00:00:00 UTC, CPU Test."
    assert run_all.splice("sidecar", table, page)
    after = page.read_text()
    assert f"<!-- bench:sidecar -->\n{table}\n<!-- /bench:sidecar -->" in after

    def outside(text: str) -> str:
        return text.split("<!-- bench:sidecar -->")[0] + text.split("<!-- /bench:sidecar -->")[1]

    assert outside(after) == outside(before)
    assert not run_all.splice("no-such-table", table, page)
    assert page.read_text() == after


def test_results_carry_commit_date_and_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    common.write_results("example", {"rows": [1]}, "| a |\n|---|\n| 1 |")
    env = json.loads((tmp_path / "example.json").read_text())["environment"]
    assert len(env["commit"]) == 40 and isinstance(env["dirty"], bool)
    assert env["date"].endswith("Z") and env["platform"] and env["cpu"] and env["torch"]
    last = (tmp_path / "example.md").read_text().strip().splitlines()[-1]
    assert last == common.provenance(env)
    assert env["commit"][:12] in last and env["date"][:10] in last and env["cpu"] in last


def test_a_payload_keeps_the_environment_it_brings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    env = {"commit": "0123456789abcdef", "dirty": True, "date": "2026-01-02T03:04:05Z", "cpu": "CPU Test", "cpus": 2}
    common.write_results("example", {"environment": env}, "table")
    assert json.loads((tmp_path / "example.json").read_text())["environment"] == env
    assert (tmp_path / "example.md").read_text().strip().endswith(
        "Measured on commit `0123456789ab` with uncommitted changes, 2026-01-02 03:04:05 UTC, CPU Test (2 CPUs).")
