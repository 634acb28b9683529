"""The judge flow end to end: a real DuckDB file, an ephemeral Prefect API and `sidecar serve` with the tiny pair.

The tiny pair's answers are random text, never a JSON verdict, so every judged document is an error; the
flow must still complete, store both games and publish its artifact.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from server.launcher import free_port, running_server
from storage import Database, Document, OutputRecord

RUN = "run-Judge_1"
KEY = "sk-judge-block-3b9f2c71e6d84a05"
DOCS = {
    "doc-a": (["budget", "council"], ["schools", "budget"]),
    "doc-b": (["jobs", "plant"], ["economy"]),
    "doc-c": (["trade"], None),  # the standalone tagger's text could not be parsed: nothing to compare
}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    from prefect.settings import PREFECT_HOME, PREFECT_SERVER_ANALYTICS_ENABLED, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    home = tmp_path_factory.mktemp("prefect-home")
    with temporary_settings(updates={PREFECT_HOME: home, PREFECT_SERVER_ANALYTICS_ENABLED: False}), \
            prefect_test_harness(server_startup_timeout=None):  # PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS
        yield


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
            records.append(OutputRecord(doc_id, mode, summary, "hashtags", " ".join(f"#{t}" for t in tags or []),
                                        tags, parse_error=None if tags else "no hashtags found"))
    db.write_batch(RUN, records)
    return db


def games(db: Database) -> list[dict]:
    return db.query("SELECT doc_id, game, mode_a, mode_b, raw_answer, winner, error, judge_model "
                    "FROM judgement_games ORDER BY doc_id, game")


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
    stored = games(db)
    assert len(stored) == 4 and all(g["error"] and g["raw_answer"] is None for g in stored)
    assert db.judged_doc_ids(RUN, "tiny", "tags-v1") == set()

    # 2. the embedded default judge (sidecar serve with the tiny pair): the failed documents are asked again
    state = judge(RUN, judge_pair="tiny", retries=0, concurrency=2, db_path=str(db.path), return_state=True)
    assert state.is_completed()
    summary = state.result()
    assert (summary.total, summary.errors, summary.skipped, summary.judged) == (3, 2, 1, 0)
    assert set(summary.error_docs) == {"doc-a", "doc-b"}
    assert all("JudgeAnswerError" in error for error in summary.error_docs.values())
    stored = games(db)
    assert [(g["doc_id"], g["game"], g["mode_a"], g["mode_b"]) for g in stored] == [
        ("doc-a", 1, "sidecar", "standalone"), ("doc-a", 2, "standalone", "sidecar"),
        ("doc-b", 1, "sidecar", "standalone"), ("doc-b", 2, "standalone", "sidecar")]
    # an answer came back but is no verdict: kept raw with its parse error, no winner, and it counts as judged
    assert all(g["raw_answer"] is not None and g["winner"] is None and g["error"].startswith("JudgeAnswerError")
               for g in stored)
    assert db.judged_doc_ids(RUN, "tiny", "tags-v1") == {"doc-a", "doc-b"}
    verdicts = db.query("SELECT doc_id, verdict, errors FROM judgements WHERE run_id = ? ORDER BY doc_id", [RUN])
    assert verdicts == [{"doc_id": "doc-a", "verdict": None, "errors": 2},
                        {"doc_id": "doc-b", "verdict": None, "errors": 2}]
    report = artifacts(state.state_details.flow_run_id)["judge-run-judge-1"]
    assert "| error | 2 |" in report and "| skipped (missing tags) | 1 |" in report
    assert "Order consistency" in report and "doc-a" in report

    # 3. a rerun asks only what is missing: nothing but the document without standalone tags
    summary = judge(RUN, judge_pair="tiny", retries=0, db_path=str(db.path))
    assert (summary.total, summary.errors, summary.skipped) == (1, 0, 1)
    assert len(games(db)) == 4


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
