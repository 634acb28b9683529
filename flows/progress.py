"""Progress of a flow's long phases: tqdm bars on a terminal, a Prefect progress artifact in the UI.

The bars show only where stderr is a terminal (tqdm's ``disable=None``), so a worker's logs and the
tests stay clean; the artifact is updated at most every ``interval_s``, since each update is an API call.
"""

from __future__ import annotations

import logging
import time
from types import TracebackType

from prefect.artifacts import create_progress_artifact, update_progress_artifact
from tqdm.auto import tqdm


class PhaseBars:
    """``on_progress(phase, done, total)`` for the engine: one transient bar per phase. A stream's phases
    interleave (documents are prefilled while others decode), so each phase keeps its bar until ``close``,
    its total follows the engine's as documents join, and only a phase's first report is logged (the run's
    logs are what the UI shows of it)."""

    def __init__(self, prefix: str = "", logger: logging.Logger | logging.LoggerAdapter | None = None) -> None:
        self.prefix = prefix
        self.logger = logger
        self.bars: dict[str, tqdm] = {}

    def __call__(self, phase: str, done: int, total: int) -> None:
        bar = self.bars.get(phase)
        if bar is None:
            if self.logger is not None:
                self.logger.info("%s%s: %d to do", self.prefix, phase, total)
            bar = self.bars[phase] = tqdm(total=total, desc=f"{self.prefix}{phase}", leave=False, disable=None,
                                          dynamic_ncols=True)
        if bar.total != total:
            bar.total = total
            bar.refresh()
        bar.update(done - bar.n)

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()
        self.bars = {}


class RunProgress:
    """Units of a run done (documents, judged documents), as a terminal bar and a progress artifact."""

    def __init__(self, key: str, description: str, total: int, unit: str, interval_s: float = 2.0) -> None:
        self.total = total
        self.done = 0
        self.interval_s = interval_s
        self.artifact_id = create_progress_artifact(0.0 if total else 100.0, key=key, description=description)
        self.bar = tqdm(total=total, desc=description, unit=unit, disable=None, dynamic_ncols=True)
        self.last_update = time.monotonic()
        self.published = 0

    def advance(self, units: int = 1) -> None:
        self.done += units
        self.bar.update(units)
        if self.done >= self.total or time.monotonic() - self.last_update >= self.interval_s:
            self.publish()

    def publish(self) -> None:
        update_progress_artifact(self.artifact_id, 100.0 * self.done / self.total if self.total else 100.0)
        self.last_update = time.monotonic()
        self.published = self.done

    def __enter__(self) -> RunProgress:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        # the last units may have come within interval_s of the previous update (or never reach the total)
        if self.done != self.published:
            self.publish()
        self.bar.close()
