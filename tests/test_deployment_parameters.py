"""A nightly deployment run that overrides one parameter keeps the deployment's others, on a real `prefect server
start` with prefect.yaml deployed (infra/deploy.sh): through the API, through `prefect deployment run -p`, and
through the triggers, which hand the run's db_path and pair on to judge and its db_path to cost-report. A value a
field refuses is refused when the run is created. No worker runs here: the runs are created, read and deleted (the
triggers fire on a Completed state set through the API)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import test_deployments
from test_deployments import PREFECT, REPO, wait_for

# test_deployments.py's fixtures: a real server on loopback, prefect.yaml deployed on it, a client
server, deployed, api = test_deployments.server, test_deployments.deployed, test_deployments.api

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.timeout(600)]


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
    before = len(api.read_flow_runs())
    with pytest.raises(PrefectHTTPStatusError, match=r"limit"):
        api.create_flow_run_from_deployment(nightly.id, parameters={"limit": 0})
    done = subprocess.run([str(PREFECT), "deployment", "run", "nightly/nightly", "-p", "batch_size=0"], env=deployed,
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "batch_size" in done.stdout + done.stderr, done.stdout + done.stderr
    assert len(api.read_flow_runs()) == before


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
