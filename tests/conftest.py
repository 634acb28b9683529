"""Shared fixtures: the tiny random pair (fast) and the real offline Qwen pair (integration)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from durations import write_durations
from inductor_paths import name_torch_by_its_build
from servers import SERVER_FIXTURES, refuse_servers

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tiny pairs load in fp32 whatever the machine (a CPU with native bf16 would choose bf16 by timing it): their
# results must not depend on the machine. The processes tests start inherit it; tests of the choice itself set
# their own, and the real pair loads in the dtype the product chooses (``real_pair``).
os.environ["SIDECAR_DTYPE"] = "fp32"
# Forwards run eager unless a test asks for another mode: auto on a CPU would time (and compile) each new pair
# shape at its first load, and its choice depends on the machine, and a developer's SIDECAR_CAPTURE=compile
# would compile every test's shapes. The processes tests start inherit it; tests of auto unset it.
os.environ["SIDECAR_CAPTURE"] = "eager"
# the accelerator locks of test runs (and of the processes they start) stay apart from a user's real runs,
# and each pytest-xdist worker's from the other's: two workers are two machines, not two runs on one device
if os.environ.get("PYTEST_XDIST_WORKER") or "SIDECAR_LOCK_DIR" not in os.environ:
    os.environ["SIDECAR_LOCK_DIR"] = tempfile.mkdtemp(prefix="sidecar-test-locks-")
# and its Prefect database: the flows tests run on the ephemeral API (those without ``prefect_api``) would
# otherwise start two servers on one SQLite file
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="sidecar-test-prefect-")
# The tiny pair's forwards are a few small matmuls: one thread does them as fast as two, and on a busy machine
# two threads that wait for each other at every op take many times longer. The processes tests start inherit
# it. The real pair's tests get their process's share of the cores, up to two (``pytest_runtest_setup``): beside
# another busy xdist worker, two threads on two cores wait on each other at every op and are slower than one.
os.environ.setdefault("OMP_NUM_THREADS", "1")
REAL_PAIR_THREADS = max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
torch.set_num_threads(1)
# kernels compiled through one venv serve every venv of the same torch build (tests/inductor_paths.py)
name_torch_by_its_build()

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny():
    from sidecar.models.tiny import tiny_pair

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
        monkeypatch.setattr("sidecar.runtime.prefill_plan.CANDIDATES", (32,))
    return request.param


@pytest.fixture(scope="session")
def real_pair():
    """The real Qwen2.5-Coder 1.5B/0.5B pair in the dtype the product chooses here (bf16 on a CPU with native
    bf16, else fp32); `make test` fetches it first, so a missing pair fails."""
    from sidecar import load_pair

    return load_pair("qwen-coder-small", dtype="auto")


@pytest.fixture
def bench_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """bench/results/ moved to a temporary directory: what a benchmark writes goes there."""
    from bench import common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    return tmp_path


@pytest.fixture(scope="session")
def news_parquet() -> Path:
    """The real news corpus (`make corpus` builds data/news.parquet; built here when it is missing)."""
    from study.corpus import build_news_corpus

    path = REPO / "data" / "news.parquet"
    if not path.exists():
        build_news_corpus(path)
    return path


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--durations-file", type=Path, metavar="PATH",
                     help="write every test's setup, call and teardown seconds to PATH, slowest first")


TEST_TIMES: dict[str, dict[str, float]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each phase's seconds per test; under pytest-xdist the controller gets every worker's reports."""
    TEST_TIMES.setdefault(report.nodeid, {})[report.when] = report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("durations_file")
    if path is not None and not hasattr(session.config, "workerinput"):  # the controller writes, not a worker
        write_durations(path, TEST_TIMES)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that uses a fixture that starts a server is marked ``servers`` (tests/servers.py); the longest
    modules run first (``module_rank``)."""
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.servers)
    modules: dict[Path, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.path, []).append(item)
    ranks = {path: module_rank(module_items) for path, module_items in modules.items()}
    items.sort(key=lambda item: ranks[item.path])  # stable: the modules of a rank, and their tests, keep their order


def module_rank(items: list[pytest.Item]) -> int:
    """0 for a module of the real pair, 1 for one whose every test is slow, 2 for the rest.

    pytest-xdist (`make test`, ``--dist loadfile --no-loadscope-reorder``) hands modules to its workers in
    collection order, each to the worker that runs out first; a long module handed out late runs on alone while
    the other worker idles (the real pair's, the longest, came 54th of 81 in file order), so the long ones go
    first. Without ``--no-loadscope-reorder`` xdist hands them out by their number of tests instead."""
    if any(item.get_closest_marker("real") for item in items):
        return 0
    return 1 if all(item.get_closest_marker("slow") for item in items) else 2


@pytest.fixture(autouse=True)
def servers_are_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a run that deselects ``servers`` (`make test-fast`), a test that starts one unmarked fails saying so."""
    if "not servers" in (request.config.getoption("markexpr") or "") and not request.node.get_closest_marker(
            "servers"):
        refuse_servers(monkeypatch)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """One torch thread for a test, two for a test of the real pair, set before the fixtures it sets up."""
    torch.set_num_threads(REAL_PAIR_THREADS if item.get_closest_marker("real") else 1)


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """One ephemeral Prefect API server (uvicorn in a subprocess, a temporary SQLite database) for the
    session, as ``prefect_test_harness`` starts one; starting it takes 10-30 s, so the modules share it."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import (
        PREFECT_HOME,
        PREFECT_SERVER_ANALYTICS_ENABLED,
        PREFECT_SERVER_DATABASE_CONNECTION_URL,
        temporary_settings,
    )

    from server.launcher import free_port

    home = tmp_path_factory.mktemp("prefect-server-home")
    with temporary_settings(updates={PREFECT_HOME: home, PREFECT_SERVER_ANALYTICS_ENABLED: False,
                                     PREFECT_SERVER_DATABASE_CONNECTION_URL: f"sqlite+aiosqlite:///{home}/prefect.db"}):
        server = SubprocessASGIServer(port=free_port())  # a port of its own: not the default ephemeral server
        server.start(timeout=120)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def prefect_api(prefect_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The session's Prefect API for a test module, with the module's own PREFECT_HOME; yields the environment
    a subprocess needs to use it.

    As in ``prefect_test_harness``, the settings are also the process-global ones while the module runs, so
    that flows run in threads (which start without the test's context) use this API instead of starting an
    embedded one. Modules share the API's records: tests find theirs by flow run id, run id or key.
    """
    import prefect.context
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, PREFECT_SERVER_ANALYTICS_ENABLED, temporary_settings

    home = tmp_path_factory.mktemp("prefect-home")
    with temporary_settings(updates={PREFECT_HOME: home, PREFECT_SERVER_ANALYTICS_ENABLED: False,
                                     PREFECT_API_URL: prefect_server.api_url}), pytest.MonkeyPatch.context() as patch:
        patch.setattr(prefect.context, "GLOBAL_SETTINGS_CONTEXT", prefect.context.get_settings_context())
        patch.setitem(SubprocessASGIServer._instances, None, prefect_server)
        yield {"PREFECT_API_URL": prefect_server.api_url, "PREFECT_HOME": str(home),
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        # what the module's flows logged and emitted reaches the API before its settings go
        APILogWorker.drain_all()
        EventsWorker.drain_all()
