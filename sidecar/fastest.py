"""The fastest time of each of several calls, timed in turn.

A loaded machine stalls a two-thread call for a whole scheduler slice now and then, several times its own
length, so one short burst of timings can crown the wrong call. The calls are timed in turn, one of each per
round, so a burst of load falls on all of them alike, and each keeps its fastest run: the one least disturbed
by the load. The dtype a pair loads in, its capture mode, its Linear layout and the width of its one-row
forwards are all chosen this way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

MIN_CALLS = 5  # timed calls of each at least
MAX_CALLS = 200  # and at most, however fast
TIMING_BUDGET_S = 0.15  # seconds of timed calls of each, unless MAX_CALLS come first


def fastest_seconds(calls: Sequence[Callable[[], object]], budget_s: float = TIMING_BUDGET_S,
                    min_calls: int = MIN_CALLS, max_calls: int = MAX_CALLS,
                    clock: Callable[[], float] = time.perf_counter, cap_s: float | None = None) -> list[float]:
    """Each call's fastest time, the calls timed in turn until each has run ``min_calls`` times and ``budget_s``
    or ``max_calls`` is spent, or the timed rounds have taken ``cap_s`` in all (after one round at least: calls
    of seconds each). Each call runs once untimed first: that picks and prepares its kernel."""
    best, spent = [float("inf")] * len(calls), [0.0] * len(calls)
    with torch.inference_mode():
        for call in calls:
            call()
        for done in range(1, max_calls + 1):
            for i, call in enumerate(calls):
                began = clock()
                call()
                took = clock() - began
                best[i], spent[i] = min(best[i], took), spent[i] + took
            if (done >= min_calls and min(spent) >= budget_s) or (cap_s is not None and sum(spent) >= cap_s):
                break
    return best
