"""Several processes on one database file: lock retries, DatabaseLockedError, and atomic batches.

The second process is real (a subprocess running DuckDB), because DuckDB's file lock only conflicts
between processes.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import duckdb
import pytest

from storage import Database, DatabaseLockedError, LockHeldError, OutputRecord, RequestStats, SidecarRecord
from storage.connection import RetryPolicy, attach_file, parse_lock_holder

pytestmark = pytest.mark.servers  # writers and readers in other processes

REPO_ROOT = Path(__file__).resolve().parent.parent
FAST_GIVE_UP = RetryPolicy(attempts=4, first_delay_s=0.01, max_delay_s=0.05)
PATIENT = RetryPolicy(attempts=40, first_delay_s=0.02, max_delay_s=0.25)


def output(doc_id: str, mode: str, phase: str = "main") -> OutputRecord:
    return OutputRecord(doc_id=doc_id, mode=mode, summary="S.", sidecars=[SidecarRecord.of("hashtags", "#a", ["#a"])],
                        stats=[RequestStats(phase, new_tokens=3, wall_s=0.1)])


def spawn(code: str, *args: str) -> subprocess.Popen[str]:
    """Run ``code`` in a new Python process; it prints one line once it holds what the test needs."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)


def wait_ready(child: subprocess.Popen[str]) -> None:
    line = child.stdout.readline()
    assert line.strip() == "ready", f"child failed: {line!r} {child.stderr.read() if child.poll() else ''}"


HOLD_LOCK_UNTIL_STDIN_CLOSES = """
    import sys, duckdb
    con = duckdb.connect(sys.argv[1])
    print("ready", flush=True)
    sys.stdin.read()
"""

HOLD_LOCK_FOR_SECONDS = """
    import sys, time, duckdb
    con = duckdb.connect(sys.argv[1])
    print("ready", flush=True)
    time.sleep(float(sys.argv[2]))
    con.close()
"""


@pytest.fixture
def db(tmp_path: Path) -> Database:
    database = Database(tmp_path / "shared.duckdb", retry=FAST_GIVE_UP)
    database.start_run("run-1", {}, "tiny", "cpu", "cpu", 4, 2, code_version="test")
    return database


def test_lock_message_parsing() -> None:
    message = ('IO Error: Could not set lock on file "/tmp/x.duckdb": Conflicting lock is held in '
               "/usr/bin/python3.11 (PID 4242) by user root. See also https://duckdb.org/docs/current/connect/")
    holder = parse_lock_holder(message)
    assert (holder.pid, holder.process) == (4242, "/usr/bin/python3.11")
    assert parse_lock_holder("IO Error: Could not set lock on file") == parse_lock_holder("")


def test_writer_retries_then_names_the_process_holding_the_lock(db: Database,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    attempts: list[str] = []
    real_attach = attach_file

    def counting_attach(host, path, alias):
        attempts.append(path)
        real_attach(host, path, alias)

    monkeypatch.setattr("storage.connection.attach_file", counting_attach)
    holder = spawn(HOLD_LOCK_UNTIL_STDIN_CLOSES, str(db.path))
    try:
        wait_ready(holder)
        with pytest.raises(DatabaseLockedError) as caught:
            db.write_batch("run-1", [output("d1", "sidecar")])
        error = caught.value
        assert error.holder_pid == holder.pid
        assert f"PID {holder.pid}" in str(error) and str(db.path) in str(error)
        assert error.holder_process and "python" in error.holder_process
        assert error.attempts == FAST_GIVE_UP.attempts == len(attempts)
        # readers queue behind the same lock
        with pytest.raises(DatabaseLockedError):
            db.results()
    finally:
        holder.communicate(timeout=30)
    monkeypatch.undo()
    assert db.query("SELECT count(*) AS n FROM outputs")[0]["n"] == 0


def test_writer_waits_out_a_short_lock(db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    patient = Database(db.path, retry=PATIENT)
    attempts: list[str] = []
    monkeypatch.setattr("storage.connection.attach_file",
                        lambda *a: attempts.append("try") or attach_file(*a))
    holder = spawn(HOLD_LOCK_FOR_SECONDS, str(db.path), "0.7")
    try:
        wait_ready(holder)
        patient.write_batch("run-1", [output("d1", "sidecar"), output("d1", "standalone")])
    finally:
        holder.communicate(timeout=30)
    assert len(attempts) > 1, "the lock should have been met at least once"
    assert holder.returncode == 0
    assert [r["doc_id"] for r in patient.results("run-1")] == ["d1"]


def test_a_batch_failing_midway_leaves_nothing_visible(db: Database) -> None:
    db.write_batch("run-1", [output("d0", "sidecar"), output("d0", "standalone")])
    # outputs insert fine; the stats row then breaks the phase CHECK inside the same transaction
    broken = [output("d1", "sidecar"), output("d1", "standalone", phase="not-a-phase")]
    with pytest.raises(duckdb.ConstraintException):
        db.write_batch("run-1", broken)
    assert db.query("SELECT DISTINCT doc_id FROM outputs") == [{"doc_id": "d0"}]
    assert db.query("SELECT count(*) AS n FROM request_stats WHERE doc_id = 'd1'")[0]["n"] == 0
    assert [r["doc_id"] for r in db.results()] == ["d0"]


KILLED_MIDWAY = """
    import sys, duckdb
    con = duckdb.connect(sys.argv[1])
    con.execute("BEGIN TRANSACTION")
    for mode in ("sidecar", "standalone"):
        con.execute(
            "INSERT INTO outputs (run_id, doc_id, mode, summary) VALUES ('run-1', 'half', ?, 'S.')", [mode])
    print("ready", flush=True)
    sys.stdin.read()
"""


def test_a_writer_killed_inside_its_transaction_leaves_nothing_visible(db: Database) -> None:
    db.write_batch("run-1", [output("whole", "sidecar"), output("whole", "standalone")])
    writer = spawn(KILLED_MIDWAY, str(db.path))
    try:
        wait_ready(writer)
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        writer.communicate(timeout=30)
    assert writer.returncode == -signal.SIGKILL
    reopened = Database(db.path, retry=PATIENT)
    assert [r["doc_id"] for r in reopened.results()] == ["whole"]
    assert reopened.query("SELECT count(*) AS n FROM outputs WHERE doc_id = 'half'")[0]["n"] == 0


READER = """
    import sys, json
    from storage import Database, RetryPolicy
    db = Database(sys.argv[1], retry=RetryPolicy(attempts=200, first_delay_s=0.005, max_delay_s=0.05))
    print("ready", flush=True)
    seen = []
    while True:
        seen.append(len(db.results("run-1")))
        if seen[-1] >= int(sys.argv[2]):
            break
    print(json.dumps(seen), flush=True)
"""


def test_a_concurrent_reader_only_ever_sees_whole_batches(db: Database) -> None:
    batches, per_batch = 12, 3
    writer_db = Database(db.path, retry=RetryPolicy(attempts=200, first_delay_s=0.005, max_delay_s=0.05))
    reader = spawn(READER, str(db.path), str(batches * per_batch))
    try:
        wait_ready(reader)
        for b in range(batches):
            docs = [f"b{b}-d{i}" for i in range(per_batch)]
            writer_db.write_batch("run-1", [output(d, m) for d in docs for m in ("sidecar", "standalone")])
            time.sleep(0.02)
        out, err = reader.communicate(timeout=120)
    finally:
        if reader.poll() is None:
            reader.kill()
    assert reader.returncode == 0, err
    seen = json.loads(out.strip().splitlines()[-1])
    assert len(set(seen)) > 2, "the reader should have read between batches"
    assert all(n % per_batch == 0 for n in seen), seen


def test_threads_of_one_process_share_the_file_and_release_it_when_done(db: Database) -> None:
    threads, batches = 6, 5
    failures: list[BaseException] = []

    def write(thread: int) -> None:
        try:
            for b in range(batches):
                doc = f"t{thread}-b{b}"
                db.write_batch("run-1", [output(doc, "sidecar"), output(doc, "standalone")])
                db.results("run-1")
        except BaseException as exc:  # a thread cannot raise into the test: collected, asserted below
            failures.append(exc)

    workers = [threading.Thread(target=write, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert not failures, failures
    assert len(db.results("run-1")) == threads * batches
    # the last transaction detached the file: another process can take the lock at once
    reader = subprocess.run([sys.executable, "-c", "import sys, duckdb; con = duckdb.connect(sys.argv[1]); "
                             "print(con.execute('SELECT count(*) FROM outputs').fetchone()[0])", str(db.path)],
                            capture_output=True, text=True, timeout=60)
    assert reader.stdout.strip() == str(2 * threads * batches), reader.stderr


def test_a_connection_this_process_holds_is_named_as_the_holder(db: Database) -> None:
    raw = duckdb.connect(str(db.path))
    try:
        with pytest.raises(DatabaseLockedError) as caught:
            db.write_batch("run-1", [output("d1", "sidecar")])
        assert caught.value.holder_pid == os.getpid()
        assert "this process" in str(caught.value)
    finally:
        raw.close()
    db.write_batch("run-1", [output("d1", "sidecar"), output("d1", "standalone")])
    assert [r["doc_id"] for r in db.results("run-1")] == ["d1"]


HOLD_RUN_UNTIL_STDIN_CLOSES = """
    import sys
    from storage import Database
    with Database(sys.argv[1]).running(sys.argv[2]):
        print("ready", flush=True)
        sys.stdin.read()
"""


def test_a_run_held_by_another_process_is_refused_naming_it_until_that_process_dies(db: Database) -> None:
    holder = spawn(HOLD_RUN_UNTIL_STDIN_CLOSES, str(db.path), "run-1")
    try:
        wait_ready(holder)
        with pytest.raises(LockHeldError) as refused, db.running("run-1"):
            pytest.fail("two processes ran run-1 at once")
        assert refused.value.holder.pid == holder.pid and refused.value.holder.host == socket.gethostname()
        assert f"PID {holder.pid} on {socket.gethostname()}" in str(refused.value) and "refused" in str(refused.value)
        started = time.monotonic()
        heard: list[int | None] = []
        with pytest.raises(LockHeldError, match="gave up after waiting"), \
                db.running("run-1", wait_s=0.6, on_wait=lambda h, _: heard.append(h.pid)):
            pytest.fail("two processes ran run-1 at once")
        assert time.monotonic() - started >= 0.6 and heard and set(heard) == {holder.pid}
        with db.running("another run"):  # one lock per run id
            pass
        os.kill(holder.pid, signal.SIGKILL)  # no chance to let go: the kernel drops the lock
        holder.wait(timeout=30)
        with db.running("run-1", wait_s=10):
            assert db.get_run("run-1")["status"] == "running"
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.communicate(timeout=30)


HOLD_READ_ONLY_FOR_SECONDS = """
    import sys, time, duckdb
    con = duckdb.connect(sys.argv[1], read_only=True)
    print("ready", flush=True)
    time.sleep(float(sys.argv[2]))
    con.close()
"""


def test_a_patient_writer_waits_out_a_reader_and_logs_who_holds_the_file(db: Database, caplog) -> None:
    patient = Database(db.path, retry=RetryPolicy(wait_s=60))
    reader = spawn(HOLD_READ_ONLY_FOR_SECONDS, str(db.path), "7")
    try:
        wait_ready(reader)
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="storage.connection"):
            patient.write_batch("run-1", [output("d1", "sidecar"), output("d1", "standalone")])
        assert time.monotonic() - started > 5, "the reader should have kept the writer waiting"
    finally:
        reader.communicate(timeout=30)
    assert reader.returncode == 0
    assert [r["doc_id"] for r in patient.results("run-1")] == ["d1"]
    assert any(f"PID {reader.pid}" in record.getMessage() for record in caplog.records), caplog.text


def test_writes_deferred_past_a_locked_file_are_committed_by_the_next_open(db: Database) -> None:
    db.write_batch("run-1", [output("d0", "sidecar"), output("d0", "standalone")])
    runner = spawn(HOLD_RUN_UNTIL_STDIN_CLOSES, str(db.path), "run-1")
    try:
        wait_ready(runner)
        holder = spawn(HOLD_LOCK_UNTIL_STDIN_CLOSES, str(db.path))
        try:
            wait_ready(holder)
            with pytest.raises(DatabaseLockedError):
                db.write_batch("run-1", [output("d1", "sidecar"), output("d1", "standalone")])
            # what a run that gave up on the lock does, as its last act
            db.defer_batch("run-1", [output("d1", "sidecar"), output("d1", "standalone")], finish="failed",
                           error="DatabaseLockedError: locked by a notebook")
        finally:
            holder.communicate(timeout=30)
        # while a process holds the run, another one's open leaves its writes alone
        assert [r["doc_id"] for r in Database(db.path).results("run-1")] == ["d0"]
    finally:
        runner.communicate(timeout=30)
    reopened = Database(db.path)
    assert [r["doc_id"] for r in reopened.results("run-1")] == ["d0", "d1"]
    run = reopened.get_run("run-1")
    assert run["status"] == "failed" and "locked by a notebook" in run["error"] and run["finished_at"]
    assert not list(reopened.runs_dir.glob("*.pending")), "a deferred write is committed once"
    reopened.start_run("run-1", {}, "tiny", "cpu", "cpu", 4, 2, code_version="test")  # a resume
    assert Database(db.path).get_run("run-1")["status"] == "running"
