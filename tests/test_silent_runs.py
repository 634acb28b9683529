"""infra/crash-silent-runs.yaml on a real Prefect API: a flow run whose heartbeats stop is marked Crashed, one
that keeps beating or has ended is left alone. The file's 600 s window is cut to 10 s for the test (the server
looks at proactive triggers every 5 s); the heartbeats are sent as a flow run's engine sends them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import yaml

AUTOMATION = Path(__file__).resolve().parents[1] / "infra" / "crash-silent-runs.yaml"
WINDOW_S = 10


@pytest.fixture
def automation(prefect_api):
    """The file's automation on the test API, with a short window; deleted afterwards (the API is shared)."""
    from prefect import get_client
    from prefect.events.schemas.automations import AutomationCore

    spec = yaml.safe_load(AUTOMATION.read_text())
    spec["trigger"]["within"] = WINDOW_S
    with get_client(sync_client=True) as client:
        automation_id = client.create_automation(AutomationCore.model_validate(spec))
        yield automation_id
        client.delete_automation(automation_id)


def running_flow_run(name: str) -> str:
    from prefect import flow, get_client
    from prefect.states import Running

    @flow(name="silent-run-test")
    def placeholder() -> None: ...

    with get_client(sync_client=True) as client:
        return str(client.create_flow_run(placeholder, name=name, state=Running()).id)


def beat(*flow_run_ids: str) -> None:
    """One heartbeat event of each run, as the flow run engine emits it."""
    from prefect.events import Event
    from prefect.events.clients import get_events_client

    async def send() -> None:
        async with get_events_client() as events:
            for flow_run_id in flow_run_ids:
                await events.emit(Event(event="prefect.flow-run.heartbeat",
                                        resource={"prefect.resource.id": f"prefect.flow-run.{flow_run_id}"}))

    asyncio.run(send())


def state_of(flow_run_id: str):
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).state


def test_a_run_whose_heartbeats_stop_is_crashed_and_a_beating_or_ended_run_is_not(automation) -> None:
    from prefect import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.states import Completed

    silent, beating, ended = (running_flow_run(n) for n in ("silent", "beating", "ended"))
    beat(silent, beating, ended)
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(ended, Completed())
    deadline = time.monotonic() + 6 * WINDOW_S
    while state_of(silent).type != StateType.CRASHED:
        assert time.monotonic() < deadline, f"still {state_of(silent).type} after {6 * WINDOW_S} s"
        assert state_of(beating).type == StateType.RUNNING
        beat(beating)
        time.sleep(2)
    assert "No heartbeat" in state_of(silent).message
    # it went silent once it was crashed: one more window with heartbeats every 2 s keeps the other alive
    for _ in range(WINDOW_S // 2 + 3):
        beat(beating)
        time.sleep(2)
    assert state_of(beating).type == StateType.RUNNING
    assert state_of(ended).type == StateType.COMPLETED
