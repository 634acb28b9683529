"""The judge flow end to end: a real DuckDB file, an ephemeral Prefect API, and as the judge `sidecar serve` with
the tiny pair or an OpenAI-shaped endpoint mocked on loopback that answers with log probabilities.

The tiny pair's answers are random text, never a verdict, so every judged document is an error; the flow must
still complete, store every game and publish its artifact.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from server.launcher import free_port, running_server
from storage import Database, Document, OutputRecord, SidecarRecord

REPO = Path(__file__).resolve().parents[1]
RUN = "run-Judge_1"
KEY = "sk-judge-block-3b9f2c71e6d84a05"
DOCS = {
    "doc-a": (["budget", "council"], ["schools", "budget"]),
    "doc-b": (["jobs", "plant"], ["economy"]),
    "doc-c": (["trade"], None),  # the standalone tagger's text could not be parsed: nothing to compare
}

pytestmark = [pytest.mark.slow, pytest.mark.servers]


@pytest.fixture
def db(tmp_path: Path) -> Database:
    db = Database(tmp_path / "sidecar.duckdb")
    db.start_run(RUN, {"test": True}, pair="tiny", device="cpu", gpu_type=None, gamma=4, batch_size=2)
    docs = [Document(doc_id, f"Document {doc_id} about the city council.", i) for i, doc_id in enumerate(DOCS)]
    db.record_documents(RUN, docs, [])
    records = []
    for doc_id, (sidecar_tags, standalone_tags) in DOCS.items():
        summary = f"The council of {doc_id} approved a budget."
        for mode, tags in (("sidecar", sidecar_tags), ("standalone", standalone_tags)):
            records.append(OutputRecord(doc_id, mode, summary, [SidecarRecord.of(
                "hashtags", " ".join(f"#{t}" for t in tags or []), tags,
                parse_error=None if tags else "no hashtags found")]))
    db.write_batch(RUN, records)
    return db


def games(db: Database, prompt_version: str | None = None) -> list[dict]:
    """The main games (of one prompt version, or all)."""
    return db.query("SELECT doc_id, game, mode_a, mode_b, raw_answer, winner, error, judge_model "
                    "FROM judgement_games WHERE kind = 'main' AND ($version IS NULL OR prompt_version = $version) "
                    "ORDER BY doc_id, game", {"version": prompt_version})


def artifacts(flow_run_id) -> dict:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return {a.key: a.data for a in found}


def logs(flow_run_id) -> list[str]:
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    APILogWorker.instance().drain()  # logs reach the API in the background
    with get_client(sync_client=True) as client:
        return [log.message for log in client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(
            any_=[flow_run_id])))]


def test_failed_calls_are_asked_again_garbage_answers_are_errors_and_reruns_ask_nothing(
        prefect_api, db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    from flows.judge import judge

    # 1. an endpoint that does not answer: every game fails, the flow still completes
    monkeypatch.setenv("SIDECAR_JUDGE_API_KEY", "sk-env-key")
    dead = f"http://127.0.0.1:{free_port()}/v1"
    summary = judge(RUN, judge_model="tiny", base_url=dead, retries=0, db_path=str(db.path))
    assert (summary.total, summary.errors, summary.skipped, summary.judged) == (3, 2, 1, 0)
    # the probe could not tell whether the endpoint has log probabilities: the default prompt stays
    assert summary.prompt_version == "tags-p1" and "unconfirmed" in summary.mode_note
    stored = games(db)
    assert len(stored) == 4 and all(g["error"] and g["raw_answer"] is None for g in stored)
    assert db.judged_doc_ids(RUN, "tiny", "tags-p1") == set()
    # the control ladder was asked too, and failed: no control answered, so the run is not reliable
    kinds = db.query("SELECT kind, count(*) AS n FROM judgement_games GROUP BY kind ORDER BY kind")
    assert kinds == [{"kind": kind, "n": 4} for kind in ("control", "hard", "main", "null")]
    # the likelihood method's scores failed too (its probe decided nothing): every method UNRELIABLE
    quality = [(q["method"], q["prompt_version"], q["reliable"]) for q in db.judge_quality(RUN)]
    assert not summary.reliable and quality == [
        ("likelihood", "tags-l1", False), ("likelihood", "tags-l2", False), ("pairwise", "tags-p1", False)]

    # 2. the embedded default judge (sidecar serve with the tiny pair): the failed documents are asked again,
    # in whichever mode the server offers (the text mode where it refuses log probabilities)
    state = judge(RUN, judge_pair="tiny", retries=0, concurrency=2, db_path=str(db.path), return_state=True)
    assert state.is_completed()
    summary = state.result()
    version = summary.prompt_version
    assert (summary.total, summary.errors, summary.skipped, summary.judged) == (3, 2, 1, 0)
    assert set(summary.error_docs) == {"doc-a", "doc-b"}
    assert all("JudgeAnswerError" in error for error in summary.error_docs.values())
    stored = games(db, version)
    assert [(g["doc_id"], g["game"], g["mode_a"], g["mode_b"]) for g in stored] == [
        ("doc-a", 1, "sidecar", "standalone"), ("doc-a", 2, "standalone", "sidecar"),
        ("doc-b", 1, "sidecar", "standalone"), ("doc-b", 2, "standalone", "sidecar")]
    # an answer came back but is no verdict: kept raw with its parse error, no winner, and it counts as judged
    assert all(g["raw_answer"] is not None and g["winner"] is None and g["error"].startswith("JudgeAnswerError")
               for g in stored)
    assert db.judged_doc_ids(RUN, "tiny", version) == {"doc-a", "doc-b"}
    verdicts = db.query("SELECT doc_id, verdict, errors, reliable FROM judgements WHERE run_id = ? AND "
                        "prompt_version = ? ORDER BY doc_id", [RUN, version])
    assert verdicts == [{"doc_id": "doc-a", "verdict": None, "errors": 2, "reliable": False},
                        {"doc_id": "doc-b", "verdict": None, "errors": 2, "reliable": False}]
    report = artifacts(state.state_details.flow_run_id)["judge-run-judge-1"]
    assert "| error | 2 |" in report and "| skipped (missing tags) | 1 |" in report
    assert "Order consistency" in report and "doc-a" in report and "UNRELIABLE" in report
    assert summary.mode_note in report

    # 3. a rerun asks only what is missing: nothing but the document without standalone tags
    summary = judge(RUN, judge_pair="tiny", retries=0, db_path=str(db.path))
    assert (summary.total, summary.errors, summary.skipped) == (1, 0, 1)
    assert len(games(db, version)) == 4


def shown(user_message: str) -> tuple[str, list[str], list[str]]:
    """The summary and the tag sets (or another task's outputs) in positions A and B of a judge prompt."""
    summary = user_message.split("<<<", 1)[1].split(">>>", 1)[0]
    lines = dict(line.split(": ", 1) for line in user_message.splitlines() if line.startswith(("Tag set ", "Output ")))
    a, b = (lines.get(f"Tag set {side}", lines.get(f"Output {side}")) for side in "AB")
    return summary, json.loads(a), json.loads(b)


# where a likelihood scorer prompt's task form ends and the output starts (study.judge.prompts.SCORER_PROMPTS)
TASK_FORM_ENDS = ("\nAnswer:", "The desk wrote:")


def echoed(prompt: str) -> dict:
    """The legacy completions route's ``echo`` log probabilities of ``prompt``: one token per word; an output
    token (a tag, holding '#', or any word after a task form's end) -0.5 when its word appears before the output,
    else -3; other tokens -1."""
    ends = [prompt.rfind(end) + len(end) for end in TASK_FORM_ENDS if end in prompt]
    start = prompt.find(" #") if " #" in prompt or not ends else max(ends)
    context = prompt[:start].lower()
    words = list(re.finditer(r"\s*\S+", prompt))
    logprobs = [None] + [(-0.5 if w.group().strip().strip("#,.;:").lower() in context else -3.0)
                         if w.start() >= start else -1.0 for w in words[1:]]
    return {"tokens": [w.group() for w in words], "token_logprobs": logprobs,
            "text_offset": [w.start() for w in words], "top_logprobs": None}


@contextmanager
def letters_endpoint(p_a: Callable[[str, list[str], list[str]], float], echo: bool = False,
                     echo_fails: Callable[[str], bool] = lambda prompt: False,
                     seen: list[dict] | None = None) -> Iterator[str]:
    """An OpenAI-shaped chat completions endpoint on loopback whose one-token answer carries the top log
    probabilities of A and B, P(A) = ``p_a(summary, tags_a, tags_b)``; with ``echo`` also the legacy
    completions route with the prompt's log probabilities (``echoed``), else 404 there; a prompt for which
    ``echo_fails`` is true gets HTTP 500 there. ``seen`` collects every request's body."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            request = json.loads(self.rfile.read(int(self.headers["content-length"])))
            if seen is not None:
                seen.append(request)
            if not self.path.endswith("/chat/completions"):
                if not echo:
                    self.send_error(404)
                    return
                if echo_fails(request["prompt"]):
                    self.send_error(500)
                    return
                choice = {"index": 0, "text": request["prompt"], "finish_reason": "length",
                          "logprobs": echoed(request["prompt"])}
                self.answer({"id": "cmpl-mock", "object": "text_completion", "created": 0,
                             "model": request["model"], "choices": [choice]})
                return
            p = p_a(*shown(request["messages"][-1]["content"]))
            top = [{"token": "A", "logprob": math.log(p)}, {"token": " B", "logprob": math.log(1 - p)}]
            self.answer({
                "id": "chatcmpl-mock", "object": "chat.completion", "created": 0, "model": request["model"],
                "choices": [{"index": 0, "finish_reason": "length",
                             "message": {"role": "assistant", "content": "A" if p >= 0.5 else "B"},
                             "logprobs": {"content": [{**top[0 if p >= 0.5 else 1], "top_logprobs": top}]}}],
            })

        def answer(self, reply: dict) -> None:
            body = json.dumps(reply).encode()
            try:
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # a judge killed while its answer was held

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def reads_tags(summary: str, tags_a: list[str] | str, tags_b: list[str] | str) -> float:
    """Prefers the set whose tags the summary names (another task's output: whose words), with a pull towards
    position A."""
    named = sum(t in summary for t in _words(tags_a)) - sum(t in summary for t in _words(tags_b))
    return min(0.95, max(0.05, 0.6 + 0.15 * named))


def _words(output: list[str] | str) -> list[str]:
    return output if isinstance(output, list) else [w.strip(",.;:").lower() for w in output.split()]


TOPICAL = "run-topical"


def topical_run(db: Database) -> None:
    """A run whose summaries name their sidecar's tags, so a judge that reads can tell own tags from others'."""
    db.start_run(TOPICAL, {"test": True}, pair="tiny", device="cpu", gpu_type=None, gamma=4, batch_size=2)
    topics = {"doc-x": ("flood", "river"), "doc-y": ("strike", "union"), "doc-z": ("harvest", "wheat")}
    db.record_documents(TOPICAL, [Document(d, f"Document {d}.", i) for i, d in enumerate(topics)], [])
    db.write_batch(TOPICAL, [
        OutputRecord(doc_id, mode, f"- The {a} and the {b} were reported.", [SidecarRecord.of("hashtags", "", tags)])
        for doc_id, (a, b) in topics.items()
        for mode, tags in (("sidecar", [a, b]), ("standalone", ["news", "today"]))])


@pytest.mark.parametrize(("p_a", "reliable"), [
    pytest.param(lambda *_shown: 0.999, False, id="always-A"),
    pytest.param(reads_tags, True, id="reads-the-tags"),
])
def test_probability_mode_with_controls_marks_a_judge_that_fails_them_unreliable(
        prefect_api, db: Database, monkeypatch: pytest.MonkeyPatch, p_a, reliable: bool) -> None:
    from flows.judge import judge

    topical_run(db)
    monkeypatch.setenv("SIDECAR_JUDGE_API_KEY", "sk-env-key")
    with letters_endpoint(p_a) as url:
        state = judge(TOPICAL, judge_model="mock", base_url=url, retries=0, db_path=str(db.path), return_state=True)
    summary = state.result()
    assert (summary.prompt_version, summary.mode, summary.judged) == ("tags-p1", "probability", 3)
    assert summary.reliable is reliable
    pairwise, *likelihood = sorted(db.judge_quality(TOPICAL), key=lambda q: q["method"] != "pairwise")
    quality = pairwise
    # the endpoint has no /completions: the likelihood method is stored as unavailable, with the reason
    assert [(q["method"], q["reliable"], q["note"].split(":")[0]) for q in likelihood] == [
        ("likelihood", False, "unavailable, the pairwise method's verdict stands")] * 2
    assert "HTTP 404" in likelihood[0]["note"]
    assert (quality["mode"], quality["control_documents"], quality["reliable"]) == ("probability", 3, reliable)
    assert quality["control_accuracy"] == summary.control_accuracy == (1.0 if reliable else 0.0)
    assert quality["auc"] == summary.reliability.auc == (1.0 if reliable else 0.5)
    assert quality["separation"] == pytest.approx(summary.reliability.easy.mean)
    assert quality["position_bias"] == pytest.approx(summary.position_bias) and quality["position_bias"] > 0.5
    assert quality["margin"] == pytest.approx(summary.margin) and quality["margin"] >= 0.02
    verdicts = db.query("SELECT doc_id, verdict, preference, reliable FROM judgements WHERE run_id = ? "
                        "ORDER BY doc_id", [TOPICAL])
    assert [v["doc_id"] for v in verdicts] == ["doc-x", "doc-y", "doc-z"]
    assert all(v["reliable"] is reliable for v in verdicts)
    [tally] = db.judge_tally(TOPICAL)
    assert tally["mean_preference"] == pytest.approx(summary.mean_preference)
    assert tally["reliable"] is reliable
    report = artifacts(state.state_details.flow_run_id)["judge-run-topical"]
    assert "probability mode" in report and "Mean preference" in report
    assert ("UNRELIABLE" in report) is not reliable
    assert quality["verdict"] == summary.reliability.verdict == ("sidecar" if reliable else "UNRELIABLE")
    assert db.query("SELECT verdict FROM judge_headline WHERE run_id = ?", [TOPICAL]) == [
        {"verdict": quality["verdict"]}]
    if reliable:
        # both sidecar tags named against none: P(sidecar) 0.9 shown first, 0.7 shown second
        assert [(v["verdict"], round(v["preference"], 6)) for v in verdicts] == [("sidecar", 0.8)] * 3
    else:
        assert all(v["preference"] == pytest.approx(0.5) and v["verdict"] == "tie" for v in verdicts)


def test_an_endpoint_with_prompt_log_probabilities_adds_the_likelihood_method_with_its_own_ladder(
        prefect_api, db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    from flows.judge import judge

    topical_run(db)
    monkeypatch.setenv("SIDECAR_JUDGE_API_KEY", "sk-env-key")
    with letters_endpoint(reads_tags, echo=True) as url:
        state = judge(TOPICAL, judge_model="mock", base_url=url, retries=0, db_path=str(db.path),
                      likelihood_model="mock/draft", likelihood_prompts=("tags-l2",), return_state=True)
    summary = state.result()
    quality = {(q["judge_model"], q["method"]): q for q in db.judge_quality(TOPICAL)}
    assert set(quality) == {("mock", "pairwise"), ("mock", "likelihood"), ("mock/draft", "likelihood")}
    for scorer in ("mock", "mock/draft"):
        ladder = quality[(scorer, "likelihood")]
        assert (ladder["control_cleared"], ladder["null_tied"], ladder["reliable"]) == (3, 3, True)
        assert ladder["verdict"] == "sidecar" and ladder["note"].startswith("scorer prompt tags-l2")
    stored = db.query("SELECT DISTINCT judge_model, prompt_version, kind FROM judgement_scores ORDER BY ALL")
    assert {(r["judge_model"], r["prompt_version"]) for r in stored} == {("mock", "tags-l2"), ("mock/draft", "tags-l2")}
    assert {r["kind"] for r in stored} == {"main", "control", "hard", "null"}
    # each doc's sidecar tags are named in its summary, the standalone's nowhere: a PMI of 2.5 per token
    verdicts = db.query("SELECT verdict, difference FROM judgements WHERE method = 'likelihood'")
    assert len(verdicts) == 6 and all(v["verdict"] == "sidecar" and v["difference"] == pytest.approx(2.5)
                                      for v in verdicts)
    assert db.query("SELECT verdict FROM judge_headline WHERE run_id = ?", [TOPICAL]) == [{"verdict": "sidecar"}]
    report = artifacts(state.state_details.flow_run_id)["judge-run-topical"]
    assert "## Likelihood method" in report and "| mock/draft | tags-l2 | easy 3/3 (100%)" in report
    assert "Verdict of the run: the sidecar's tags are better (pairwise mock tags-p1" in report
    assert [part.reliability.trusted for part in summary.likelihood] == [True, True]


def likelihood_scored(db: Database) -> list[dict]:
    return db.query("SELECT doc_id, count(*) AS scores, count(error) AS errors FROM judgement_scores "
                    "WHERE run_id = ? AND kind = 'main' GROUP BY doc_id ORDER BY doc_id", [TOPICAL])


def test_a_rerun_scores_by_likelihood_what_a_failed_pass_left_though_every_game_is_stored(
        prefect_api, db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    from flows.judge import judge

    topical_run(db)
    monkeypatch.setenv("SIDECAR_JUDGE_API_KEY", "sk-env-key")
    settings = {"judge_model": "mock", "retries": 0, "db_path": str(db.path), "likelihood_prompts": ("tags-l2",)}
    with letters_endpoint(reads_tags, echo=True, echo_fails=lambda prompt: True) as url:
        judge(TOPICAL, base_url=url, **settings)
    assert db.judged_doc_ids(TOPICAL, "mock", "tags-p1") == {"doc-x", "doc-y", "doc-z"}
    assert db.scored_doc_ids(TOPICAL, "mock", "tags-l2") == set()  # every score failed, with its error stored

    with letters_endpoint(reads_tags, echo=True) as url:
        judge(TOPICAL, base_url=url, **settings)
    assert db.scored_doc_ids(TOPICAL, "mock", "tags-l2") == {"doc-x", "doc-y", "doc-z"}
    verdicts = db.query("SELECT verdict FROM judgements WHERE method = 'likelihood' AND run_id = ?", [TOPICAL])
    assert [v["verdict"] for v in verdicts] == ["sidecar"] * 3


def test_a_document_whose_control_score_failed_is_scored_again_on_the_next_run(
        prefect_api, db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    from flows.judge import judge

    topical_run(db)
    monkeypatch.setenv("SIDECAR_JUDGE_API_KEY", "sk-env-key")
    settings = {"judge_model": "mock", "retries": 0, "db_path": str(db.path), "likelihood_prompts": ("tags-l2",)}

    def doc_ys_tags_after_doc_xs_summary(prompt: str) -> bool:  # doc-x's easy control: its foil is doc-y
        context, tags = prompt.split(" #", 1)
        return "flood" in context and "strike" in tags

    with letters_endpoint(reads_tags, echo=True, echo_fails=doc_ys_tags_after_doc_xs_summary) as url:
        judge(TOPICAL, base_url=url, **settings)
    failed = db.query("SELECT doc_id, kind, side FROM judgement_scores WHERE error IS NOT NULL ORDER BY ALL")
    # the easy rung, and the hard rung that mixes doc-y's tags in; doc-x's main scores stand
    assert {(f["doc_id"], f["kind"]) for f in failed} == {("doc-x", "control"), ("doc-x", "hard")}
    assert db.scored_doc_ids(TOPICAL, "mock", "tags-l2") == {"doc-y", "doc-z"}

    with letters_endpoint(reads_tags, echo=True) as url:
        judge(TOPICAL, base_url=url, **settings)
    assert db.query("SELECT count(*) AS n FROM judgement_scores WHERE error IS NOT NULL") == [{"n": 0}]
    assert db.scored_doc_ids(TOPICAL, "mock", "tags-l2") == {"doc-x", "doc-y", "doc-z"}
    [ladder] = [q for q in db.judge_quality(TOPICAL) if q["method"] == "likelihood"]
    assert (ladder["control_documents"], ladder["control_cleared"]) == (3, 3)


def test_a_resumed_likelihood_pass_scores_a_lone_pending_document_against_a_baseline_from_the_whole_run(
        prefect_api, db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    import duckdb

    from flows.judge import judge

    topical_run(db)
    monkeypatch.setenv("SIDECAR_JUDGE_API_KEY", "sk-env-key")
    settings = {"judge_model": "mock", "retries": 0, "db_path": str(db.path), "likelihood_prompts": ("tags-l2",)}
    with letters_endpoint(reads_tags, echo=True) as url:
        judge(TOPICAL, base_url=url, **settings)
    first = db.query("SELECT * EXCLUDE (created_at) FROM judgement_scores WHERE doc_id = 'doc-y' ORDER BY ALL")
    # a likelihood pass killed before doc-y's scores were committed
    with duckdb.connect(str(db.path)) as con:
        con.execute("DELETE FROM judgement_scores WHERE doc_id = 'doc-y'")
    assert db.scored_doc_ids(TOPICAL, "mock", "tags-l2") == {"doc-x", "doc-z"}

    with letters_endpoint(reads_tags, echo=True) as url:
        judge(TOPICAL, base_url=url, **settings)
    # scored again as the whole pass scored it: the same baseline, ladder and scores
    assert db.query("SELECT * EXCLUDE (created_at) FROM judgement_scores WHERE doc_id = 'doc-y' ORDER BY ALL"
                    ) == first
    assert db.scored_doc_ids(TOPICAL, "mock", "tags-l2") == {"doc-x", "doc-y", "doc-z"}


def test_a_malformed_log_probability_fails_its_games_only_and_every_other_game_is_stored(
        prefect_api, db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    from flows.judge import judge

    topical_run(db)
    monkeypatch.setenv("SIDECAR_JUDGE_API_KEY", "sk-env-key")

    def nan_for_doc_y(summary: str, tags_a: list[str], tags_b: list[str]) -> float:
        return math.nan if "strike" in summary else reads_tags(summary, tags_a, tags_b)

    with letters_endpoint(nan_for_doc_y) as url:
        state = judge(TOPICAL, judge_model="mock", base_url=url, retries=0, controls=0, db_path=str(db.path),
                      return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    assert (summary.wins, summary.errors, list(summary.error_docs)) == (2, 1, ["doc-y"])
    stored = db.query("SELECT doc_id, count(p_a) AS answered, count(error) AS errors FROM judgement_games "
                      "WHERE run_id = ? GROUP BY doc_id ORDER BY doc_id", [TOPICAL])
    assert stored == [{"doc_id": "doc-x", "answered": 2, "errors": 0}, {"doc_id": "doc-y", "answered": 0, "errors": 2},
                      {"doc_id": "doc-z", "answered": 2, "errors": 0}]


class HoldsAfter:
    """A judge that reads the tags for the first ``answered`` documents it is asked about and holds every
    request about a later one until ``release`` is set: documents in flight when the judge is killed."""

    def __init__(self, answered: int) -> None:
        self.limit = answered
        self.answered: list[str] = []  # summaries
        self.held = threading.Event()
        self.release = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, summary: str, tags_a: list[str], tags_b: list[str]) -> float:
        with self._lock:
            if summary not in self.answered and len(self.answered) < self.limit:
                self.answered.append(summary)
            answered = summary in self.answered
        if not answered:
            self.held.set()
            self.release.wait(300)
        return reads_tags(summary, tags_a, tags_b)


def wait_for(condition: Callable[[], object], timeout_s: float) -> object:
    """``condition()``'s first truthy value within ``timeout_s``, else its last value."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return value


def test_a_judge_killed_mid_run_keeps_the_documents_it_finished_and_a_rerun_asks_only_the_rest(
        prefect_api, db: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flows.judge import judge

    monkeypatch.setenv("SIDECAR_JUDGE_API_KEY", "sk-env-key")  # for this process and the killed one

    run_id, summaries = "run-killed-judge", {f"doc-{i}": f"- The topic{i} and the place{i} were reported." for i in
                                             range(8)}
    db.start_run(run_id, {"test": True}, pair="tiny", device="cpu", gpu_type=None, gamma=4, batch_size=2)
    db.record_documents(run_id, [Document(d, f"Document {d}.", i) for i, d in enumerate(summaries)], [])
    db.write_batch(run_id, [OutputRecord(doc_id, mode, summary, [SidecarRecord.of("hashtags", "", tags)])
                            for i, (doc_id, summary) in enumerate(summaries.items())
                            for mode, tags in (("sidecar", [f"topic{i}", f"place{i}"]), ("standalone", ["news"]))])

    def doc_ids(shown_summaries) -> set[str]:
        return {doc_id for doc_id, summary in summaries.items() if any(summary in s for s in shown_summaries)}

    gate = HoldsAfter(answered=3)
    command = [sys.executable, "-m", "cli", "judge", "--run-id", run_id, "--db", str(db.path), "--model", "mock",
               "--controls", "0"]
    env = os.environ | prefect_api | {"PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    log = tmp_path / "judge.log"
    with letters_endpoint(gate) as url, log.open("wb") as out:
        process = subprocess.Popen([*command, "--base-url", url], stdout=out, stderr=subprocess.STDOUT, env=env,
                                   cwd=tmp_path)
        try:
            wait_for(lambda: gate.held.is_set() or process.poll() is not None, 300)
            assert process.poll() is None and gate.held.is_set(), f"no document was held:\n{log.read_text()}"
            finished = doc_ids(gate.answered)
            stored = wait_for(lambda: db.judged_doc_ids(run_id, "mock", "tags-p1") == finished, 60)
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=60)
        finally:
            process.kill()
            gate.release.set()
    # what the killed judge finished is in DuckDB, each document's games and the settings they are read with
    assert stored, f"{db.judged_doc_ids(run_id, 'mock', 'tags-p1')} stored of {sorted(finished)} finished"
    verdicts = db.query("SELECT doc_id, verdict FROM judgements WHERE run_id = ? ORDER BY doc_id", [run_id])
    assert verdicts == [{"doc_id": doc_id, "verdict": "sidecar"} for doc_id in sorted(finished)]

    asked: list[str] = []

    def recording(summary: str, tags_a: list[str], tags_b: list[str]) -> float:
        asked.append(summary)
        return reads_tags(summary, tags_a, tags_b)

    with letters_endpoint(recording) as url:
        summary = judge(run_id, judge_model="mock", base_url=url, retries=0, controls=0, db_path=str(db.path))
    assert doc_ids(asked) == set(summaries) - finished
    assert (summary.total, summary.wins) == (5, 5)
    assert db.judged_doc_ids(run_id, "mock", "tags-p1") == set(summaries)
    assert db.query("SELECT count(*) AS n FROM judgement_games WHERE run_id = ?", [run_id]) == [{"n": 16}]


def test_key_from_a_secret_block_reaches_the_endpoint_and_never_the_logs(prefect_api, db: Database,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.blocks.system import Secret

    from flows.judge import judge

    for name in ("SIDECAR_JUDGE_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    Secret(value=KEY).save("judge-key", overwrite=True)
    with running_server("tiny", api_key=KEY, model_name="judge-tiny") as url:
        state = judge(RUN, judge_model="judge-tiny", base_url=url, api_key_secret_block="judge-key", retries=0,
                      db_path=str(db.path), return_state=True)
    summary = state.result()
    assert summary.errors == 2
    # the key from the block is accepted (a wrong one would be a 401 with no raw answer): the tiny pair's random
    # answers are stored raw, each with its parse error
    assert all(g["raw_answer"] is not None and g["error"].startswith("JudgeAnswerError") for g in games(db))
    messages = logs(state.state_details.flow_run_id)
    assert any("documents to judge" in m for m in messages)
    assert not any(KEY in m for m in messages)


def test_unknown_run_and_missing_model_fail_the_flow(prefect_api, tmp_path: Path) -> None:
    from flows.judge import judge

    state = judge("no-such-run", judge_pair="tiny", db_path=str(tmp_path / "empty.duckdb"), return_state=True)
    assert state.is_failed() and "does not exist" in str(state.message)
    state = judge(RUN, base_url="http://127.0.0.1:9/v1", db_path=str(tmp_path / "empty.duckdb"), return_state=True)
    assert state.is_failed() and "judge_model is required" in str(state.message)


HEADLINE = {"name": "headline", "instruction": "Then write a one-line headline for the summary.",
            "max_new_tokens": 24, "attend_document": False, "parser": "text", "bridge": None}
TOPIC = {"name": "topic", "instruction": "Then name the summary's topic.", "max_new_tokens": 4,
         "attend_document": False, "parser": "text", "bridge": None, "choices": ["politics", "sport", "weather"]}


def tasks_run(db: Database) -> None:
    """The topical run with three tasks from one main output: its hashtags, a headline that names the summary's
    words (the standalone's names none), and a topic from fixed labels that is "politics" for every document."""
    from sidecar.tasks.task import HASHTAGS

    tasks = [HASHTAGS.model_dump(mode="json"), HEADLINE, TOPIC]
    db.start_run(TOPICAL, {"sidecar_tasks": tasks}, pair="tiny", device="cpu", gpu_type=None, gamma=4, batch_size=2)
    topics = {"doc-x": ("flood", "river"), "doc-y": ("strike", "union"), "doc-z": ("harvest", "wheat")}
    db.record_documents(TOPICAL, [Document(d, f"Document {d}.", i) for i, d in enumerate(topics)], [])
    db.write_batch(TOPICAL, [
        OutputRecord(doc_id, mode, f"- The {a} and the {b} were reported.", [
            SidecarRecord.of("hashtags", "", [a, b] if mode == "sidecar" else ["news", "today"]),
            SidecarRecord.of("headline", headline := f"{a} and {b}, reported" if mode == "sidecar" else
                             "News of today, more soon", headline),
            SidecarRecord.of("topic", "politics", "politics")])
        for doc_id, (a, b) in topics.items() for mode in ("sidecar", "standalone")])


def test_each_task_of_a_run_is_judged_on_its_own_and_the_pairwise_judge_names_its_instruction(
        prefect_api, db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    from flows.judge import judge

    tasks_run(db)
    monkeypatch.setenv("SIDECAR_JUDGE_API_KEY", "sk-env-key")
    seen: list[dict] = []
    with letters_endpoint(reads_tags, echo=True, seen=seen) as url:
        state = judge(TOPICAL, judge_model="mock", base_url=url, retries=0, db_path=str(db.path),
                      likelihood_prompts=("tags-l1", "tags-l2"), return_state=True)
    summary = state.result()
    # a judge row per task and method: both tasks' ladders pass, and both verdicts favour the sidecar's outputs
    quality = {(q["task"], q["method"], q["prompt_version"]): q for q in db.judge_quality(TOPICAL)}
    assert set(quality) == {(task, method, version) for task in ("hashtags", "headline") for method, version in
                            (("pairwise", "tags-p1"), ("likelihood", "tags-l1"), ("likelihood", "tags-l2"))}
    assert all((q["control_cleared"], q["null_tied"], q["reliable"], q["verdict"]) == (3, 3, True, "sidecar")
               for q in quality.values()), quality
    verdicts = db.judge_verdicts(TOPICAL)
    assert {task: (v["status"], v["verdict"]) for task, v in verdicts.items()} == {
        "hashtags": ("judged", "sidecar"), "headline": ("judged", "sidecar"), "topic": ("not judged", None)}
    assert [q["method"] for q in verdicts["headline"]["quality"]] == ["likelihood", "likelihood", "pairwise"]
    assert verdicts["headline"]["instruction"] == "Write a one-line headline for the summary."
    # the headline's games and scores are its own: its outputs, not the tags
    assert db.query("SELECT DISTINCT tags FROM judgement_scores WHERE task = 'headline' AND kind = 'null' "
                    "AND side = 'reversed' AND doc_id = 'doc-x'") == [{"tags": ["reported, flood and river"]}]
    # the pairwise prompt asks about the headline by its instruction, and about the tags as before
    asked = [request["messages"] for request in seen if "messages" in request]
    headline = [m for m in asked if "Output A: " in m[1]["content"]]
    assert headline and all("Instruction: Write a one-line headline for the summary." in m[1]["content"]
                            and "headline" in m[0]["content"] for m in headline)
    assert all("hashtags" in m[0]["content"] for m in asked if m not in headline)
    assert [task.task for task in (summary, *summary.tasks)] == ["hashtags", "headline"]
    report = artifacts(state.state_details.flow_run_id)["judge-run-topical"]
    assert "# Sidecar vs standalone task `headline` (LLM judge)" in report
    assert "Not judged: task topic is not judged: every document of its control sample (3)" in report


def test_a_choices_task_with_one_label_for_every_document_is_not_judged_with_why_never_unreliable(
        prefect_api, db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    from flows.judge import judge

    tasks_run(db)
    monkeypatch.setenv("SIDECAR_JUDGE_API_KEY", "sk-env-key")
    with letters_endpoint(lambda *_shown: 0.999) as url:  # a judge that fails every control, and cannot score
        summary = judge(TOPICAL, judge_model="mock", base_url=url, retries=0, db_path=str(db.path))
    topic = db.judge_verdicts(TOPICAL)["topic"]
    assert (topic["status"], topic["verdict"], topic["quality"]) == ("not judged", None, [])
    assert topic["reason"].startswith('every document of its control sample (3) has the same sidecar output '
                                      '("politics"), so there is no control')
    assert summary.not_judged == {"topic": topic["reason"]}
    assert db.query("SELECT count(*) AS n FROM judgement_games WHERE task = 'topic'") == [{"n": 0}]
    # the judged tasks of the same run are unreliable under this judge, and say why
    headline = db.judge_verdicts(TOPICAL)["headline"]
    assert headline["status"] == "unreliable" and "pairwise mock tags-p1: easy 0/3, null 3/3 (threshold 0.9)" in (
        headline["reason"]) and "likelihood mock tags-l1: unavailable" in headline["reason"]


def test_a_database_judged_before_tasks_were_judged_apart_is_not_asked_again(
        prefect_api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A schema-12 file whose hashtag run was judged then: migration 013 files its games under hashtags, so the
    judge finds every document judged, asks nothing and reads its verdict per task."""
    import duckdb

    from flows.judge import judge
    from storage.connection import RetryPolicy
    from storage.migrate import known_migrations, migrate

    path = tmp_path / "old.duckdb"
    migrate(path, RetryPolicy(), known_migrations()[:12])
    with duckdb.connect(str(path)) as con:
        con.execute("INSERT INTO runs (run_id, status, params, modes, pair) VALUES "
                    "('old', 'completed', '{}', ['sidecar', 'standalone'], 'tiny')")
        for doc, own in (("doc-x", '["flood", "river"]'), ("doc-y", '["strike", "union"]')):
            for mode, tags in (("sidecar", own), ("standalone", '["news"]')):
                con.execute("INSERT INTO outputs (run_id, doc_id, mode, summary) VALUES ('old', ?, ?, 'The flood.')",
                            [doc, mode])
                con.execute("INSERT INTO sidecar_outputs (run_id, doc_id, mode, task, text, parsed) VALUES "
                            "('old', ?, ?, 'hashtags', '', ?)", [doc, mode, tags])
            for game, (mode_a, mode_b) in ((1, ("sidecar", "standalone")), (2, ("standalone", "sidecar"))):
                con.execute("INSERT INTO judgement_games (run_id, doc_id, judge_model, prompt_version, game, mode_a, "
                            "mode_b, raw_answer, winner, p_a, p_b) VALUES ('old', ?, 'mock', 'tags-p1', ?, ?, ?, 'A', "
                            "?, 0.9, 0.1)", [doc, game, mode_a, mode_b, mode_a])
        con.execute("INSERT INTO judge_settings (run_id, judge_model, prompt_version, mode, threshold, margin_floor) "
                    "VALUES ('old', 'mock', 'tags-p1', 'probability', 0.9, 0.02)")
    monkeypatch.setenv("SIDECAR_JUDGE_API_KEY", "sk-env-key")
    seen: list[dict] = []
    with letters_endpoint(reads_tags, seen=seen) as url:
        summary = judge("old", judge_model="mock", base_url=url, retries=0, db_path=str(path), likelihood_prompts=())
    assert (summary.task, summary.total, summary.not_judged, seen) == ("hashtags", 0, {}, [])
    db = Database(path)
    assert db.judged_doc_ids("old", "mock", "tags-p1") == {"doc-x", "doc-y"}
    # judged then without a control ladder: unreliable, as it was, and saying why
    hashtags = db.judge_verdicts("old")["hashtags"]
    assert (hashtags["status"], hashtags["reason"]) == ("unreliable", "pairwise mock tags-p1: no control answered")


def test_a_task_the_judge_cannot_score_is_reported_not_judged_with_why(prefect_api, tmp_path: Path) -> None:
    """A run whose one task writes one headline: one document, so no control. The judge says so and asks
    nothing; it does not call the run UNRELIABLE."""
    from flows.judge import judge

    db = Database(tmp_path / "sidecar.duckdb")
    db.start_run("headlines", {"sidecar_tasks": [HEADLINE]}, pair="tiny", device="cpu", gpu_type=None, gamma=4,
                 batch_size=2)
    db.record_documents("headlines", [Document("d1", "The council approved a budget.", 0)], [])
    db.write_batch("headlines", [OutputRecord("d1", mode, "A budget.", [SidecarRecord.of(
        "headline", "Council passes budget", "Council passes budget")]) for mode in ("sidecar", "standalone")])
    summary = judge("headlines", judge_pair="tiny", db_path=str(db.path))
    line = summary.reliability_line()
    assert line.startswith("Not judged: task headline is not judged: every document of its control sample (1) "
                           'has the same sidecar output ("Council passes budget")'), line
    assert "UNRELIABLE" not in summary.to_markdown()
    assert summary.verdict_line() == "none, not judged"
    assert games(db) == []
    assert db.judge_verdicts("headlines")["headline"]["status"] == "not judged"


def test_api_key_from_prefect_secret_block(monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.blocks.system import Secret

    loaded: list[str] = []

    class LoadedSecret:
        def get(self) -> str:
            return "sk-from-block"

    def load(name: str) -> LoadedSecret:
        loaded.append(name)
        return LoadedSecret()

    monkeypatch.setattr(Secret, "load", load)
    monkeypatch.setenv("SIDECAR_JUDGE_API_KEY", "sk-env")

    from flows.judge import api_key_from_block

    assert api_key_from_block("judge-key").get_secret_value() == "sk-from-block"
    assert api_key_from_block(None) is None
    assert loaded == ["judge-key"]


def test_sidecar_judge_runs_the_flow_on_a_finished_run_and_prints_its_summary(
        prefect_api, db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from cli.main import app

    topical_run(db)
    monkeypatch.setenv("SIDECAR_JUDGE_API_KEY", "sk-env-key")
    with letters_endpoint(reads_tags) as url:
        result = CliRunner().invoke(app, ["judge", "--run-id", TOPICAL, "--db", str(db.path), "--base-url", url,
                                          "--model", "mock", "--likelihood-prompt", "tags-l2",
                                          "--likelihood-model", "mock/draft"])
    assert result.exit_code == 0, result.output
    # this endpoint has no /completions: both likelihood scorers are stored as unavailable
    assert [(q["judge_model"], q["prompt_version"], q["verdict"]) for q in db.judge_quality(TOPICAL)
            if q["method"] == "likelihood"] == [("mock", "tags-l2", "UNRELIABLE"),
                                                ("mock/draft", "tags-l2", "UNRELIABLE")]
    assert "| mock/draft | tags-l2 | unavailable: HTTP 404" in result.output
    assert "Reliable (pairwise): controls cleared the margin 0.020 in 3 of 3 documents" in result.output
    assert "| sidecar better | 3 |" in result.output
    assert "Mean preference for the sidecar's tags: 0.800" in result.output
    assert [q["reliable"] for q in db.judge_quality(TOPICAL) if q["method"] == "pairwise"] == [True]

    missing = CliRunner().invoke(app, ["judge", "--run-id", TOPICAL, "--db", str(db.path), "--base-url", url])
    assert missing.exit_code == 2 and "--model is required" in missing.output


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


def test_a_locally_served_judge_holds_the_accelerator_like_a_run(prefect_api, db: Database) -> None:
    import subprocess
    import sys

    from flows.accelerator import accelerator_lock
    from flows.judge import judge
    from sidecar.models.devices import accelerator_id
    from storage import LockHeldError

    holder = subprocess.Popen([sys.executable, "-c", HOLD_ACCELERATOR, str(accelerator_lock(accelerator_id()))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[1])
    try:
        assert holder.stdout.readline().strip() == "ready"
        state = judge(RUN, judge_pair="tiny", retries=0, db_path=str(db.path), device_wait_s=0, return_state=True)
        assert state.is_failed()
        with pytest.raises(LockHeldError, match=f"accelerator .* is held by PID {holder.pid} on "):
            state.result()
    finally:
        holder.communicate("done\n", timeout=60)
    assert games(db) == [], "the judge asked nothing while it could not have the accelerator"
