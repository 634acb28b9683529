"""`python -m bench.syncs` counts a stream's syncs under both schedules, within the budget the table prints."""

from __future__ import annotations

import pytest

from bench.syncs import measure
from sidecar.decoding.batch import SCHEDULES
from sidecar.models.tiny import tiny_pair


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_stream_is_counted_with_one_read_per_prefilled_group(schedule: str) -> None:
    row = measure(tiny_pair(), 2, "adaptive", 8, schedule=schedule, stream=True)
    assert row["rows"] == 4 and row["schedule"] == schedule
    assert row["steps"] == row["target_forwards"] > 0
    # static: two fixed batches of 2; continuous: at least as many admissions, as rows join one by one
    assert row["prefilled_groups"] == 2 if schedule == "static" else row["prefilled_groups"] >= 2
    assert 0 < row["syncs"] <= row["budget"] == row["target_forwards"] + row["draft_forwards"] + row["prefilled_groups"]
