"""prefect.yaml against a real `prefect server start` on loopback: what `prefect deploy --all` creates, and the
trigger chain nightly -> judge -> cost-report run by a real process worker with the tiny pair."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from storage import Database

REPO = Path(__file__).resolve().parents[1]
PREFECT = Path(sys.executable).parent / "prefect"

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM the process group, SIGKILL what is left after ``grace_s``."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A Prefect server on a free loopback port with its own PREFECT_HOME; yields the environment to reach it."""
    home = tmp_path_factory.mktemp("prefect-server-home")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")} | {
        "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api", "SIDECAR_REPO": str(REPO)}
    log = (home / "server.log").open("wb")
    proc = subprocess.Popen([str(PREFECT), "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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
def deployed(server: dict[str, str]) -> dict[str, str]:
    for command in ([str(PREFECT), "work-pool", "create", "sidecar-pool", "--type", "process"],
                    [str(PREFECT), "--no-prompt", "deploy", "--all", "--prefect-file", "prefect.yaml"]):
        done = subprocess.run(command, env=server, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
    return server


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


def test_deploy_all_creates_the_three_deployments(api) -> None:
    from flows.nightly import NightlyParams

    deployments = {d.name: d for d in api.read_deployments()}
    assert set(deployments) == {"nightly", "judge", "cost-report"}
    assert {d.work_pool_name for d in deployments.values()} == {"sidecar-pool"}
    assert {d.entrypoint for d in deployments.values()} == {
        "flows/nightly.py:nightly", "flows/judge.py:judge", "flows/cost_report.py:cost_report"}
    assert all(d.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}]
               for d in deployments.values())

    nightly = deployments["nightly"]
    [schedule] = nightly.schedules
    assert schedule.active and (schedule.schedule.cron, schedule.schedule.timezone) == ("0 2 * * *", "UTC")
    assert nightly.global_concurrency_limit.limit == 1
    params = NightlyParams.model_validate(nightly.parameters["params"])
    assert (params.pair, params.db_path, params.title_column) == ("qwen-coder-small", "data/sidecar.duckdb", "title")
    # the UI renders the run form from this schema: one object parameter with the model's fields
    schema = nightly.parameter_openapi_schema
    assert list(schema["properties"]) == ["params"]
    assert {"corpus", "batch_size", "sidecar_tasks", "modes", "run_id"} <= set(
        schema["definitions"]["NightlyParams"]["properties"])
    assert not deployments["judge"].schedules and not deployments["cost-report"].schedules


def test_triggers_start_judge_after_nightly_and_cost_report_after_judge(api) -> None:
    deployments = {d.name: d for d in api.read_deployments()}
    automations = {a.name: a for a in api.read_automations()}
    assert set(automations) == {"judge-after-nightly", "cost-report-after-judge"}
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


def test_a_nightly_deployment_run_triggers_judge_then_cost_report(deployed: dict[str, str], tmp_path: Path) -> None:
    corpus = tmp_path / "news.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "article": [
        "The city council approved a new budget on Tuesday after a long debate about schools.",
        "Officials said the plan would add jobs at the plant in the north of the state."]}), corpus)
    db_path = tmp_path / "sidecar.duckdb"
    worker_log = (tmp_path / "worker.log").open("wb")
    # the worker polls every 2 s instead of 10: each of the three flow runs starts sooner
    worker = subprocess.Popen([str(PREFECT), "worker", "start", "--pool", "sidecar-pool", "--type", "process"],
                              env=deployed | {"PREFECT_WORKER_QUERY_SECONDS": "2"}, cwd=tmp_path, stdout=worker_log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with api_client(deployed) as api:
            nightly = api.read_deployment_by_name("nightly/nightly")
            started = api.create_flow_run_from_deployment(nightly.id, parameters={"params": {
                "corpus": str(corpus), "pair": "tiny", "max_new_tokens": 8, "db_path": str(db_path)}})
            runs = wait_for_completed_chain(api, started.id, timeout_s=900, log=tmp_path / "worker.log")
    finally:
        stop(worker)
        worker_log.close()

    run_id = runs["nightly"].name
    assert run_id.startswith("nightly-")
    assert runs["judge"].parameters == {"run_id": run_id, "db_path": str(db_path), "judge_pair": "tiny"}
    assert runs["cost-report"].parameters == {"run_id": run_id, "db_path": str(db_path)}
    db = Database(db_path)
    assert db.get_run(run_id)["status"] == "completed" and len(db.results(run_id)) == 2
    assert db.query("SELECT count(*) AS n FROM costs WHERE run_id = ?", [run_id])[0]["n"] > 0


def wait_for_completed_chain(api, nightly_run_id, timeout_s: float, log: Path) -> dict:
    """The nightly run and the judge and cost-report runs its completion set off, once all are Completed."""
    deadline = time.monotonic() + timeout_s
    while True:
        runs = {}
        for run in api.read_flow_runs():
            flow = api.read_flow(run.flow_id).name
            # the schedule adds future nightly runs; judge and cost-report runs come only from the triggers
            if run.id == nightly_run_id or flow != "nightly":
                runs[flow] = run
        states = {flow: run.state_name for flow, run in runs.items()}
        failed = {flow: state for flow, state in states.items() if state in ("Failed", "Crashed")}
        assert not failed, f"{failed}\n{log.read_text(errors='replace')[-5000:]}"
        if set(runs) == {"nightly", "judge", "cost-report"} and set(states.values()) == {"Completed"}:
            return runs
        assert time.monotonic() < deadline, f"{states}\n{log.read_text(errors='replace')[-5000:]}"
        time.sleep(2)
