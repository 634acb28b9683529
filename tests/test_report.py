"""The cost report: aggregation, verdicts, calibration, files, and the storage view it is fed from."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

import pytest
from transformers import Qwen2Config

from sidecar.decoding.stats import GenerationStats
from storage import Database, Document
from storage.records import CostRecord, OutputRecord, RequestStats, SidecarRecord
from study.cost import (
    DEFAULT_BATCHES,
    STUDY_WORKLOAD,
    CostInputError,
    ModelFacts,
    TagTokens,
    Workload,
    load_catalog,
    load_host_floors,
    prefill_seconds,
)
from study.cost.workload import QWEN2_5_1_5B_CONFIG
from study.report import Measurement, group_measurements, write_cost_report
from study.report.filters import num
from tests.host_overhead_results import host_result

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# The draft of the rows' pair, qwen2.5-7b: Qwen2.5-1.5B-Instruct's published shapes.
DRAFT_CONFIG = Qwen2Config(**QWEN2_5_1_5B_CONFIG)
PAIR_WORKLOAD = "qwen2.5-7b (bfloat16)"  # projected in the dtype load_pair gives the pair on a GPU
STUDY = "source study shapes: Qwen2.5-7B/1.5B"


def drafts(pair: str) -> Qwen2Config:
    """draft_config as it answers on a machine that has the rows' pair and nothing else."""
    if pair != "qwen2.5-7b":
        raise CostInputError(f"the config of pair {pair!r}'s draft is not on this machine")
    return DRAFT_CONFIG


def row(gpu_type: str, mode: str, phase: str, batch: int, tokens: float, device_s: float, **extra) -> dict:
    """A row shaped like the storage ``throughput`` view's, one batch per row, every request with a ledger:
    ``device_s`` attributed device seconds, a tenth of them prefill. Its wall clock is three times that, as a
    stream's clock runs on through other rows' steps: no rate may divide by it."""
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
        "wall_s": 3 * device_s,
        "tokens_per_s": tokens / device_s,
        "acceptance_rate": None,
        "ledger_requests": batch,
        "ledger_new_tokens": tokens,
        "device_s": device_s,
        "prefill_device_s": device_s / 10,
        "decode_device_s": device_s * 9 / 10,
        "instruction_device_s": 0.0,
    } | extra


def h200_rows(batch: int = 32) -> list[dict]:
    # Sidecar: 1000 tag tokens in 1.0 device s; standalone: the same tokens in 1.25 s, i.e. 20% dearer per token.
    # Each batch's longest row made 32 tag tokens: 31 decode steps, 20 ms each evicted, 22 ms attended.
    main = {"prompt_tokens": 635.0}  # the target's prompt per request: template, document, instruction
    return [
        row("NVIDIA H200", "sidecar", "main", batch, 4000, 2.0, acceptance_rate=0.75, **main),
        row("NVIDIA H200", "sidecar", "sidecar", batch, 1000, 1.0, decode_s=0.62, longest_row_tokens=32),
        row("NVIDIA H200", "sidecar_attended", "main", batch, 4000, 2.0, acceptance_rate=0.74, **main),
        row("NVIDIA H200", "sidecar_attended", "sidecar", batch, 1000, 1.1, decode_s=0.682, longest_row_tokens=32),
        row("NVIDIA H200", "standalone", "sidecar", batch, 1000, 1.25, decode_s=0.62, longest_row_tokens=32),
    ]


def h200_workload(batch: int = 32) -> Workload:
    """The projection h200_rows(batch) must get: the pair's draft with the rows' tokens per request."""
    tokens = TagTokens.from_measured(main_prompt=635, summary=4000 / batch, tags=1000 / batch)
    return Workload.from_model(ModelFacts.from_config(DRAFT_CONFIG, dtype_bytes=2), tokens, PAIR_WORKLOAD)


def section(markdown: str, heading: str) -> str:
    return markdown.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_rows_read_the_ledger_for_cost_and_the_wall_clock_for_latency_only() -> None:
    from study.report.measurements import pooled_cost

    view = Measurement.from_row(row("NVIDIA H200", "sidecar", "sidecar", 8, 320, 0.8, requests=16, batches=2,
                                    ledger_requests=16, instruction_device_s=0.08))
    assert view.has_ledger and view.tokens == 320 and view.seconds == pytest.approx(2.4)
    cost = pooled_cost([view])
    # per request: 20 tag tokens and 0.08 + 0.72 + 0.08 / 16 device seconds; the wall clock's 2.4 s count nowhere
    assert (cost.tag_tokens, cost.prefill_s, cost.decode_s, cost.instruction_s) == pytest.approx(
        (20, 0.005, 0.045, 0.005))
    assert cost.tokens_per_s == pytest.approx(320 / 0.88)
    # Written without a ledger: no rate, whatever its wall clock says.
    unledgered = Measurement.from_row({"gpu_type": "NVIDIA H200", "mode": "sidecar", "phase": "sidecar",
                                       "batch_size": 8, "tokens": 320, "seconds": 0.8, "requests": 16, "batches": 2})
    assert not unledgered.has_ledger and pooled_cost([unledgered]) is None
    assert pooled_cost([view, unledgered]) == cost  # and it does not dilute the rows that have one
    # Wall time holds the prefill: without decode times there is no step time rather than a wrong one.
    assert view.step_ms is None and unledgered.step_ms is None
    given = Measurement.from_row({**row("T4", "standalone", "sidecar", 4, 10, 1.0), "ms_per_step": 7.5})
    assert given.step_ms == 7.5 and given.is_tagging
    assert not Measurement.from_row(row("T4", "sidecar", "main", 4, 10, 1.0)).is_tagging
    # A standalone tagger has no main task: whatever phase its stats carry, they are tagging work.
    assert Measurement.from_row(row("T4", "standalone", "main", 4, 10, 1.0)).is_tagging


def test_step_time_is_decode_time_over_the_steps_of_each_batchs_longest_row() -> None:
    # 4 rows made 10, 20, 30 and 40 tokens (100 in all) in one batch: after its prefill, which gave every row
    # its first token, the batch stepped 39 times (not 100 / 4 = 25) in 0.78 s; the 0.22 s prefill is no step.
    one = row("NVIDIA H200", "standalone", "sidecar", 4, 100, 1.0, prefill_s=0.22, decode_s=0.78, longest_row_tokens=40)
    assert Measurement.from_row(one).step_ms == pytest.approx(780 / 39)
    # two such batches: 78 steps in 1.56 s
    two = one | {"requests": 8, "batches": 2, "new_tokens": 200, "decode_s": 1.56, "longest_row_tokens": 80}
    assert Measurement.from_row(two).step_ms == pytest.approx(1560 / 78)


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
    assert group.tag_tokens_per_s == pytest.approx(200.0)  # 400 tokens over 2 device s, not the mean of 100 and 300
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


def test_the_report_leads_with_the_verdict_and_the_usd_plot(tmp_path: Path) -> None:
    report = write_cost_report(h200_rows(), tmp_path, draft_config=drafts)
    headings = re.findall(r"^## (.+)$", report.markdown, flags=re.MULTILINE)
    assert headings == ["Verdict per GPU type", "What this report compares", "What was measured", "What was projected",
                        "Capture mode: eager against captured", "Calibration: measured ÷ projected",
                        "What the roofline leaves out", "More plots"]  # fmt: skip
    # the verdict table (measured, then projected rows), the $ plot, then the lines the measured verdict adds up
    verdicts = section(report.markdown, "Verdict per GPU type")
    plot = f"]({report.plot_paths['usd_per_mtok'].name})"
    assert verdicts.index("| measured |") < verdicts.index("| projected |") < verdicts.index(plot) \
        < verdicts.index("| device ms / request | device ms / tag token |")
    # the HTML page says the same in the same order
    page = report.html_path.read_text(encoding="utf-8")
    assert re.findall(r"<h2>(.+?)</h2>", page) == headings
    assert page.index("<table>") < page.index("<img") < page.index("<h2>What this report compares</h2>")


def test_measured_verdict_says_how_much_cheaper_the_sidecar_is(tmp_path: Path) -> None:
    report = write_cost_report(h200_rows(), tmp_path)
    verdicts = section(report.markdown, "Verdict per GPU type")
    assert "| GPU type | basis | pair | batch 32 | batch 64 | batch 128 |" in verdicts
    # 1 vs 1.25 device ms per tag token: the sidecar 20% cheaper, and so at $3.50/h $0.9722 vs $1.2153 per 1M
    assert "| NVIDIA H200 | measured | qwen2.5-7b | 20.0% cheaper | – | – |" in verdicts
    assert ("a sidecar tag token costs 20.0% less than a standalone tagger's: 1 vs 1.25 device ms per tag token "
            "($0.9722 vs $1.2153 per 1M tag tokens at $3.50/GPU-hour)") in verdicts
    [measured] = [v for v in report.verdicts if v.basis == "measured"]
    assert measured.sidecar_saving_pct == pytest.approx(20.0)
    # Every catalog GPU gets projected verdicts at the measured batch and 32, 64 and 128, the measured H200 too.
    projected = {(v.gpu_type, v.batch) for v in report.verdicts if v.basis == "projected"}
    assert projected == {(gpu, batch) for gpu in load_catalog() for batch in (32, 64, 128)}
    assert "| H200 | projected | source study shapes: Qwen2.5-7B/1.5B |" in verdicts


def test_the_verdict_table_shows_the_measured_batch_and_32_to_128_projected_with_a_note(tmp_path: Path) -> None:
    report = write_cost_report(h200_rows(batch=4), tmp_path, draft_config=drafts)
    verdicts = section(report.markdown, "Verdict per GPU type")
    _, table, note, *_ = [block for block in verdicts.split("\n\n") if block.strip()]
    assert table.splitlines()[0] == "| GPU type | basis | pair | batch 4 | batch 32 | batch 64 | batch 128 |"
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    # one measured row at the batch it ran, then a projected row per catalog GPU type, of the measured pair
    assert [(r[0].lstrip("| "), r[1], r[2]) for r in rows] == [("NVIDIA H200", "measured", "qwen2.5-7b")] + [
        (gpu, "projected", PAIR_WORKLOAD) for gpu in load_catalog()]
    assert rows[0][4:] == ["–", "–", "– |"]
    assert all(cell.rstrip(" |").endswith(("cheaper", "dearer", "even")) for r in rows[1:] for cell in r[3:])
    # each projected cell is its verdict's saving
    [h100] = [v for v in report.verdicts if (v.gpu_type, v.pair, v.batch) == ("H100 SXM", PAIR_WORKLOAD, 64)]
    h100_row = next(r for r in rows if r[0] == "| H100 SXM")
    assert h100.sidecar_saving_pct > 0 and h100_row[5] == f"{h100.sidecar_saving_pct:.1f}% cheaper"
    assert "Rows marked measured are this report's runs" in note
    assert "Rows marked projected are not measurements" in note
    assert "at batch 4, 32, 64 and 128 (the measured batch 4, and 32-128" in note
    # the study's shapes are projected too, summed up under the plot rather than in the table
    assert STUDY not in table and f"Projected with {STUDY} on 7 GPU types" in verdicts


def test_the_headline_is_the_measured_verdict_with_its_lines_and_the_kv_per_request(tmp_path: Path) -> None:
    report = write_cost_report(h200_rows(), tmp_path, draft_config=drafts)
    headline = report.headline
    assert (headline.gpu_type, headline.pair, headline.basis, headline.batch) == (
        "NVIDIA H200", "qwen2.5-7b", "measured", 32)
    # per request: 1000 / 32 tag tokens, a tenth of the device seconds prefill
    assert headline.sidecar == pytest.approx({"tag_tokens": 1000 / 32, "prefill_s": 0.1 / 32, "decode_s": 0.9 / 32,
                                              "instruction_s": 0.0})
    assert headline.standalone["prefill_s"] == pytest.approx(0.125 / 32)
    assert (headline.sidecar_ms_per_tag_token, headline.standalone_ms_per_tag_token) == pytest.approx((1.0, 1.25))
    assert headline.sidecar_saving_pct == pytest.approx(20.0)
    assert (headline.sidecar_tokens_per_s, headline.standalone_tokens_per_s) == pytest.approx((1000, 800))
    assert headline.sidecar_usd_per_mtok == pytest.approx(0.9722, abs=1e-4)
    assert headline.standalone_usd_per_mtok == pytest.approx(1.2153, abs=1e-4)
    kv = h200_workload().kv_bytes_per_request
    assert (headline.kv_evicted_bytes, headline.kv_attended_bytes, headline.kv_standalone_bytes) == (
        kv["sidecar"], kv["sidecar_attended"], kv["standalone"])
    assert headline.kv_evicted_bytes < headline.kv_attended_bytes
    assert json.loads(report.headline_path.read_text()) == json.loads(json.dumps(headline.as_dict()))
    # nothing measured in both modes: no headline, and the file says so
    assert write_cost_report([], tmp_path / "empty").headline is None
    assert json.loads((tmp_path / "empty" / "headline.json").read_text()) is None


def test_projected_verdicts_when_nothing_was_measured(tmp_path: Path) -> None:
    report = write_cost_report([], tmp_path)
    assert "Nothing was measured" in report.markdown
    expected = {(gpu, batch) for gpu in load_catalog() for batch in (32, 64, 128)}
    assert {(v.gpu_type, v.batch) for v in report.verdicts} == expected
    # Evicted, the sidecar still reads its main prompt's KV (3.7 vs 3.0 MB): per step it cannot beat standalone,
    # but it skips the standalone's prefill of the summary, which from batch 32 on weighs more on every catalog
    # GPU than that and its instruction line together.
    assert all(v.sidecar.decode_s > v.standalone.decode_s for v in report.verdicts)
    assert all(v.sidecar.instruction_s > 0 == v.standalone.instruction_s for v in report.verdicts)
    assert all(v.sidecar_saving_pct > 0 for v in report.verdicts)
    verdicts = section(report.markdown, "Verdict per GPU type")
    assert "no row is measured" in verdicts
    assert "prefill, decode and instruction lines: a sidecar tag token costs" in verdicts
    assert {r["source"] for r in report.cost_rows} == {"projected"}
    assert {r["timed_by"] for r in report.cost_rows} == {"roofline"}
    assert len(report.cost_rows) == len(load_catalog()) * 3 * len(DEFAULT_BATCHES)


def test_projected_verdicts_price_the_standalone_prefill_next_to_the_decode(tmp_path: Path) -> None:
    # a captured floor of its own, so the figures do not hang on the committed host-overhead result
    floors = host_result(tmp_path / "host_overhead_gpu.json", cudagraph_ms=0.05)
    report = write_cost_report([], tmp_path, reference_batch=64, host_overhead=floors)
    [h100] = [v for v in report.verdicts if v.gpu_type == "H100 SXM" and v.batch == 64]
    # The standalone tagger's summary prefill is the cost a sidecar avoids: priced, it is cheaper.
    assert h100.sidecar_saving_pct > 5
    # At batch 64 that prefill costs about as much per request as the tag tokens' decode steps.
    alone, sidecar = h100.standalone, h100.sidecar
    assert 0.3 < alone.prefill_s / alone.decode_s < 3
    assert sidecar.prefill_s < alone.prefill_s / 5
    # The sidecar's instruction line: its 25 tokens' share of the main draft prefill, per request.
    tokens = STUDY_WORKLOAD.tokens
    main_prefill = prefill_seconds(STUDY_WORKLOAD.facts, load_catalog()["H100 SXM"], 64, tokens.main_prefill,
                                   host=load_host_floors(floors).captured)
    assert sidecar.instruction_s == pytest.approx(main_prefill / 64 * 25 / tokens.main_prefill)
    # The rates are the whole tagging phase's: a request's tag tokens over its lines.
    assert h100.standalone_tokens_per_s == pytest.approx(tokens.tags / (alone.prefill_s + alone.decode_s))
    assert h100.sidecar_tokens_per_s == pytest.approx(
        tokens.tags / (sidecar.prefill_s + sidecar.decode_s + sidecar.instruction_s))
    # The lines side by side, in ms per request, at the reference batch.
    verdicts = section(report.markdown, "Verdict per GPU type")
    assert ("| sidecar prefill ms | sidecar decode ms | sidecar instruction ms | standalone prefill ms | "
            "standalone decode ms |") in verdicts
    lines = (sidecar.prefill_s, sidecar.decode_s, sidecar.instruction_s, alone.prefill_s, alone.decode_s)
    assert f"| H100 SXM | {STUDY} | 64 | {' | '.join(num(s * 1000) for s in lines)} |" in verdicts
    cell = f"{h100.sidecar_saving_pct:.1f}% cheaper"
    assert f"| H100 SXM | projected | {STUDY} | " in verdicts and cell in verdicts
    # The cost rows of the projection count every line too.
    row = next(r for r in report.cost_rows if r["gpu_type"] == "H100 SXM" and r["mode"] == "standalone"
               and r["batch_size"] == 64)  # fmt: skip
    assert row["tokens_per_s"] == pytest.approx(h100.standalone_tokens_per_s)
    assert "prefill and decode" in row["note"]
    sidecar_row = next(r for r in report.cost_rows if r["gpu_type"] == "H100 SXM" and r["mode"] == "sidecar"
                       and r["batch_size"] == 64)  # fmt: skip
    assert sidecar_row["tokens_per_s"] == pytest.approx(h100.sidecar_tokens_per_s)
    assert "instruction line" in sidecar_row["note"]


def test_a_measured_verdict_shows_its_lines_per_request_from_the_ledger(tmp_path: Path) -> None:
    rows = [
        row("NVIDIA H200", "sidecar", "sidecar", 32, 1000, 1.0, prefill_device_s=0.05, decode_device_s=0.9,
            instruction_device_s=0.05),
        row("NVIDIA H200", "standalone", "sidecar", 32, 1000, 1.25, prefill_device_s=0.3, decode_device_s=0.95),
    ]
    report = write_cost_report(rows, tmp_path)
    [verdict] = [v for v in report.verdicts if v.basis == "measured"]
    assert (verdict.sidecar.prefill_s, verdict.sidecar.decode_s, verdict.sidecar.instruction_s) == pytest.approx(
        (0.05 / 32, 0.9 / 32, 0.05 / 32))
    assert verdict.standalone.prefill_s == pytest.approx(0.3 / 32)
    verdicts = section(report.markdown, "Verdict per GPU type")
    for line in ("| sidecar | prefill: catch-up and bridge feed | 1.562 |  |",
                 "| sidecar | decode: draft steps | 28.12 |  |",
                 "| sidecar | instruction: its share of the main draft prefill | 1.562 |  |",
                 "| sidecar | total, 31.25 tag tokens | 31.25 | 1 |",
                 "| standalone | prefill: whole prompt | 9.375 |  |",
                 "| standalone | total, 31.25 tag tokens | 39.06 | 1.25 |"):
        assert f"| NVIDIA H200 | qwen2.5-7b | 32 {line}" in verdicts


def test_a_workload_without_a_shape_is_projected_on_decode_steps_only(tmp_path: Path) -> None:
    bare = Workload("bytes only", STUDY_WORKLOAD.weight_bytes_per_step, STUDY_WORKLOAD.kv_bytes_per_request, "")
    # a captured floor of 0 (no compile row): the committed result's would move the figure with each run
    report = write_cost_report([], tmp_path, study_workload=bare,
                               host_overhead=host_result(tmp_path / "host_overhead_cpu.json"))
    assert all(not v.prefill_priced and v.sidecar.instruction_s == 0 for v in report.verdicts)
    assert "decode steps only: a sidecar tag token costs 0.7% more at batch 32" in section(
        report.markdown, "Verdict per GPU type")


def test_eviction_speedup_measured_next_to_projected(tmp_path: Path) -> None:
    report = write_cost_report(h200_rows(batch=64), tmp_path, draft_config=drafts)
    measured = section(report.markdown, "What was measured")
    workload = h200_workload(batch=64)
    projected = (workload.step_bytes("sidecar_attended", 64) / workload.step_bytes("sidecar", 64) - 1) * 100
    # 31 decode steps in 0.682 s attended and 0.62 s evicted: 22 vs 20 ms, 10% measured.
    assert f"| NVIDIA H200 | qwen2.5-7b | 64 | 22 | 20 | 10 | {projected:.3g} |" in measured


def test_calibration_projects_the_measured_pair_not_the_study(tmp_path: Path) -> None:
    h200 = load_catalog()["H200"]
    report = write_cost_report(h200_rows(batch=16), tmp_path, draft_config=drafts)
    workload = h200_workload(batch=16)
    assert workload.kv_bytes_per_request != STUDY_WORKLOAD.kv_bytes_per_request  # the rows' own token counts
    calibration = section(report.markdown, "Calibration: measured ÷ projected")
    for mode, measured_ms in (("sidecar", 20.0), ("sidecar_attended", 22.0), ("standalone", 20.0)):
        projected_ms = workload.step_seconds(mode, 16, h200.bandwidth_bytes_s) * 1000
        line = f"| NVIDIA H200 | H200 | {PAIR_WORKLOAD} | {mode} | 16 | {measured_ms:.3g} | {projected_ms:.3g} |"
        assert line in calibration
        assert calibration.split(line)[1].split("\n")[0] == f" {measured_ms / projected_ms:.2f} |"
    assert STUDY not in calibration
    # The study's shapes stay, labelled, as an extra projection on every GPU type.
    assert f"### {STUDY}" in section(report.markdown, "What was projected")
    projected_pairs = {r["pair"] for r in report.cost_rows if r["source"] == "projected"}
    assert projected_pairs == {PAIR_WORKLOAD, STUDY}
    assert {v.pair for v in report.verdicts if v.basis == "projected"} == {PAIR_WORKLOAD, STUDY}


def test_a_pair_whose_config_is_not_here_is_reported_and_not_calibrated(tmp_path: Path) -> None:
    def nothing_here(pair: str) -> Qwen2Config:
        raise CostInputError(f"the config of pair {pair!r}'s draft is not on this machine: not fetched")

    report = write_cost_report(h200_rows(), tmp_path, draft_config=nothing_here)
    reason = "qwen2.5-7b: the config of pair 'qwen2.5-7b''s draft is not on this machine: not fetched"
    assert f"No projection of the measured pair, so no calibration, for: {reason}." in report.markdown
    calibration = section(report.markdown, "Calibration: measured ÷ projected")
    assert "Nothing is calibrated" in calibration
    assert f"Not calibrated, for want of a projection of their pair: {reason}." in calibration
    assert {r["pair"] for r in report.cost_rows if r["source"] == "projected"} == {STUDY}
    assert [v.basis for v in report.verdicts].count("measured") == 1  # measuring still counts


def test_acceptance_is_a_distribution_over_requests(tmp_path: Path) -> None:
    def request(mode: str, rate: float, gpu_type: str = "NVIDIA H200") -> dict[str, Any]:
        return {"run_id": "run-1", "pair": "qwen2.5-7b", "gpu_type": gpu_type, "mode": mode, "doc_id": "d",
                "drafted": 8, "accepted": round(8 * rate), "acceptance_rate": rate}  # fmt: skip

    acceptance = [request("sidecar", r) for r in (0.0, 0.25, 0.5, 0.75, 1.0)]
    acceptance += [request("sidecar_attended", 0.5), request("sidecar", 0.5, gpu_type="Tesla T4")]
    report = write_cost_report(h200_rows(), tmp_path, acceptance=acceptance)
    measured = section(report.markdown, "What was measured")
    assert "| GPU type | pair | mode | requests | min | median | max |" in measured
    assert "| NVIDIA H200 | qwen2.5-7b | sidecar | 5 | 0 | 0.5 | 1 |" in measured
    assert "| NVIDIA H200 | qwen2.5-7b | sidecar_attended | 1 | 0.5 | 0.5 | 0.5 |" in measured
    assert "| Tesla T4 | qwen2.5-7b | sidecar | 1 | 0.5 | 0.5 | 0.5 |" in measured
    assert report.plot_paths["acceptance"].read_bytes().startswith(PNG_MAGIC)
    # the rows' own acceptance_rate is one value per run, not a distribution: it is not what is plotted
    assert "requests | min" not in write_cost_report(h200_rows(), tmp_path / "none").markdown


def test_a_device_outside_the_catalog_is_reported_as_measured_only(tmp_path: Path) -> None:
    cpu = "AMD EPYC 7B13"
    rows = [row(cpu, "sidecar", "sidecar", 4, 40, 4.0), row(cpu, "standalone", "sidecar", 4, 40, 5.0)]
    report = write_cost_report(rows, tmp_path)
    assert f"Measured only (not in the GPU catalog, so no bandwidth or price): {cpu}." in report.markdown
    [verdict] = [v for v in report.verdicts if v.basis == "measured"]
    assert verdict.usd_per_gpu_hour is None and verdict.sidecar_saving_pct == pytest.approx(20.0)
    assert ("a sidecar tag token costs 20.0% less than a standalone tagger's: 100 vs 125 device ms per tag token "
            "(no catalog price for this device); prefill") in report.markdown
    measured_rows = [r for r in report.cost_rows if r["source"] == "measured"]
    assert {r["usd_per_mtok"] for r in measured_rows} == {None}


def test_a_gpu_measured_in_one_mode_only_is_named_as_not_compared(tmp_path: Path) -> None:
    report = write_cost_report([row("Tesla T4", "sidecar", "sidecar", 8, 100, 1.0)], tmp_path)
    assert "not compared" in report.markdown and "Tesla T4 (qwen2.5-7b)" in report.markdown
    assert "T4" in {v.gpu_type for v in report.verdicts if v.basis == "projected"}


def stored_run(path: Path, pair: str, dtype: str | None = None, capture: str | None = None,
               capture_counters: dict | None = None) -> Database:
    """A database holding one run of two documents, stored as the engine writes them (its stats records with
    the device-time ledger): as a sidecar in a stream of batch 2 whose sidecar rows ran beside main rows of later
    requests, finishing 30 and 34 s into the stream; and by a standalone tagger in a batch of its own. With
    ``capture`` and ``capture_counters`` its capture mode and counters, as the nightly flow records them."""
    db = Database(path)
    db.start_run("run-1", {}, pair=pair, device="cuda", gpu_type="NVIDIA H200", gamma=4, batch_size=2,
                 code_version="test", modes=("sidecar", "standalone"), dtype=dtype, capture=capture)  # fmt: skip
    if capture_counters is not None:
        db.record_capture("run-1", capture_counters)

    def ledger(prefill_tokens: int, prefill_s: float, tokens: int, decode_s: float, **extra: float) -> dict:
        return {"prefill_tokens": prefill_tokens, "prefill_forwards": 1, "prefill_device_seconds": prefill_s,
                "decode_tokens": tokens, "decode_forwards": tokens, "decode_device_seconds": decode_s,
                "queue_seconds": 0.0, "first_token_seconds": 0.1} | extra  # fmt: skip

    def output(doc: str, mode: str, accepted: int) -> OutputRecord:
        # d1 tags with 16 tokens, d2 with 12; each batch decoded until d1's 16th token, 15 steps after the prefill
        tags, decode_wall = (16, 0.3) if doc == "d1" else (12, 0.25)
        if mode == "sidecar":
            # the sidecar feeds 3 tokens and is charged its 25 instruction tokens' share of the main draft prefill
            tagging = GenerationStats(new_tokens=tags, prefill_seconds=0.01, decode_seconds=decode_wall,
                                      wall_seconds=decode_wall + 0.01, kv_bytes=4_000_000, batch_size=2, **ledger(
                3, 0.004, tags, 0.15 if doc == "d1" else 0.13, instruction_tokens=25, instruction_device_seconds=0.006))
            main = GenerationStats(prompt_tokens=500, new_tokens=64, drafted=80, accepted=accepted, target_forwards=20,
                                   wall_seconds=2.0, batch_size=2, **ledger(525, 0.2, 64, 1.0))
            stats = [replace(RequestStats.main_phase(main), ended_s=2.0 if doc == "d1" else 6.0),
                     replace(RequestStats.sidecar_phase(tagging), ended_s=30.0 if doc == "d1" else 34.0)]
        else:
            tagging = GenerationStats(new_tokens=tags, prefill_seconds=0.1, decode_seconds=decode_wall + 0.1,
                                      wall_seconds=decode_wall + 0.2, kv_bytes=4_000_000, batch_size=2, **ledger(
                90, 0.06, tags, 0.15 if doc == "d1" else 0.13, instruction_tokens=0, instruction_device_seconds=0.0))
            stats = [replace(RequestStats.sidecar_phase(tagging), ended_s=0.5 if doc == "d1" else 0.45)]
        return OutputRecord(doc_id=doc, mode=mode, summary="s", sidecars=[SidecarRecord.of("hashtags", "#a", ["#a"])],
                            batch_id=0 if mode == "sidecar" else 1, stats=stats)  # fmt: skip

    db.write_batch("run-1", [output(d, m, a) for d, a in (("d1", 60), ("d2", 20)) for m in ("sidecar", "standalone")])
    return db


def test_report_is_fed_by_storage_and_fills_the_costs_table(tmp_path: Path) -> None:
    db = stored_run(tmp_path / "sidecar.duckdb", pair="qwen2.5-7b")
    report = write_cost_report(db.query("SELECT * FROM throughput"), tmp_path / "report", draft_config=drafts,
                               acceptance=db.request_acceptance("run-1"))  # fmt: skip

    [verdict] = [v for v in report.verdicts if v.basis == "measured"]
    # 28 tag tokens over 0.3 (sidecar: 0.008 prefill + 0.28 decode + 0.012 instruction) and 0.4 device seconds
    assert (verdict.sidecar_tokens_per_s, verdict.standalone_tokens_per_s) == pytest.approx((28 / 0.3, 70.0))
    # latency, not cost: each batch decoded until d1's 16th token, 15 steps after the prefill, in 0.3 and 0.4 s
    step_ms = {r["mode"]: r["ms_per_step"] for r in report.cost_rows if r["source"] == "measured"}
    assert step_ms == pytest.approx({"sidecar": 300 / 15, "standalone": 400 / 15})
    assert "| NVIDIA H200 | qwen2.5-7b | sidecar | 2 | 0.25 | 0.5 | 0.75 |" in report.markdown
    # the projection of the pair counts the run's own instruction and feed tokens
    assert (report.headline and report.headline.pair) == "qwen2.5-7b"
    db.write_costs([CostRecord(**r) for r in report.cost_rows])
    stored = db.query("SELECT source, pair, timed_by, count(*) AS n FROM cost_estimates GROUP BY ALL "
                      "ORDER BY source, pair")
    per_projection = len(load_catalog()) * 3 * len(DEFAULT_BATCHES)
    assert stored == [
        {"source": "measured", "pair": "qwen2.5-7b", "timed_by": "device_ledger", "n": 2},
        {"source": "projected", "pair": PAIR_WORKLOAD, "timed_by": "roofline", "n": per_projection},
        {"source": "projected", "pair": STUDY, "timed_by": "roofline", "n": per_projection},
    ]
    costs = {r["mode"]: r for r in db.query("SELECT * FROM costs WHERE source = 'measured'")}
    assert costs["sidecar"]["tokens_per_s"] == pytest.approx(verdict.sidecar_tokens_per_s)
    assert costs["sidecar"]["usd_per_mtok"] == pytest.approx(verdict.sidecar_usd_per_mtok)


def test_the_report_names_the_dtype_each_run_loaded_its_pair_in_and_why(tmp_path: Path) -> None:
    db = stored_run(tmp_path / "sidecar.duckdb", pair="qwen2.5-7b", dtype="bf16 (default on CUDA: bf16)")
    report = write_cost_report(db.throughput("run-1"), tmp_path / "report", draft_config=drafts)
    assert "from 1 run(s) on NVIDIA H200 in bf16 (default on CUDA: bf16) with pair(s) qwen2.5-7b." in report.markdown


def capture_counters(recompiles: int = 0, graph_breaks: int = 0, skips: int = 0) -> dict:
    counted = {"compiles": 6, "recompiles": recompiles, "graph_breaks": graph_breaks, "forwards": 400,
               "graph_calls": 400, "chained_forwards": 0, "distinct_shapes": 6, "compile_seconds": 0.0,
               "graph_bytes": 2**20, "cudagraph_skips": skips}
    return {"target": counted, "draft": counted | {"recompiles": 0, "graph_breaks": 0}}


def test_the_report_names_the_capture_mode_each_run_measured_in_beside_its_dtype(tmp_path: Path) -> None:
    db = stored_run(tmp_path / "sidecar.duckdb", pair="qwen2.5-7b", dtype="bf16 (default on CUDA: bf16)",
                    capture="cudagraph (auto: CUDA, decode forwards captured as CUDA graphs)",
                    capture_counters=capture_counters())
    report = write_cost_report(db.throughput("run-1"), tmp_path / "report", draft_config=drafts)
    assert ("from 1 run(s) on NVIDIA H200 in bf16 (default on CUDA: bf16), capture cudagraph (auto: CUDA, decode "
            "forwards captured as CUDA graphs) with pair(s) qwen2.5-7b.") in report.markdown
    calibration = section(report.markdown, "Calibration: measured ÷ projected")
    assert "The steps were measured in capture mode cudagraph; the projections assume captured" in calibration
    assert "Fault:" not in report.markdown


def test_recompiles_or_graph_breaks_of_a_measured_run_are_a_fault_the_report_names(tmp_path: Path) -> None:
    db = stored_run(tmp_path / "sidecar.duckdb", pair="qwen2.5-7b", capture="compile (SIDECAR_CAPTURE=compile)",
                    capture_counters=capture_counters(recompiles=2, graph_breaks=1))
    report = write_cost_report(db.throughput("run-1"), tmp_path / "report", draft_config=drafts)
    assert ("Fault: a compiled step must compile once per shape at warm-up, never break its graph and, in cudagraph "
            "mode, run captured, but run run-1 (compile (SIDECAR_CAPTURE=compile)): 2 recompile(s) after warm-up, 1 "
            "graph break(s).") in " ".join(report.markdown.split())
    assert "Fault:" in report.html_path.read_text(encoding="utf-8")
    uncaptured = stored_run(tmp_path / "cudagraph.duckdb", pair="qwen2.5-7b", capture="cudagraph (auto: CUDA)",
                            capture_counters=capture_counters(skips=3))
    report = write_cost_report(uncaptured.throughput("run-1"), tmp_path / "uncaptured", draft_config=drafts)
    # 3 of the target's and 3 of the draft's (``capture_counters`` gives the draft the target's skips)
    assert "run run-1 (cudagraph (auto: CUDA)): 6 graph(s) left uncaptured." in " ".join(report.markdown.split())


def test_the_report_gives_each_runs_syncs_and_host_time_per_step_where_its_steps_were_counted(tmp_path: Path) -> None:
    steps = {"steps": 200, "syncs": 260, "step_seconds": 9.0, "read_seconds": 1.0}
    db = stored_run(tmp_path / "sidecar.duckdb", pair="qwen2.5-7b", capture="eager (auto: CPU, eager)",
                    capture_counters=capture_counters() | {"steps": steps})
    report = write_cost_report(db.throughput("run-1"), tmp_path / "report", draft_config=drafts)
    # (9.0 - 1.0) s over 200 steps: 40 ms; 260 reads over 200 steps: 1.3
    assert "step): run run-1 (eager): 1.30 syncs and 40.0 ms of host time per step." in " ".join(
        report.markdown.split())
    unstepped = stored_run(tmp_path / "old.duckdb", pair="qwen2.5-7b", capture="eager (auto: CPU, eager)",
                           capture_counters=capture_counters())
    report = write_cost_report(unstepped.throughput("run-1"), tmp_path / "old", draft_config=drafts)
    assert "of host time per step" not in report.markdown


def ms_per_tag_token(markdown: str, mode: str) -> float:
    """The 'device ms / tag token' cell of ``mode``'s total line in the table under the measured verdict."""
    [line] = [line for line in markdown.splitlines() if f"| {mode} | total, " in line]
    return float(line.strip(" |").split(" | ")[-1])


def test_the_measured_verdict_is_the_ratio_of_attributed_seconds_per_tag_token_in_its_table(tmp_path: Path) -> None:
    db = stored_run(tmp_path / "sidecar.duckdb", pair="qwen2.5-7b")
    report = write_cost_report(db.throughput("run-1"), tmp_path / "report", draft_config=drafts)
    [verdict] = [v for v in report.verdicts if v.basis == "measured"]
    verdicts = section(report.markdown, "Verdict per GPU type")

    # the table under the verdict: 0.3 s over 28 tag tokens against 0.4 s, per tag token
    sidecar, standalone = ms_per_tag_token(verdicts, "sidecar"), ms_per_tag_token(verdicts, "standalone")
    assert (sidecar, standalone) == pytest.approx((300 / 28, 400 / 28), rel=1e-3)
    # the verdict's ratio is the table's, to the 4 significant digits the table prints
    verdict_ratio = 1 - verdict.sidecar_saving_pct / 100
    assert verdict_ratio == pytest.approx(sidecar / standalone, rel=1e-3)
    # and what the verdict table, its sentence and headline.json print is that saving
    saving = f"{verdict.sidecar_saving_pct:.1f}%"
    assert f"| NVIDIA H200 | measured | qwen2.5-7b | {saving} cheaper |" in verdicts
    assert f"a sidecar tag token costs {saving} less than a standalone tagger's" in verdicts
    assert json.loads(report.headline_path.read_text())["sidecar_saving_pct"] == verdict.sidecar_saving_pct

    # and the same, exactly, from the rows the engine wrote: attributed seconds per tag token per mode
    per_token = {r["mode"]: r["s"] for r in db.query(
        "SELECT mode, sum(prefill_device_s + decode_device_s + coalesce(instruction_device_s, 0)) / sum(new_tokens) "
        "AS s FROM request_stats WHERE phase = 'sidecar' GROUP BY mode")}
    assert verdict.sidecar_saving_pct == pytest.approx((1 - per_token["sidecar"] / per_token["standalone"]) * 100)
    # The stream's clock says the opposite (28 tag tokens by 34 s into the stream against 0.5 s): the accounting
    # artefact that no rate divides by any more.
    wall = {r["mode"]: r["new_tokens"] / r["wall_s"] for r in db.throughput("run-1") if r["phase"] == "sidecar"}
    assert wall["sidecar"] < wall["standalone"] / 10 and verdict.sidecar_saving_pct > 0


def test_the_flow_links_each_file_by_its_absolute_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import flows.cost_report as flow_module

    stored_run(tmp_path / "sidecar.duckdb", pair="tiny")
    published: dict[str, dict[str, Any]] = {"markdown": {}, "table": {}, "link": {}}  # kind -> key -> content
    for kind in published:
        monkeypatch.setattr(flow_module, f"create_{kind}_artifact",
                            lambda content, key, kind=kind, **_: published[kind].__setitem__(key, content))  # fmt: skip
    monkeypatch.setattr(flow_module, "get_run_logger", lambda: logging.getLogger("cost-report"))
    monkeypatch.chdir(tmp_path)  # a relative database path, as the flow's default is
    result = flow_module.cost_report.fn(db_path="sidecar.duckdb", run_id="run-1")

    links = published["link"]
    assert set(links) == {"cost-report-html", "cost-report-step-time", "cost-report-usd-per-mtok",
                          "cost-report-acceptance"}  # fmt: skip
    linked = {Path(url2pathname(urlparse(uri).path)) for uri in links.values()}
    assert linked == {p for p in result.files if p.suffix in (".html", ".png")}
    assert all(p.is_absolute() and p.is_relative_to(tmp_path.resolve()) and p.is_file() for p in linked)
    markdown = published["markdown"]["cost-report"]
    assert all(f"- `{p}`" in markdown for p in result.files)
    assert set(published["table"]) == {"cost-report-lines"}
    # the tiny pair needs no files to be projected, so its measured steps are calibrated
    assert "| NVIDIA H200 | H200 | tiny (bfloat16) | sidecar | 2 |" in markdown
    assert "| NVIDIA H200 | tiny | sidecar | 2 | 0.25 | 0.5 | 0.75 |" in markdown  # acceptance per request


# the source study's shapes counted tags, whatever the run's tasks are
STUDY_TAGS = "32 tag tokens per request, the counts that give those KV figures"


def two_task_run(path: Path) -> Database:
    """A run of two documents with two sidecar tasks, hashtags and a headline, in both modes: the hashtags' sidecar
    tokens cost half the standalone ones; the headline's standalone rows have no ledger seconds."""
    db = Database(path)
    db.start_run("tasks", {}, pair="tiny", device="cpu", gpu_type=None, gamma=4, batch_size=2)
    db.record_documents("tasks", [Document(d, f"Text {d}.", i) for i, d in enumerate(("d1", "d2"))], [])

    def record(doc: str, mode: str, headline_s: float | None) -> OutputRecord:
        return OutputRecord(doc, mode, "s", [
            SidecarRecord.of("hashtags", "#a", ["a"], new_tokens=4, device_s=0.004 if mode == "sidecar" else 0.008),
            SidecarRecord.of("headline", "A head", "A head", new_tokens=5, device_s=headline_s)])

    db.write_batch("tasks", [record(d, "sidecar", 0.01) for d in ("d1", "d2")]
                   + [record(d, "standalone", None) for d in ("d1", "d2")])
    return db


def test_each_sidecar_task_gets_its_own_cost_verdict_in_its_own_words(tmp_path: Path) -> None:
    """Per task, from sidecar_outputs: the ledger seconds per token of that task, sidecar against standalone, in
    the report (markdown, page and headline.json) under the verdict per GPU type."""
    db = two_task_run(tmp_path / "sidecar.duckdb")
    report = write_cost_report(h200_rows(), tmp_path / "report", tasks=list(db.sidecar_tasks("tasks")),
                               task_costs=db.task_costs("tasks"))
    tasks = section(report.markdown, "Verdict per sidecar task")
    assert "| task | sidecar device ms / token | standalone device ms / token | sidecar $/1M tok |" in tasks
    # at the H200's $3.50 an hour: 1 device ms per token is $0.9722 per million
    assert "and its price per million tokens at the catalog's rent for NVIDIA H200." in tasks
    assert ("| hashtags | 1 | 2 | $0.9722 | $1.9444 | 8 / 8 | a sidecar tag token costs 50.0% less than a standalone "
            "one |") in tasks
    assert ("| headline | 2 | – | $1.9444 | – | 10 / 0 | no verdict: no ledger seconds per headline token in "
            "standalone |") in tasks
    # the run-wide figures count both tasks' tokens: output tokens, against a standalone draft
    verdicts = section(report.markdown, "Verdict per GPU type")
    assert "Is a sidecar output token cheaper than one from a standalone deployment" in verdicts
    assert "a sidecar output token costs 20.0% less than a standalone draft's" in verdicts
    # tag tokens only in the hashtags' own verdict, and in the source study's shapes (which counted tags)
    assert "tag tok" not in report.markdown.replace("a sidecar tag token costs 50.0%", "").replace(STUDY_TAGS, "")
    assert "a sidecar tag token costs 50.0% less than a standalone one" in report.html_path.read_text()
    headline = json.loads(report.headline_path.read_text())
    assert headline["unit"] == "output"
    assert [(t["task"], t["noun"], t["saving_pct"]) for t in headline["tasks"]] == [
        ("hashtags", "tag", 50.0), ("headline", "headline", None)]
    # one report of every run: its words from all runs' tasks, no verdict per task
    assert db.sidecar_tasks(None) == db.sidecar_tasks("tasks")


def test_a_headline_runs_report_speaks_of_headline_tokens(tmp_path: Path) -> None:
    report = write_cost_report(h200_rows(), tmp_path, draft_config=drafts, tasks=["headline"])
    assert "Is a sidecar headline token cheaper than one from a standalone deployment" in report.markdown
    assert "| headline tok/s | device ms/headline tok | $/1M headline tok |" in report.markdown
    assert "a sidecar headline token costs 20.0% less than a standalone draft's: 1 vs 1.25 device ms per headline " \
           "token ($0.9722 vs $1.2153 per 1M headline tokens at $3.50/GPU-hour)" in report.markdown
    assert not re.search(r"\btag tok|tagger", report.markdown.replace(STUDY_TAGS, ""))
    assert "Verdict per sidecar task" not in report.markdown  # no task costs given: no section
    from study.report.plots import mode_labels  # and the plots' legends name no tagger either

    assert mode_labels("headline")["standalone"] == "standalone draft" != mode_labels("tag")["standalone"]
    assert all("headline tokens per attributed device second" in r["note"] for r in report.cost_rows
               if r["source"] == "measured")


CAPTURE = "Capture mode: eager against captured"


def test_a_large_eager_floor_makes_speculation_lose_and_the_report_says_so(tmp_path: Path) -> None:
    floors = host_result(tmp_path / "host_overhead_gpu.json", eager_ms=20.0, cudagraph_ms=0.05)
    report = write_cost_report(h200_rows(), tmp_path / "report", host_overhead=floors)
    capture = section(report.markdown, CAPTURE)
    # the projections name the mode they assume, and its floor
    assert "captured (CUDA graphs), host floor 0.05 ms per 28-layer forward" in capture
    assert "eager, host floor 20 ms per 28-layer forward" in capture
    assert "in captured (CUDA graphs), host floor 0.05 ms" in section(report.markdown, "Verdict per GPU type")
    # the main phase's measured acceptance (0.75 and 0.74)
    assert "acceptance 0.74 for qwen2.5-7b" in capture
    assert ("| GPU | eager, batch 1 | eager, batch 8 | eager, batch 32 | eager overlapped, batch 1 | eager overlapped, "
            "batch 8 | eager overlapped, batch 32 | captured, batch 1 |") in capture
    assert re.search(r"\| H100 SXM \| 0\.\d+x \(slower\) \|", capture)
    assert "In eager mode speculation with Qwen2.5-7B/1.5B is slower than plain decoding on: " in capture
    assert ("Read as overlapping the device, in eager mode speculation with Qwen2.5-7B/1.5B is slower than plain "
            "decoding on: ") in capture
    assert "H100 SXM at batch 1, 8, 32" in capture


def test_a_small_eager_floor_lets_speculation_win_and_the_report_says_so(tmp_path: Path) -> None:
    floors = host_result(tmp_path / "host_overhead_gpu.json", eager_ms=0.01, cudagraph_ms=0.0)
    capture = section(write_cost_report(h200_rows(), tmp_path / "r", host_overhead=floors).markdown, CAPTURE)
    assert "(slower)" not in capture
    assert "In eager mode speculation with Qwen2.5-7B/1.5B beats plain decoding on every catalog GPU" in capture


def test_the_captured_floor_adds_to_every_projected_forward(tmp_path: Path) -> None:
    bare = write_cost_report(h200_rows(), tmp_path / "bare", draft_config=drafts,
                             host_overhead=host_result(tmp_path / "cpu.json", cudagraph_ms=0.0))
    floored = write_cost_report(h200_rows(), tmp_path / "floored", draft_config=drafts,
                                host_overhead=host_result(tmp_path / "gpu.json", cudagraph_ms=1.5))

    def projected(report: Any) -> dict:
        return {(r["gpu_type"], r["pair"], r["mode"], r["batch_size"]): r for r in report.cost_rows
                if r["source"] == "projected"}

    bare_rows, floored_rows = projected(bare), projected(floored)
    assert bare_rows.keys() == floored_rows.keys()
    for key, row in floored_rows.items():
        # a 28-layer draft's decode step pays the whole 1.5 ms floor
        assert row["ms_per_step"] == pytest.approx(bare_rows[key]["ms_per_step"] + 1.5)
        assert row["tokens_per_s"] < bare_rows[key]["tokens_per_s"]
        assert "captured (CUDA graphs), host floor 1.5 ms" in row["note"]


def test_an_unmeasured_captured_floor_is_projected_as_a_lower_bound(tmp_path: Path) -> None:
    report = write_cost_report(h200_rows(), tmp_path / "r", host_overhead=host_result(tmp_path / "cpu.json"))
    capture = section(report.markdown, CAPTURE)
    unmeasured = "captured (CUDA graphs), a forward's host floor unmeasured on a GPU, projected as 0: a lower bound"
    assert unmeasured in capture
    assert "captured (lower bound), batch 1" in capture
    assert "host floor unmeasured" in section(report.markdown, "Verdict per GPU type")


def test_a_cpus_step_work_is_named_and_the_captured_floor_still_labelled_a_lower_bound(tmp_path: Path) -> None:
    report = write_cost_report(h200_rows(), tmp_path / "r",
                               host_overhead=host_result(tmp_path / "cpu.json", outside_graphs_ms=0.2))
    capture = " ".join(section(report.markdown, CAPTURE).split())
    assert "captured (CUDA graphs), a forward's host floor unmeasured on a GPU, projected as 0: a lower bound " \
           "(cpu.json has no cudagraph row); plus a step's host work around its forwards, 0.2 ms per forward at 1 " \
           "row (a compile step's host time outside its compiled calls" in capture
    assert "captured (lower bound), batch 1" in capture and "not measured on a GPU, so captured times" in capture


def test_a_corrupt_floor_file_stops_the_report_naming_the_file_and_field(tmp_path: Path) -> None:
    path = tmp_path / "host_overhead_gpu.json"
    path.write_text('{"layers": 28, "rows": [{"mode": "eager", "our_forward_ms": NaN}]}')
    with pytest.raises(CostInputError, match=r"host_overhead_gpu\.json: rows\[mode=eager\]\.our_forward_ms"):
        write_cost_report(h200_rows(), tmp_path / "r", host_overhead=path)
    assert not (tmp_path / "r").exists()  # nothing half-written
