"""pipeline on the tiny pair: modes to storage records, the token-level context check, OOM bisection."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flows.embedded import embedded_prefect
from pipeline import (
    OOM_REASON,
    BatchOutcome,
    BatchSettings,
    PendingCommit,
    is_out_of_memory,
    plan_batches,
    run_batch,
    run_modes,
    split_by_context,
    store_outcomes,
)
from sidecar import HASHTAGS, InputError, SidecarEngine, SidecarRequest
from sidecar.models import tiny_pair
from storage import Database, Document, OutputRecord

MAX_NEW = 12
TEXTS = [
    "The city council approved a new budget on Tuesday after a long debate about schools and roads.",
    "Officials said the plan would add jobs at the plant in the north of the state.",
    "The president met leaders in Berlin, Moscow, Beijing and Doha to discuss prices.",
    "Prices rose 3.5 percent in 2017 while 1,200 workers lost their jobs at the factory.",
    "Public health officials warned about the climate and its effect on sports and technology.",
]


def documents(n: int = len(TEXTS)) -> list[Document]:
    return [Document(f"doc-{i}", TEXTS[i % len(TEXTS)], row_index=10 + i, title=f"Title {i}") for i in range(n)]


@pytest.fixture(scope="module")
def engine() -> SidecarEngine:
    # A fixed gamma: with the adaptive controller, how much of the summary the draft has cached when the
    # sidecar starts depends on timing, and the sidecar text with it (reported as an engine issue).
    return SidecarEngine(tiny_pair(), gamma=4, adaptive=False)


def settings(*modes: str, max_new_tokens: int = MAX_NEW) -> BatchSettings:
    task = HASHTAGS.model_copy(update={"max_new_tokens": 8})
    return BatchSettings(task, modes or ("sidecar", "sidecar_attended", "standalone"), max_new_tokens)


class InjectedOOM:
    """Wraps ``engine.run`` to raise a CUDA-style OOM for batches over ``max_batch`` or holding ``doc_text``."""

    def __init__(self, engine: SidecarEngine, monkeypatch: pytest.MonkeyPatch, max_batch: int | None = None,
                 doc_text: str | None = None, error: type[Exception] = torch.OutOfMemoryError) -> None:
        self.calls: list[int] = []
        self.real_run = engine.run
        self.max_batch, self.doc_text, self.error = max_batch, doc_text, error
        monkeypatch.setattr(engine, "run", self.run)

    def run(self, requests: list[SidecarRequest], **kwargs):
        self.calls.append(len(requests))
        too_big = self.max_batch is not None and len(requests) > self.max_batch
        if too_big or any(r.document == self.doc_text for r in requests):
            raise self.error("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 139.8 GiB total capacity)")
        return self.real_run(requests, **kwargs)


# -- modes to records ---------------------------------------------------------------------------------------


def test_each_mode_becomes_one_record_matching_the_engine(engine: SidecarEngine) -> None:
    docs = documents(3)
    records = run_modes(engine, docs, settings(), batch_id=10)
    by_key = {(r.doc_id, r.mode): r for r in records}
    assert len(records) == len(by_key) == 9

    task = settings().task
    direct = engine.run([SidecarRequest(d.text, sidecars=[task]) for d in docs], max_new_tokens=MAX_NEW,
                        batch_size=3)
    attended_task = task.model_copy(update={"attend_document": True})
    attended = engine.run([SidecarRequest(d.text, sidecars=[attended_task]) for d in docs],
                          max_new_tokens=MAX_NEW, batch_size=3)
    tagger = engine.standalone([r.main.text for r in direct], [task], batch_size=3)
    for doc, evicted, kept, alone in zip(docs, direct, attended, tagger, strict=True):
        sidecar = by_key[(doc.doc_id, "sidecar")]
        assert sidecar.summary == evicted.main.text and sidecar.main_tokens == len(evicted.main.token_ids)
        assert sidecar.sidecar_text == evicted.sidecars["hashtags"].text
        assert sidecar.sidecar_name == "hashtags" and sidecar.finish_reason == evicted.main.finish_reason
        assert [s.phase for s in sidecar.stats] == ["main", "sidecar"]
        assert sidecar.stats[1].new_tokens == len(evicted.sidecars["hashtags"].token_ids)

        attended_record = by_key[(doc.doc_id, "sidecar_attended")]
        assert attended_record.sidecar_text == kept.sidecars["hashtags"].text
        assert attended_record.summary == sidecar.summary, "the main output is target-exact in every mode"
        # attending to the document keeps its KV columns in the sidecar's cache
        assert attended_record.stats[1].kv_bytes > sidecar.stats[1].kv_bytes

        standalone = by_key[(doc.doc_id, "standalone")]
        assert standalone.summary == sidecar.summary and standalone.main_tokens is None
        assert standalone.sidecar_text == alone["hashtags"].text
        assert [s.phase for s in standalone.stats] == ["sidecar"]
        for record, output in ((sidecar, evicted.sidecars["hashtags"]), (standalone, alone["hashtags"])):
            assert record.batch_id == 10
            # unparseable text keeps its raw form and says why; parsed text becomes tags
            assert record.tags == (output.parsed if output.parse_error is None else None)
            assert record.parse_error == output.parse_error


def test_standalone_alone_still_gets_the_target_exact_summary(engine: SidecarEngine) -> None:
    docs = documents(2)
    alone = run_modes(engine, docs, settings("standalone"))
    both = run_modes(engine, docs, settings("sidecar", "standalone"))
    assert [r.mode for r in alone] == ["standalone", "standalone"]
    assert [r.summary for r in alone] == [r.summary for r in both if r.mode == "sidecar"]


def test_unknown_modes_are_refused() -> None:
    with pytest.raises(ValueError, match="subset"):
        BatchSettings(HASHTAGS, ("sidecar", "judge"))
    with pytest.raises(ValueError, match="subset"):
        BatchSettings(HASHTAGS, ())


def test_records_land_in_the_results_view(engine: SidecarEngine, tmp_path: Path) -> None:
    db = Database(tmp_path / "sidecar.duckdb")
    modes = ("sidecar", "sidecar_attended", "standalone")
    db.start_run("r", {}, pair="tiny", device="cpu", gpu_type="cpu", gamma=4, batch_size=3, modes=modes,
                 code_version="test")
    docs = documents(3)
    db.record_documents("r", docs, [])
    store_outcomes(db, "r", [run_batch(engine, docs, settings(*modes))])
    rows = db.results_table("r")
    assert [row["doc_id"] for row in rows] == ["doc-0", "doc-1", "doc-2"]
    assert [row["title"] for row in rows] == ["Title 0", "Title 1", "Title 2"]
    assert db.done_doc_ids("r", list(modes)) == {"doc-0", "doc-1", "doc-2"}


def test_a_commit_with_finish_finishes_the_run_also_with_nothing_to_write(tmp_path: Path) -> None:
    db = Database(tmp_path / "sidecar.duckdb")
    for run_id in ("written", "empty"):
        db.start_run(run_id, {}, pair="tiny", device="cpu", gpu_type="cpu", gamma=4, batch_size=1,
                     modes=("sidecar",), code_version="test")
    pending = PendingCommit(interval_s=3600)
    pending.add(BatchOutcome(records=[OutputRecord("doc-0", "sidecar", "A summary.", "hashtags", "#a", ["#a"])]))
    assert pending.commit(db, "written", finish="completed") == 1
    assert db.done_doc_ids("written", ["sidecar"]) == {"doc-0"}
    assert db.get_run("written")["status"] == "completed"

    # with nothing to write there is no batch transaction to carry the finish: the run is still finished
    pending.add(BatchOutcome())
    assert pending.commit(db, "empty", finish="completed") == 0
    assert db.get_run("empty")["status"] == "completed"


# -- the token-level context check --------------------------------------------------------------------------


def test_over_context_documents_become_rejects_that_the_engine_would_refuse() -> None:
    pair = tiny_pair()
    pair.target.config.max_position_embeddings = 200  # a small context, so short texts overflow it
    engine = SidecarEngine(pair, gamma=4, adaptive=False)
    short = Document("short", "A short note about the budget.", row_index=0)
    long = Document("long", " ".join(TEXTS * 4), row_index=1, title="Long")
    fit, rejects = split_by_context(engine, [short, long], settings("sidecar", "standalone"))
    assert [d.doc_id for d in fit] == ["short"]
    [reject] = rejects
    assert (reject.doc_id, reject.reason, reject.row_index, reject.title) == ("long", "over_context", 1, "Long")
    assert "model context is 200 tokens" in reject.detail
    # the check counts as the engine does: the kept document runs, the rejected one fails its batch
    assert len(run_modes(engine, fit, settings("sidecar", "standalone"))) == 2
    with pytest.raises(InputError, match="exceeds the model context"):
        run_modes(engine, [short, long], settings("sidecar", "standalone"))


# -- out of memory -------------------------------------------------------------------------------------------


def test_oom_splits_the_batch_in_halves_until_it_fits(engine: SidecarEngine, monkeypatch) -> None:
    docs = documents(5)
    expected = {(r.doc_id, r.mode): r for r in run_modes(engine, docs, settings("sidecar", "standalone"))}
    oom = InjectedOOM(engine, monkeypatch, max_batch=2)
    outcome = run_batch(engine, docs, settings("sidecar", "standalone"))
    # 5 fails, then the halves in input order: 2 runs, 3 fails, 1 runs, 2 runs
    assert oom.calls == [5, 2, 3, 1, 2]
    assert outcome.oom_splits == 2 and outcome.sub_batches == 3 and not outcome.failures
    assert outcome.done_doc_ids == [d.doc_id for d in docs]
    # each sub-batch is its own batch in the stats, named by its first document's input row
    assert {r.doc_id: r.batch_id for r in outcome.records} == {
        "doc-0": 10, "doc-1": 10, "doc-2": 12, "doc-3": 13, "doc-4": 13}
    # Summaries are target-exact and the standalone tagger sees only them, so neither may change with the
    # split. (The sidecar text can: it depends on how much of the summary the draft had cached when the
    # row finished, which varies with the batch; reported as an engine issue.)
    for record in outcome.records:
        assert record.summary == expected[(record.doc_id, record.mode)].summary
        if record.mode == "standalone":
            assert record.sidecar_text == expected[(record.doc_id, record.mode)].sidecar_text


@pytest.mark.parametrize("error", [torch.OutOfMemoryError, RuntimeError])
def test_a_document_that_fails_alone_is_recorded_and_the_rest_continue(engine: SidecarEngine, monkeypatch,
                                                                       tmp_path: Path, error) -> None:
    docs = documents(4)
    InjectedOOM(engine, monkeypatch, doc_text=docs[2].text, error=error)
    outcome = run_batch(engine, docs, settings("sidecar", "standalone"))
    assert outcome.done_doc_ids == ["doc-0", "doc-1", "doc-3"]
    [failure] = outcome.failures
    assert failure.doc.doc_id == "doc-2" and "CUDA out of memory" in failure.error

    db = Database(tmp_path / "sidecar.duckdb")
    db.start_run("r", {}, pair="tiny", device="cpu", gpu_type="cpu", gamma=4, batch_size=4, code_version="test")
    db.record_documents("r", docs, [])
    store_outcomes(db, "r", [outcome])
    rows = db.query("SELECT doc_id, status, reject_reason, reject_detail FROM documents WHERE status <> 'ok'")
    assert [(r["doc_id"], r["status"], r["reject_reason"]) for r in rows] == [("doc-2", "rejected", OOM_REASON)]
    assert "CUDA out of memory" in rows[0]["reject_detail"]
    assert db.done_doc_ids("r", ["sidecar", "standalone"]) == {"doc-0", "doc-1", "doc-3"}


def test_other_errors_are_not_taken_for_oom(engine: SidecarEngine, monkeypatch) -> None:
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not is_out_of_memory(RuntimeError("expected scalar type Float"))
    assert not is_out_of_memory(ValueError("out of memory"))

    def broken(requests, **kwargs):
        raise RuntimeError("expected scalar type Float but found Half")

    monkeypatch.setattr(engine, "run", broken)
    with pytest.raises(RuntimeError, match="scalar type"):
        run_batch(engine, documents(3), settings("sidecar"))


# -- batches --------------------------------------------------------------------------------------------------


def test_batches_are_cut_from_the_whole_list_so_a_resume_repeats_them() -> None:
    docs = documents(7)
    batches, skipped = plan_batches(docs, 3, done_ids=set())
    assert [[d.doc_id for d in b.docs] for b in batches] == [
        ["doc-0", "doc-1", "doc-2"], ["doc-3", "doc-4", "doc-5"], ["doc-6"]]
    assert skipped == 0

    batches, skipped = plan_batches(docs, 3, done_ids={"doc-0", "doc-1", "doc-2", "doc-4"})
    assert [(b.index, [d.doc_id for d in b.docs], b.skipped) for b in batches] == [
        (1, ["doc-3", "doc-5"], 1), (2, ["doc-6"], 0)]
    assert skipped == 4
    with pytest.raises(ValueError, match="batch_size"):
        plan_batches(docs, 0, set())


def test_embedded_prefect_turns_heartbeats_off_only_without_a_server(monkeypatch) -> None:
    from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    configured = PREFECT_FLOWS_HEARTBEAT_FREQUENCY.value()
    assert configured is not None  # Prefect's default: heartbeats on
    with temporary_settings(restore_defaults={PREFECT_API_URL}), embedded_prefect():
        assert PREFECT_FLOWS_HEARTBEAT_FREQUENCY.value() is None
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:4200/api"}), embedded_prefect():
        assert PREFECT_FLOWS_HEARTBEAT_FREQUENCY.value() == configured
    assert PREFECT_FLOWS_HEARTBEAT_FREQUENCY.value() == configured
