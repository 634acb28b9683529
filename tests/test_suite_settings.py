"""The suite's own settings: a hung test fails in bounded time instead of holding the run forever."""

from __future__ import annotations

import pytest


def test_every_test_has_a_time_limit_covering_its_setup(pytestconfig: pytest.Config) -> None:
    # pytest-timeout reads an unset `timeout` as no limit; with func_only off, the limit covers the fixtures a
    # test sets up (the real pair's module fixture decodes its references there)
    assert 0 < float(pytestconfig.getini("timeout") or 0) <= 600
    assert not pytestconfig.getini("timeout_func_only")
