"""Sharded nightly runs with the tiny pair: shard attempts as real processes on the module's Prefect API, part
files under the results location, the parent the only writer of a real DuckDB file.

Faults are real: a shard process or the parent is killed with SIGKILL while it runs; a shard that always
fails or never writes a part is launched by a launcher that starts another process in its place.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from shard_parts import manifest_ids, part_doc_ids

from storage import Database

REPO = Path(__file__).resolve().parents[1]
MODES = ["sidecar", "standalone"]
SENTENCES = [
    "The city council approved a new budget on Tuesday after a long debate about schools and roads.",
    "Officials said the plan would add jobs at the plant in the north of the state.",
    "The president met leaders in Berlin, Moscow, Beijing and Doha to discuss prices.",
]
pytestmark = [pytest.mark.slow, pytest.mark.servers]


def write_corpus(path: Path, n: int, huge: bool = False, edition: str = "") -> Path:
    """``n`` short documents; with ``huge``, one more beyond the models' context (4096 tokens), id ``huge``;
    another ``edition`` gives the same ids other texts."""
    ids = [f"doc-{i:02d}" for i in range(n)]
    texts = [f"{edition}{SENTENCES[i % 3]} Report number {i}." + " More." * (i % 5) for i in range(n)]
    if huge:
        ids, texts = [*ids, "huge"], [*texts, " ".join(SENTENCES * 300)]
    pq.write_table(pa.table({"id": ids, "article": texts}), path)
    return path


def params(tmp_path: Path, corpus: Path, **overrides):
    from flows.nightly import NightlyParams

    values = {"corpus": str(corpus), "pair": "tiny", "batch_size": 3, "max_new_tokens": 12,
              "db_path": str(tmp_path / "sidecar.duckdb"), "trigger_judge": False, "trigger_cost_report": False}
    return NightlyParams(**(values | overrides))


# -- what the run left behind --


def launch_dirs(db_path: Path | str, results: Path | None = None) -> list[Path]:
    """The attempts' directories under ``results`` (default: beside the database)."""
    root = results if results is not None else Path(f"{db_path}.runs") / "parts"
    return sorted(p for p in root.glob("run-*/*") if p.is_dir())


def attempts(db: Database, run_id: str) -> list[dict]:
    return db.query("SELECT shard, attempt, launch_id, flow_run_id, status, docs, error FROM shard_attempts "
                    "WHERE run_id = ? ORDER BY shard, attempt, started_at", [run_id])


def assert_each_doc_and_mode_once(db: Database, run_id: str, n_docs: int) -> None:
    stored = db.query("SELECT count(*) AS rows, count(DISTINCT (doc_id, mode)) AS keys FROM outputs "
                      "WHERE run_id = ?", [run_id])[0]
    assert stored == {"rows": n_docs * len(MODES), "keys": n_docs * len(MODES)}
    phases = db.query("SELECT count(*) AS rows, count(DISTINCT (doc_id, mode, phase)) AS keys FROM request_stats "
                      "WHERE run_id = ?", [run_id])[0]
    assert phases == {"rows": n_docs * 3, "keys": n_docs * 3}  # main + sidecar, and standalone's one phase
    # the parts carry each row's device-time ledger, a sidecar's instruction line included
    ledger = db.query("SELECT count(*) FILTER (WHERE prefill_device_s > 0 AND decode_device_s > 0 AND "
                      "prefill_forwards > 0 AND decode_forwards > 0) AS charged, "
                      "count(*) FILTER (WHERE mode = 'sidecar' AND phase = 'sidecar' AND instruction_device_s > 0) "
                      "AS instructions FROM request_stats WHERE run_id = ?", [run_id])[0]
    assert ledger == {"charged": n_docs * 3, "instructions": n_docs}
    assert len(db.results(run_id)) == n_docs


def outputs_of(db: Database, run_id: str) -> list[tuple]:
    return [tuple(r.values()) for r in db.query(
        "SELECT o.doc_id, o.mode, o.summary, t.text FROM outputs AS o "
        "JOIN sidecar_outputs AS t USING (run_id, doc_id, mode) WHERE run_id = ? ORDER BY o.doc_id, o.mode, t.task",
        [run_id])]


# -- processes --


def shard_processes(root_pid: int, launch_prefix: str = "") -> list[psutil.Process]:
    """The ``flows.nightly_shard`` processes under ``root_pid`` whose launch id starts with ``launch_prefix``."""
    found = []
    for child in psutil.Process(root_pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            command = " ".join(child.cmdline())
            if "flows.nightly_shard" in command and f'"launch_id": "{launch_prefix}' in command:
                found.append(child)
    return found


def wait_for(condition, timeout_s: float, what: str, poll_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def run_in_thread(target) -> tuple[threading.Thread, dict[str, object]]:
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["value"] = target()
        except BaseException as exc:  # the test thread reports it
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


# -- tests --


def test_two_workers_store_the_outputs_of_one_each_document_and_mode_once(prefect_api, tmp_path: Path) -> None:
    from flows.nightly import nightly

    n_docs = 20
    corpus = write_corpus(tmp_path / "news.parquet", n_docs, huge=True)
    # no character limit: the huge document is caught by the token check, in its shard
    one = nightly(**params(tmp_path, corpus, run_id="one-worker", window=4, commit_every_s=0,
                           max_chars=None).model_dump())
    assert one.shard_attempts == 0, "one worker: the run in this process"
    # three shards on two workers: the third waits for a slot
    two = nightly(**params(tmp_path, corpus, run_id="two-workers", window=4, commit_every_s=0, max_chars=None,
                         workers=2, shards=3, trigger_cost_report=True).model_dump())
    assert two.downstream == {"cost-report": "Completed"}, "the cost report follows the parent, once"
    assert (two.documents, two.done, two.skipped_done, two.shard_attempts) == (n_docs + 1, n_docs, 0, 3)

    db = Database(tmp_path / "sidecar.duckdb")
    assert db.get_run("two-workers")["status"] == "completed"
    assert_each_doc_and_mode_once(db, "two-workers", n_docs)
    # greedy decoding: where a document ran changes nothing it got
    assert outputs_of(db, "two-workers") == outputs_of(db, "one-worker")
    rejected = db.query("SELECT doc_id, reject_reason FROM documents WHERE run_id = ? AND reject_reason IS NOT NULL",
                        ["two-workers"])
    assert rejected == [{"doc_id": "huge", "reject_reason": "over_context"}]
    tried = attempts(db, "two-workers")
    assert [(a["shard"], a["attempt"], a["status"]) for a in tried] == [(0, 1, "completed"), (1, 1, "completed"),
                                                                        (2, 1, "completed")]
    # the shards' manifests split the documents between them, balanced by tokens: the huge one alone
    manifests = [manifest_ids(d) for d in launch_dirs(tmp_path / "sidecar.duckdb")]
    assert sorted(len(m) for m in manifests) == [1, 10, 10] and {"huge"} in manifests
    assert set.union(*manifests) == {f"doc-{i:02d}" for i in range(n_docs)} | {"huge"}
    # each shard recorded where it ran; the parent's run row holds no device
    where = db.query("SELECT DISTINCT launch_id, host, device, gpu_type FROM request_stats WHERE run_id = ?",
                     ["two-workers"])
    ran = {d.name for d in launch_dirs(tmp_path / "sidecar.duckdb") if manifest_ids(d) != {"huge"}}
    assert {w["launch_id"] for w in where} == ran and len(ran) == 2
    assert all(w["host"] and w["device"] == "cpu" and w["gpu_type"] for w in where)
    assert db.get_run("two-workers")["gpu_type"] is None
    # ... and how its forwards ran: each shard's capture mode and its own counters, from its latest part (the
    # huge document's shard too, which loaded the pair and rejected it)
    recorded = db.shard_attempts("two-workers")
    assert {a["capture"] for a in recorded} == {"eager (SIDECAR_CAPTURE=eager)"}
    assert all(c["forwards"] > 0 and c["recompiles"] == 0 for a in recorded if a["launch_id"] in ran
               for model, c in json.loads(a["capture_counters"]).items() if model != "steps")
    assert all(json.loads(a["capture_counters"])["steps"]["steps"] > 0 for a in recorded if a["launch_id"] in ran)
    summed = db.capture("two-workers")
    assert (summed["capture"], summed["recorded"], summed["faults"]) == (recorded[0]["capture"], 3, 0)
    assert db.get_run("two-workers")["capture"] is None, "the parent ran no forward"
    # ... which the throughput view, and the cost report measured from it, take per GPU type
    assert {t["gpu_type"] for t in db.throughput("two-workers")} == {where[0]["gpu_type"]}
    measured = db.query("SELECT DISTINCT mode FROM costs WHERE source = 'measured' AND run_id = ?", ["two-workers"])
    assert {m["mode"] for m in measured} == set(MODES)
    # the shards' flow runs are on the parent's API, named by their launch ids, and recorded with them
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            name=FlowRunFilterName(any_=[a["launch_id"] for a in tried])))
        names = {client.read_flow(r.flow_id).name for r in runs}
    assert names == {"nightly-shard"} and all(r.state.is_completed() for r in runs)
    assert {str(r.id) for r in runs} == {a["flow_run_id"] for a in tried}


def test_shards_carry_every_sidecar_task_as_one_process_stores_them(prefect_api, tmp_path: Path) -> None:
    from flows.nightly import nightly
    from sidecar.tasks.task import HASHTAGS
    from storage import RunMismatchError

    tasks = [HASHTAGS.model_dump(), {"name": "headline", "instruction": "Then write a one-line headline.",
                                     "max_new_tokens": 6}]
    corpus = write_corpus(tmp_path / "news.parquet", 6)
    nightly(**params(tmp_path, corpus, run_id="tasks-here", sidecar_tasks=tasks).model_dump())
    sharded = nightly(**params(tmp_path, corpus, run_id="tasks-shards", sidecar_tasks=tasks, workers=2,
                               commit_every_s=0).model_dump())
    assert (sharded.done, sharded.shard_attempts) == (6, 2)
    db = Database(tmp_path / "sidecar.duckdb")
    # greedy decoding: each task's output is the same wherever its document ran
    assert outputs_of(db, "tasks-shards") == outputs_of(db, "tasks-here")
    assert len(outputs_of(db, "tasks-shards")) == 6 * len(MODES) * 2
    with pytest.raises(RunMismatchError, match="sidecar_tasks hashtags, headline"):
        nightly(**params(tmp_path, corpus, run_id="tasks-shards", workers=2).model_dump())


def test_a_killed_shard_is_relaunched_with_only_its_unfinished_documents(prefect_api, tmp_path: Path) -> None:
    from flows.nightly import nightly

    n_docs = 20
    corpus = write_corpus(tmp_path / "news.parquet", n_docs)
    run = params(tmp_path, corpus, run_id="shard-killed", batch_size=2, window=2, commit_every_s=0,
                 max_new_tokens=16, workers=2)
    thread, result = run_in_thread(lambda: nightly(**run.model_dump()))
    try:
        first = wait_for(lambda: [d for d in launch_dirs(run.db_path)
                                  if d.name.startswith("s0000-a01-") and any(d.glob("part-*.parquet"))],
                         300, "shard 0's first part")[0]
        [victim] = shard_processes(os.getpid(), "s0000-a01-")
        # not waited for here: the launcher reaps its own child, and learns from it how it ended
        victim.send_signal(signal.SIGKILL)
    finally:
        thread.join(timeout=600)
    assert "error" not in result, result
    counts = result["value"]
    assert counts.shard_attempts == 3 and counts.done == n_docs

    db = Database(run.db_path)
    assert db.get_run("shard-killed")["status"] == "completed"
    assert_each_doc_and_mode_once(db, "shard-killed", n_docs)
    tried = attempts(db, "shard-killed")
    assert [(a["shard"], a["attempt"], a["status"]) for a in tried] == [
        (0, 1, "crashed"), (0, 2, "completed"), (1, 1, "completed")]
    # the relaunch got exactly the documents of shard 0 that the killed attempt had not written
    killed_done = part_doc_ids(first)
    [second] = [d for d in launch_dirs(run.db_path) if d.name.startswith("s0000-a02-")]
    assert killed_done and manifest_ids(second) == manifest_ids(first) - killed_done
    assert manifest_ids(second), "the kill came after shard 0 had finished"


# holds the accelerator of the slot whose environment it runs in, as another run would, until its stdin closes
HOLD_ACCELERATOR = """
import sys
from flows.accelerator import accelerator_lock
from sidecar.models.devices import accelerator_id
from storage.locks import exclusive
with exclusive(accelerator_lock(accelerator_id()), "another run", None):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_a_shard_waiting_for_its_accelerator_is_not_stalled_however_long_it_waits(prefect_api,
                                                                                tmp_path: Path) -> None:
    from flows.nightly import nightly
    from flows.shard_processes import slot_environment, usable_cores
    from sidecar.models.devices import visible_gpus
    from storage import PartStore

    # more than a shard's stall clock runs on a loaded machine: from its start until it says it waits for its
    # device (its imports and the pair come after), then from holding it to its first part; 5-10 s at load 8 on
    # 2 cores
    stall_s = 20
    n_docs = 8
    run = params(tmp_path, write_corpus(tmp_path / "news.parquet", n_docs), run_id="device-wait", window=2,
                 commit_every_s=0, workers=2, shard_retries=0, shard_stall_s=stall_s)
    # another run holds slot 0's accelerator (its GPU, or on a CPU its share of the cores)
    env = os.environ | slot_environment(0, 2, visible_gpus(), usable_cores()) | {"PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, "-c", HOLD_ACCELERATOR], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    thread = None
    try:
        assert holder.stdout.readline() == "held\n"
        started = time.monotonic()
        thread, result = run_in_thread(lambda: nightly(**run.model_dump()))
        # shard 1 has its device and writes parts while shard 0 waits for its own; well past the stall limit,
        # the wait is no stall, and the shard says it waits
        wait_for(lambda: not thread.is_alive() or [d for d in launch_dirs(run.db_path) if d.name.startswith(
            "s0001-a01-") and any(d.glob("part-*.parquet"))], 300, "shard 1's first part")
        time.sleep(max(0.0, started + stall_s + 10 - time.monotonic()))
        assert thread.is_alive(), result
        [waiting] = [d.name for d in launch_dirs(run.db_path) if d.name.startswith("s0000-")]
        assert PartStore.beside(run.db_path).read_device_state("device-wait", waiting) == "waiting"
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
        if thread is not None:
            thread.join(timeout=600)
    assert "error" not in result, result
    counts = result["value"]
    assert counts.done == n_docs and counts.shard_attempts == 2
    assert counts.device_wait_seconds > 0, "the wait is in the run's summary"
    db = Database(run.db_path)
    assert [(a["shard"], a["attempt"], a["status"]) for a in attempts(db, "device-wait")] == [
        (0, 1, "completed"), (1, 1, "completed")]
    assert_each_doc_and_mode_once(db, "device-wait", n_docs)


def test_a_killed_parent_is_resumed_from_its_parts_relaunching_only_what_is_missing(prefect_api,
                                                                                   tmp_path: Path) -> None:
    n_docs = 20
    corpus = write_corpus(tmp_path / "news.parquet", n_docs)
    db_path, results = tmp_path / "sidecar.duckdb", tmp_path / "results"
    command = [sys.executable, "-m", "cli", "nightly", "--corpus", str(corpus), "--pair", "tiny", "--db", str(db_path),
               "--batch-size", "2", "--window", "2", "--max-new-tokens", "16", "--run-id", "parent-killed",
               "--commit-every", "0", "--workers", "2", "--results-uri", str(results), "--no-judge", "--no-cost-report"]
    # the module's API rather than an embedded one per parent process, which takes some 30 s to start here
    env = os.environ | prefect_api | {"PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    log = tmp_path / "first.log"
    with log.open("wb") as out:
        parent = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
        try:
            wait_for(lambda: parent.poll() is not None or any(
                any(d.glob("part-*.parquet")) for d in launch_dirs(db_path, results)), 300, "a first part", poll_s=0.1)
            assert parent.poll() is None, f"the run ended before it could be killed:\n{log.read_text()}"
            shards = shard_processes(parent.pid)
            assert len(shards) == 2, shards
            parent.send_signal(signal.SIGKILL)
            parent.wait(timeout=60)
        finally:
            parent.kill()
    # the shards end with their parent: nothing writes parts of the run any more
    _, alive = psutil.wait_procs(shards, timeout=60)
    assert not alive, f"shard processes outlived their parent: {alive}"
    db = Database(db_path)
    assert db.get_run("parent-killed")["status"] == "running"  # nobody got to mark it
    before = launch_dirs(db_path, results)
    written = set().union(*(part_doc_ids(d) for d in before))

    rerun = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert db.get_run("parent-killed")["status"] == "completed"
    assert_each_doc_and_mode_once(db, "parent-killed", n_docs)
    relaunched = [d for d in launch_dirs(db_path, results) if d not in before]
    redone = set().union(*(manifest_ids(d) for d in relaunched))
    # the rerun planned only the documents no part held, whatever the first parent had ingested
    assert redone == {f"doc-{i:02d}" for i in range(n_docs)} - written
    assert written and redone, f"killed after {len(written)} of {n_docs} documents"
    assert not launch_dirs(db_path), "the parts went to --results-uri, not beside the database"
    tried = attempts(db, "parent-killed")
    assert [a["status"] for a in tried if a["launch_id"] in {d.name for d in relaunched}] == ["completed"] * len(
        relaunched)


@pytest.mark.parametrize(("first", "then"), [(1, 2), (2, 1)], ids=["in-process-then-sharded",
                                                                  "sharded-then-in-process"])
def test_a_run_resumes_with_other_workers_and_reports_every_row_under_its_gpu_type(prefect_api, tmp_path: Path,
                                                                                   first: int, then: int) -> None:
    from flows.nightly import nightly

    n_docs, started = 9, 4
    corpus = write_corpus(tmp_path / "news.parquet", n_docs)
    run_id = f"workers-{first}-then-{then}"
    # the first start runs the first documents only; a larger limit extends the run
    begun = nightly(**params(tmp_path, corpus, run_id=run_id, limit=started, window=2, commit_every_s=0,
                           workers=first).model_dump())
    assert begun.done == started
    resumed = nightly(**params(tmp_path, corpus, run_id=run_id, window=2, commit_every_s=0, workers=then).model_dump())
    assert (resumed.skipped_done, resumed.done) == (started, n_docs - started)
    assert (resumed.shard_attempts > 0) == (then > 1), "the resume ran in the mode it was asked for"

    db = Database(tmp_path / "sidecar.duckdb")
    assert db.get_run(run_id)["status"] == "completed"
    assert_each_doc_and_mode_once(db, run_id, n_docs)
    # every request says where it ran, written in this process (no launch id) or by a shard
    where = db.query("SELECT launch_id IS NULL AS own, count(*) AS rows, count(host) AS hosts, "
                     "count(gpu_type) AS gpu_types, list(DISTINCT device) AS devices FROM request_stats "
                     "WHERE run_id = ? GROUP BY own ORDER BY own", [run_id])
    assert [w["own"] for w in where] == [False, True]
    assert all(w["hosts"] == w["gpu_types"] == w["rows"] and w["devices"] == ["cpu"] for w in where)
    throughput = db.throughput(run_id)
    assert throughput and all(t["gpu_type"] for t in throughput)
    assert sum(t["requests"] for t in throughput) == n_docs * 3, "every request stats row is counted"


class FaultyShards:
    """Local shard processes, but shard 1's first attempt never writes a part and its later ones fail at once.

    The real shard's stall clock stays well within the limit the test sets (20 s) even on a loaded machine: it
    runs from the shard's start until it says it waits for its device (its imports and the pair come after),
    then from holding it to its first part, 5-10 s at load 8 on 2 cores."""

    def __init__(self, real) -> None:
        self.real = real

    def launch(self, launch):
        from flows.shard_processes import ShardProcess

        if launch.shard != 1:
            return self.real.launch(launch)
        code = "import time; time.sleep(600)" if launch.attempt == 1 else "raise SystemExit(3)"
        process = subprocess.Popen([sys.executable, "-c", code], process_group=0)
        return ShardProcess(launch, slot=1, process=process)

    def wait(self, timeout_s: float) -> None:
        self.real.wait(timeout_s)


def test_a_shard_that_never_finishes_fails_the_run_naming_its_documents_and_keeps_the_rest(
        prefect_api, tmp_path: Path, monkeypatch) -> None:
    import flows.nightly
    from flows.nightly import nightly
    from flows.shard_supervisor import IncompleteRunError

    real_launcher = flows.nightly._launcher
    monkeypatch.setattr(flows.nightly, "_launcher", lambda p: FaultyShards(real_launcher(p)))
    n_docs = 12
    run = params(tmp_path, write_corpus(tmp_path / "news.parquet", n_docs), run_id="never", window=3,
                 commit_every_s=0, workers=2, shard_retries=1, shard_stall_s=20)
    state = nightly(**run.model_dump(), return_state=True)
    assert state.is_failed()
    with pytest.raises(IncompleteRunError, match="6 documents not finished after 1 relaunches per shard"):
        state.result()

    db = Database(run.db_path)
    stored = db.get_run("never")
    assert stored["status"] == "failed"
    [good, bad] = [manifest_ids(d) for d in launch_dirs(run.db_path) if d.name.startswith("s0000-a01-")] + [
        manifest_ids(d) for d in launch_dirs(run.db_path) if d.name.startswith("s0001-a01-")]
    named = sorted(bad)[:5]
    assert all(repr(doc_id) in stored["error"] for doc_id in named) and "and 1 more" in stored["error"]
    # the other shard's documents are all kept
    assert db.done_doc_ids("never", MODES) == good and len(good) == n_docs - len(bad)
    tried = attempts(db, "never")
    assert [(a["shard"], a["attempt"], a["status"]) for a in tried] == [
        (0, 1, "completed"), (1, 1, "cancelled"), (1, 2, "failed")]
    assert "stalled" in tried[1]["error"]

    from cli.errors import EXIT_FAILED, exit_code

    assert exit_code(IncompleteRunError("x")) == EXIT_FAILED == 1


def test_a_rerun_in_a_new_database_refuses_the_parts_of_the_old_one_and_runs_its_own(prefect_api,
                                                                                  tmp_path: Path) -> None:
    from flows.nightly import nightly

    # two corpora with the same ids and other texts, two databases, one results location, one run id: the
    # second start must not take the first one's parts for its own
    results = tmp_path / "results"
    shared = {"run_id": "same-id", "results_uri": str(results), "workers": 1, "shards": 2, "window": 2,
              "commit_every_s": 0}
    first = write_corpus(tmp_path / "first.parquet", 4)
    nightly(**params(tmp_path, first, db_path=str(tmp_path / "first.duckdb"), **shared).model_dump())
    second = write_corpus(tmp_path / "second.parquet", 4, edition="Late edition. ")
    counts = nightly(**params(tmp_path, second, db_path=str(tmp_path / "second.duckdb"), **shared).model_dump())
    assert counts.shard_attempts == 2, "the second run launched its own shards"

    db = Database(tmp_path / "second.duckdb")
    assert db.get_run("same-id")["status"] == "completed"
    assert_each_doc_and_mode_once(db, "same-id", 4)
    own = {a["launch_id"] for a in attempts(db, "same-id")}
    ingested = db.query("SELECT DISTINCT launch_id FROM ingested_parts WHERE run_id = 'same-id'")
    stored = db.query("SELECT DISTINCT launch_id FROM request_stats WHERE run_id = 'same-id'")
    assert {r["launch_id"] for r in ingested} == {r["launch_id"] for r in stored} == own


def test_a_rerun_of_a_completed_run_launches_nothing_for_a_document_over_the_context(prefect_api,
                                                                                     tmp_path: Path) -> None:
    from flows.nightly import nightly

    run = params(tmp_path, write_corpus(tmp_path / "news.parquet", 3, huge=True), run_id="over-context",
                 max_chars=None, workers=1, shards=2, window=2, commit_every_s=0)
    assert nightly(**run.model_dump()).shard_attempts == 2
    rerun = nightly(**run.model_dump())
    assert (rerun.shard_attempts, rerun.done, rerun.skipped_done) == (0, 0, 3)
    db = Database(run.db_path)
    assert db.get_run("over-context")["status"] == "completed"
    rejected = db.query("SELECT doc_id, reject_reason FROM documents WHERE run_id = ? AND status = 'rejected'",
                        ["over-context"])
    assert rejected == [{"doc_id": "huge", "reject_reason": "over_context"}]
    assert len(attempts(db, "over-context")) == 2


def test_a_mistyped_pair_exits_2_with_one_line_and_writes_no_run(prefect_api, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "news.parquet", 2)
    db_path = tmp_path / "sidecar.duckdb"
    command = [sys.executable, "-m", "cli", "nightly", "--corpus", str(corpus), "--pair", "tinyy", "--db",
               str(db_path), "--run-id", "typo", "--workers", "1", "--shards", "2", "--no-judge", "--no-cost-report"]
    env = os.environ | prefect_api | {"PYTHONPATH": str(REPO), "COLUMNS": "200"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "tinyy" in errors[0], output
    assert "Traceback" not in output
    assert not db_path.exists() or Database(db_path).get_run("typo") is None
