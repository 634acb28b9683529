"""Errors the cost model raises for inputs it cannot use, and the checks every cost input passes.

Every number a cost comes from (a command-line option, the GPU catalog, a step-cost table, a workload's sizes,
a measurement) goes through ``number`` or ``count``: finite and in range, an integer where one is meant,
else ``CostInputError`` naming the field and why. (A check written ``value <= 0`` lets NaN and infinity
through, and ``int(1.9)`` makes a batch of 1 without a word.)
"""

from __future__ import annotations

import math

from vocab.numbers import NumberError, finite, integer


class CostInputError(ValueError):
    """Inputs the cost model cannot use (non-positive sizes, unsupported model type, bad mode)."""


class UnknownGPUError(CostInputError):
    """A GPU name that is not in the catalog."""


def number(field: str, value: object, low: float = 0.0, high: float = math.inf, *, positive: bool = True) -> float:
    """``value`` as a finite float, above ``low`` (at least ``low`` unless ``positive``) and at most ``high``."""
    try:
        return finite(field, value, low, high, low_open=positive)
    except NumberError as exc:
        raise CostInputError(str(exc)) from None


def count(field: str, value: object, low: int = 1, high: int | None = None) -> int:
    """``value`` as an int of at least ``low`` (and at most ``high``): an integer, not 1.9 nor 2.0."""
    try:
        return integer(field, value, low, high)
    except NumberError as exc:
        raise CostInputError(str(exc)) from None
