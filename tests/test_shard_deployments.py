"""flows.shard_deployments against a real Prefect API (no worker: the tests move the flow runs' states
themselves): one flow run per attempt, named after its launch id, without tags, created once however often
it is launched; its state read back as the attempt's status; cancel through the API."""

from __future__ import annotations

import uuid

import pytest

from flows.shard_launch import ShardLaunch, new_launch_id


@pytest.fixture(scope="module")
def deployment(prefect_api) -> str:
    """A deployment of the shard flow on the test API, under a name of its own (modules share the API)."""
    from prefect import get_client

    name = f"launcher-test-{uuid.uuid4().hex[:8]}"
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name("nightly-shard")
        client.create_deployment(flow_id=flow_id, name=name, entrypoint="flows/nightly_shard.py:nightly_shard")
    return f"nightly-shard/{name}"


def a_launch(shard: int = 0, attempt: int = 1) -> ShardLaunch:
    return ShardLaunch(run_id="run-1", launch_id=new_launch_id(shard, attempt), shard=shard, attempt=attempt,
                       results_uri="/tmp/parts", params={"corpus": "news.parquet", "pair": "tiny"})


def flow_run(flow_run_id: str):
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id)


def force(flow_run_id: str, state) -> None:
    """What a worker and the flow run's engine would report."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, state, force=True)


def test_each_attempt_is_one_flow_run_of_the_deployment_named_after_its_launch_id(deployment: str) -> None:
    from prefect import get_client

    from flows.shard_deployments import ShardDeployments

    launcher = ShardDeployments(deployment)
    launch = a_launch(shard=3, attempt=2)
    handle = launcher.launch(launch)
    run = flow_run(handle.flow_run_id)
    with get_client(sync_client=True) as client:
        assert run.deployment_id == client.read_deployment_by_name(deployment).id
    assert (run.name, run.parameters, run.tags) == (launch.launch_id, launch.parameters(), [])
    assert run.parent_task_run_id is None, "launched outside a flow: no parent to link to"
    assert handle.status() == "queued", "scheduled, not picked up by a worker yet"
    # the launch id is the idempotency key: a launch repeated (its answer lost) is the same flow run
    assert launcher.launch(launch).flow_run_id == handle.flow_run_id
    assert launcher.launch(a_launch(shard=3, attempt=2)).flow_run_id != handle.flow_run_id


def test_the_flow_runs_state_is_the_attempts_status(deployment: str) -> None:
    from prefect.client.schemas.objects import StateType
    from prefect.states import (
        AwaitingConcurrencySlot,
        Cancelled,
        Cancelling,
        Completed,
        Crashed,
        Failed,
        Late,
        Pending,
        Running,
    )

    from flows.shard_deployments import ShardDeployments

    launcher = ShardDeployments(deployment)
    for state, status in ((Late(), "queued"), (AwaitingConcurrencySlot(), "queued"),
                          (Pending(), "running"), (Running(), "running"), (Cancelling(), "running"),
                          (Completed(), "completed"), (Failed(), "failed"), (Crashed(), "crashed"),
                          (Cancelled(), "crashed")):
        handle = launcher.launch(a_launch())
        if state.type not in (StateType.SCHEDULED, StateType.PENDING):
            force(handle.flow_run_id, Running())  # a scheduled run is never Cancelling: nothing to stop yet
        force(handle.flow_run_id, state)
        assert flow_run(handle.flow_run_id).state.type == state.type
        assert handle.status() == status, state


def test_cancel_stops_a_scheduled_run_at_once_a_running_one_through_its_worker_and_leaves_a_finished_one(
        deployment: str) -> None:
    from prefect.client.schemas.objects import StateType
    from prefect.states import Completed, Running

    from flows.shard_deployments import ShardDeployments

    launcher = ShardDeployments(deployment)
    scheduled = launcher.launch(a_launch())
    scheduled.cancel()
    assert flow_run(scheduled.flow_run_id).state.type == StateType.CANCELLED
    assert scheduled.status() == "crashed"

    running = launcher.launch(a_launch())
    force(running.flow_run_id, Running())
    running.cancel()
    # its worker sees Cancelling, stops the process and reports Cancelled
    assert flow_run(running.flow_run_id).state.type == StateType.CANCELLING
    assert running.status() == "running"

    finished = launcher.launch(a_launch())
    force(finished.flow_run_id, Completed())
    finished.cancel()
    assert finished.status() == "completed"


def test_launched_from_a_flow_the_attempt_is_its_subflow(deployment: str) -> None:
    from prefect import flow, get_client
    from prefect.runtime import flow_run as current

    from flows.shard_deployments import ShardDeployments

    @flow
    def parent() -> tuple[str, str]:
        return current.get_id(), ShardDeployments(deployment).launch(a_launch()).flow_run_id

    parent_id, child_id = parent()
    child = flow_run(child_id)
    with get_client(sync_client=True) as client:
        assert str(client.read_task_run(child.parent_task_run_id).flow_run_id) == parent_id
