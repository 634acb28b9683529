"""From games to numbers: debiased preferences, the calibrated margin, verdicts, the position bias
and a bootstrap interval. ``storage/migrations/010_judge_ladder.sql`` computes the same
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
# The text mode's margin: its preferences are 0, 0.25, 0.5, 0.75 and 1, and only both games agreeing
# (1 or 0) is a verdict, so a control or verdict needs more than 0.25 from 0.5, as ``final_verdict`` does.
TEXT_MARGIN = 0.25


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
