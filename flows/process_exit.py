"""Ending a process whose flow run is over at once: what Prefect still holds is sent, the rest is skipped.

A shard process's work ends with its flow run (its parts written, its final state on the API), but a normal
interpreter exit then takes seconds on a small machine: Prefect's log and event workers drain from exit
hooks, and the interpreter tears down torch, transformers and every other module it imported. The parent
waits for that exit before it settles the shard or starts the next one on the slot.

Invariant: nothing the flow run logged or emitted is lost. The log and event workers are drained first (each
up to ``DRAIN_S``), the standard streams flushed, and only then does the process leave with ``os._exit``;
a drain that does not finish in time falls back to the normal exit, whose hooks try again.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

# how long each Prefect worker gets to send what it holds before the normal, slow exit is taken instead
DRAIN_S = 30.0


def drain_prefect(timeout_s: float = DRAIN_S) -> bool:
    """Send what Prefect's event and log workers hold to the API and stop them; True when both finished in
    ``timeout_s`` each."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    # events first: their worker may log, and the log worker then takes those logs too
    drained = True
    for worker in (EventsWorker, APILogWorker):
        _, pending = worker.drain_all(timeout=timeout_s)
        drained = drained and not pending
    return drained


def exit_now(code: int) -> NoReturn:
    """End this process with ``code`` once Prefect's workers are drained, skipping the interpreter's teardown."""
    drained = drain_prefect()
    sys.stdout.flush()
    sys.stderr.flush()
    if not drained:
        sys.exit(code)
    os._exit(code)
