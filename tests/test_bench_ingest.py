"""`python -m bench.ingest --quick` ingests its synthetic parts once, skips them all on the rerun and says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import common
from bench import ingest as bench_ingest


def test_the_quick_ingest_benchmark_stores_every_row_once_and_reruns_for_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    result = bench_ingest.main(["--quick", "--allow-dirty", "--workdir", str(tmp_path / "work")])
    # 2,000 documents in parts of 250, the last of each an oom reject: 8 parts, 8 rejects
    assert (result["documents"], result["parts"], result["rejects"]) == (2_000, 8, 8)
    assert result["output_rows"] == 2 * (2_000 - 8)
    assert result["stats_rows"] == 3 * (2_000 - 8)  # sidecar: main + sidecar phase; standalone: one
    assert result["rerun_skipped"] == 8 and result["ingest_s"] > 0 and result["part_bytes"] > 0
    # a ~300-character summary per row at least, whatever the compression
    assert result["part_bytes"] > 8 * 250 * 2 * 60
    saved = json.loads((tmp_path / "results" / "ingest_cpu_quick.json").read_text())
    assert saved["result"] == result and saved["command"] == "python -m bench.ingest --quick"
    table = (tmp_path / "results" / "ingest_cpu_quick.md").read_text()
    assert "| 8 |" in table and table.strip().splitlines()[-1].startswith("Measured on commit")
