"""Every test's time, kept: `--durations-file PATH` writes each test's setup, call and teardown seconds there,
slowest first, where pytest's `--durations` only prints the slowest few to the terminal."""

from __future__ import annotations

from pathlib import Path

PHASES = ("setup", "call", "teardown")


def durations_table(times: dict[str, dict[str, float]]) -> str:
    """One line per test, slowest total first: total, then each phase's seconds, then the test's id."""
    header = f"{'total':>9} {'setup':>9} {'call':>9} {'teardown':>9}  test"
    rows = sorted(times.items(), key=lambda item: (-sum(item[1].values()), item[0]))
    lines = [f"{sum(t.values()):9.2f} " + " ".join(f"{t.get(p, 0.0):9.2f}" for p in PHASES) + f"  {node}"
             for node, t in rows]
    return "\n".join([header, *lines]) + "\n"


def write_durations(path: Path, times: dict[str, dict[str, float]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(durations_table(times))
