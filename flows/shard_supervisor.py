"""The parent's side of a sharded run: launch the shards' attempts, ingest the parts they write as they
appear, relaunch an attempt that failed, crashed or stalled with only its documents not yet in the database,
and say at the end which documents are missing.

Invariants: the parent is the only process that writes the database, and everything an attempt finished
reaches it (parts are ingested idempotently, ``Database.ingest_parts``), whatever happens to the attempt
later. A shard is settled when one of its attempts completed (every document of its manifest is in its
parts: outputs, or rejects) or when the database has every mode of each of its documents; it is given up
after ``shard_retries`` relaunches, its unfinished documents then missing from the run.

A lost attempt costs at most its documents in flight plus ``commit_every_s`` of finished ones (the cadence
of its parts); the parent lists and ingests new parts at that cadence too (every poll when it is 0, and at
least four times per ``shard_stall_s``), and always before it decides what an ended attempt left undone.
An attempt's stall clock runs from when a worker took it: waiting in its pool's queue is not a stall, and
neither is waiting for its accelerator while another run holds it (the attempt says so in its launch
directory, ``PartStore.write_device_state``): that wait lasts as long as ``device_wait_s`` allows, and the
clock starts again once the attempt holds the device. Each shard's phase (to launch, queued for a worker,
waiting for a device, running, settled, given up) is logged as the counts change, and the seconds attempts
waited for their devices are in the run's summary.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from flows.nightly_params import NightlyParams
from flows.shard_launch import FINAL_STATUSES, ShardHandle, ShardLaunch, ShardLauncher, new_launch_id
from pipeline import RunCounts, Shard
from storage import Database, Document
from storage.parts import DeviceState, Manifest, PartStore

# how often the parent looks at its attempts; it looks at once when its launcher sees one end
POLL_S = 0.5
# the missing documents a failed run's error names before it only counts them
NAMED_MISSING = 5
# where a shard can be (ShardAttempts.phase), in the order the parent lists them
PHASES = ("to launch", "queued for a worker", "waiting for a device", "running", "settled", "given up")


class IncompleteRunError(RuntimeError):
    """A sharded run ended with documents that no attempt finished; the run is marked failed, its finished
    documents kept, and a rerun with the same run id does only the missing ones."""


def missing_error(missing: list[Document], retries: int) -> str:
    names = ", ".join(repr(d.doc_id) for d in missing[:NAMED_MISSING])
    more = f" and {len(missing) - NAMED_MISSING} more" if len(missing) > NAMED_MISSING else ""
    return (f"{len(missing)} documents not finished after {retries} relaunches per shard: {names}{more}; "
            f"rerun the same run id to do only them")


@dataclass
class ShardAttempts:
    """One shard and its attempts so far: the documents its next or running attempt gets, and the attempt."""

    shard: Shard
    docs: list[Document]
    attempts: int = 0
    launch: ShardLaunch | None = None
    handle: ShardHandle | None = None
    # when the running attempt last showed life: a worker taking it, a new part
    last_change: float = 0.0
    # since when the attempt waits for a worker (None: one took it), and when the parent last said so
    queued_since: float | None = None
    queue_warned: float = 0.0
    parts_seen: int = 0
    # what the running attempt last said of its accelerator, since when it waits for it, when the parent last
    # said so and last read what it says
    device: DeviceState | None = None
    device_wait_since: float | None = None
    device_warned: float = 0.0
    device_read: float = float("-inf")
    recorded_flow_run_id: str | None = None
    state: Literal["waiting", "running", "settled", "given_up"] = "waiting"
    errors: list[str] = field(default_factory=list)

    def phase(self) -> str:
        """Where the shard is, in words."""
        if self.state != "running":
            return {"waiting": "to launch", "settled": "settled", "given_up": "given up"}[self.state]
        if self.queued_since is not None:
            return "queued for a worker"
        return "waiting for a device" if self.device == "waiting" else "running"


class ShardSupervisor:
    """Runs ``shards`` of run ``run_id`` to the end through ``launcher``, at most ``max_running`` at once."""

    def __init__(self, db: Database, store: PartStore, launcher: ShardLauncher, params: NightlyParams, run_id: str,
                 run_nonce: str, max_running: int, counts: RunCounts,
                 logger: logging.Logger | logging.LoggerAdapter) -> None:
        self.db, self.store, self.launcher, self.params, self.run_id = db, store, launcher, params, run_id
        self.run_nonce = run_nonce
        self.max_running, self.counts, self.logger = max_running, counts, logger
        # the run's parts as last listed: how many, and how many of each attempt (by launch id)
        self.last_list = float("-inf")
        self.parts_listed = 0
        self.parts_per_launch: Counter[str] = Counter()
        # parts refused once (another start's, other texts): not listed again, so refused and logged once
        self.refused: set[str] = set()
        self.list_every_s = min(params.commit_every_s, params.shard_stall_s / 4)
        # every attempt launched, for the temporary files a killed writer of one left
        self.launched: list[tuple[ShardLaunch, ShardHandle]] = []
        self.phases_said = ""

    def run(self, shards: list[Shard]) -> list[Document]:
        """Every shard settled or given up; returns the documents of the given-up shards still missing."""
        states = [ShardAttempts(shard, list(shard.docs)) for shard in shards]
        try:
            while any(s.state in ("waiting", "running") for s in states):
                self._launch_waiting(states)
                self.launcher.wait(POLL_S)
                self.ingest(due_only=True)
                for state in states:
                    if state.state == "running":
                        self._check(state)
                self._say_phases(states)
        finally:
            self._cancel_running(states)
        self.ingest()
        self._remove_temporary()
        return [doc for s in states if s.state == "given_up" for doc in s.docs]

    # -- launching --

    def _launch_waiting(self, states: list[ShardAttempts]) -> None:
        running = sum(s.state == "running" for s in states)
        for state in states:
            if running >= self.max_running:
                return
            if state.state == "waiting":
                self._launch(state)
                running += 1

    def _launch(self, state: ShardAttempts) -> None:
        state.attempts += 1
        index = state.shard.index
        launch = ShardLaunch(run_id=self.run_id, launch_id=new_launch_id(index, state.attempts), shard=index,
                             attempt=state.attempts, results_uri=self.store.uri,
                             params=self.params.model_dump(mode="json"))
        self.store.write_manifest(self.run_id, launch.launch_id, Manifest(self.run_nonce, state.docs))
        self.logger.info("run %s: shard %d attempt %d (%s): %d documents", self.run_id, index, state.attempts,
                         launch.launch_id, len(state.docs))
        state.launch, state.handle = launch, self.launcher.launch(launch)
        self.launched.append((launch, state.handle))
        self._record(state)
        state.last_change = state.queue_warned = time.monotonic()
        state.parts_seen, state.queued_since, state.state = 0, None, "running"
        state.device, state.device_wait_since, state.device_read = None, None, float("-inf")
        self.counts.shard_attempts += 1

    # -- watching --

    def _check(self, state: ShardAttempts) -> None:
        assert state.handle is not None and state.launch is not None
        status = state.handle.status()
        if status == "queued":
            self._queued(state)
        elif status == "running":
            self._running(state)
        else:
            self._ended(state, status, None if status == "completed" else f"the attempt ended {status}")

    def _queued(self, state: ShardAttempts) -> None:
        """No worker has taken the attempt yet (its pool is busy with other shards or runs): the stall clock
        waits too, and the parent says so once per ``shard_stall_s``."""
        assert state.launch is not None
        now = time.monotonic()
        if state.queued_since is None:
            state.queued_since = now
        if now - state.queue_warned > self.params.shard_stall_s:
            self.logger.warning("run %s: %s still waits for a worker after %.0f s", self.run_id,
                                state.launch.launch_id, now - state.queued_since)
            state.queue_warned = now
        state.last_change = now

    def _running(self, state: ShardAttempts) -> None:
        assert state.handle is not None and state.launch is not None
        state.queued_since = None
        parts = self.parts_per_launch[state.launch.launch_id]
        if parts > state.parts_seen:
            if state.device != "held":  # a part was written on the device, whether or not the parent read so
                self._device_changed(state, "held", time.monotonic())
            state.parts_seen, state.last_change = parts, time.monotonic()
        elif self._waits_for_device(state):
            return
        elif time.monotonic() - state.last_change > self.params.shard_stall_s:
            self.logger.warning("run %s: %s stalled (no new part for %g s); cancelling it", self.run_id,
                                state.launch.launch_id, self.params.shard_stall_s)
            state.handle.cancel()
            self._ended(state, "cancelled", f"stalled: no new part for {self.params.shard_stall_s:g} s")

    def _waits_for_device(self, state: ShardAttempts) -> bool:
        """Whether the running attempt, with no new part, waits for its accelerator: then the stall clock
        waits too, and the parent says so once per ``shard_stall_s``. Read at the listing cadence."""
        assert state.launch is not None
        now = time.monotonic()
        if state.device != "held" and now - state.device_read >= self.list_every_s:
            state.device_read = now
            said = self.store.read_device_state(self.run_id, state.launch.launch_id)
            if said is not None and said != state.device:
                self._device_changed(state, said, now)
        if state.device != "waiting":
            return False
        state.last_change = now
        if now - state.device_warned > self.params.shard_stall_s:
            self.logger.warning("run %s: %s still waits for its accelerator after %.0f s (not a stall)", self.run_id,
                                state.launch.launch_id, now - (state.device_wait_since or now))
            state.device_warned = now
        return True

    def _device_changed(self, state: ShardAttempts, said: DeviceState, now: float) -> None:
        assert state.launch is not None
        if said == "waiting":
            self.logger.info("run %s: %s waits for its accelerator (another run may hold it): not a stall; its "
                             "stall clock starts once it holds it", self.run_id, state.launch.launch_id)
            state.device_wait_since = state.device_warned = now
        else:
            if state.device == "waiting":
                self.logger.info("run %s: %s holds its accelerator after waiting %.0f s", self.run_id,
                                 state.launch.launch_id, self._end_device_wait(state, now))
            state.last_change = now
        state.device = said

    def _end_device_wait(self, state: ShardAttempts, now: float) -> float:
        """Count the attempt's wait for its device, if it waited, in the run's summary; returns its seconds."""
        waited = now - state.device_wait_since if state.device_wait_since is not None else 0.0
        self.counts.device_wait_seconds += waited
        state.device_wait_since = None
        return waited

    def _say_phases(self, states: list[ShardAttempts]) -> None:
        """Log how many shards are in each phase, when that changes."""
        phases = Counter(s.phase() for s in states)
        said = ", ".join(f"{phases[phase]} {phase}" for phase in PHASES if phases[phase])
        if said != self.phases_said:
            self.logger.info("run %s: shards: %s", self.run_id, said)
            self.phases_said = said

    def _ended(self, state: ShardAttempts, status: str, error: str | None) -> None:
        """Record how the attempt ended and decide what follows: settled, relaunched with what is left, or
        given up."""
        assert state.handle is not None and state.launch is not None
        self._end_device_wait(state, time.monotonic())
        self.ingest()  # its last parts: what it finished is in the database before the rest is decided
        if state.recorded_flow_run_id is None:
            self._record(state)
        self.db.finish_attempt(self.run_id, state.launch.launch_id, status, error=error)
        index = state.shard.index
        if status == "completed":
            state.state, state.docs = "settled", []
            return
        state.errors.append(f"{state.launch.launch_id}: {error}")
        done = self.db.done_doc_ids(self.run_id, list(self.params.modes))
        state.docs = [d for d in state.docs if d.doc_id not in done]
        if not state.docs:
            state.state = "settled"
        elif state.attempts <= self.params.shard_retries:
            self.logger.warning("run %s: shard %d attempt %d %s; relaunching it with its %d unfinished documents",
                                self.run_id, index, state.attempts, status, len(state.docs))
            state.state = "waiting"
        else:
            self.logger.error("run %s: shard %d gave up after %d attempts (%s); %d documents unfinished",
                              self.run_id, index, state.attempts, "; ".join(state.errors), len(state.docs))
            state.state = "given_up"

    def _record(self, state: ShardAttempts) -> None:
        """The attempt in ``shard_attempts``, with its flow run once the launcher knows it."""
        assert state.handle is not None and state.launch is not None
        state.recorded_flow_run_id = state.handle.flow_run_id
        self.db.record_attempt(self.run_id, state.launch.launch_id, state.shard.index, state.attempts,
                               docs=len(state.docs), flow_run_id=state.recorded_flow_run_id)

    def _cancel_running(self, states: list[ShardAttempts]) -> None:
        """The parent is leaving (an error, an interrupt): stop what still runs, so no attempt outlives it."""
        for state in states:
            if state.state == "running" and state.handle is not None and state.handle.status() not in FINAL_STATUSES:
                state.handle.cancel()

    # -- parts --

    def _remove_temporary(self) -> None:
        """Delete what killed writers left: the temporary files of every attempt whose flow run is over (one
        still stopping, a cancelled flow run on a worker, keeps its files)."""
        removed = sum(self.store.remove_temporary(self.run_id, launch.launch_id) for launch, handle in self.launched
                      if handle.status() in FINAL_STATUSES)
        if removed:
            self.logger.info("run %s: removed %d temporary part files of killed writers", self.run_id, removed)

    def ingest(self, due_only: bool = False) -> None:
        """List the run's parts and ingest the new ones; with ``due_only``, only once a listing is due."""
        now = time.monotonic()
        if due_only and now - self.last_list < self.list_every_s:
            return
        listed = [path for path in self.store.parts(self.run_id) if path not in self.refused]
        self.last_list = now
        if len(listed) == self.parts_listed:
            return
        self.parts_per_launch = Counter(self.store.part_name(self.run_id, p).split("/", 1)[0] for p in listed)
        with self.counts.timed("storage"):
            result = self.db.ingest_parts(self.run_id, self.store, paths=listed)
        self.parts_listed = len(listed) - len(result.refused)
        self.refused.update(result.refused)
        self.counts.parts += result.parts
        if result.parts:
            self.counts.commits += 1
