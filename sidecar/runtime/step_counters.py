"""What a pair's decoding steps cost the host: steps, host syncs, and host time, kept per run.

A GPU runs behind the host that queues its work, and waits on the host at every read of a device value
(``sidecar.runtime.syncs`` lists them). Two quantities of a step transfer from this CPU to a GPU and are kept
here for every decode step (``RunningBatch.step``'s forwards, acceptance and update; admission's prefill is
not a step):

* **syncs per step**: the reads a step makes (``sidecar.runtime.transfers.to_host``, the only way the step
  reads the device). Its one read of accepted counts and next tokens is the floor; early stopping, a
  constrained row and logprobs each add their own.
* **host time per step**: the step's wall time less the time spent in those reads. On a GPU a read waits
  for the device, so what is left is the host's own work, the floor a captured step cannot go below; on a
  CPU, where the forwards run on the host, it is the whole step.

``counting(counters)`` makes ``counters`` the ones the reads of this thread (or task) count into: a server's
worker thread and a pipeline's loop each count their own steps.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass
class StepCounters:
    steps: int = 0
    syncs: int = 0  # reads of device values made by steps
    step_seconds: float = 0.0  # the steps' wall time
    read_seconds: float = 0.0  # of which in reads (waiting for the device, on a GPU)

    def as_dict(self) -> dict:
        """The counters, and per step: syncs, and host milliseconds (wall less reads)."""
        per_step = max(self.steps, 1)
        return {"steps": self.steps, "syncs": self.syncs, "step_seconds": round(self.step_seconds, 6),
                "read_seconds": round(self.read_seconds, 6), "syncs_per_step": round(self.syncs / per_step, 3),
                "host_ms_per_step": round((self.step_seconds - self.read_seconds) * 1e3 / per_step, 3)}


def counters_of(pair: object) -> StepCounters:
    """The step counters of ``pair`` (a ``ModelPair``), kept on it since its first step, as its capture runners
    are kept on its models."""
    return pair.__dict__.setdefault("sidecar_step_counters", StepCounters())


_CURRENT: ContextVar[StepCounters | None] = ContextVar("sidecar_step_counters", default=None)


def current() -> StepCounters | None:
    """The counters the running step counts into (None outside a step)."""
    return _CURRENT.get()


@contextmanager
def counting(counters: StepCounters) -> Iterator[StepCounters]:
    """One step, counted into ``counters``: its reads (``to_host``) and its wall time."""
    token = _CURRENT.set(counters)
    started = time.perf_counter()
    try:
        yield counters
    finally:
        counters.step_seconds += time.perf_counter() - started
        counters.steps += 1
        _CURRENT.reset(token)
