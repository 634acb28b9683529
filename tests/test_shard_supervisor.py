"""flows.shard_supervisor against a real DuckDB file and real part files, with a scripted launcher at the edge
(what a work pool's flow runs would report): a shard waiting for a worker or for its accelerator is not stalled,
a running one that writes nothing is, and the parent lists parts at the commit cadence, not at every poll."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
from shard_parts import both_modes

from flows.nightly_params import NightlyParams
from flows.shard_launch import ShardLaunch, ShardStatus
from flows.shard_supervisor import ShardSupervisor
from pipeline import RunCounts, Shard
from storage import Database, Document, PartStore, ShardInfo

RUN = "run-1"
MODES = ["sidecar", "standalone"]
DOCS = [Document(f"d{i}", f"Text of document {i}.", i, title=f"Title {i}") for i in range(4)]


# a step of a scripted attempt: a status, or "device": running, and waiting for its accelerator
Step = ShardStatus | Literal["device"]


@dataclass
class ScriptedShard:
    """An attempt whose status follows ``script``: (status, seconds) steps from its launch, the last one for
    good. In a ``device`` step it runs and says it waits for its accelerator; entering ``running`` it says it
    holds it and writes its documents' outputs as one part, as a shard would; a ``killed_writer`` leaves only
    the temporary file of that part, as a SIGKILL mid-write does."""

    launch: ShardLaunch
    store: PartStore
    script: list[tuple[Step, float]]
    killed_writer: bool = False
    launched: float = field(default_factory=time.monotonic)
    waiting: bool = False
    wrote: bool = False
    cancelled: bool = False
    flow_run_id: str | None = None

    def status(self) -> ShardStatus:
        if self.cancelled:
            return "crashed"
        elapsed, status = time.monotonic() - self.launched, self.script[-1][0]
        for step, seconds in self.script:
            if elapsed < seconds:
                status = step
                break
            elapsed -= seconds
        if status == "device":
            if not self.waiting:
                self.store.write_device_state(RUN, self.launch.launch_id, "waiting")
                self.waiting = True
            return "running"
        if status in ("running", "completed") and self.waiting:
            self.store.write_device_state(RUN, self.launch.launch_id, "held")
            self.waiting = False
        if status != "queued" and not self.wrote and self.killed_writer:
            directory = Path(self.store.launch_dir(RUN, self.launch.launch_id))
            (directory / ".part-000001.parquet.tmp-0123abcd").write_bytes(b"PAR1 half a part")
            self.wrote = True
        if status in ("running", "completed") and not self.wrote:
            manifest = self.store.read_manifest(RUN, self.launch.launch_id)
            info = ShardInfo(RUN, self.launch.launch_id, self.launch.shard, self.launch.attempt, "gpu-a", "cuda:0",
                             "NVIDIA H100", manifest.run_nonce)
            self.store.writer(info, manifest.docs).write([r for d in manifest.docs for r in both_modes(d.doc_id)], [])
            self.wrote = True
        return status

    def cancel(self) -> None:
        self.cancelled = True


class ScriptedLauncher:
    def __init__(self, store: PartStore, *scripts: list[tuple[Step, float]],
                 killed_writers: frozenset[int] = frozenset()) -> None:
        self.store, self.scripts, self.killed_writers, self.handles = store, list(scripts), killed_writers, []

    def launch(self, launch: ShardLaunch) -> ScriptedShard:
        n = len(self.handles)
        handle = ScriptedShard(launch, self.store, self.scripts[n], killed_writer=n in self.killed_writers)
        self.handles.append(handle)
        return handle

    def wait(self, timeout_s: float) -> None:
        time.sleep(min(timeout_s, 0.05))


class CountingStore(PartStore):
    """A real part store that counts its listings."""

    listings = 0

    def parts(self, run_id: str) -> list[str]:
        self.listings += 1
        return super().parts(run_id)


@pytest.fixture
def db(tmp_path: Path) -> Database:
    db = Database(tmp_path / "sidecar.duckdb")
    db.begin_run(RUN, {"workers": 2}, "tiny", None, None, 4, 2, DOCS, [], code_version="test")
    return db


def supervise(db: Database, store: PartStore, launcher: ScriptedLauncher, counts: RunCounts | None = None,
              **params) -> tuple[list[Document], int]:
    params = NightlyParams(**({"corpus": "news.parquet", "pair": "tiny", "modes": MODES, "db_path": str(db.path),
                               "shard_retries": 0, "shard_deployment": "nightly-shard/nightly-shard"} | params))
    counts = counts or RunCounts(RUN)
    shards = [Shard(0, DOCS[:2], 20), Shard(1, DOCS[2:], 20)]
    missing = ShardSupervisor(db, store, launcher, params, RUN, db.get_run(RUN)["nonce"], max_running=2, counts=counts,
                              logger=logging.getLogger("test")).run(shards)
    return missing, counts.shard_attempts


def attempts(db: Database) -> list[tuple[int, str]]:
    return [(r["shard"], r["status"]) for r in db.query(
        f"SELECT shard, status FROM shard_attempts WHERE run_id = '{RUN}' ORDER BY shard, attempt")]


def test_a_shard_waiting_for_a_worker_is_not_stalled_however_long_it_waits(db: Database) -> None:
    store = PartStore.beside(db.path)
    # shard 1 waits for a worker four times the stall limit, then runs and completes
    launcher = ScriptedLauncher(store, [("running", 0.3), ("completed", 0)],
                                [("queued", 2.0), ("running", 0.3), ("completed", 0)])
    missing, launched = supervise(db, store, launcher, shard_stall_s=0.5, commit_every_s=0)
    assert (missing, launched) == ([], 2)
    assert attempts(db) == [(0, "completed"), (1, "completed")]
    assert not any(h.cancelled for h in launcher.handles)
    assert db.done_doc_ids(RUN, MODES) == {d.doc_id for d in DOCS}


def test_a_shard_waiting_for_its_accelerator_is_not_stalled_and_its_wait_is_reported(db: Database, caplog) -> None:
    store = PartStore.beside(db.path)
    # shard 1 waits for its accelerator four times the stall limit, then holds it, writes its part and completes
    launcher = ScriptedLauncher(store, [("running", 0.3), ("completed", 0)],
                                [("device", 2.0), ("running", 0.3), ("completed", 0)])
    counts = RunCounts(RUN)
    with caplog.at_level(logging.INFO, logger="test"):
        missing, launched = supervise(db, store, launcher, counts, shard_stall_s=0.5, commit_every_s=0)
    assert (missing, launched) == ([], 2)
    assert attempts(db) == [(0, "completed"), (1, "completed")]
    assert not any(h.cancelled for h in launcher.handles)
    # its own state, in the logs and in the run's summary
    said = caplog.messages
    assert any("waits for its accelerator (another run may hold it): not a stall" in m for m in said), said
    assert any("still waits for its accelerator after" in m for m in said), said
    assert any(m.endswith("shards: 1 waiting for a device, 1 settled") for m in said), said
    assert any("holds its accelerator after waiting" in m for m in said), said
    assert 1.5 < counts.device_wait_seconds < 3.0, counts.device_wait_seconds
    assert f"after waiting {counts.device_wait_seconds:.0f} s in all for accelerators" in counts.markdown()


def test_a_shard_that_holds_its_accelerator_and_writes_nothing_is_stalled(db: Database) -> None:
    store = PartStore.beside(db.path)
    # shard 1 waited for its accelerator, holds it since, and writes nothing for twice the stall limit
    launcher = ScriptedLauncher(store, [("completed", 0)], [("device", 0.5), ("running", 60.0)],
                                killed_writers=frozenset({1}))
    missing, _ = supervise(db, store, launcher, shard_stall_s=0.5, commit_every_s=0)
    assert [d.doc_id for d in missing] == ["d2", "d3"]
    assert attempts(db) == [(0, "completed"), (1, "cancelled")]


def test_a_running_shard_with_no_new_part_is_cancelled_as_stalled(db: Database) -> None:
    store = PartStore.beside(db.path)
    # shard 1's worker took it and it wrote its one part, then nothing more for twice the stall limit
    launcher = ScriptedLauncher(store, [("completed", 0)], [("queued", 0.5), ("running", 60.0)])
    missing, _ = supervise(db, store, launcher, shard_stall_s=0.5, commit_every_s=0)
    assert missing == [], "its part had every document: cancelled, and settled by what it wrote"
    assert attempts(db) == [(0, "completed"), (1, "cancelled")]
    assert launcher.handles[1].cancelled
    [error] = [r["error"] for r in db.query(f"SELECT error FROM shard_attempts WHERE run_id = '{RUN}' AND shard = 1")]
    assert "stalled" in error


def test_the_parent_lists_parts_at_the_commit_cadence_not_at_every_poll(db: Database) -> None:
    store = CountingStore.beside(db.path)
    launcher = ScriptedLauncher(store, [("running", 1.5), ("completed", 0)], [("running", 1.5), ("completed", 0)])
    started = time.monotonic()
    missing, _ = supervise(db, store, launcher, shard_stall_s=60, commit_every_s=0.5)
    wall_s = time.monotonic() - started
    assert missing == []
    polls = wall_s / 0.05
    # one listing per commit interval, plus one as each attempt ends and one at the end
    assert store.listings <= wall_s / 0.5 + 1 + 2 + 1 < polls / 3, (store.listings, polls)


def test_a_crashed_attempt_is_relaunched_and_its_killed_writers_temporary_file_removed(db: Database) -> None:
    store = PartStore.beside(db.path)
    # launches: shard 0, shard 1 (killed mid-write, then crashed), shard 1 again
    launcher = ScriptedLauncher(store, [("completed", 0)], [("running", 0.3), ("crashed", 0)], [("completed", 0)],
                                killed_writers=frozenset({1}))
    missing, launched = supervise(db, store, launcher, shard_stall_s=60, commit_every_s=0, shard_retries=1)
    assert (missing, launched) == ([], 3)
    assert attempts(db) == [(0, "completed"), (1, "crashed"), (1, "completed")]
    assert db.done_doc_ids(RUN, MODES) == {d.doc_id for d in DOCS}
    crashed = Path(store.launch_dir(RUN, launcher.handles[1].launch.launch_id))
    assert [p.name for p in crashed.iterdir()] == ["manifest.parquet"]
