"""How many padded tokens a prefill forward may hold, chosen from forwards timed at run time.

A prefill feeds consecutive rows in one forward while rows x widest row stays within a budget (at least one
row per forward; None: all rows in one). The budget never changes the result, only its cost, and the best
one depends on the machine: a CPU runs a forward's rows one after another, and past some size a forward
costs more per token (caches overflow); an accelerator runs rows in parallel, so per-token cost falls with
size and one forward for all rows is best.

The planner files every timed forward under a size class, the smallest candidate budget its padded size
fits in (None: above every finite candidate), and keeps per class a decayed mean of seconds per *real*
token. Seconds per real token charge a forward's padding together with its size effects, so a budget that
packs more rows but pads more, or spills out of a cache, reads as dearer. A class's first timing is
replaced by its second, as ``sidecar.decoding.controller.LinearCost`` does, since a first forward pays one-off costs.

A timing is filed by the forward's own size, not by the budget in force: rows decide how big forwards
get (a row wider than the budget runs alone, a small batch fits any budget whole), and timings read late
(CUDA events, ``sidecar.decoding.controller.DeviceTimer``) need no record of which budget they ran under.

``budget`` returns, in this order:
- a candidate whose class has fewer than ``EXPLORE_POINTS`` timings, up to ``EXPLORE_TRIES`` times each
  (a class that the rows never reach stays empty, hence the bound);
- every ``probe_every``-th prefill, the best candidate's neighbour (in candidate order) given out least
  recently, so the choice follows a drift (longer documents, a busier machine) a step at a time while
  probes stay at most one prefill in ``probe_every``;
- otherwise the candidate whose class has the lowest seconds per real token (ties: the larger budget,
  fewer forwards).

On an accelerator the planner is pinned to None unless told to learn; ``SIDECAR_ONE_PREFILL_FORWARD``
(``Settings().one_prefill_forward``) pins it to None anywhere, so that CPU tests run the accelerator's
path. A single candidate pins it to that candidate. Use one planner per model: a target and its draft
have different costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from sidecar.settings import Settings

if TYPE_CHECKING:
    import torch

CANDIDATES: tuple[int | None, ...] = (64, 128, 256, 512, 1024, 2048, None)
# two timings per class: the first is replaced by the second, so a class counts as timed once it has one
# timing free of one-off costs
EXPLORE_POINTS = 2
EXPLORE_TRIES = 2
PROBE_EVERY = 16


def group_rows(lengths: Sequence[int], budget: int | None) -> list[tuple[int, int]]:
    """The [start, stop) row ranges a prefill feeds per forward: consecutive rows while rows x widest row
    stays within ``budget`` padded tokens, one row at least (None: all rows in one forward)."""
    groups: list[tuple[int, int]] = []
    start = 0
    while start < len(lengths):
        stop, width = start + 1, lengths[start]
        while stop < len(lengths) and (budget is None or (stop + 1 - start) * max(width, lengths[stop]) <= budget):
            width = max(width, lengths[stop])
            stop += 1
        groups.append((start, stop))
        start = stop
    return groups


class SecondsPerToken:
    """Decayed mean of seconds per real token over the forwards of one size class."""

    def __init__(self, decay: float = 0.7) -> None:
        self.decay = decay
        self.mean: float | None = None
        self.count = 0

    def add(self, seconds_per_token: float) -> None:
        self.count += 1
        if self.mean is None or self.count == 2:  # the second timing replaces the first
            self.mean = seconds_per_token
        else:
            self.mean = self.decay * self.mean + (1 - self.decay) * seconds_per_token


class PrefillPlanner:
    """The padded-token budget of each prefill forward on one model, learned from timed forwards.

    ``candidates``: the budgets to choose from (default: ``CANDIDATES``, read when the planner is made).
    ``learn``: None learns on a CPU and pins None on an accelerator; True or False decide for any device.
    """

    def __init__(self, device: torch.device, candidates: Sequence[int | None] | None = None,
                 learn: bool | None = None, probe_every: int = PROBE_EVERY) -> None:
        candidates = CANDIDATES if candidates is None else candidates
        finite = sorted({c for c in candidates if c is not None})
        if not candidates or any(c < 1 for c in finite):
            raise ValueError(f"candidate budgets must be positive token counts or None, got {candidates!r}")
        self.candidates: list[int | None] = [*finite, *([None] if None in candidates else [])]
        learning = device.type == "cpu" if learn is None else learn
        self.pinned = not learning or Settings().one_prefill_forward
        self.probe_every = probe_every
        self.rates = {c: SecondsPerToken() for c in self.candidates}
        self.tries = dict.fromkeys(self.candidates, 0)
        self.given_at = dict.fromkeys(self.candidates, 0)  # the prefill that last got each candidate
        self.prefills = 0

    def size_class(self, padded_tokens: int) -> int | None:
        """The smallest candidate that holds ``padded_tokens`` (the largest when none does)."""
        for candidate in self.candidates:
            if candidate is None or padded_tokens <= candidate:
                return candidate
        return self.candidates[-1]

    def observe(self, padded_tokens: int, real_tokens: int, seconds: float) -> None:
        """One timed prefill forward: rows x widest row padded tokens, the rows' lengths summed real ones."""
        self.rates[self.size_class(padded_tokens)].add(seconds / max(real_tokens, 1))

    def best(self) -> int | None:
        """The timed candidate with the lowest seconds per real token (ties: the larger); the largest
        candidate when none is timed."""
        timed = [(rate.mean, -i) for i, rate in enumerate(self.rates.values()) if rate.mean is not None]
        return self.candidates[-min(timed)[1]] if timed else self.candidates[-1]

    def budget(self) -> int | None:
        """The padded-token budget per forward for the next prefill (None: one forward for all rows)."""
        if self.pinned:
            return None
        if len(self.candidates) == 1:
            return self.candidates[0]
        self.prefills += 1
        choice = self._choose()
        self.given_at[choice] = self.prefills
        return choice

    def _choose(self) -> int | None:
        for candidate, rate in self.rates.items():
            if rate.count < EXPLORE_POINTS and self.tries[candidate] < EXPLORE_TRIES:
                self.tries[candidate] += 1
                return candidate
        best = self.best()
        if self.prefills % self.probe_every:
            return best
        i = self.candidates.index(best)
        neighbours = self.candidates[max(i - 1, 0):i] + self.candidates[i + 1:i + 2]
        return min(neighbours, key=lambda c: self.given_at[c])
