"""Children die with their parent, ``kill -9`` included: a tethered child, and Prefect's embedded API server
that ``sidecar nightly`` starts (it once kept listening on its port for as long as the machine ran)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.servers  # parents, children and Prefect servers in processes, killed for real

REPO = Path(__file__).resolve().parents[1]


def gone(pid: int) -> bool:
    # an orphan that died may linger as a zombie where PID 1 does not reap: gone all the same
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.1)
    return False


def start_parent(code: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)


def read_until_ready(parent: subprocess.Popen[str]) -> list[str]:
    lines: list[str] = []
    for line in parent.stdout:
        lines.append(line)
        if line.startswith("ready"):
            return lines
    raise AssertionError(f"the parent exited with {parent.wait()} before it was ready:\n{''.join(lines)}")


TETHERED_SLEEPER = """
    import subprocess, time
    from server.tether import tether
    child = subprocess.Popen(["sleep", "600"])
    tether(child.pid)
    print("ready", child.pid, flush=True)
    time.sleep(600)
"""


def test_a_tethered_child_dies_when_its_parent_is_killed() -> None:
    parent = start_parent(TETHERED_SLEEPER)
    try:
        child = int(read_until_ready(parent)[-1].split()[1])
        assert not gone(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        assert wait_gone(child, 10), f"the tethered child {child} outlived its parent"
    finally:
        parent.kill()
        parent.communicate(timeout=30)


EMBEDDED_FLOW = """
    import time
    from flows.embedded import embedded_prefect

    with embedded_prefect():
        from prefect import flow

        @flow
        def hold() -> None:
            print("ready", flush=True)
            time.sleep(600)

        hold()
"""


def prefect_servers(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children(recursive=True)
            if "prefect.server.api.server:create_app" in " ".join(p.cmdline())]


def test_the_embedded_prefect_server_dies_when_its_flow_process_is_killed(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env |= {"PREFECT_HOME": str(tmp_path / "prefect"), "PYTHONPATH": str(REPO)}
    parent = start_parent(EMBEDDED_FLOW, env)
    servers: list[psutil.Process] = []
    try:
        read_until_ready(parent)
        servers = prefect_servers(parent.pid)
        assert len(servers) == 1, servers
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        assert wait_gone(servers[0].pid, 10), f"Prefect's embedded server {servers[0].pid} outlived the flow's process"
    finally:
        parent.kill()
        for orphan in servers:  # what the test found left over, it stops
            with contextlib.suppress(psutil.NoSuchProcess):
                orphan.kill()
        parent.communicate(timeout=30)
