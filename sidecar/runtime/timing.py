"""Timing work queued on a device (a CPU or a GPU) without making the host wait for it."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


class DeviceTimer:
    """Times work queued on a device without waiting for it.

    On a CPU an op has run when it returns, so the wall clock around it is its time. A GPU runs behind the
    host: a wall clock would need a synchronize, which stalls it. There, CUDA events bracket the work and
    their time is read once a later event has completed (``Event.query`` does not wait), which the loop's
    next read of the device ensures: in effect one step late.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._queued: deque[tuple[torch.cuda.Event, torch.cuda.Event, Callable[[float], None]]] = deque()

    @contextmanager
    def __call__(self, on_seconds: Callable[[float], None]) -> Iterator[None]:
        """Time the work queued inside; ``on_seconds`` hears its duration, now or at a later ``collect``."""
        if self.device.type != "cuda":
            start = time.perf_counter()
            yield
            on_seconds(time.perf_counter() - start)
            return
        start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start_event.record()
        yield
        end_event.record()
        self._queued.append((start_event, end_event, on_seconds))

    def collect(self, wait: bool = False) -> None:
        """Deliver the timings of work that has finished, oldest first; with ``wait``, of all queued work,
        waiting for it (a sync: only for rows that leave before any later read of the device)."""
        if wait and self._queued:
            self._queued[-1][1].synchronize()
        while self._queued and self._queued[0][1].query():
            start_event, end_event, on_seconds = self._queued.popleft()
            on_seconds(start_event.elapsed_time(end_event) / 1000)
