"""Local shard processes: each slot's share of the machine, and an attempt's status from its process."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

from flows.shard_launch import ShardLaunch, new_launch_id
from flows.shard_processes import ShardProcess, slot_environment
from sidecar.devices import CPU_SLOT_ENV, accelerator_id


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
