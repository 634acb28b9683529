"""Whether a judging method can tell tags apart in a run: its controls against the run's own margin.

Every document's result is a *difference* for its subject side: in the pairwise method the preference
less 0.5, in the likelihood method the subject's score less the other side's. A verdict or a control
needs a difference beyond the run's margin, so a control counts as right only when it clears that margin:
a judge whose controls sit inside its own noise tells nothing, however many lie on the right side of 0.
``storage/migrations/010_judge_ladder.sql`` computes the same numbers from the stored games and scores.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel

Method = Literal["pairwise", "likelihood"]
RungName = Literal["easy", "hard", "null"]
# z of a two-sided 5% test and of 80% power: a true mean difference of (1.96 + 0.84) standard errors is
# found in 80% of runs of this size
Z_TEST = 1.96
Z_POWER = 0.84


class Rung(BaseModel):
    """One rung of the control ladder in a run: its documents' differences and how many passed. The easy
    and hard rungs pass by clearing the margin towards the document's own tags; the null rung (a tag set
    against itself reordered) passes by staying within the method's floor, since its true difference is 0."""

    name: RungName
    documents: int
    passed: int
    mean: float | None = None
    spread: float | None = None

    @property
    def share(self) -> float | None:
        return self.passed / self.documents if self.documents else None


def rung(name: RungName, differences: Sequence[float], margin: float, floor: float) -> Rung:
    """The rung's pass count, mean difference and spread (sample standard deviation)."""
    passed = sum(abs(d) <= floor for d in differences) if name == "null" else sum(d > margin for d in differences)
    return Rung(name=name, documents=len(differences), passed=passed,
                mean=statistics.fmean(differences) if differences else None,
                spread=statistics.stdev(differences) if len(differences) > 1 else None)


def auc(own: Sequence[float], foil: Sequence[float]) -> float | None:
    """The chance that a document's own tags score above another's (a tie counting half), over every pair of
    an own score and a foil score: 0.5 is a judge blind to the tags, 1 one that always ranks them right."""
    if not own or not foil:
        return None
    wins = sum(1.0 if o > f else 0.5 if o == f else 0.0 for o in own for f in foil)
    return wins / (len(own) * len(foil))


def detectable_difference(differences: Sequence[float]) -> float | None:
    """The smallest mean sidecar-vs-standalone difference this run finds in 80% of runs of its size at a
    two-sided 5% level: (1.96 + 0.84) × the standard error of the mean difference over documents."""
    if len(differences) < 2:
        return None
    return (Z_TEST + Z_POWER) * statistics.stdev(differences) / math.sqrt(len(differences))


def mean_interval(differences: Sequence[float]) -> tuple[float, float] | None:
    """The normal 95% interval of the mean difference: mean ± 1.96 standard errors."""
    if len(differences) < 2:
        return None
    mean = statistics.fmean(differences)
    half = Z_TEST * statistics.stdev(differences) / math.sqrt(len(differences))
    return mean - half, mean + half


RunVerdict = Literal["sidecar", "standalone", "tie", "UNRELIABLE"]


class Reliability(BaseModel):
    """A method's control ladder in one run, and whether its verdicts can be trusted: when the easy rung
    cleared the margin and the null rung tied, each in at least ``threshold`` of its documents. The hard
    rung is reported, not required."""

    method: Method
    margin: float
    floor: float
    threshold: float
    easy: Rung
    hard: Rung
    null: Rung
    # the null rung's tie band: the floor (pairwise), or the margin its own noise sets (likelihood)
    null_band: float | None = None
    auc: float | None = None
    detectable: float | None = None
    # the normal 95% interval of the mean sidecar-vs-standalone difference (``mean_interval``)
    interval: tuple[float, float] | None = None

    @property
    def trusted(self) -> bool:
        return all(share is not None and share >= self.threshold for share in (self.easy.share, self.null.share))

    @property
    def verdict(self) -> RunVerdict:
        """The run's verdict by this method: a side when the interval of the mean difference excludes 0, else
        a tie; UNRELIABLE when the method is not trusted (or nothing was compared)."""
        if not self.trusted or self.interval is None:
            return "UNRELIABLE"
        low, high = self.interval
        return "sidecar" if low > 0 else "standalone" if high < 0 else "tie"

    def ladder(self) -> str:
        """The rungs in one line: how many documents passed each."""
        return "; ".join(f"{r.name} {r.passed}/{r.documents}" + ("" if r.share is None else f" ({r.share:.0%})")
                         for r in (self.easy, self.hard, self.null))

    def line(self) -> str:
        """One sentence on whether the verdicts measure anything, UNRELIABLE in capitals when they do not."""
        easy = self.easy
        if not easy.documents:
            return (f"UNRELIABLE ({self.method}): no control was answered (a run needs two documents with different "
                    "tags), so nothing shows that this judge tells right tags from wrong ones.")
        cleared = (f"controls cleared the margin {self.margin:.3f} in {easy.passed} of {easy.documents} documents "
                   f"({easy.share:.0%}, separation {_number(easy.mean)} ± {_number(easy.spread)}, AUC "
                   f"{_number(self.auc)}); ladder {self.ladder()}, null within "
                   f"{self.floor if self.null_band is None else self.null_band:.3f}")
        if self.trusted:
            return f"Reliable ({self.method}): {cleared}; easy and null at least {self.threshold:.0%}."
        return (f"UNRELIABLE ({self.method}): {cleared}; easy or null below {self.threshold:.0%}: this judge does "
                "not tell a document's own tags from another's beyond its noise, so its verdicts measure nothing.")


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"
