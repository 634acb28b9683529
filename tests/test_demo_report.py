"""The demo's closing report: every line within 80 columns, nothing wrapped into a column of words, and
the figures it is given, in the words a person reads."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from cli.demo_report import WIDTH, DemoFindings, render, summary_head

LONG_SUMMARY = ("- The city council approved a new budget on Tuesday after a long debate about schools, roads, "
                "parks and the new library downtown\n- Second bullet")


TEXT_TALLY = {"judge_model": "qwen-coder-small", "prompt_version": "tags-v1", "documents": 4, "wins": 1,
              "losses": 0, "ties": 2, "undecided": 1, "consistent": 2, "mean_preference": None, "preferences": [],
              "reliable": False, "control_documents": 4, "control_cleared": 2, "control_accuracy": 0.5,
              "hard_documents": 4, "hard_cleared": 1, "null_documents": 4, "null_tied": 4, "verdict": "UNRELIABLE",
              "separation": 0.125, "separation_spread": 0.25, "auc": 0.625, "detectable": 0.35, "position_bias": 0.875,
              "margin": None, "threshold": 0.75, "preference_ci": None}
PROBABILITY_TALLY = TEXT_TALLY | {
    "prompt_version": "tags-p1", "wins": 0, "ties": 4, "undecided": 0, "consistent": 1, "mean_preference": 0.5125,
    "preferences": [0.49, 0.51, 0.52, 0.53], "reliable": True, "control_cleared": 4, "control_accuracy": 1.0,
    "hard_cleared": 3, "verdict": "tie", "separation": 0.2,
    "separation_spread": 0.05, "auc": 1.0, "detectable": 0.021, "position_bias": 0.6213,
    "margin": 0.031, "preference_ci": (0.4975, 0.5275)}


# 1 vs 1.25 device ms per tag token over 32 tag tokens per request: the sidecar's 32 ms are 2 of prefill, 29 of
# decode and 1 of its instruction line; the standalone tagger's 40 ms are 10 of prefill and 30 of decode
HEADLINE = {"gpu_type": "NVIDIA H200", "pair": "qwen2.5-7b", "basis": "measured", "batch": 32,
            "sidecar": {"tag_tokens": 32.0, "prefill_s": 0.002, "decode_s": 0.029, "instruction_s": 0.001},
            "standalone": {"tag_tokens": 32.0, "prefill_s": 0.010, "decode_s": 0.030, "instruction_s": 0.0},
            "sidecar_ms_per_tag_token": 1.0, "standalone_ms_per_tag_token": 1.25, "sidecar_saving_pct": 20.0,
            "sidecar_tokens_per_s": 1000.0, "standalone_tokens_per_s": 800.0, "usd_per_gpu_hour": 3.5,
            "sidecar_usd_per_mtok": 0.9722, "standalone_usd_per_mtok": 1.2153,
            "kv_evicted_bytes": 1.3e6, "kv_attended_bytes": 13.8e6, "kv_standalone_bytes": 1.1e6}


def findings(**changes) -> DemoFindings:
    values = dict(
        run_id="nightly-20261201-abc", db_path=Path("data/sidecar.duckdb"),
        rows=[{"doc_id": "a1", "title": "Council budget", "summary": LONG_SUMMARY,
               "sidecar_tags": ["budget", "council", "schools"], "standalone_tags": None}],
        judge=[TEXT_TALLY],
        headline=HEADLINE,
        html_path=Path("data/cost_report/nightly-20261201-abc/cost_report.html"), seconds=412.0)
    return DemoFindings(**(values | changes))


def rendered(report: DemoFindings, width: int = 200) -> list[str]:
    console = Console(record=True, width=width, color_system=None)
    render(report, console)
    return console.export_text().splitlines()


def test_every_line_fits_80_columns_and_a_long_summary_is_cut_not_wrapped() -> None:
    lines = rendered(findings())
    assert max(map(len, lines)) <= WIDTH
    [head] = [line for line in lines if line.startswith("  summary")]
    assert head.startswith("  summary    The city council approved") and head.endswith("…")
    assert not any("Second bullet" in line for line in lines)
    assert "  sidecar    #budget #council #schools" in lines
    assert "  standalone (no tags parsed)" in lines


def test_a_narrower_terminal_gets_a_narrower_report() -> None:
    assert max(map(len, rendered(findings(), width=60))) <= 60


def test_the_cost_headline_and_the_judge_tally_are_stated() -> None:
    lines = rendered(findings())
    text = "\n".join(lines)
    assert "measured on NVIDIA H200, batch 32; device time" in text
    # 1 vs 1.25 ms per tag token: a sidecar token costs 20% less; 1.3 of 13.8 MB: eviction frees 91%
    assert "a sidecar tag token costs 20% less than a standalone one (1.00 vs 1.25 ms)" in text
    assert "frees 91% of the KV" in text
    # under the verdict, the lines it follows from; the instruction line is the sidecar's own
    table = lines[lines.index(next(line for line in lines if line.startswith("sidecar "))):]
    assert table[:7] == [
        "sidecar        32.0           1.00           $0.9722",
        "  prefill      2.00",
        "  decode       29.0",
        "  instruction  1.00",
        "standalone     40.0           1.25           $1.2153",
        "  prefill      10.0",
        "  decode       30.0"]
    assert "1.30 MB evicted, 13.80 MB attended, 1.10 MB standalone" in text
    assert "judge   qwen-coder-small (pairwise, prompt tags-v1)" in text
    assert "sidecar 1 wins, 2 ties, 0 losses of 4; position-consistent 2/3; 1 undecided" in text
    assert "SELECT * FROM results WHERE run_id = 'nightly-20261201-abc';" in text
    assert "cost_report.html" in text and "412 s in all" in text


@pytest.mark.parametrize(("tasks", "said"), [
    (("headline",), ["Cost of the headline sidecar output", "a sidecar headline token costs 20% less",
                     "headline tokens per request: 32.0 sidecar", "ms / out tok"]),
    (("hashtags", "headline"), ["Cost of the sidecar outputs", "a sidecar output token costs 20% less",
                                "output tokens per request"]),
])
def test_the_cost_section_names_the_runs_tasks_not_tags(tasks: tuple[str, ...], said: list[str]) -> None:
    text = "\n".join(rendered(findings(tasks=tasks)))
    assert all(words in text for words in said), text
    assert "tag token" not in text and "tag tok" not in text
    assert all(len(line) <= WIDTH for line in rendered(findings(tasks=tasks), width=WIDTH))


def test_each_tasks_cost_verdict_is_stated_in_its_own_words() -> None:
    tasks = [{"task": "hashtags", "noun": "tag", "sidecar_ms_per_token": 1.0, "standalone_ms_per_token": 2.0,
              "sidecar_tokens": 8, "standalone_tokens": 8, "saving_pct": 50.0},
             {"task": "headline", "noun": "headline", "sidecar_ms_per_token": 2.0, "standalone_ms_per_token": None,
              "sidecar_tokens": 10, "standalone_tokens": 0, "saving_pct": None}]
    lines = rendered(findings(tasks=("hashtags", "headline"), headline=HEADLINE | {"unit": "output", "tasks": tasks}),
                     width=WIDTH)
    assert "  hashtags: a sidecar tag token costs 50% less (1.00 vs 2.00 ms)" in lines
    assert "  headline: no verdict, no ledger seconds in standalone" in lines
    # one task: its verdict is the run's, said once
    one = rendered(findings(tasks=("headline",), headline=HEADLINE | {"unit": "headline", "tasks": tasks[1:]}))
    assert not any("no ledger seconds" in line for line in one)


def test_the_judges_controls_are_stated_and_a_judge_that_fails_them_is_unreliable() -> None:
    text = "\n".join(lines := rendered(findings(judge=[TEXT_TALLY, PROBABILITY_TALLY])))
    assert max(map(len, lines)) <= WIDTH
    assert "ladder: easy 2/4, hard 1/4, null 4/4; position bias 0.88 (0.5 = none)" in text
    assert "separation 0.125 ± 0.250, AUC 0.625; detectable difference 0.350" in text
    assert "UNRELIABLE: easy or null rung under 75%; no verdict" in text
    assert text.count("UNRELIABLE") == 1  # the probability judge passed its controls
    assert "preference for the sidecar 0.512 (95% CI 0.497-0.527); tie within 0.031 of 0.5" in text
    assert "ladder: easy 4/4, hard 3/4, null 4/4; position bias 0.62 (0.5 = none)" in text
    assert "verdict: no difference found" in text
    assert "separation 0.200 ± 0.050, AUC 1.000; detectable difference 0.021" in text
    narrow = rendered(findings(judge=[TEXT_TALLY, PROBABILITY_TALLY]), width=60)
    assert max(map(len, narrow)) <= 60 and any(line.startswith("UNRELIABLE") for line in narrow)


def test_missing_parts_say_why() -> None:
    text = "\n".join(rendered(findings(headline=None, judge=[], html_path=None)))
    assert "no measured cost verdict" in text and "nothing judged" in text and "cost_report.html" not in text
    older = {k: v for k, v in HEADLINE.items() if k not in ("sidecar", "standalone")}
    assert "no device-time lines" in "\n".join(rendered(findings(headline=older)))


def test_the_demos_verdict_follows_from_the_numbers_printed_under_it(tmp_path: Path) -> None:
    """A real run's rows in a real DuckDB file, the cost report's headline.json, the demo's closing lines: the
    percentage it prints is what the device milliseconds per tag token printed under it give."""
    import json

    from test_report import drafts, stored_run

    from study.report import write_cost_report

    db = stored_run(tmp_path / "sidecar.duckdb", pair="qwen2.5-7b")
    report = write_cost_report(db.throughput("run-1"), tmp_path / "report", draft_config=drafts)
    everything = rendered(findings(headline=json.loads(report.headline_path.read_text())), width=WIDTH)
    assert max(map(len, everything)) <= WIDTH
    start = next(i for i, line in enumerate(everything) if line.startswith("Cost of tagging"))
    lines = everything[start:everything.index("", start)]
    [verdict] = [line for line in lines if line.startswith("a sidecar tag token costs")]
    printed = {line.split()[0]: [float(cell) for cell in line.split()[1:3]] for line in lines
               if line.startswith(("sidecar ", "standalone "))}
    per_token = {mode: values[1] for mode, values in printed.items()}
    saving = (1 - per_token["sidecar"] / per_token["standalone"]) * 100
    amount, direction = verdict.split("costs ")[1].split("% ")[0], verdict.split("% ")[1].split()[0]
    assert (int(amount), direction) == (round(abs(saving)), "less" if saving >= 0 else "more")
    assert f"({per_token['sidecar']:.1f} vs {per_token['standalone']:.1f} ms)" in verdict
    # per request, each mode's lines add up to its total, and the total over its tag tokens is its ms per tag token
    for mode, labels in (("sidecar", 3), ("standalone", 2)):
        start = lines.index(next(line for line in lines if line.startswith(f"{mode} ")))
        parts = [float(line.split()[1]) for line in lines[start + 1:start + 1 + labels]]
        assert sum(parts) == pytest.approx(printed[mode][0], rel=0.01)
    # and it is the cost report's own verdict
    [measured] = [v for v in report.verdicts if v.basis == "measured"]
    assert round(abs(measured.sidecar_saving_pct)) == int(amount)


LIKELIHOOD_TALLY = PROBABILITY_TALLY | {
    "prompt_version": "tags-l2", "method": "likelihood", "wins": 3, "ties": 1, "mean_preference": None,
    "mean_difference": 0.412, "margin": 0.1, "verdict": "sidecar", "preferences": [], "preference_ci": None}
UNAVAILABLE = {"judge_model": "qwen-coder-small/draft", "prompt_version": "tags-l2", "method": "likelihood",
               "documents": 0, "note": "unavailable, the pairwise method's verdict stands: HTTP 404"}


def test_the_judge_is_reported_per_method_with_its_ladder_and_the_runs_verdict_from_trusted_methods() -> None:
    text = "\n".join(lines := rendered(findings(judge=[TEXT_TALLY, LIKELIHOOD_TALLY, UNAVAILABLE],
                                                judge_verdict="sidecar")))
    assert max(map(len, lines)) <= WIDTH
    assert "judge   qwen-coder-small (likelihood, prompt tags-l2)" in text
    assert "sidecar 3 wins, 1 ties, 0 losses of 4\n" in text  # no position consistency without positions
    assert "sidecar minus standalone 0.412 nats per tag token; tie within 0.100" in text
    assert "verdict: the sidecar's tags are better" in text
    assert "judge   qwen-coder-small/draft (likelihood, prompt tags-l2)" in text
    assert "UNRELIABLE: unavailable, the pairwise method's verdict stands: HTTP 404" in text
    assert "run verdict (trusted methods only): the sidecar's tags are better" in text
    nothing = "\n".join(rendered(findings(judge=[TEXT_TALLY], judge_verdict="UNRELIABLE")))
    assert "run verdict (trusted methods only): UNRELIABLE: no method's controls passed" in nothing


def test_summary_head_is_the_first_line_without_its_bullet() -> None:
    assert summary_head("\n\n* First point\n- second") == "First point"
    assert summary_head("") == "(empty summary)"


def test_findings_join_the_tally_with_the_judges_quality_and_interval(tmp_path: Path) -> None:
    from cli.pipeline import findings as read_findings
    from storage import Database, JudgementRecord, JudgeSettingsRecord

    db = Database(tmp_path / "sidecar.duckdb")
    db.start_run("r", {}, pair="tiny", device="cpu", gpu_type=None, gamma=4, batch_size=1)

    def pair(doc: str, kind: str, subject: str, other: str, p1: float, p2: float) -> list[JudgementRecord]:
        foil = "d0" if kind == "control" else None
        return [JudgementRecord(doc, "j", "tags-p1", 1, subject, other, "A", subject if p1 > 0.5 else other,
                                kind=kind, p_a=p1, p_b=1 - p1, foil_doc_id=foil),
                JudgementRecord(doc, "j", "tags-p1", 2, other, subject, "A", other if p2 > 0.5 else subject,
                                kind=kind, p_a=p2, p_b=1 - p2, foil_doc_id=foil)]

    games = [*pair("d1", "main", "sidecar", "standalone", 0.9, 0.6), *pair("d2", "main", "sidecar", "standalone",
                                                                            0.7, 0.8),
             *pair("d1", "control", "own", "other", 0.9, 0.2), *pair("d1", "null", "original", "reversed", 0.51, 0.5)]
    db.write_judgements("r", games, JudgeSettingsRecord("j", "tags-p1", "probability", 0.75, 0.02))

    [tally] = read_findings(db, "r", 1.0).judge
    assert (tally["control_documents"], tally["control_cleared"], tally["control_accuracy"], tally["threshold"]) == (
        1, 1, 1.0, 0.75)
    assert (tally["separation"], tally["auc"]) == (pytest.approx(0.35), 1.0)  # (0.9 + 0.8) / 2 - 0.5
    assert tally["margin"] == pytest.approx(0.02) and tally["reliable"] is True  # the null 0.505 tied
    assert (tally["null_tied"], tally["null_documents"], tally["verdict"]) == (1, 1, "tie")
    assert tally["mean_preference"] == pytest.approx((0.65 + 0.45) / 2)
    low, high = tally["preference_ci"]
    assert low <= tally["mean_preference"] <= high
    text = "\n".join(rendered(findings(judge=[tally])))
    assert "preference for the sidecar 0.550 (95% CI" in text and "UNRELIABLE" not in text


def test_the_demo_lists_every_tasks_output_per_document_and_mode(tmp_path: Path) -> None:
    from test_report import two_task_run

    from cli.pipeline import findings as read_findings
    from storage import OutputRecord, SidecarRecord

    db = two_task_run(tmp_path / "sidecar.duckdb")
    read = read_findings(db, "tasks", 1.0)
    assert {(o["doc_id"], o["task"], o["mode"]) for o in read.outputs} == {
        (d, t, m) for d in ("d1", "d2") for t in ("hashtags", "headline") for m in ("sidecar", "standalone")}
    lines = rendered(read, width=WIDTH)
    assert "2 documents: title, summary head, each task's output per mode" in lines
    d1 = lines[lines.index(next(line for line in lines if line.startswith("d1"))):][:8]
    assert d1[2:] == ["  hashtags", "    sidecar      #a", "    standalone   #a", "  headline",
                      "    sidecar      A head", "    standalone   A head"]
    # an object as JSON, a label list joined, an output that did not parse as its raw text, marked
    db.write_batch("tasks", [OutputRecord("d1", "sidecar", "s", [
        SidecarRecord.of("entities", '{"people": ["Ada"]}', {"people": ["Ada"]}),
        SidecarRecord.of("topics", "sport, politics", ["sport", "politics"]),
        SidecarRecord.of("headline", "no", None, parse_error="not one line")])])
    text = "\n".join(rendered(read_findings(db, "tasks", 1.0), width=WIDTH))
    assert '    sidecar      {"people": ["Ada"]}' in text and "    sidecar      sport, politics" in text
    assert "    sidecar      (not parsed) no" in text
    # a hashtags run keeps its two tag sets per document
    assert "sidecar and standalone tags" in "\n".join(rendered(findings()))


def test_each_tasks_judge_verdict_is_stated_and_a_task_not_judged_says_why_without_unreliable() -> None:
    headline = LIKELIHOOD_TALLY | {"task": "headline", "mean_difference": 0.3}
    tasks = {"hashtags": {"status": "unreliable", "verdict": None, "trusted": [],
                          "reason": "pairwise qwen-coder-small tags-v1: easy 2/4, null 4/4 (threshold 0.75)"},
             "headline": {"status": "judged", "verdict": "sidecar", "trusted": ["likelihood qwen-coder-small tags-l2"],
                          "reason": None},
             "topic": {"status": "not judged", "verdict": None, "trusted": [],
                       "reason": "every document of its control sample (4) has the same sidecar output"}}
    text = "\n".join(lines := rendered(findings(judge=[TEXT_TALLY | {"task": "hashtags"}, headline],
                                                judge_verdict="UNRELIABLE", judge_tasks=tasks)))
    assert max(map(len, lines)) <= WIDTH
    assert "Judge: sidecar vs standalone outputs, per task and method" in text
    assert "task hashtags: UNRELIABLE: pairwise qwen-coder-small tags-v1: easy 2/4" in text
    assert "task headline: the sidecar's outputs are better (trusted: likelihood" in text
    assert "sidecar minus standalone 0.300 nats per token;" in text
    assert "task topic: not judged: every document of its control sample (4) has the same" in text
    assert "UNRELIABLE" not in text.split("task topic")[1].split("\n")[0]
    # each task's methods under its own line, hashtags first
    assert text.index("task hashtags") < text.index("prompt tags-v1") < text.index("task headline") < text.index(
        "prompt tags-l2") < text.index("task topic")
    assert "run verdict" not in text  # per task instead
