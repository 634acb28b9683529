"""On a Prefect server a run holds a slot of the concurrency limit its worker's environment names
(``SIDECAR_GPU_LIMIT``, one per GPU on a pool of several), not of one shared ``gpu``: runs on two GPUs never
wait for each other."""

from __future__ import annotations

import pytest


def slots(names: list[str]) -> dict[str, int]:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return {name: client.read_global_concurrency_limit_by_name(name).active_slots for name in names}


def logs(flow_run_id) -> list[str]:
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    APILogWorker.instance().drain()  # logs reach the API in the background
    with get_client(sync_client=True) as client:
        return [log.message for log in client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(
            any_=[flow_run_id])))]


@pytest.fixture
def two_gpu_limits(prefect_api) -> list[str]:
    from prefect import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    names = ["gpu-testhost-0", "gpu-testhost-1"]
    with get_client(sync_client=True) as client:
        for name in names:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
    yield names
    with get_client(sync_client=True) as client:
        for name in names:
            client.delete_global_concurrency_limit_by_name(name)


def test_a_run_holds_the_limit_its_environment_names_and_not_another_gpus(
        two_gpu_limits: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect import flow
    from prefect.concurrency.sync import concurrency
    from prefect.runtime import flow_run

    from flows.accelerator import gpu_limit, holding_accelerator

    assert gpu_limit() == "gpu", "without the variable, the single-GPU limit of before"
    busy, mine = two_gpu_limits
    monkeypatch.setenv("SIDECAR_GPU_LIMIT", mine)

    @flow
    def hold() -> tuple[str, dict[str, int]]:
        # wait_s=0 on the device lock: the test fails at once instead of hanging if the run had to wait
        with holding_accelerator("run on GPU 1", wait_s=0):
            return flow_run.get_id(), slots(two_gpu_limits)

    with concurrency(busy, occupy=1, timeout_seconds=30):  # another run has GPU 0
        flow_run_id, held = hold()
    assert held == {busy: 1, mine: 1}
    assert slots(two_gpu_limits) == {busy: 0, mine: 0}, "the slot is released when the run lets go"
    assert f"run on GPU 1: taking a slot of the '{mine}' concurrency limit (waits while other runs hold it)" in logs(
        flow_run_id)


def test_a_process_told_its_api_is_a_parents_embedded_one_takes_no_limit_there(
        prefect_api, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a local shard process of a parent on its embedded API: PREFECT_API_URL is set, and no limit exists there
    from prefect import flow
    from prefect.runtime import flow_run

    from flows.accelerator import holding_accelerator
    from flows.embedded import EMBEDDED_API_ENV, on_embedded_api

    monkeypatch.setenv("SIDECAR_GPU_LIMIT", "gpu-nobody-created-0")
    monkeypatch.setenv("SIDECAR_LOCK_DIR", str(tmp_path))

    @flow
    def hold() -> str:
        with holding_accelerator("shard 0", wait_s=0):
            return flow_run.get_id()

    monkeypatch.delenv(EMBEDDED_API_ENV, raising=False)
    assert not on_embedded_api(), "an API URL alone is a server's"
    on_server = logs(hold())
    assert any("'gpu-nobody-created-0'] do not exist" in m for m in on_server), on_server

    monkeypatch.setenv(EMBEDDED_API_ENV, "1")
    assert on_embedded_api()
    told = logs(hold())
    assert not any("concurrency limit" in m or "do not exist" in m for m in told), told
    assert any(m.startswith("shard 0: holding accelerator") for m in told), "the OS lock is still taken"


def test_a_parents_local_shard_processes_are_told_what_api_it_is_on(prefect_api, monkeypatch) -> None:
    import flows.nightly
    from flows.embedded import EMBEDDED_API_ENV
    from flows.nightly_params import NightlyParams

    monkeypatch.delenv(EMBEDDED_API_ENV, raising=False)
    on_server = flows.nightly._launcher(NightlyParams(workers=2))
    assert not on_server.embedded and on_server.api_url.rstrip("/") == prefect_api["PREFECT_API_URL"].rstrip("/")
    monkeypatch.setattr("flows.embedded.on_embedded_api", lambda: True)
    assert flows.nightly._launcher(NightlyParams(workers=2)).embedded
