"""The nightly and cost-report flows with the tiny pair, on an ephemeral Prefect API and a real DuckDB file.

One ephemeral Prefect server (temporary PREFECT_HOME and database) serves the whole module; the crash
test's subprocesses talk to it too.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from storage import Database
from storage.run_keys import run_key

REPO = Path(__file__).resolve().parents[1]
BAD_CORPUS = REPO / "tests" / "data" / "bad_corpus.parquet"
SIDECAR = Path(sys.executable).parent / "sidecar"
PLANTED_KEY = "sk-planted-7f3c9e1d4b2a8c6e0f5d"
SENTENCES = [
    "The city council approved a new budget on Tuesday after a long debate about schools and roads.",
    "Officials said the plan would add jobs at the plant in the north of the state.",
    "The president met leaders in Berlin, Moscow, Beijing and Doha to discuss prices.",
    "Prices rose 3.5 percent in 2017 while 1,200 workers lost their jobs at the factory.",
]

pytestmark = [pytest.mark.slow, pytest.mark.servers]


def write_corpus(path: Path, n: int) -> Path:
    texts = [f"{SENTENCES[i % 4]} Report number {i}." for i in range(n)]
    pq.write_table(pa.table({"id": [f"doc-{i:02d}" for i in range(n)], "article": texts,
                             "title": [f"Title {i}" for i in range(n)]}), path)
    return path


def params(tmp_path: Path, corpus: Path, **overrides):
    from flows.nightly import NightlyParams

    values = {"corpus": str(corpus), "pair": "tiny", "batch_size": 3, "max_new_tokens": 12,
              "db_path": str(tmp_path / "sidecar.duckdb"), "trigger_judge": False, "trigger_cost_report": False}
    return NightlyParams(**(values | overrides))


def flow_run_artifacts(flow_run_id) -> dict[str, object]:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return {a.key: a for a in artifacts}


def test_nightly_runs_every_mode_commits_and_reports(prefect_api, tmp_path: Path) -> None:
    from flows.nightly import nightly

    corpus = write_corpus(tmp_path / "news.parquet", 5)
    run = params(tmp_path, corpus, modes=["sidecar", "sidecar_attended", "standalone"], title_column="title",
                 trigger_cost_report=True, commit_every_s=3600, window=3)
    state = nightly(**run.model_dump(), return_state=True)
    counts = state.result()
    assert (counts.documents, counts.done, counts.skipped_done, counts.windows) == (5, 5, 0, 2)
    assert counts.commits == 1, "both windows finished within the commit interval: one transaction"
    assert counts.rejected == {} and counts.errors == {}

    db = Database(run.db_path)
    results = db.results(counts.run_id)
    assert [r["doc_id"] for r in results] == [f"doc-{i:02d}" for i in range(5)]
    assert all(r["title"] and r["summary"] and r["run_status"] == "completed" for r in results)
    stored = db.get_run(counts.run_id)
    assert stored["params"]["pair"] == "tiny" and stored["modes"] == ["sidecar", "sidecar_attended", "standalone"]
    import torch

    from sidecar.models.devices import device_name

    assert stored["gpu_type"] == device_name(torch.device(stored["device"])), "the GPU type the cost report prices"
    assert stored["dtype"] == "fp32 (SIDECAR_DTYPE=fp32)", "the dtype and why, beside the device"
    assert stored["capture"] == "eager (SIDECAR_CAPTURE=eager)", "its capture mode too"
    captured = json.loads(stored["capture_counters"])
    assert set(captured) == {"target", "draft", "steps"}
    steps = captured.pop("steps")
    assert all(c["forwards"] > 0 and c["recompiles"] == 0 and c["graph_breaks"] == 0 for c in captured.values())
    # and what its steps cost the host: at least the step's one read each
    assert steps["steps"] > 0 and steps["syncs"] >= steps["steps"] and steps["step_seconds"] > 0
    summed = db.capture(counts.run_id)
    assert summed["faults"] == 0 and summed["syncs_per_step"] >= 1 and summed["host_ms_per_step"] > 0
    # two windows, each streamed once per mode: two batches per mode and phase in the throughput view
    throughput = {(t["mode"], t["phase"]): t for t in db.query("SELECT * FROM throughput")}
    assert set(throughput) == {("sidecar", "main"), ("sidecar", "sidecar"), ("sidecar_attended", "main"),
                               ("sidecar_attended", "sidecar"), ("standalone", "sidecar")}
    assert all(t["batches"] == 2 and t["requests"] == 5 for t in throughput.values())

    artifacts = flow_run_artifacts(state.state_details.flow_run_id)
    assert artifacts["nightly-progress"].data == 100.0
    summary = artifacts["nightly-summary"].data
    assert "| done in this run | 5 |" in summary and "| errors | 0 |" in summary

    # the cost report ran afterwards: measured lines in DuckDB, files next to the database
    measured = db.query("SELECT mode, batch_size FROM costs WHERE source = 'measured' AND run_id = ?",
                        [counts.run_id])
    assert {r["mode"] for r in measured} == {"sidecar", "sidecar_attended", "standalone"}
    out_dir = Path(run.db_path).parent / "cost_report" / run_key(counts.run_id)
    for name in ("cost_report.md", "cost_report.html", "step_time_vs_batch.png"):
        assert (out_dir / name).stat().st_size > 0
    # the verdict is the ratio of the device seconds the engine charged per tag token in this run's streams,
    # where sidecar rows decoded beside main rows
    per_token = {r["mode"]: r["s"] for r in db.query(
        "SELECT mode, sum(prefill_device_s + decode_device_s + instruction_device_s) / sum(new_tokens) AS s "
        "FROM request_stats WHERE run_id = ? AND phase = 'sidecar' GROUP BY mode", [counts.run_id])}
    headline = json.loads((out_dir / "headline.json").read_text())
    assert headline["basis"] == "measured"
    assert headline["sidecar_saving_pct"] == pytest.approx((1 - per_token["sidecar"] / per_token["standalone"])
                                                           * 100, rel=1e-6)
    # ... and published its artifacts (from its own flow run, a subflow of this one; the keys are shared by
    # every run's report, the description names the run)
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    keys = {"cost-report", "cost-report-lines", "cost-report-html", "cost-report-step-time",
            "cost-report-usd-per-mtok", "cost-report-acceptance"}
    with get_client(sync_client=True) as client:
        published = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=sorted(keys))))
    assert {a.key for a in published if counts.run_id in (a.description or "")} == keys


def test_a_rerun_resumes_and_skips_finished_documents(prefect_api, tmp_path: Path) -> None:
    from flows.nightly import nightly

    corpus = write_corpus(tmp_path / "news.parquet", 7)
    first = nightly(**params(tmp_path, corpus, limit=4, run_id="resume-me", commit_every_s=0, window=3).model_dump())
    assert (first.done, first.skipped_done, first.windows, first.commits) == (4, 0, 2, 2)
    # the same run with more documents: the first four are not run again
    second = nightly(**params(tmp_path, corpus, run_id="resume-me").model_dump())
    assert (second.documents, second.done, second.skipped_done) == (7, 3, 4)

    # without a run id the id comes from the parameters and the date: an identical rerun resumes
    derived = nightly(**params(tmp_path, corpus, limit=2).model_dump())
    again = nightly(**params(tmp_path, corpus, limit=2, batch_size=1).model_dump())
    assert derived.run_id == again.run_id and derived.run_id.startswith("nightly-")
    assert (again.done, again.skipped_done, again.windows) == (0, 2, 0)

    db = Database(tmp_path / "sidecar.duckdb")
    counts = db.query("SELECT run_id, count(*) AS n, count(DISTINCT (doc_id, mode)) AS keys FROM outputs "
                      "GROUP BY run_id ORDER BY run_id")
    assert [(c["n"], c["keys"]) for c in counts] == [(4, 4), (14, 14)]


def test_sidecar_capture_hf_runs_and_records_huggingfaces_forward(prefect_api, tmp_path: Path, monkeypatch) -> None:
    from flows.nightly import nightly

    monkeypatch.setenv("SIDECAR_CAPTURE", "hf")
    run = params(tmp_path, write_corpus(tmp_path / "news.parquet", 2), run_id="hf-run", modes=["sidecar"])
    counts = nightly(**run.model_dump())
    assert counts.done == 2
    db = Database(run.db_path)
    stored = db.get_run("hf-run")
    # Hugging Face's forward keeps no counters of its own: none per model, only its steps'
    counters = json.loads(stored["capture_counters"])
    assert (stored["capture"], set(counters)) == ("hf (SIDECAR_CAPTURE=hf)", {"steps"})
    assert counters["steps"]["syncs"] >= counters["steps"]["steps"] > 0
    assert [r["capture"] for r in db.throughput("hf-run")] == ["hf (SIDECAR_CAPTURE=hf)"] * 2


def test_a_run_id_reused_for_another_corpus_is_refused_before_anything_is_written(prefect_api,
                                                                                   tmp_path: Path) -> None:
    from flows.nightly import nightly
    from storage import RunMismatchError

    first = nightly(**params(tmp_path, write_corpus(tmp_path / "news.parquet", 3), run_id="taken").model_dump())
    assert first.done == 3
    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"id": ["x-0", "x-1"], "article": [SENTENCES[1], SENTENCES[2]]}), other)
    db = Database(tmp_path / "sidecar.duckdb")

    def stored() -> list[object]:
        return [db.query(f"SELECT * FROM {table} ORDER BY ALL")
                for table in ("runs", "documents", "outputs", "request_stats")]

    before = stored()
    with pytest.raises(RunMismatchError, match="row 0 is 'doc-00' there and 'x-0' here"):
        nightly(**params(tmp_path, other, run_id="taken").model_dump())
    with pytest.raises(RunMismatchError, match="max_new_tokens 12 \\(this start: 8\\)"):
        nightly(**params(tmp_path, tmp_path / "news.parquet", run_id="taken", max_new_tokens=8).model_dump())
    assert stored() == before
    assert db.get_run("taken")["status"] == "completed"


def test_two_tasks_are_stored_per_document_and_mode_with_the_summary_once(prefect_api, tmp_path: Path) -> None:
    from flows.nightly import nightly
    from sidecar.tasks.task import HASHTAGS
    from storage import RunMismatchError

    headline = {"name": "headline", "instruction": "Then write a one-line headline for the summary.",
                "max_new_tokens": 8}
    corpus = write_corpus(tmp_path / "news.parquet", 3)
    run = params(tmp_path, corpus, run_id="two-tasks", sidecar_tasks=[HASHTAGS.model_dump(), headline])
    counts = nightly(**run.model_dump())
    assert counts.done == 3 and counts.errors == {}
    db = Database(run.db_path)
    assert db.query("SELECT count(*) AS n, count(DISTINCT (doc_id, mode)) AS keys FROM outputs") == [
        {"n": 6, "keys": 6}], "the summary once per document and mode"
    tasks = db.query("SELECT doc_id, mode, list(task ORDER BY task) AS tasks, bool_and(new_tokens > 0) AS tokens, "
                     "bool_and(device_s > 0) AS charged FROM sidecar_outputs WHERE run_id = ? GROUP BY ALL "
                     "ORDER BY ALL", [counts.run_id])
    assert [(t["doc_id"], t["mode"]) for t in tasks] == [
        (f"doc-{i:02d}", mode) for i in range(3) for mode in ("sidecar", "standalone")]
    assert all(t["tasks"] == ["hashtags", "headline"] and t["tokens"] and t["charged"] for t in tasks)
    # a parsed headline is a JSON string, parsed hashtags a list
    kinds = db.query("SELECT task, list_distinct(list(json_type(parsed))) AS kinds FROM sidecar_outputs "
                     "WHERE parsed IS NOT NULL GROUP BY task ORDER BY task")
    assert [(k["task"], set(k["kinds"])) for k in kinds] == [("hashtags", {"ARRAY"}), ("headline", {"VARCHAR"})]
    # the request's sidecar phase holds both tasks' tokens
    phases = db.query("SELECT s.new_tokens AS phase, sum(t.new_tokens) AS tasks FROM request_stats AS s "
                      "JOIN sidecar_outputs AS t USING (run_id, doc_id, mode) WHERE s.phase = 'sidecar' "
                      "GROUP BY s.run_id, s.doc_id, s.mode, s.new_tokens")
    assert len(phases) == 6 and all(p["phase"] == p["tasks"] for p in phases)
    results = db.results(counts.run_id)
    assert len(results) == 3 and {r["sidecar_name"] for r in results} == {"hashtags"}
    # the cost report gives each task its own verdict, in its own words
    from flows.cost_report import cost_report

    report = cost_report(db_path=run.db_path, run_id=counts.run_id)
    [markdown] = [path for path in report.files if path.name == "cost_report.md"]
    tasks = markdown.read_text().split("## Verdict per sidecar task\n", 1)[1].split("\n## ", 1)[0]
    assert "| hashtags |" in tasks and "a sidecar tag token costs" in tasks
    assert "| headline |" in tasks and "a sidecar headline token costs" in tasks
    assert "a sidecar output token" in markdown.read_text()  # both tasks together

    before = db.query("SELECT * FROM sidecar_outputs ORDER BY ALL")
    with pytest.raises(RunMismatchError, match=re.escape("sidecar_tasks hashtags, headline (this start: hashtags)")):
        nightly(**params(tmp_path, corpus, run_id="two-tasks").model_dump())
    assert db.query("SELECT * FROM sidecar_outputs ORDER BY ALL") == before


def test_a_crash_after_k_documents_loses_none_of_them_and_the_resume_stores_each_once(prefect_api, tmp_path: Path,
                                                                                    monkeypatch) -> None:
    import flows.nightly_decode
    from flows.nightly import nightly

    real_run_window = flows.nightly_decode.run_window
    handed: list[str] = []

    def crashing_run_window(engine, docs, settings, max_batch, on_documents, on_progress=None):
        def hand_on(finished) -> None:
            on_documents(finished)
            handed.extend(d.doc.doc_id for d in finished)
            if len(handed) >= 3:  # while the engine still holds the window's other documents
                raise RuntimeError("injected crash after 3 finished documents")

        return real_run_window(engine, docs, settings, max_batch, hand_on, on_progress)

    monkeypatch.setattr(flows.nightly_decode, "run_window", crashing_run_window)
    corpus = write_corpus(tmp_path / "news.parquet", 6)
    # one sidecar mode: documents finish one by one inside the window; a long commit interval keeps them pending
    run = params(tmp_path, corpus, run_id="crash-k", batch_size=2, window=6, modes=["sidecar"],
                 commit_every_s=3600, max_new_tokens=8)
    state = nightly(**run.model_dump(), return_state=True)
    assert state.is_failed()
    db = Database(run.db_path)
    assert len(handed) == 3 and db.get_run("crash-k")["status"] == "failed"
    # the failed start's forwards are kept; the resume adds its own to them, once
    crashed_forwards = db.capture("crash-k")["forwards"]
    assert crashed_forwards > 0
    assert db.done_doc_ids("crash-k", ["sidecar"]) == set(handed), "every finished document was committed"
    crashed_batches = {r["batch_id"] for r in db.query("SELECT batch_id FROM outputs WHERE run_id = 'crash-k'")}

    monkeypatch.setattr(flows.nightly_decode, "run_window", real_run_window)
    resumed = nightly(**run.model_dump())
    assert (resumed.documents, resumed.done, resumed.skipped_done) == (6, 3, 3)
    assert db.get_run("crash-k")["status"] == "completed" and len(db.results("crash-k")) == 6
    assert db.capture("crash-k")["forwards"] > crashed_forwards
    stored = db.query("SELECT count(*) AS rows, count(DISTINCT doc_id) AS docs FROM outputs WHERE run_id = 'crash-k'")
    assert stored == [{"rows": 6, "docs": 6}]
    phases = db.query("SELECT count(*) AS rows, count(DISTINCT (doc_id, phase)) AS keys FROM request_stats "
                      "WHERE run_id = 'crash-k'")
    assert phases == [{"rows": 12, "keys": 12}]
    # the resume's streams are batches of their own: no batch id mixes rows of both processes
    resumed_batches = {r["batch_id"] for r in db.query(
        "SELECT batch_id FROM outputs WHERE run_id = 'crash-k' AND NOT list_contains(?, doc_id)", [handed])}
    assert resumed_batches and not crashed_batches & resumed_batches


def bad_corpus_rows() -> list[tuple[str | None, bytes | None, str | None, str | None]]:
    spec = importlib.util.spec_from_file_location("make_bad_corpus", BAD_CORPUS.parent / "make_bad_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ROWS


def test_a_failing_window_keeps_the_finished_ones_and_fails_the_run(prefect_api, tmp_path: Path,
                                                                    monkeypatch) -> None:
    import flows.nightly_decode
    from flows.nightly import nightly

    real_run_window = flows.nightly_decode.run_window

    def run_window(engine, docs, settings, max_batch, on_documents, on_progress=None):
        if docs[0].doc_id == "doc-03":
            raise ValueError("injected failure in the fourth window")
        return real_run_window(engine, docs, settings, max_batch, on_documents, on_progress)

    monkeypatch.setattr(flows.nightly_decode, "run_window", run_window)
    run = params(tmp_path, write_corpus(tmp_path / "news.parquet", 7), run_id="fails", batch_size=1, window=1,
                 commit_every_s=3600)
    state = nightly(**run.model_dump(), return_state=True)
    assert state.is_failed()
    db = Database(run.db_path)
    # the three windows before the failure were pending a group commit; the failure committed them
    assert db.done_doc_ids("fails", ["sidecar", "standalone"]) == {"doc-00", "doc-01", "doc-02"}
    stored = db.get_run("fails")
    assert stored["status"] == "failed" and "injected failure" in stored["error"]


def test_bad_input_rows_are_recorded_with_their_reason(prefect_api, tmp_path: Path) -> None:
    from flows.nightly import nightly

    # no character limit: the huge row is caught by the token count instead
    counts = nightly(**params(tmp_path, BAD_CORPUS, title_column="title", max_chars=None).model_dump())
    expected = [(doc_id, "over_context" if reason == "too_long" else reason)
                for doc_id, _, _, reason in bad_corpus_rows()]
    db = Database(tmp_path / "sidecar.duckdb")
    rows = db.query("SELECT row_index, doc_id, reject_reason, reject_detail FROM documents WHERE run_id = ? "
                    "ORDER BY row_index", [counts.run_id])
    assert [(r["doc_id"], r["reject_reason"]) for r in rows] == expected
    huge = next(r for r in rows if r["doc_id"] == "huge")
    assert "model context is 4096 tokens" in huge["reject_detail"]

    good = sorted(doc_id for doc_id, reason in expected if reason is None)
    assert counts.done == len(good) == 3
    assert sorted(r["doc_id"] for r in db.results(counts.run_id)) == good
    assert sum(counts.rejected.values()) == len(expected) - len(good)
    assert counts.rejected["over_context"] == 1


def test_demo_ends_with_a_report_of_what_it_found_in_80_columns(prefect_api, tmp_path: Path) -> None:
    from cli.main import app

    corpus = write_corpus(tmp_path / "news.parquet", 3)
    db_path = tmp_path / "demo.duckdb"
    result = CliRunner().invoke(app, ["demo", "--corpus", str(corpus), "--limit", "2", "--pair", "tiny",
                                      "--db", str(db_path), "--max-new-tokens", "8"], terminal_width=200)
    assert result.exit_code == 0, result.output
    report = result.output[result.output.index("sidecar demo: run"):]
    assert max(map(len, report.splitlines())) <= 80, report
    assert "FROM results" in report and "doc-00" in report and "doc-01" in report
    assert "Title 1" in report and "2 documents done" in result.output
    lines = report.splitlines()
    assert sum(line.startswith("  sidecar ") for line in lines) == 2
    assert sum(line.startswith("  standalone ") for line in lines) == 2
    # the demo ran the judge and the cost report after the nightly run, and reports both
    assert "judge: Completed" in result.output and "cost-report: Completed" in result.output
    # the measured verdict, with the device ms per request and per tag token it follows from under it
    assert "cost_report.html" in report and "ms / tag tok" in report and "MB evicted" in report
    # the tiny pair's random tags do not parse, so the judge has nothing to compare and says so, wrapped over
    # lines (tests/test_demo_report.py renders a tally)
    assert "task hashtags: not judged: no document has both a sidecar and a standalone output that parsed" in (
        " ".join(report.split()))
    db = Database(db_path)
    [run] = db.query("SELECT run_id FROM runs")
    assert len(db.results(run["run_id"])) == 2
    assert db.query("SELECT count(*) AS n FROM costs WHERE run_id = ?", [run["run_id"]])[0]["n"] > 0


def test_the_cli_runs_the_main_task_it_is_given_and_a_resume_with_other_prompts_is_refused(prefect_api,
                                                                                          tmp_path: Path) -> None:
    from cli.main import app

    corpus = write_corpus(tmp_path / "news.parquet", 2)
    db_path = tmp_path / "sidecar.duckdb"
    args = ["nightly", "--corpus", str(corpus), "--pair", "tiny", "--db", str(db_path), "--max-new-tokens", "6",
            "--no-judge", "--no-cost-report", "--run-id", "mine", "--modes", "sidecar"]
    headline = ["--instruction", "Write a one-line headline for the document.", "--system", ""]
    done = CliRunner().invoke(app, [*args, *headline])
    assert done.exit_code == 0, done.output
    [run] = Database(db_path).query("SELECT identity FROM runs")
    assert json.loads(run["identity"]).items() >= {"instruction": headline[1], "system": ""}.items()
    again = CliRunner().invoke(app, [*args, *headline])  # the same prompts: the run resumes, nothing left to do
    assert again.exit_code == 0 and "| skipped, already done | 2 |" in again.output, again.output
    refused = CliRunner().invoke(app, [*args, "--instruction", "Summarize the document."])
    assert refused.exit_code == 2, refused.output
    [line] = refused.output.strip().splitlines()
    assert line.startswith("error: ") and "instruction" in line and "system" in line and "another run id" in line


def test_the_cli_runs_every_sidecar_task_of_a_tasks_file_in_every_mode(prefect_api, tmp_path: Path) -> None:
    from cli.main import app

    tasks = tmp_path / "tasks.yaml"
    tasks.write_text("- name: headline\n  instruction: Write a one-line headline for the document.\n"
                     "  max_new_tokens: 6\n"
                     "- name: topic\n  instruction: Give the document's topic.\n  max_new_tokens: 16\n"
                     "  choices: [politics, business, sports]\n")
    db_path = tmp_path / "sidecar.duckdb"
    done = CliRunner().invoke(app, ["nightly", "--corpus", str(write_corpus(tmp_path / "news.parquet", 2)),
                                    "--pair", "tiny", "--db", str(db_path), "--max-new-tokens", "6", "--no-judge",
                                    "--no-cost-report", "--tasks", str(tasks)])
    assert done.exit_code == 0, done.output
    db = Database(db_path)
    assert db.query("SELECT mode, task, count(*) AS n FROM sidecar_outputs GROUP BY ALL ORDER BY mode, task") == [
        {"mode": mode, "task": task, "n": 2} for mode in ("sidecar", "standalone") for task in ("headline", "topic")]
    # the choices are enforced while decoding: 16 tokens hold any of them
    topics = db.query("SELECT parsed, parse_error FROM sidecar_outputs WHERE task = 'topic'")
    assert all(json.loads(t["parsed"]) in ("politics", "business", "sports") and t["parse_error"] is None
               for t in topics), topics
    [run] = db.query("SELECT identity FROM runs")
    assert [t["name"] for t in json.loads(run["identity"])["sidecar_tasks"]] == ["headline", "topic"]


def test_a_jsonl_corpus_runs_and_one_without_its_columns_leaves_no_database_file(prefect_api, tmp_path: Path) -> None:
    from flows.nightly import nightly
    from storage import InputSchemaError

    corpus = tmp_path / "news.jsonl"
    corpus.write_text("".join(json.dumps({"doc": f"d{i}", "body": SENTENCES[i]}) + "\n" for i in range(2)))
    with pytest.raises(InputSchemaError, match="no id column 'id' and no text column 'article'"):
        nightly(**params(tmp_path, corpus).model_dump())
    assert not (tmp_path / "sidecar.duckdb").exists()
    counts = nightly(**params(tmp_path, corpus, id_column="doc", text_column="body", modes=["sidecar"]).model_dump())
    assert counts.done == 2
    assert [r["doc_id"] for r in Database(tmp_path / "sidecar.duckdb").results(counts.run_id)] == ["d0", "d1"]


def wait_until(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    """Return once ``condition()`` holds, asked every 0.1 s; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.1)


class _Hears(logging.Handler):
    def __init__(self, words: str) -> None:
        super().__init__()
        self.words, self.heard = words, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.words in record.getMessage():
            self.heard.set()


@contextlib.contextmanager
def hearing(logger: str, words: str) -> Iterator[threading.Event]:
    """An event set once logger ``logger`` logs a message holding ``words`` while the block runs."""
    handler = _Hears(words)
    logging.getLogger(logger).addHandler(handler)
    try:
        yield handler.heard
    finally:
        logging.getLogger(logger).removeHandler(handler)


def test_a_run_waits_while_another_holds_the_gpu_slot(prefect_api, tmp_path: Path) -> None:
    from prefect import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.concurrency.sync import concurrency

    from flows.accelerator import gpu_limit
    from flows.nightly import nightly

    run = params(tmp_path, write_corpus(tmp_path / "news.parquet", 2), run_id="waits")
    db = Database(run.db_path)
    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=gpu_limit(), limit=1))
    try:
        finished: dict[str, object] = {}
        with concurrency(gpu_limit(), occupy=1):  # another run has the GPU
            thread = threading.Thread(target=lambda: finished.update(counts=nightly(**run.model_dump())))
            thread.start()
            time.sleep(5)
            assert thread.is_alive() and db.get_run("waits") is None, "the run started while the slot was taken"
            released = datetime.now(UTC)
        thread.join(timeout=600)
    finally:
        with get_client(sync_client=True) as client:
            client.delete_global_concurrency_limit_by_name(gpu_limit())
    assert finished["counts"].done == 2
    assert db.get_run("waits")["created_at"] >= released


def done_docs_read_only(db_path: Path, run_id: str) -> int | None:
    """Finished documents, read the way an outside observer would; None while the writer holds the file."""
    try:
        with duckdb.connect(str(db_path), read_only=True) as con:
            return con.execute(
                "SELECT count(*) FROM (SELECT doc_id FROM outputs WHERE run_id = ? GROUP BY doc_id "
                "HAVING count(DISTINCT mode) = 2)", [run_id]).fetchone()[0]
    except (duckdb.IOException, duckdb.CatalogException):
        return None


def started_windows(log: Path) -> set[int]:
    return {int(m) for m in re.findall(r"window (\d+): \d+ documents", log.read_text(errors="replace"))}


def test_sigkill_mid_run_then_rerun_redoes_at_most_one_window(prefect_api, tmp_path: Path) -> None:
    n_docs, window = 16, 2
    corpus = write_corpus(tmp_path / "news.parquet", n_docs)
    db_path = tmp_path / "sidecar.duckdb"
    # with standalone among the modes a window's documents finish together, so each commits in one transaction
    command = [str(SIDECAR), "nightly", "--corpus", str(corpus), "--pair", "tiny", "--db", str(db_path),
               "--batch-size", "2", "--window", str(window), "--max-new-tokens", "16", "--run-id", "crash",
               "--commit-every", "0", "--no-judge", "--no-cost-report"]
    env = os.environ | prefect_api | {"PYTHONUNBUFFERED": "1"}

    first_log = tmp_path / "first.log"
    with first_log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
        deadline = time.monotonic() + 600
        committed = None
        while time.monotonic() < deadline and proc.poll() is None:
            committed = done_docs_read_only(db_path, "crash") if db_path.exists() else None
            if committed:
                break
            time.sleep(0.2)
        assert proc.poll() is None, f"the run ended before it could be killed:\n{first_log.read_text()}"
        assert committed, "no window was committed in time"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL

    db = Database(db_path)
    assert db.get_run("crash")["status"] == "running"  # nobody got to mark it
    done_at_kill = db.done_doc_ids("crash", ["sidecar", "standalone"])
    assert len(done_at_kill) % window == 0, "a window's documents are committed together or not at all"
    committed_windows = {int(doc_id.removeprefix("doc-")) // window for doc_id in done_at_kill}
    started_first = started_windows(first_log)

    second_log = tmp_path / "second.log"
    with second_log.open("wb") as out:
        rerun = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, timeout=900)
    assert rerun.returncode == 0, second_log.read_text()
    started_second = started_windows(second_log)

    assert started_second == set(range(n_docs // window)) - committed_windows
    redone = started_first & started_second
    print(f"\nkilled after {len(done_at_kill)} of {n_docs} documents were committed; windows started before the "
          f"kill: {sorted(started_first)}, redone after it: {sorted(redone)}")
    assert len(redone) <= 1

    assert db.get_run("crash")["status"] == "completed"
    assert len(db.results("crash")) == n_docs
    stats = db.query("SELECT count(*) AS rows, count(DISTINCT (doc_id, mode)) AS keys FROM outputs "
                     "WHERE run_id = 'crash'")[0]
    assert stats == {"rows": n_docs * 2, "keys": n_docs * 2}
    per_phase = db.query("SELECT count(*) AS rows, count(DISTINCT (doc_id, mode, phase)) AS keys "
                         "FROM request_stats WHERE run_id = 'crash'")[0]
    assert per_phase == {"rows": n_docs * 3, "keys": n_docs * 3}  # main + sidecar, and standalone's one phase


def everything_prefect_stored() -> str:
    """Logs, artifacts and flow/task run records of the module's Prefect API, as one text."""
    from prefect import get_client
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)
    parts: list[str] = []
    with get_client(sync_client=True) as client:
        for read in (client.read_logs, client.read_artifacts, client.read_flow_runs, client.read_task_runs):
            offset = 0
            while page := read(limit=200, offset=offset):
                parts += [item.model_dump_json() for item in page]
                offset += len(page)
    return "\n".join(parts)


def everything_duckdb_stored(db_path: Path) -> str:
    with duckdb.connect(str(db_path), read_only=True) as con:
        tables = [row[0] for row in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()]
        dump = [repr(con.execute(f'SELECT * FROM "{table}"').fetchall()) for table in tables]
    # the file, its WAL, and what lies beside it (run locks, deferred writes)
    files = [f for p in db_path.parent.glob(db_path.name + "*") for f in ([p] if p.is_file() else p.rglob("*"))]
    raw = b"".join(path.read_bytes() for path in files if path.is_file())
    return "\n".join(dump) + raw.decode("latin-1")


def test_a_planted_api_key_never_reaches_logs_artifacts_or_duckdb(prefect_api, tmp_path: Path,
                                                                   monkeypatch) -> None:
    from flows.judge import judge
    from flows.nightly import nightly
    from server.launcher import running_server
    from storage import OutputRecord, SidecarRecord

    for name in ("OPENAI_API_KEY", "SIDECAR_JUDGE_API_KEY", "SIDECAR_API_KEY"):
        monkeypatch.setenv(name, PLANTED_KEY)
    corpus = write_corpus(tmp_path / "news.parquet", 3)
    run = params(tmp_path, corpus, trigger_judge=True, trigger_cost_report=True)
    counts = nightly(**run.model_dump())
    assert counts.downstream == {"judge": "Completed", "cost-report": "Completed"}

    # Give every document tags on both sides, so that an external judge is really called with the key (tags of
    # their own: a task whose documents all have the same output has no control and is not judged).
    db = Database(run.db_path)
    rows = db.query("SELECT doc_id, mode, summary FROM outputs WHERE run_id = ?", [counts.run_id])
    number = {doc_id: n for n, doc_id in enumerate(sorted({r["doc_id"] for r in rows}))}
    db.write_batch(counts.run_id, [OutputRecord(r["doc_id"], r["mode"], r["summary"], [SidecarRecord.of(
        "hashtags", f"#budget #council{number[r['doc_id']]}", ["budget", f"council{number[r['doc_id']]}"])])
        for r in rows])
    with running_server("tiny", api_key=PLANTED_KEY, model_name="tiny-judge") as url:
        summary = judge(run_id=counts.run_id, judge_model="tiny-judge", base_url=url, db_path=run.db_path,
                        retries=0)
    assert summary.total == 3
    games = db.query("SELECT kind, raw_answer FROM judgement_games WHERE run_id = ?", [counts.run_id])
    # two main games per document, besides the control and null games the judge plays in every run
    assert sum(g["kind"] == "main" for g in games) == 6, games
    assert all(g["raw_answer"] is not None for g in games), "the judge got answers"

    prefect_text = everything_prefect_stored()
    duckdb_text = everything_duckdb_stored(Path(run.db_path))
    report_files = "".join(p.read_text(errors="replace") for p in (tmp_path / "cost_report").rglob("*.md"))
    # the searches can find what is there ...
    assert counts.run_id in prefect_text and "doc-02" in duckdb_text and "Measured" in report_files
    assert "window 0: 3 documents" in prefect_text and "Nightly run" in prefect_text and "Cost report" in prefect_text
    # ... and the key is nowhere
    for where, text in (("Prefect logs, artifacts and runs", prefect_text), ("DuckDB", duckdb_text),
                        ("cost report", report_files)):
        assert PLANTED_KEY not in text, f"the planted key leaked into {where}"


def blocking_first_window(monkeypatch, release: threading.Event, started: threading.Event) -> None:
    """Make the in-process run's first window wait for ``release``; ``started`` is set once it waits."""
    import flows.nightly_decode

    real_run_window = flows.nightly_decode.run_window

    def run_window(engine, docs, settings, max_batch, on_documents, on_progress=None):
        if any(d.row_index == 0 for d in docs):
            started.set()
            assert release.wait(600), "the test never released the first window"
        return real_run_window(engine, docs, settings, max_batch, on_documents, on_progress)

    monkeypatch.setattr(flows.nightly_decode, "run_window", run_window)


# `python -m cli ARGS`, saying on stderr as it exits whether it loaded torch
SAYS_IF_TORCH_LOADED = """
import atexit, runpy, sys
atexit.register(lambda: print(f"torch loaded: {'torch' in sys.modules}", file=sys.stderr))
sys.argv[0] = "cli"
runpy.run_module("cli", run_name="__main__", alter_sys=True)
"""


def test_a_second_process_of_a_running_run_refuses_and_names_the_first(prefect_api, tmp_path: Path,
                                                                      monkeypatch) -> None:
    from flows.nightly import nightly

    corpus = write_corpus(tmp_path / "news.parquet", 4)
    run = params(tmp_path, corpus, run_id="twice", batch_size=2, commit_every_s=0)
    release, started = threading.Event(), threading.Event()
    blocking_first_window(monkeypatch, release, started)
    finished: dict[str, object] = {}
    first = threading.Thread(target=lambda: finished.update(counts=nightly(**run.model_dump())))
    first.start()
    try:
        assert started.wait(300), "the first run never started its first window"
        # the same run id from another process, as a second `sidecar nightly` started by hand or by cron; it says
        # as it exits whether it loaded torch
        second = subprocess.run(
            [sys.executable, "-c", SAYS_IF_TORCH_LOADED, "nightly", "--corpus", str(corpus), "--pair", "tiny", "--db",
             run.db_path, "--batch-size", "2", "--max-new-tokens", "12", "--run-id", "twice", "--no-judge",
             "--no-cost-report"],
            capture_output=True, text=True, timeout=600, cwd=tmp_path,
            env=os.environ | prefect_api | {"PYTHONPATH": str(REPO)})
    finally:
        release.set()
        first.join(timeout=600)
    assert second.returncode == 4, second.stdout + second.stderr  # busy: a later retry can work
    errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, second.stderr
    assert "run 'twice'" in errors[0] and f"PID {os.getpid()} on " in errors[0], errors[0]
    # it refused before loading the models' libraries (seconds), not after
    assert "torch loaded: False" in second.stderr.splitlines(), second.stderr
    assert finished["counts"].done == 4
    db = Database(run.db_path)
    assert db.query("SELECT count(*) AS n FROM outputs WHERE run_id = 'twice'")[0]["n"] == 8
    assert db.get_run("twice")["status"] == "completed"


HOLD_READ_ONLY = """
    import sys, duckdb
    con = duckdb.connect(sys.argv[1], read_only=True)
    print("ready", flush=True)
    sys.stdin.readline() if sys.argv[2] == "stdin" else __import__("time").sleep(float(sys.argv[2]))
"""


def hold_file_during_second_window(monkeypatch, db_path: str, hold: str) -> list[subprocess.Popen[str]]:
    """From the run's second window (of two documents) on, a notebook-like process holds a read-only
    connection on the database (for ``hold`` seconds, or until its stdin gets a line)."""
    import flows.nightly_decode

    real_run_window = flows.nightly_decode.run_window
    readers: list[subprocess.Popen[str]] = []

    def run_window(engine, docs, settings, max_batch, on_documents, on_progress=None):
        if any(d.row_index == 2 for d in docs) and not readers:
            reader = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLD_READ_ONLY), db_path, hold],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            readers.append(reader)
            assert reader.stdout.readline().strip() == "ready"
        return real_run_window(engine, docs, settings, max_batch, on_documents, on_progress)

    monkeypatch.setattr(flows.nightly_decode, "run_window", run_window)
    return readers


def test_a_reader_holding_the_database_for_12_s_only_delays_the_run(prefect_api, tmp_path: Path, monkeypatch,
                                                                   caplog) -> None:
    from flows.nightly import nightly

    run = params(tmp_path, write_corpus(tmp_path / "news.parquet", 6), run_id="notebook", batch_size=2, window=2,
                 commit_every_s=0)
    readers = hold_file_during_second_window(monkeypatch, run.db_path, "12")
    with caplog.at_level(logging.WARNING, logger="storage.connection"):
        counts = nightly(**run.model_dump())
    [reader] = readers
    assert reader.wait(timeout=60) == 0
    assert (counts.done, counts.commits) == (6, 3)
    assert Database(run.db_path).get_run("notebook")["status"] == "completed"
    assert any(f"PID {reader.pid}" in r.getMessage() for r in caplog.records), "the wait names the reader"


def test_a_run_that_gives_up_on_a_locked_database_keeps_its_documents_for_the_next_open(prefect_api,
                                                                                       tmp_path: Path,
                                                                                       monkeypatch) -> None:
    from flows.nightly import nightly

    run = params(tmp_path, write_corpus(tmp_path / "news.parquet", 6), run_id="gives-up", batch_size=2, window=2,
                 commit_every_s=0, lock_wait_s=2)
    readers = hold_file_during_second_window(monkeypatch, run.db_path, "stdin")
    state = nightly(**run.model_dump(), return_state=True)
    [reader] = readers
    assert state.is_failed() and reader.poll() is None
    reader.communicate("done\n", timeout=60)
    db = Database(run.db_path)  # the next open
    stored = db.get_run("gives-up")
    assert stored["status"] == "failed" and "DatabaseLockedError" in stored["error"], stored
    assert f"PID {reader.pid}" in stored["error"]
    # every window that finished is there: the first one committed, the second kept while the file was locked
    assert db.done_doc_ids("gives-up", ["sidecar", "standalone"]) == {f"doc-{i:02d}" for i in range(4)}


# Another process holds the lock file of this machine's accelerator (the path from flows.accelerator, given as
# argv[1]); the lock alone needs neither torch nor Prefect, which take seconds to import.
HOLD_ACCELERATOR = """
    import sys
    from pathlib import Path
    from storage.locks import exclusive
    with exclusive(Path(sys.argv[1]), "accelerator", wait_s=0):
        print("ready", flush=True)
        sys.stdin.readline()
"""


def test_embedded_runs_take_turns_on_the_accelerator(prefect_api, tmp_path: Path, monkeypatch) -> None:
    from flows.accelerator import accelerator_lock
    from flows.nightly import nightly
    from sidecar.models.devices import accelerator_id
    from storage import LockHeldError

    # as on the embedded API, where Prefect's `gpu` limit does not exist
    monkeypatch.setattr("flows.accelerator.on_embedded_api", lambda: True)
    corpus = write_corpus(tmp_path / "news.parquet", 2)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLD_ACCELERATOR),
                               str(accelerator_lock(accelerator_id()))], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "ready"
        refused = nightly(**params(tmp_path, corpus, run_id="refused", device_wait_s=0).model_dump(), return_state=True)
        assert refused.is_failed()
        with pytest.raises(LockHeldError, match=f"PID {holder.pid} on "):
            refused.result()
        finished: dict[str, object] = {}
        waiting = threading.Thread(target=lambda: finished.update(
            counts=nightly(**params(tmp_path, corpus, run_id="waits-for-device").model_dump())))
        with hearing("prefect.flow_runs", "is in use by") as told_to_wait:
            waiting.start()
            # the run finds the accelerator held: it waits, and has not started
            wait_until(lambda: told_to_wait.is_set() or not waiting.is_alive(), 300, "the run to find the device held")
        assert told_to_wait.is_set(), "the run never found the accelerator held"
        db = Database(tmp_path / "sidecar.duckdb")
        assert waiting.is_alive() and db.get_run("waits-for-device") is None, "the run shared the accelerator"
        released = datetime.now(UTC)
    finally:
        holder.communicate("done\n", timeout=60)
    waiting.join(timeout=600)
    assert finished["counts"].done == 2
    assert db.get_run("waits-for-device")["created_at"] >= released
    assert db.get_run("refused") is None
