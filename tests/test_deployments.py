"""prefect.yaml against a real `prefect server start` on loopback: what `infra/deploy.sh` (pools, limits,
`prefect deploy --all`) creates, and a sharded nightly deployment run with the tiny pair on real process workers
(infra/worker.sh for the control pool, infra/gpu-workers.sh --cpu 2 for the GPU pool): its shards run as flow
runs of the nightly-shard deployment, every (document, mode) is stored once, and the trigger chain
nightly -> judge -> cost-report fires once.

Last, without workers, on the same server (one start and deploy, ~40 s, for both): a nightly run that overrides
one parameter keeps the deployment's others, through the API, through `prefect deployment run -p` and through
the triggers, which hand the run's db_path and pair on to judge and its db_path to cost-report; a value a field
refuses is refused when the run is created. Those runs are created, read and deleted (the triggers fire on a
Completed state set through the API).

Every test here runs on PostgreSQL where a cluster can start (tests/test_deployments_postgres.py collects them
all), on this module's SQLite server only where none can: no machine pays for two server starts and deploys."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from postgres import unavailable
from shard_parts import manifest_ids, part_doc_ids

from storage import Database

REPO = Path(__file__).resolve().parents[1]
PREFECT = Path(sys.executable).parent / "prefect"

# a real Prefect server, deploys and process workers: a test with its module's setup takes up to ~3.5 minutes
pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.timeout(900), pytest.mark.usefixtures("tests_here")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(*procs: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM each process's group at once, SIGKILL the groups of those still up after ``grace_s``."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


# Prefect 3.9's process worker turns a SIGTERM into a SIGINT to itself and then often stays up (idle in its event
# loop, or after printing "Worker stopped!"): the module's teardown waited out the 30 s grace for the control
# worker, and gpu-workers.sh its own 10 s before its SIGKILL (tests/test_deployments_postgres.py's teardown took
# 35-46 s in `make test`). `sidecar ui` gives such a worker 3 s (cli/ui.py); the workers here get as long, all at once.
WORKER_STOP_GRACE_S = 3


@contextlib.contextmanager
def prefect_server(home: Path, settings: dict[str, str] | None = None) -> Iterator[dict[str, str]]:
    """`infra/server.sh` (a Prefect server on a free loopback port) with its own PREFECT_HOME and ``settings``
    (its database, say), until the block ends; yields the environment to reach it."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")} | {
        "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_PORT": str(port),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api", "SIDECAR_REPO": str(REPO), "SIDECAR_PREFECT": str(PREFECT)}
    log = (home / "server.log").open("wb")
    proc = subprocess.Popen([str(REPO / "infra" / "server.sh")], env=env | (settings or {}), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (home / "server.log").read_text()
            try:
                if httpx.get(f"{env['PREFECT_API_URL']}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the Prefect server did not come up in 180 s"
            time.sleep(0.5)
        yield env
    finally:
        stop(proc)
        log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A Prefect server on its default database, SQLite under its PREFECT_HOME (as `sidecar ui` runs one)."""
    with prefect_server(tmp_path_factory.mktemp("prefect-server-home")) as env:
        yield env


@pytest.fixture(scope="module")
def tests_here() -> None:
    """This module's tests run on PostgreSQL where a cluster can start here (tests/test_deployments_postgres.py),
    as production keeps Prefect's state there; on this module's SQLite server only where none can, so that no
    machine pays for both (a server start and two deploys here; the whole runs, ~4 minutes). A deploy onto
    SQLite, as `sidecar ui` runs one, is also tested end to end in tests/test_ui.py."""
    if unavailable() is None:
        pytest.skip("run on PostgreSQL here: tests/test_deployments_postgres.py")


HOST = "testhost"  # the host name in the GPU workers' limit names (SIDECAR_HOST)


@pytest.fixture(scope="module")
def deployed(server: dict[str, str]) -> dict[str, str]:
    """infra/deploy.sh run against the server for two GPUs of HOST; yields the environment of the scripts."""
    env = server | {"SIDECAR_HOST": HOST}
    done = subprocess.run([str(REPO / "infra" / "deploy.sh"), f"{HOST}:2"], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return env


@contextlib.contextmanager
def api_client(env: dict[str, str]):
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"]}), \
            get_client(sync_client=True) as api:
        yield api


@pytest.fixture
def api(deployed: dict[str, str]):
    with api_client(deployed) as client:
        yield client


def gpu_limits(api) -> dict[str, int]:
    """The global concurrency limits but the nightly deployment's own (``deployment:<id>``)."""
    return {limit.name: limit.limit for limit in api.read_global_concurrency_limits()
            if not limit.name.startswith("deployment:")}


def test_deploy_creates_the_four_deployments_on_two_pools_and_a_limit_per_gpu(api) -> None:
    from flows.nightly import NightlyParams

    deployments = {d.name: d for d in api.read_deployments()}
    assert {name: d.work_pool_name for name, d in deployments.items()} == {
        "nightly": "sidecar-control", "cost-report": "sidecar-control",
        "nightly-shard": "sidecar-gpu", "judge": "sidecar-gpu"}
    pools = {(pool.name, pool.type) for pool in api.read_work_pools()}
    assert pools >= {("sidecar-control", "process"), ("sidecar-gpu", "process")}
    assert {d.entrypoint for d in deployments.values()} == {
        "flows/nightly.py:nightly", "flows/nightly_shard.py:nightly_shard", "flows/judge.py:judge",
        "flows/cost_report.py:cost_report"}
    assert all(d.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}]
               for d in deployments.values())
    assert gpu_limits(api) == {"gpu": 1, f"gpu-{HOST}-0": 1, f"gpu-{HOST}-1": 1}

    nightly = deployments["nightly"]
    [schedule] = nightly.schedules
    assert schedule.active and (schedule.schedule.cron, schedule.schedule.timezone) == ("0 2 * * *", "UTC")
    assert nightly.global_concurrency_limit is None, "parents hold no GPU: two runs go side by side"
    params = NightlyParams.model_validate(nightly.parameters)
    assert (params.pair, params.db_path, params.title_column) == ("qwen-coder-small", "data/sidecar.duckdb", "title")
    assert (params.shard_deployment, params.shards, params.results_uri) == ("nightly-shard/nightly-shard", 2, None)
    # the UI renders the run form from this schema: one parameter per field of the model, in the model's order by
    # their positions (PostgreSQL keeps the schema as JSONB, which does not keep the keys' order)
    properties = nightly.parameter_openapi_schema["properties"]
    assert sorted(properties, key=lambda name: properties[name]["position"]) == list(NightlyParams.model_fields)
    # the parent launches the shard deployment by the name it is given
    shard = api.read_deployment_by_name(params.shard_deployment)
    assert shard.id == deployments["nightly-shard"].id
    assert not shard.schedules and shard.global_concurrency_limit is None and not shard.parameters
    assert set(shard.parameter_openapi_schema["properties"]) == {
        "run_id", "launch_id", "shard", "attempt", "results_uri", "params"}
    assert not deployments["judge"].schedules and not deployments["cost-report"].schedules


def test_the_server_gives_a_killed_runs_gpu_slot_back_seconds_after_its_lease_expires(
        server: dict[str, str]) -> None:
    # a killed shard's slot is free once the repossessor revokes its expired lease, and the relaunch takes it
    # when it next asks: infra/server.sh has the server look every 2 s and the relaunch ask within ~5 s
    # (Prefect's defaults, 15 s and 30 s, would idle the GPU up to 54 s past the lease)
    settings = httpx.get(f"{server['PREFECT_API_URL']}/admin/settings", timeout=30).json()["server"]
    assert settings["services"]["repossessor"]["enabled"]
    assert settings["services"]["repossessor"]["loop_seconds"] <= 2
    assert settings["concurrency"]["maximum_concurrency_slot_wait_seconds"] <= 5


def test_deploy_again_changes_nothing(deployed: dict[str, str], api) -> None:
    before = {d.name: (d.id, d.work_pool_name) for d in api.read_deployments()}
    done = subprocess.run([str(REPO / "infra" / "deploy.sh"), f"{HOST}:2"], env=deployed, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert {d.name: (d.id, d.work_pool_name) for d in api.read_deployments()} == before
    # the silent-run automation is replaced, not added twice
    assert sorted(a.name for a in api.read_automations()) == ["cost-report-after-judge", "judge-after-nightly",
                                                              "sidecar-crash-silent-runs"]
    assert gpu_limits(api) == {"gpu": 1, f"gpu-{HOST}-0": 1, f"gpu-{HOST}-1": 1}


def test_triggers_start_judge_after_nightly_and_cost_report_after_judge(api) -> None:
    deployments = {d.name: d for d in api.read_deployments()}
    automations = {a.name: a for a in api.read_automations()}
    assert set(automations) == {"judge-after-nightly", "cost-report-after-judge", "sidecar-crash-silent-runs"}
    for name, source, target in (("judge-after-nightly", "nightly", "judge"),
                                 ("cost-report-after-judge", "judge", "cost-report")):
        automation = automations[name]
        trigger = automation.trigger
        assert automation.enabled and trigger.expect == {"prefect.flow-run.Completed"}
        assert trigger.match.root == {"prefect.resource.id": "prefect.flow-run.*"}
        related = [spec.root for spec in trigger.match_related]
        assert related == [{"prefect.resource.role": "flow", "prefect.resource.name": source},
                           {"prefect.resource.role": "deployment", "prefect.resource.name": source}]
        [action] = automation.actions
        assert action.type == "run-deployment" and action.deployment_id == deployments[target].id
    assert automations["judge-after-nightly"].actions[0].parameters["run_id"] == "{{ flow_run.name }}"


@contextlib.contextmanager
def workers(env: dict[str, str], logs: Path) -> Iterator[dict[str, subprocess.Popen]]:
    """The control pool's worker (infra/worker.sh) and two CPU workers of the GPU pool (infra/gpu-workers.sh
    --cpu 2, limits gpu-HOST-0 and gpu-HOST-1), until the block ends; yields their processes by pool."""
    # the workers poll every 2 s instead of 10: each flow run starts sooner
    env = env | {"PREFECT_WORKER_QUERY_SECONDS": "2"}
    started: dict[str, subprocess.Popen] = {}
    try:
        for name, command in (("control", ["worker.sh"]), ("gpu", ["gpu-workers.sh", "--cpu", "2"])):
            with (logs / f"{name}-worker.log").open("wb") as log:
                started[name] = subprocess.Popen([str(REPO / "infra" / command[0]), *command[1:]], env=env, cwd=REPO,
                                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        yield started
    finally:
        stop(*started.values(), grace_s=WORKER_STOP_GRACE_S)


# the workers by pool, and the directory of their logs
PoolWorkers = tuple[dict[str, subprocess.Popen], Path]


@pytest.fixture(scope="module")
def pool_workers(deployed: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolWorkers]:
    """The workers of both pools (``workers``), started once for the module's whole-run tests: three processes
    that import Prefect and poll, which each test would otherwise start and stop again. A test finds its own runs
    by their ids and run ids, and counts the judge runs it sets off from those there were before it."""
    logs = tmp_path_factory.mktemp("worker-logs")
    with workers(deployed, logs) as started:
        yield started, logs


def worker_logs(logs: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in sorted(logs.glob("*.log")))


def test_a_sharded_nightly_deployment_run_on_two_gpu_workers_stores_each_document_once_and_is_judged_once(
        deployed: dict[str, str], pool_workers: PoolWorkers, tmp_path: Path) -> None:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    docs = 20
    corpus = tmp_path / "news.parquet"
    pq.write_table(pa.table({"id": [f"d{i:02d}" for i in range(docs)], "article": [
        f"Story {i}: the city council approved a new budget after a long debate about schools and roads. "
        * (1 + i % 3) for i in range(docs)]}), corpus)
    db_path = tmp_path / "sidecar.duckdb"
    _, logs = pool_workers
    with api_client(deployed) as api:
        judged_before = {run.id for run in judge_runs(api)}  # by the module's other tests, in any order
        nightly = api.read_deployment_by_name("nightly/nightly")
        # as the UI's form: the deployment's parameters, some changed
        # as the UI's form: the fields changed, the deployment's other parameters kept by the server
        params = {"corpus": str(corpus), "title_column": None, "pair": "tiny", "max_new_tokens": 8,
                  "db_path": str(db_path)}
        started = api.create_flow_run_from_deployment(nightly.id, parameters=params)
        [runs] = wait_for_completed_chains(api, [started.id], timeout_s=1200, logs=logs)
        shard_logs = {run.name: [log.message for log in api.read_logs(log_filter=LogFilter(
            flow_run_id=LogFilterFlowRunId(any_=[run.id])))] for run in runs["nightly-shard"]}
        shard_pools = {run.work_pool_name for run in runs["nightly-shard"]}
        judges = [run for run in judge_runs(api) if run.id not in judged_before]

    run_id = runs["nightly"].name
    assert run_id.startswith("nightly-")
    assert len(runs["nightly-shard"]) == 2 and shard_pools == {"sidecar-gpu"}
    # each shard held the limit of the GPU worker that ran it
    taken = {found[1] for ms in shard_logs.values() for m in ms
             if (found := re.search(r"taking a slot of the '([^']+)' concurrency limit", m))}
    assert taken and taken <= {f"gpu-{HOST}-0", f"gpu-{HOST}-1"}, shard_logs
    # the judge fired once, on the parent's Completed, not on the shards'
    assert len(judges) == 1, [(r.name, r.parameters) for r in judges]
    assert runs["judge"].parameters == {"run_id": run_id, "db_path": str(db_path), "judge_pair": "tiny"}
    assert runs["cost-report"].parameters == {"run_id": run_id, "db_path": str(db_path)}

    db = Database(db_path)
    assert db.get_run(run_id)["status"] == "completed"
    stored = db.query("SELECT doc_id, mode, count(*) AS n FROM outputs WHERE run_id = ? GROUP BY doc_id, mode",
                      [run_id])
    assert sorted((r["doc_id"], r["mode"]) for r in stored) == sorted(
        (f"d{i:02d}", mode) for i in range(docs) for mode in ("sidecar", "standalone"))
    assert {r["n"] for r in stored} == {1}
    attempts = db.shard_attempts(run_id)
    assert [(a["shard"], a["status"]) for a in attempts] == [(0, "completed"), (1, "completed")]
    assert {a["flow_run_id"] for a in attempts} == {str(r.id) for r in runs["nightly-shard"]}
    assert db.query("SELECT count(*) AS n FROM costs WHERE run_id = ?", [run_id])[0]["n"] > 0


def chain_of(api, nightly_run_id) -> dict:
    """The nightly run and the runs of its run id (its name once it runs): {"nightly": run, "nightly-shard":
    [runs], "judge": [runs], "cost-report": [runs]}."""
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    nightly = api.read_flow_run(nightly_run_id)
    runs: dict = {"nightly": nightly}
    for flow in ("nightly-shard", "judge", "cost-report"):
        found = api.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[flow])))
        runs[flow] = [run for run in found if run.parameters.get("run_id") == nightly.name]
    return runs


def wait_for_completed_chains(api, nightly_run_ids: list, timeout_s: float, logs: Path,
                              crashed: frozenset[str] = frozenset()) -> list[dict]:
    """Each nightly run, its shard runs, and the judge and cost-report runs its completion set off, once all
    are over: every run Completed but the shard runs named in ``crashed`` (launch ids), which must be Crashed.
    One dict per nightly run: {"nightly": run, "nightly-shard": [runs], "judge": run, "cost-report": run}."""
    deadline = time.monotonic() + timeout_s
    while True:
        chains = [chain_of(api, run_id) for run_id in nightly_run_ids]
        every = [run for chain in chains for flow in ("nightly", "nightly-shard", "judge", "cost-report")
                 for run in (chain[flow] if isinstance(chain[flow], list) else [chain[flow]])]
        states = {run.name: run.state_name for run in every}
        wrong = {name: state for name, state in states.items()
                 if state in ("Failed", "Crashed", "Cancelled") and not (name in crashed and state == "Crashed")}
        assert not wrong, f"{wrong}\n{worker_logs(logs)}"
        over = all(state == ("Crashed" if name in crashed else "Completed") for name, state in states.items())
        if over and all(chain["judge"] and chain["cost-report"] for chain in chains):
            return [chain | {"judge": chain["judge"][0], "cost-report": chain["cost-report"][0]} for chain in chains]
        assert time.monotonic() < deadline, f"{states}\n{worker_logs(logs)}"
        time.sleep(1)


# -- faults through real workers --


def write_corpus(path: Path, prefix: str, docs: int) -> Path:
    pq.write_table(pa.table({"id": [f"{prefix}{i:02d}" for i in range(docs)], "article": [
        f"Story {i}: the city council approved a new budget after a long debate about schools and roads. "
        * (1 + i % 3) for i in range(docs)]}), path)
    return path


def wait_for(condition, timeout_s: float, what: str, poll_s: float = 0.1):
    """``condition()``'s first truthy value, asked every ``poll_s`` for up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def flow_run_process(workers_proc: subprocess.Popen, flow_run_id: str):
    """The process a worker under ``workers_proc`` runs flow run ``flow_run_id`` in, or None. Its command line
    is the engine's, the same for every run; the worker hands it the run in ``PREFECT__FLOW_RUN_ID``."""
    import psutil

    found = {}
    for proc in psutil.Process(workers_proc.pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            if proc.environ().get("PREFECT__FLOW_RUN_ID") == flow_run_id:
                found[proc.pid] = proc
    tops = [proc for proc in found.values() if proc.ppid() not in found]
    return tops[0] if len(tops) == 1 else None


def logs_of(api, flow_run_id) -> list:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    return api.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))


def held_gpu(api, shard_run) -> tuple[str, datetime]:
    """The GPU limit shard run ``shard_run`` took a slot of, and when it held its accelerator."""
    messages = logs_of(api, shard_run.id)
    [limit] = {found[1] for log in messages
               if (found := re.search(r"taking a slot of the '([^']+)' concurrency limit", log.message))}
    [held] = [log.timestamp for log in messages if ": holding accelerator " in log.message]
    return limit, held


def judge_runs(api) -> list:
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    return api.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["judge"])))


def assert_each_doc_and_mode_once(db: Database, run_id: str, doc_ids: list[str]) -> None:
    stored = db.query("SELECT doc_id, mode, count(*) AS n FROM outputs WHERE run_id = ? GROUP BY doc_id, mode",
                      [run_id])
    assert sorted((r["doc_id"], r["mode"]) for r in stored) == sorted(
        (doc_id, mode) for doc_id in doc_ids for mode in ("sidecar", "standalone"))
    assert {r["n"] for r in stored} == {1}


def test_a_shard_killed_under_its_worker_crashes_and_is_relaunched_with_only_its_unfinished_documents(
        deployed: dict[str, str], pool_workers: PoolWorkers, tmp_path: Path) -> None:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from flows.accelerator import LEASE_S

    docs = 16
    corpus = write_corpus(tmp_path / "news.parquet", "k", docs)
    db_path = tmp_path / "sidecar.duckdb"
    parts = Path(f"{db_path}.runs") / "parts"
    started, logs = pool_workers
    with api_client(deployed) as api:
        judges_before = len(judge_runs(api))
        nightly = api.read_deployment_by_name("nightly/nightly")
        # windows of 2 and a part per window: shard 0 has written some of its 8 documents when it is killed
        params = {"corpus": str(corpus), "title_column": None, "pair": "tiny", "max_new_tokens": 16, "batch_size": 2,
                  "window": 2, "commit_every_s": 0, "shards": 2, "db_path": str(db_path)}
        run = api.create_flow_run_from_deployment(nightly.id, parameters=params)
        first = wait_for(lambda: sorted(parts.glob("run-*/s0000-a01-*")), 600, "shard 0's first attempt")[0]
        [attempt] = wait_for(lambda: api.read_flow_runs(flow_run_filter=FlowRunFilter(
            name=FlowRunFilterName(any_=[first.name]))), 60, "its flow run")
        victim = wait_for(lambda: flow_run_process(started["gpu"], str(attempt.id)), 600,
                          f"a GPU worker's process for flow run {attempt.name}")
        wait_for(lambda: any(first.glob("part-*.parquet")), 600, "its first part", poll_s=0.02)
        victim.kill()  # SIGKILL, as kill -9
        killed_at = datetime.now(UTC)
        [chain] = wait_for_completed_chains(api, [run.id], timeout_s=900, logs=logs, crashed=frozenset({first.name}))
        shards = {shard.name: shard for shard in chain["nightly-shard"]}
        relaunch = next(shard for name, shard in shards.items() if name.startswith("s0000-a02-"))
        _, relaunch_held = held_gpu(api, relaunch)
        judges = chain_of(api, run.id)["judge"]
        judges_after = len(judge_runs(api))

    run_id = chain["nightly"].name
    # the worker saw its process die and said so; the parent relaunched shard 0 once, shard 1 ran once
    assert shards[first.name].state_name == "Crashed"
    assert sorted(name[:9] for name in shards) == ["s0000-a01", "s0000-a02", "s0001-a01"]
    # the dead attempt's GPU slot was no longer held once its lease ran out
    assert (relaunch_held - killed_at).total_seconds() < LEASE_S + 45, (killed_at, relaunch_held)
    db = Database(db_path)
    tried = db.shard_attempts(run_id)
    assert [(a["shard"], a["attempt"], a["status"]) for a in tried] == [
        (0, 1, "crashed"), (0, 2, "completed"), (1, 1, "completed")]
    assert {a["flow_run_id"] for a in tried} == {str(shard.id) for shard in shards.values()}
    # the relaunch got exactly shard 0's documents the killed attempt had not written
    killed_done = part_doc_ids(first)
    [second] = [d for d in first.parent.iterdir() if d.name == relaunch.name]
    assert killed_done, "the kill came before shard 0's first part"
    assert manifest_ids(second) == manifest_ids(first) - killed_done
    assert manifest_ids(second), "the kill came after shard 0 had finished"
    assert_each_doc_and_mode_once(db, run_id, [f"k{i:02d}" for i in range(docs)])
    assert db.get_run(run_id)["status"] == "completed"
    assert chain["nightly"].state_name == "Completed"
    assert len(judges) == 1 and judges_after == judges_before + 1, [(r.name, r.parameters) for r in judges]


def test_two_runs_at_once_on_two_gpu_workers_both_finish_each_on_its_own_gpu(
        deployed: dict[str, str], pool_workers: PoolWorkers, tmp_path: Path) -> None:
    docs = {"two-a": 10, "two-b": 6}
    db_path = tmp_path / "sidecar.duckdb"  # one database, two parents writing it
    _, logs = pool_workers
    with api_client(deployed) as api:
        judges_before = len(judge_runs(api))
        nightly = api.read_deployment_by_name("nightly/nightly")
        starts = []
        for run_id, n in docs.items():
            corpus = write_corpus(tmp_path / f"{run_id}.parquet", f"{run_id}-", n)
            params = {"corpus": str(corpus), "title_column": None, "pair": "tiny", "max_new_tokens": 8, "shards": 1,
                      "run_id": run_id, "db_path": str(db_path)}
            starts.append(api.create_flow_run_from_deployment(nightly.id, parameters=params))
        chains = wait_for_completed_chains(api, [run.id for run in starts], timeout_s=900, logs=logs)
        limits = {}
        for chain in chains:
            [shard] = chain["nightly-shard"]
            limits[chain["nightly"].name], _ = held_gpu(api, shard)
        judges = {chain["nightly"].name: chain_of(api, chain["nightly"].id)["judge"] for chain in chains}
        judges_after = len(judge_runs(api))

    assert [chain["nightly"].name for chain in chains] == list(docs)
    # both parents ran at the same time (neither queued behind the other), and each one's shard took a GPU of
    # its own: neither waited for the other's
    parents = [(chain["nightly"].start_time, chain["nightly"].end_time) for chain in chains]
    assert max(start for start, _ in parents) < min(end for _, end in parents), parents
    assert set(limits.values()) == {f"gpu-{HOST}-0", f"gpu-{HOST}-1"}, limits
    db = Database(db_path)
    for run_id, n in docs.items():
        assert db.get_run(run_id)["status"] == "completed"
        assert_each_doc_and_mode_once(db, run_id, [f"{run_id}-{i:02d}" for i in range(n)])
        assert [(a["shard"], a["status"]) for a in db.shard_attempts(run_id)] == [(0, "completed")]
        assert len(judges[run_id]) == 1, judges
    assert judges_after == judges_before + len(docs)


# -- a run's parameters, without workers --


def runs_of(api, deployment: str, run_id: str) -> list:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    found = api.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment])))
    return [run for run in found if run.parameters.get("run_id") == run_id]


def test_one_overridden_parameter_keeps_every_other_one_through_the_api_and_the_cli(
        deployed: dict[str, str], api) -> None:
    from flows.nightly import NightlyParams

    nightly = api.read_deployment_by_name("nightly/nightly")
    by_api = api.create_flow_run_from_deployment(nightly.id, parameters={"limit": 4})
    done = subprocess.run([str(PREFECT), "deployment", "run", "nightly/nightly", "-p", "limit=4"], env=deployed,
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    by_cli = api.read_flow_run(re.search(r"UUID: (\S+)", done.stdout)[1])
    try:
        for run in (by_api, by_cli):
            assert run.parameters == nightly.parameters | {"limit": 4}
            params = NightlyParams.model_validate(run.parameters)
            assert (params.limit, params.shard_deployment, params.shards, params.title_column, params.db_path) == (
                4, "nightly-shard/nightly-shard", 2, "title", "data/sidecar.duckdb")
    finally:
        for run in (by_api, by_cli):
            api.delete_flow_run(run.id)


def test_a_value_a_field_refuses_is_refused_when_the_run_is_created(deployed: dict[str, str], api) -> None:
    from prefect.exceptions import PrefectHTTPStatusError

    nightly = api.read_deployment_by_name("nightly/nightly")
    # the scheduler adds the nightly schedule's runs when it comes round, maybe while this test runs
    made = lambda: {run.id for run in api.read_flow_runs() if not run.auto_scheduled}  # noqa: E731
    before = made()
    with pytest.raises(PrefectHTTPStatusError, match=r"limit"):
        api.create_flow_run_from_deployment(nightly.id, parameters={"limit": 0})
    done = subprocess.run([str(PREFECT), "deployment", "run", "nightly/nightly", "-p", "batch_size=0"], env=deployed,
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "batch_size" in done.stdout + done.stderr, done.stdout + done.stderr
    assert made() == before


def test_the_triggers_hand_the_runs_db_path_and_pair_on_when_it_overrides_only_one_field(
        deployed: dict[str, str], api, tmp_path: Path) -> None:
    from prefect.states import Completed

    db_path = str(tmp_path / "one.duckdb")
    nightly = api.read_deployment_by_name("nightly/nightly")
    run = api.create_flow_run_from_deployment(nightly.id, parameters={"db_path": db_path})
    api.set_flow_run_state(run.id, Completed(), force=True)
    [judge] = wait_for(lambda: runs_of(api, "judge", run.name), 120, "the judge run the trigger starts", poll_s=0.5)
    assert judge.parameters == {"run_id": run.name, "db_path": db_path, "judge_pair": "qwen-coder-small"}
    api.set_flow_run_state(judge.id, Completed(), force=True)
    [report] = wait_for(lambda: runs_of(api, "cost-report", run.name), 120, "the cost-report run", poll_s=0.5)
    assert report.parameters == {"run_id": run.name, "db_path": db_path}
    for started in (run, judge, report):
        api.delete_flow_run(started.id)
