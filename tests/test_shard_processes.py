"""Local shard processes: each slot's share of the machine, and an attempt's status from its process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from flows.shard_launch import ShardLaunch, new_launch_id
from flows.shard_processes import ShardProcess, slot_environment
from sidecar.models.devices import CPU_SLOT_ENV, accelerator_id

pytestmark = pytest.mark.servers  # shard attempts in processes


def test_each_slot_gets_its_share_of_the_cores_or_its_own_gpu() -> None:
    cpu = [slot_environment(slot, 2, gpus=[], cores=5) for slot in range(2)]
    assert [e["OMP_NUM_THREADS"] for e in cpu] == ["2", "2"]
    assert [e[CPU_SLOT_ENV] for e in cpu] == ["0", "1"] and not any("CUDA_VISIBLE_DEVICES" in e for e in cpu)
    assert cpu[0]["SIDECAR_GPU_LIMIT"] != cpu[1]["SIDECAR_GPU_LIMIT"]
    assert slot_environment(0, 4, gpus=[], cores=2)["OMP_NUM_THREADS"] == "1"
    gpu = [slot_environment(slot, 3, gpus=["2", "GPU-abc"], cores=16) for slot in range(3)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in gpu] == ["2", "GPU-abc", "2"]
    assert not any(CPU_SLOT_ENV in e for e in gpu)


def test_a_cpu_slot_is_an_accelerator_of_its_own(monkeypatch) -> None:
    monkeypatch.delenv(CPU_SLOT_ENV, raising=False)
    assert accelerator_id("cpu") == "cpu"
    monkeypatch.setenv(CPU_SLOT_ENV, "1")
    assert accelerator_id("cpu") == "cpu-1"


def test_launch_ids_are_unique_and_name_shard_and_attempt() -> None:
    ids = {new_launch_id(3, 2) for _ in range(100)}
    assert len(ids) == 100 and all(i.startswith("s0003-a02-") for i in ids)


def attempt(code: str) -> ShardProcess:
    launch = ShardLaunch("run", new_launch_id(0, 1), 0, 1, "/nowhere")
    return ShardProcess(launch, 0, subprocess.Popen([sys.executable, "-c", code], process_group=0))


def ended(handle: ShardProcess) -> str:
    deadline = time.monotonic() + 30
    while (status := handle.status()) == "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    return status


@pytest.mark.parametrize(("code", "status"), [("pass", "completed"), ("raise SystemExit(3)", "failed"),
                                               ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
                                                "crashed")])
def test_an_attempts_status_comes_from_its_exit(code: str, status: str) -> None:
    assert ended(attempt(code)) == status


def test_cancel_stops_the_attempts_whole_process_group() -> None:
    # the attempt starts a child of its own, as a library might; cancel stops both
    handle = attempt("import subprocess, time; subprocess.Popen(['sleep', '600']); time.sleep(600)")
    deadline = time.monotonic() + 30
    while not (children := psutil.Process(handle.pid).children()) and time.monotonic() < deadline:
        time.sleep(0.05)
    [child] = children
    assert handle.status() == "running"
    handle.cancel()
    assert handle.status() == "crashed" and handle.process.returncode == -signal.SIGTERM
    child.wait(timeout=30)


def test_attempts_are_told_the_parents_api_is_embedded_only_when_it_is(monkeypatch) -> None:
    from flows.embedded import EMBEDDED_API_ENV
    from flows.shard_processes import ShardProcesses

    monkeypatch.delenv(EMBEDDED_API_ENV, raising=False)
    embedded = ShardProcesses(2, "http://127.0.0.1:4321/api", embedded=True)
    assert [embedded.environment(slot)[EMBEDDED_API_ENV] for slot in range(2)] == ["1", "1"]
    assert embedded.environment(1)["PREFECT_API_URL"] == "http://127.0.0.1:4321/api"
    # on a server the attempts take their slots' limits, even when this process was itself told otherwise
    monkeypatch.setenv(EMBEDDED_API_ENV, "1")
    on_server = ShardProcesses(2, "http://prefect.internal:4200/api", embedded=False)
    assert not any(EMBEDDED_API_ENV in on_server.environment(slot) for slot in range(2))
    assert on_server.environment(1)["SIDECAR_GPU_LIMIT"].endswith("-1")


LAST_WORDS = """
import atexit, pathlib, sys
from prefect import flow, get_run_logger
from flows.process_exit import exit_now

atexit.register(lambda: pathlib.Path(sys.argv[2]).write_text("the interpreter's teardown ran"))

@flow(name="exit-now-check", flow_run_name="{tag}")
def last_words(tag: str) -> None:
    get_run_logger().info("last words of %s", tag)

last_words(sys.argv[1])
exit_now(3)
"""


def test_a_shard_process_exits_at_once_after_its_flow_run_keeping_its_last_logs(prefect_api, tmp_path) -> None:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, LogFilter, LogFilterFlowRunId

    from flows.shard_processes import REPO

    tag, teardown = f"exit-now-{new_launch_id(0, 1)}", tmp_path / "teardown"
    env = os.environ | prefect_api | {"PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", LAST_WORDS, tag, str(teardown)], env=env, timeout=300)
    assert done.returncode == 3
    assert not teardown.exists(), "the process went through the interpreter's teardown"
    with get_client(sync_client=True) as client:
        [run] = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[tag])))
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
    assert run.state.is_completed()
    messages = [log.message for log in logs]
    assert f"last words of {tag}" in messages, messages
    assert any(m.startswith("Finished in state Completed") for m in messages), "the engine's last log was lost"


def test_an_undrained_prefect_takes_the_normal_exit(monkeypatch) -> None:
    import flows.process_exit

    monkeypatch.setattr(flows.process_exit, "drain_prefect", lambda: False)
    monkeypatch.setattr(os, "_exit", lambda code: pytest.fail("left without sending what Prefect holds"))
    with pytest.raises(SystemExit) as exited:
        flows.process_exit.exit_now(4)
    assert exited.value.code == 4


def test_the_launcher_wakes_the_parent_as_soon_as_an_attempts_process_ends() -> None:
    from flows.shard_processes import ShardProcesses, _pidfd

    launcher = ShardProcesses(2, "http://127.0.0.1:4321/api", embedded=True)
    started = time.monotonic()
    launcher.wait(0.2)
    assert time.monotonic() - started >= 0.2, "nothing running: the whole timeout"
    handle = attempt("import time; time.sleep(1)")
    handle.pidfd = _pidfd(handle.pid)
    launcher.slots[1] = handle
    launcher.wait(120)
    assert time.monotonic() - started < 60, "waited for the timeout, not for the process"
    assert handle.status() == "completed" and handle.pidfd is None
