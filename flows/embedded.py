"""Prefect settings for flows run inside this process, as ``sidecar nightly`` and ``sidecar demo`` run them."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

# "1" in the environment of a process whose PREFECT_API_URL is its parent run's embedded API
EMBEDDED_API_ENV = "SIDECAR_EMBEDDED_API"


@contextlib.contextmanager
def embedded_prefect() -> Iterator[None]:
    """Settings for flows run in this process, as ``sidecar nightly`` runs them.

    Without ``PREFECT_API_URL``, Prefect starts an embedded API for the run; on a busy two-core machine it
    needs more than its default 20 s to come up. Analytics and the client's telemetry stay off: the
    machine may have no network, and the telemetry notice would ask a first-time user to act. The
    ``storage`` loggers go to Prefect's handlers too (the run's log, the console).

    On that embedded API, flow run heartbeats are off. They exist so that a server's automations can mark
    a silent run crashed, but the embedded API stops with this process, so nobody watches them; and
    Prefect stops the heartbeat thread by waiting for its 1 s sleep, 0-1 s per flow run, at random
    (bench/orchestration_overhead.py). A crashed run is recovered by rerunning it, which resumes from
    DuckDB. The same holds for a sharded run's local shard processes on their parent's embedded API
    (``on_embedded_api``). Against a real server (a worker's runs) heartbeats stay as configured.

    The embedded API server ends with this process, however it ends (``flows.embedded_server``).
    """
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")  # the client's telemetry, and its notice on every run
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    # storage says there whom a run waits for (a process holding the database file or a run's lock)
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "storage")
    from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    if not on_embedded_api():
        yield
        return
    if not PREFECT_API_URL.value():
        from flows.embedded_server import tether_embedded_server

        tether_embedded_server()
    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


def on_embedded_api() -> bool:
    """True inside flows that run on an embedded API: this process's own (no ``PREFECT_API_URL``), or the one
    of the parent run that started this process and says so with ``SIDECAR_EMBEDDED_API=1`` (its local shard
    processes, ``flows.shard_processes``, which reach it through ``PREFECT_API_URL``). Such an API lives and
    dies with one process tree on one machine, and nobody creates global concurrency limits on it, so a
    limit there guards nothing: the accelerator's OS lock keeps its runs apart (``flows.accelerator``)."""
    from prefect.settings import PREFECT_API_URL

    return os.environ.get(EMBEDDED_API_ENV) == "1" or not PREFECT_API_URL.value()
