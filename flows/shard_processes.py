"""Shard attempts as processes on this machine: ``sidecar nightly --workers N``.

Each attempt is ``python -m flows.nightly_shard`` in a process group of its own, on one of ``workers`` slots:
slot ``i`` gets the ``i``-th visible GPU (``CUDA_VISIBLE_DEVICES``), or without one the ``i``-th share of
the cores (its torch threads, and an accelerator lock of its own, ``sidecar.models.devices.CPU_SLOT_ENV``), and
the concurrency limit ``gpu-<host>-<i>`` on a Prefect server. It talks to the parent's Prefect API
(``PREFECT_API_URL``), so its flow run is listed beside the parent's, also on the embedded API. A parent on
its embedded API says so to its attempts (``SIDECAR_EMBEDDED_API=1``, ``flows.embedded.on_embedded_api``):
no limit exists there, so they hold only their slot's accelerator lock, as an in-process run does. An
attempt ends with the parent, however the parent ends (``server.tether``): a rerun of the parent relaunches
it.

Its status comes from the process: running while it runs, then ``completed`` on exit code 0, ``failed``
on any other exit code, ``crashed`` when a signal ended it. The process leaves as soon as its flow run is
over (``flows.process_exit``), and the parent hears of that at once (:meth:`ShardProcesses.wait`), so a
shard settles, and the next attempt takes its slot, without waiting out an interpreter teardown or a poll.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from flows.embedded import EMBEDDED_API_ENV
from flows.shard_launch import ShardLaunch, ShardStatus
from server.tether import Tether, tether
from sidecar.models.devices import CPU_SLOT_ENV, visible_gpus

REPO = Path(__file__).resolve().parents[1]
# the concurrency-limit name a shard's accelerator takes on a Prefect server (flows.accelerator)
GPU_LIMIT_ENV = "SIDECAR_GPU_LIMIT"
# how long a cancelled attempt gets to stop before it is killed
CANCEL_GRACE_S = 10.0


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def slot_environment(slot: int, workers: int, gpus: list[str], cores: int) -> dict[str, str]:
    """What the process on ``slot`` of ``workers`` runs with, besides the parent's environment."""
    threads = str(max(1, cores // workers))
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
           GPU_LIMIT_ENV: f"gpu-{socket.gethostname()}-{slot}"}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus[slot % len(gpus)]
    else:
        env[CPU_SLOT_ENV] = str(slot)
    return env


@dataclass
class ShardProcess:
    """One attempt's process (a :class:`flows.shard_launch.ShardHandle`)."""

    launch: ShardLaunch
    slot: int
    process: subprocess.Popen[bytes]
    _tether: Tether | None = None
    # readable once the process has ended (Linux); None where pidfds do not exist, or once released
    pidfd: int | None = None
    _flow_run_id: str | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    def status(self) -> ShardStatus:
        code = self.process.poll()
        if code is None:
            return "running"
        self._release()
        return "completed" if code == 0 else "crashed" if code < 0 else "failed"

    def cancel(self) -> None:
        """SIGTERM to the attempt's process group, SIGKILL after :data:`CANCEL_GRACE_S`."""
        for sig, wait_s in ((signal.SIGTERM, CANCEL_GRACE_S), (signal.SIGKILL, 60.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
            try:
                self.process.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        self._release()

    @property
    def flow_run_id(self) -> str | None:
        """The attempt's flow run, found on the API by its name (the launch id) once the process made it."""
        if self._flow_run_id is None:
            from prefect import get_client
            from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

            with get_client(sync_client=True) as client:
                runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                    name=FlowRunFilterName(any_=[self.launch.launch_id])), limit=1)
            self._flow_run_id = str(runs[0].id) if runs else None
        return self._flow_run_id

    def _release(self) -> None:
        if self._tether is not None:
            self._tether.release()
            self._tether = None
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _pidfd(pid: int) -> int | None:
    """A descriptor of process ``pid`` that becomes readable when it ends; None where the OS has none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


class ShardProcesses:
    """A :class:`flows.shard_launch.ShardLauncher` running at most ``workers`` attempts at once on this machine,
    each on a slot of its own, with the Prefect API at ``api_url``; ``embedded``: that API is the parent's
    embedded one."""

    def __init__(self, workers: int, api_url: str, embedded: bool) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers, self.api_url, self.embedded = workers, api_url, embedded
        self.gpus, self.cores = visible_gpus(), usable_cores()
        self.slots: list[ShardProcess | None] = [None] * workers

    def environment(self, slot: int) -> dict[str, str]:
        """The whole environment of the attempt on ``slot``: the parent's, its slot's share, the parent's API."""
        env = os.environ | slot_environment(slot, self.workers, self.gpus, self.cores)
        env |= {"PREFECT_API_URL": self.api_url, "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
        if self.embedded:
            env[EMBEDDED_API_ENV] = "1"
        else:
            # on a server, each attempt takes its slot's limit, whatever this process was started with
            env.pop(EMBEDDED_API_ENV, None)
        return env

    def launch(self, launch: ShardLaunch) -> ShardProcess:
        slot = self._free_slot()
        env = self.environment(slot)
        command = [sys.executable, "-m", "flows.nightly_shard", "--launch", json.dumps(launch.parameters())]
        # a process group of its own: a Ctrl-C in the terminal reaches the parent, which decides; cancel()
        # stops the whole group
        process = subprocess.Popen(command, env=env, cwd=os.getcwd(), process_group=0)
        handle = ShardProcess(launch, slot, process, tether(process.pid), pidfd=_pidfd(process.pid))
        self.slots[slot] = handle
        return handle

    def wait(self, timeout_s: float) -> None:
        """Return after ``timeout_s``, or as soon as the process of a running attempt ends, so that the parent
        settles the attempt without waiting for its next poll."""
        pidfds = [h.pidfd for h in self.slots if h is not None and h.pidfd is not None]
        if pidfds:
            select.select(pidfds, [], [], timeout_s)
        else:
            time.sleep(timeout_s)

    def _free_slot(self) -> int:
        for slot, handle in enumerate(self.slots):
            if handle is None or handle.status() != "running":
                return slot
        raise RuntimeError(f"all {self.workers} shard slots are busy; wait for an attempt to end")
