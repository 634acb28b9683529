"""The report's number formats, as the Jinja2 filters its templates name: the templates do no arithmetic.

Unit filters convert (``in_ms``: seconds to milliseconds, ``in_mb``, ``in_gb``: bytes); format filters write a
number as text (``num``: significant digits or thousands separators, a dash for none; ``usd``; ``fixed``;
``sig``; ``thousands``); the rest write a whole cell of a verdict or speedup table.
"""

from __future__ import annotations

import base64
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from study.cost import GB, MB, SpeculationRow
from study.report.verdicts import Verdict

NONE = "–"  # what a cell without a value shows


def num(value: float | None, digits: int = 3) -> str:
    """Significant digits for small numbers, thousands separators for large ones, a dash for none."""
    if value is None:
        return NONE
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def usd(value: float | None) -> str:
    return NONE if value is None else f"${value:.4f}"


def fixed(value: float, places: int = 2) -> str:
    """``places`` digits after the point."""
    return f"{value:.{places}f}"


def sig(value: float, digits: int = 3) -> str:
    """``digits`` significant digits, no thousands separators."""
    return f"{value:.{digits}g}"


def thousands(value: float) -> str:
    """A whole number with thousands separators."""
    return f"{value:,.0f}"


def in_ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def in_mb(size: float | None) -> float | None:
    return None if size is None else size / MB


def in_gb(size: float) -> float:
    return size / GB


def saving_cell(verdict: Verdict | None) -> str:
    """A verdict's saving: '12.3% cheaper', '4.0% dearer', or 'even' within 0.05%, where neither says anything;
    a dash for no verdict."""
    if verdict is None:
        return NONE
    saving_pct = verdict.sidecar_saving_pct
    if round(saving_pct, 1) == 0:
        return "even"
    return f"{abs(saving_pct):.1f}% {'cheaper' if saving_pct > 0 else 'dearer'}"


def less_or_more(saving_pct: float) -> str:
    """A saving read as a reader would say it: '12.3% less', '4.0% more'."""
    return f"{abs(saving_pct):.1f}% {'less' if saving_pct >= 0 else 'more'}"


def spread(savings: Sequence[float]) -> str:
    """A saving across GPU types: '3.1-4.0% less', '2.0% more', or '1.0% more to 2.0% less'."""
    low, high = min(savings), max(savings)
    if low >= 0 or high <= 0:
        amounts = sorted({abs(low), abs(high)})
        amount = f"{amounts[0]:.1f}%" if len(amounts) == 1 else f"{amounts[0]:.1f}-{amounts[1]:.1f}%"
        return f"{amount} {'less' if low >= 0 else 'more'}"
    return f"{abs(low):.1f}% more to {high:.1f}% less"


def share(percents: Sequence[int]) -> str:
    """A share in whole percent, or the range of them: '26%', '26-55%'."""
    return f"{percents[0]}%" if min(percents) == max(percents) else f"{min(percents)}-{max(percents)}%"


def speedup_cell(row: SpeculationRow) -> str:
    """Plain time over speculative time: '1.42x', or '0.81x (slower)'."""
    return row.speedup_text + (" (slower)" if row.slower else "")


def prefix(value: Any, text: str) -> str:
    """``text`` before the value: a column header ('batch 32')."""
    return f"{text}{value}"


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def png_data_uri(path: Path) -> str:
    """A PNG file as a data URI, so the HTML page needs no other file."""
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")


FILTERS: dict[str, Callable[..., Any]] = {
    f.__name__: f
    for f in (num, usd, fixed, sig, thousands, in_ms, in_mb, in_gb, saving_cell, less_or_more, spread, share,
              speedup_cell, prefix, median, png_data_uri)
}
