"""From games to numbers: debiased preferences, the calibrated margin, verdicts, control scores, the
position bias and a bootstrap interval. ``storage/migrations/003_judge_controls.sql`` computes the same
statistics from the stored games (views ``judge_documents``, ``judge_quality``, ``judgements``).

A document's preference for a side is the mean of what its two position-swapped games give that side, so
a judge's constant pull towards one position cancels. The margin is the judge's noise measured in the
same run: null games compare a tag set with itself reversed, whose true preference is 0.5, and the margin
is the largest deviation from 0.5 among them, never below the floor.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from typing import Literal

from study.judge.games import GameResult

Verdict = Literal["sidecar", "standalone", "tie", "error", "skipped"]
# a preference this close to 0.5 is even: float rounding of p and 1 - p must not decide a control
EVEN_TOLERANCE = 1e-9


def preference(games: Sequence[GameResult]) -> float | None:
    """Probability mode: the mean normalised probability the two games give their subject side; None
    unless both games have probabilities."""
    scores = [game.subject_score for game in games if game.p_first is not None]
    return statistics.fmean(scores) if len(scores) == 2 else None


def text_preference(games: Sequence[GameResult]) -> float | None:
    """Text mode: the mean of 1 (subject won), 0.5 (tie), 0 (other won) over both games; None unless both
    have a winner."""
    scores = [game.subject_score for game in games if game.winner is not None]
    return statistics.fmean(scores) if len(scores) == 2 else None


def calibrated_margin(null_preferences: Sequence[float | None], floor: float) -> float:
    """The largest deviation from 0.5 among the null documents' preferences, at least ``floor``."""
    return max([floor, *(abs(p - 0.5) for p in null_preferences if p is not None)])


def final_verdict(games: Sequence[GameResult]) -> Verdict:
    """Text mode: a side wins only if both games pick it; any disagreement is a tie; any failed game is an error."""
    if any(game.winner is None for game in games):
        return "error"
    first, second = (game.winner for game in games)
    return first if first == second else "tie"  # type: ignore[return-value]


def preference_verdict(games: Sequence[GameResult], margin: float) -> Verdict:
    """Probability mode: the sidecar's when its preference is above 0.5 by more than ``margin``, the
    standalone tagger's when below by more, else a tie; an error without both games' probabilities."""
    value = preference(games)
    if value is None:
        return "error"
    return "sidecar" if value > 0.5 + margin else "standalone" if value < 0.5 - margin else "tie"


def control_score(value: float) -> float:
    """1 when a control's preference favours the document's own tags, 0 when it favours the other
    document's, 0.5 when even: a judge blind to the tags scores 0.5 on average, chance."""
    if value > 0.5 + EVEN_TOLERANCE:
        return 1.0
    return 0.0 if value < 0.5 - EVEN_TOLERANCE else 0.5


def position_bias(games: Sequence[GameResult]) -> float | None:
    """The mean probability (text mode: share, a tie counting half) of choosing the set shown first, over
    every answered game; 0.5 is no bias."""
    scores = [score for game in games if (score := game.first_shown_score) is not None]
    return statistics.fmean(scores) if scores else None


def bootstrap_ci(values: Sequence[float], resamples: int = 2000, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the mean of ``values`` (documents resampled with replacement);
    the same values and seed give the same interval. None for fewer than two values."""
    if len(values) < 2:
        return None
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1 - level) / 2
    return means[round(tail * (resamples - 1))], means[round((1 - tail) * (resamples - 1))]
