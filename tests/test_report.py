"""The cost report: aggregation, verdicts, calibration, files, and the storage view it is fed from."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sidecar.cost import DEFAULT_BATCHES, STUDY_WORKLOAD, CostInputError, load_catalog
from sidecar.report import Measurement, group_measurements, write_cost_report
from storage import Database
from storage.records import CostRecord, OutputRecord, RequestStats

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def row(gpu_type: str, mode: str, phase: str, batch: int, tokens: float, seconds: float, **extra) -> dict:
    """A row shaped like the storage ``throughput`` view's, one batch per row."""
    return {
        "run_id": "run-1",
        "pair": "qwen2.5-7b",
        "gpu_type": gpu_type,
        "mode": mode,
        "phase": phase,
        "batch_size": batch,
        "requests": batch,
        "batches": 1,
        "new_tokens": tokens,
        "wall_s": seconds,
        "tokens_per_s": tokens / seconds,
        "acceptance_rate": None,
    } | extra


def h200_rows(batch: int = 32) -> list[dict]:
    # Sidecar: 1000 tag tokens in 1.0 s; standalone: the same tokens in 1.25 s, i.e. 20% dearer per token.
    return [
        row("NVIDIA H200", "sidecar", "main", batch, 4000, 2.0, acceptance_rate=0.75),
        row("NVIDIA H200", "sidecar", "sidecar", batch, 1000, 1.0),
        row("NVIDIA H200", "sidecar_attended", "main", batch, 4000, 2.0, acceptance_rate=0.74),
        row("NVIDIA H200", "sidecar_attended", "sidecar", batch, 1000, 1.1),
        row("NVIDIA H200", "standalone", "sidecar", batch, 1000, 1.25),
    ]


def section(markdown: str, heading: str) -> str:
    return markdown.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_rows_accept_the_view_columns_and_the_plain_names() -> None:
    from_view = Measurement.from_row(row("NVIDIA H200", "sidecar", "sidecar", 8, 320, 0.8, requests=16, batches=2))
    plain = Measurement.from_row(
        {"gpu_type": "NVIDIA H200", "mode": "sidecar", "phase": "sidecar", "batch_size": 8, "tokens": 320,
         "seconds": 0.8, "requests": 16, "batches": 2}
    )  # fmt: skip
    assert from_view.tokens == plain.tokens == 320 and from_view.seconds == plain.seconds == 0.8
    # 16 requests in 2 batches: 8 per step, so 320 tokens took 40 steps of 20 ms.
    assert from_view.step_ms == pytest.approx(20.0)
    assert from_view.throughput == pytest.approx(400.0)
    given = Measurement.from_row({**row("T4", "standalone", "sidecar", 4, 10, 1.0), "ms_per_step": 7.5})
    assert given.step_ms == 7.5 and given.is_tagging
    assert not Measurement.from_row(row("T4", "sidecar", "main", 4, 10, 1.0)).is_tagging
    # A standalone tagger has no main task: whatever phase its stats carry, they are tagging work.
    assert Measurement.from_row(row("T4", "standalone", "main", 4, 10, 1.0)).is_tagging


def test_bad_rows_are_refused_with_the_reason() -> None:
    with pytest.raises(CostInputError, match="mode 'both'"):
        Measurement.from_row(row("T4", "both", "main", 4, 10, 1.0))
    with pytest.raises(CostInputError, match="batch_size"):
        Measurement.from_row(row("T4", "sidecar", "main", 4, 10, 1.0) | {"batch_size": None, "requests": None})


def test_runs_are_pooled_per_gpu_pair_mode_and_batch() -> None:
    rows = [
        row("NVIDIA H200", "sidecar", "sidecar", 8, 100, 1.0, run_id="a"),
        row("NVIDIA H200", "sidecar", "sidecar", 8, 300, 1.0, run_id="b"),
        row("NVIDIA H200", "sidecar", "main", 8, 800, 2.0, run_id="a", acceptance_rate=0.6),
        row("NVIDIA H200", "sidecar", "main", 8, 800, 2.0, run_id="b", acceptance_rate=0.8),
    ]
    [group] = group_measurements([Measurement.from_row(r) for r in rows])
    assert group.run_ids == ("a", "b")
    assert group.tag_tokens_per_s == pytest.approx(200.0)  # 400 tokens over 2 s, not the mean of 100 and 300
    assert group.summary_tokens_per_s == pytest.approx(400.0)
    assert group.acceptance_rate == pytest.approx(0.7)


def test_report_writes_every_file(tmp_path: Path) -> None:
    report = write_cost_report(h200_rows(), tmp_path / "report")
    assert report.markdown_path.read_text(encoding="utf-8") == report.markdown
    assert set(report.plot_paths) == {"step_time", "usd_per_mtok", "acceptance"}
    for path in report.plot_paths.values():
        assert path.read_bytes().startswith(PNG_MAGIC)
        assert f"]({path.name})" in report.markdown
    page = report.html_path.read_text(encoding="utf-8")
    assert page.count("data:image/png;base64,") == 3
    assert "<table>" in page and "Verdict per GPU type" in page
    assert not re.search(r"(src|href)=\"https?:", page)  # self-contained


def test_measured_verdict_says_how_much_cheaper_the_sidecar_is(tmp_path: Path) -> None:
    report = write_cost_report(h200_rows(), tmp_path)
    verdicts = section(report.markdown, "Verdict per GPU type")
    assert "| GPU type | pair | basis | batch | sidecar tok/s | standalone tok/s |" in verdicts
    # 1000 vs 800 tag tokens/s at $3.50/h: $0.9722 vs $1.2153 per 1M, the sidecar 20% cheaper.
    assert "| NVIDIA H200 | qwen2.5-7b | measured | 32 | 1,000 | 800 | $0.9722 | $1.2153 | 20.0% cheaper |" in verdicts
    assert "a sidecar tag token costs 20.0% less than a standalone tagger's" in verdicts
    [measured] = [v for v in report.verdicts if v.basis == "measured"]
    assert measured.sidecar_saving_pct == pytest.approx(20.0)
    # Every other catalog GPU gets a projected verdict; the measured H200 is not projected again.
    projected = {v.gpu_type for v in report.verdicts if v.basis == "projected"}
    assert projected == set(load_catalog()) - {"H200"}


def test_projected_verdicts_when_nothing_was_measured(tmp_path: Path) -> None:
    report = write_cost_report([], tmp_path)
    assert "Nothing was measured" in report.markdown
    assert {v.gpu_type for v in report.verdicts} == set(load_catalog())
    # Evicted, the sidecar still reads its main prompt's KV (3.7 vs 3.0 MB): per step it cannot beat standalone.
    assert all(v.sidecar_saving_pct < 0 for v in report.verdicts)
    assert "costs 0.7% more than a standalone tagger's" in section(report.markdown, "Verdict per GPU type")
    assert {r["source"] for r in report.cost_rows} == {"projected"}
    assert len(report.cost_rows) == len(load_catalog()) * 3 * len(DEFAULT_BATCHES)


def test_eviction_speedup_measured_next_to_projected(tmp_path: Path) -> None:
    report = write_cost_report(h200_rows(batch=64), tmp_path)
    measured = section(report.markdown, "What was measured")
    full = STUDY_WORKLOAD.step_bytes("sidecar_attended", 64)
    masked = STUDY_WORKLOAD.step_bytes("sidecar", 64)
    # Attended 1.1 s vs evicted 1.0 s for the same steps: 10% measured.
    # 1000 tokens from 64 requests in one batch: 15.6 steps, 70.4 ms attended vs 64 ms evicted.
    assert f"| NVIDIA H200 | qwen2.5-7b | 64 | 70.4 | 64 | 10 | {(full / masked - 1) * 100:.3g} |" in measured


def test_calibration_compares_measured_with_projected_steps(tmp_path: Path) -> None:
    h200 = load_catalog()["H200"]
    projected_ms = STUDY_WORKLOAD.step_seconds("sidecar", 16, h200.bandwidth_bytes_s) * 1000
    rows = [row("NVIDIA H200", "sidecar", "sidecar", 16, 512, 1.0, ms_per_step=2.5 * projected_ms)]
    report = write_cost_report(rows, tmp_path)
    calibration = section(report.markdown, "Calibration: measured ÷ projected")
    assert "| NVIDIA H200 | H200 | sidecar | 16 |" in calibration
    assert calibration.split("| NVIDIA H200 | H200 | sidecar | 16 |")[1].split("\n")[0].endswith("| 2.50 |")


def test_a_device_outside_the_catalog_is_reported_as_measured_only(tmp_path: Path) -> None:
    cpu = "AMD EPYC 7B13"
    rows = [row(cpu, "sidecar", "sidecar", 4, 40, 4.0), row(cpu, "standalone", "sidecar", 4, 40, 5.0)]
    report = write_cost_report(rows, tmp_path)
    assert f"Measured only (not in the GPU catalog, so no bandwidth or price): {cpu}." in report.markdown
    [verdict] = [v for v in report.verdicts if v.basis == "measured"]
    assert verdict.usd_per_gpu_hour is None and verdict.sidecar_saving_pct == pytest.approx(20.0)
    assert "in device time (no catalog price for this device)" in verdict.sentence
    measured_rows = [r for r in report.cost_rows if r["source"] == "measured"]
    assert {r["usd_per_mtok"] for r in measured_rows} == {None}


def test_a_gpu_measured_in_one_mode_only_is_named_as_not_compared(tmp_path: Path) -> None:
    report = write_cost_report([row("Tesla T4", "sidecar", "sidecar", 8, 100, 1.0)], tmp_path)
    assert "not compared" in report.markdown and "Tesla T4 (qwen2.5-7b)" in report.markdown
    assert "T4" in {v.gpu_type for v in report.verdicts if v.basis == "projected"}


def test_report_is_fed_by_the_throughput_view_and_fills_the_costs_table(tmp_path: Path) -> None:
    db = Database(tmp_path / "sidecar.duckdb")
    db.start_run("run-1", {}, pair="qwen2.5-7b", device="cuda", gpu_type="NVIDIA H200", gamma=4, batch_size=2,
                 code_version="test", modes=("sidecar", "standalone"))  # fmt: skip

    def output(doc: str, mode: str, tag_seconds: float) -> OutputRecord:
        stats = [RequestStats("sidecar", new_tokens=16, wall_s=tag_seconds, kv_bytes=4_000_000, batch_size=2)]
        if mode == "sidecar":
            stats.append(RequestStats("main", new_tokens=64, drafted=80, accepted=60, target_forwards=20,
                                      wall_s=2.0, batch_size=2))  # fmt: skip
        return OutputRecord(doc_id=doc, mode=mode, summary="s", sidecar_name="hashtags", sidecar_text="#a",
                            tags=["#a"], batch_id=0, stats=stats)  # fmt: skip

    db.write_batch("run-1", [output(d, m, s) for d in ("d1", "d2") for m, s in (("sidecar", 0.4), ("standalone", 0.5))])
    report = write_cost_report(db.query("SELECT * FROM throughput"), tmp_path / "report")

    [verdict] = [v for v in report.verdicts if v.basis == "measured"]
    assert (verdict.sidecar_tokens_per_s, verdict.standalone_tokens_per_s) == pytest.approx((80.0, 64.0))
    db.write_costs([CostRecord(**r) for r in report.cost_rows])
    stored = db.query("SELECT source, count(*) AS n FROM cost_estimates GROUP BY source ORDER BY source")
    assert stored == [
        {"source": "measured", "n": 2},
        {"source": "projected", "n": len(load_catalog()) * 3 * len(DEFAULT_BATCHES)},
    ]
