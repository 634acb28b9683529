"""The check's global deadline: a point in time that work must end by, shared out to pairs and parts.

A measurement that would not end before its deadline is skipped with a reason; one in progress is never
interrupted, so the check can overrun by at most one measurement.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class Deadline:
    """A point in time (``time.monotonic``) that work must end by."""

    end: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds)

    def left(self) -> float:
        return self.end - time.monotonic()

    def share(self, fraction: float) -> Deadline:
        """A deadline ``fraction`` of the time left from now, never later than this one."""
        return Deadline(time.monotonic() + max(self.left(), 0.0) * fraction)

    def skip_reason(self, estimate_s: float = 0.0) -> str | None:
        """Why work that takes about ``estimate_s`` should not start, or None when it fits."""
        left = self.left()
        if left <= 0:
            return "skipped: deadline reached"
        if estimate_s > left:
            return f"skipped: ~{estimate_s:.0f} s estimated, {left:.0f} s left before the deadline"
        return None
