"""Numbers from outside (a server's reply, a file, the command line) checked where they come in: finite, in
their range, and integers where an integer is meant, else refused with the field named.

A float that is NaN or infinite poisons whatever it reaches (a mean, ``statistics.stdev``, a comparison in
SQL), and one that is finite but absurd overflows a sum (``math.fsum`` of two ``-1e308``); a count of 1.9
read as ``int`` becomes 1 without a word. So each boundary calls ``finite`` or ``integer`` once, and the
values past it can be trusted.
"""

from __future__ import annotations

import math
from numbers import Integral, Real

# A log probability: at most 0 (an endpoint's float rounding may put it this far above), at least -1e4 nats
# (a probability of e^-10000, far below any a float32 softmax gives: its smallest normal is e^-87; endpoints
# that floor their log probabilities use -9999).
LOGPROB_CEILING = 1e-6
LOGPROB_FLOOR = -1e4


class NumberError(ValueError):
    """A number from outside that is not finite, not in its range or not an integer; the message names its field
    and says why."""


def finite(field: str, value: object, low: float = -math.inf, high: float = math.inf, *,
           low_open: bool = False) -> float:
    """``value`` as a float: a real number (not a bool, not a string), finite, at least ``low`` (above it with
    ``low_open``) and at most ``high``."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise NumberError(f"{field} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise NumberError(f"{field} must be a finite number, got {value!r}")
    if number < low or (low_open and number == low) or number > high:
        if high == math.inf:
            bound = "positive" if low_open and low == 0 else f"above {low:g}" if low_open else f"at least {low:g}"
            raise NumberError(f"{field} must be {bound}, got {value!r}")
        raise NumberError(f"{field} must lie in {'(' if low_open else '['}{low:g}, {high:g}], got {value!r}")
    return number


def positive(field: str, value: object, high: float = math.inf) -> float:
    """``value`` as a finite float above 0 (and at most ``high``)."""
    return finite(field, value, 0.0, high, low_open=True)


def integer(field: str, value: object, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int: an integer (not a bool, not a float such as 1.9 or 2.0, not a string), at least
    ``low`` and at most ``high``."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise NumberError(f"{field} must be an integer, got {value!r}")
    number = int(value)
    if (low is not None and number < low) or (high is not None and number > high):
        if high is None:
            raise NumberError(f"{field} must be an integer of at least {low}, got {value!r}")
        bounds = f"[{'-inf' if low is None else low}, {high}]"
        raise NumberError(f"{field} must be an integer in {bounds}, got {value!r}")
    return number


def logprob(field: str, value: object) -> float:
    """``value`` as a log probability: finite and in [``LOGPROB_FLOOR``, ``LOGPROB_CEILING``]."""
    return finite(field, value, LOGPROB_FLOOR, LOGPROB_CEILING)
