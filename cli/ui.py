"""``sidecar ui``: a local Prefect server with its UI, the deployments of prefect.yaml and the process workers
of both pools, in the foreground until Ctrl-C.

It runs infra/server.sh, infra/deploy.sh, infra/worker.sh (the sidecar-control pool's worker: parent runs, cost
reports) and infra/gpu-workers.sh (the sidecar-gpu pool's: one per GPU, or one CPU worker; shards, judge), the
scripts a permanent installation runs,
against a server on 127.0.0.1 with Prefect's state under ``PREFECT_HOME`` (default: ``.prefect/`` in this
checkout), each script in a session of its own with its output in a log file. Ctrl-C or SIGTERM stops the
worker, then the server, then whatever either of them started: nothing keeps running after the command.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import typer

REPO = Path(__file__).resolve().parents[1]
INFRA = REPO / "infra"
SERVER_START_TIMEOUT_S = 300  # the first start creates and migrates Prefect's SQLite database
DEPLOY_TIMEOUT_S = 300
WORKER_START_TIMEOUT_S = 120
STOP_GRACE_S = 30
# Prefect 3.9's process worker stays up after the SIGTERM (a SIGINT to itself) it documents as graceful,
# so it gets a few seconds only; its flow runs get signals of their own. gpu-workers.sh gives its workers 3 s.
WORKER_STOP_GRACE_S = 3
# each work pool with the infra/ script that starts its workers and their stop grace
WORKERS = (("sidecar-control", "worker", WORKER_STOP_GRACE_S), ("sidecar-gpu", "gpu-workers", 15))


class _Script:
    """One infra/ script running in a session of its own; ``stop`` ends it and every process it started."""

    def __init__(self, name: str, env: dict[str, str], logs: Path, grace_s: float) -> None:
        self.name = name
        self.grace_s = grace_s
        self.log = logs / f"{name}.log"
        with self.log.open("wb") as out:
            self.process = subprocess.Popen([str(INFRA / f"{name}.sh")], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def running(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL after ``grace_s``; then SIGTERM to each descendant, SIGKILL to the rest.

        The descendants need signals of their own: Prefect starts each flow run in a session of its own. A
        flow run stopped so ends Crashed; the next run with the same parameters resumes it from DuckDB.
        """
        descendants = self._descendants()
        self._signal_group(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while self.running() and time.monotonic() < deadline:
            descendants |= self._descendants()
            time.sleep(0.1)
        if self.running():
            self._signal_group(signal.SIGSTOP)  # from here on it starts nothing that would be missed
            descendants |= self._descendants()
            self._signal_group(signal.SIGKILL)
        self.process.wait()
        _end(descendants)

    def _signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signum)

    def _descendants(self) -> set:
        import psutil

        try:
            return set(psutil.Process(self.process.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            return set()


def _end(processes: set) -> None:
    """SIGTERM to each process, SIGKILL to those still alive after STOP_GRACE_S (a zombie has ended)."""
    import psutil

    def alive(process: psutil.Process) -> bool:
        try:
            return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    while (left := [p for p in processes if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for process in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def _environment(port: int) -> dict[str, str]:
    """The scripts' environment: this checkout, this interpreter's prefect, a server on 127.0.0.1:``port``."""
    home = Path(os.environ.get("PREFECT_HOME") or REPO / ".prefect").expanduser().resolve()
    prefect = Path(sys.executable).with_name("prefect")
    return os.environ | {
        "PREFECT_HOME": str(home),
        "PREFECT_PORT": str(port),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": os.environ.get("PREFECT_SERVER_ANALYTICS_ENABLED", "false"),
        "SIDECAR_REPO": str(REPO),
        "SIDECAR_PREFECT": str(prefect) if prefect.exists() else "prefect",
    }


def _wait_until(ready: Callable[[], bool], script: _Script, timeout_s: float) -> None:
    """Poll ``ready`` until it holds; exit with the script's log when the script ends or time runs out."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if not script.running():
            _fail(script, f"{script.name}.sh exited with status {script.process.returncode}")
        if time.monotonic() > deadline:
            _fail(script, f"{script.name}.sh was not ready after {timeout_s:.0f} s")
        time.sleep(0.5)


def _fail(script: _Script, message: str) -> None:
    typer.secho(f"error: {message}; the end of {script.log}:\n{script.log_tail()}", fg="red", err=True)
    raise typer.Exit(1)


def _get(url: str) -> dict | None:
    """The JSON at ``url``, or None while the server does not answer it."""
    import httpx

    try:
        response = httpx.get(url, timeout=5)
    except httpx.TransportError:
        return None
    return response.json() if response.status_code == 200 else None


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        # as the server binds: a port whose old connections linger in TIME_WAIT is free
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _instructions(port: int, logs: Path) -> str:
    ui = f"http://127.0.0.1:{port}"
    return f"""
Prefect UI: {ui}
(from another machine: ssh -L {port}:127.0.0.1:{port} HOST, then open it there)

Run nightly from the UI:
  1. Open {ui}/deployments and click nightly.
  2. Run (top right) -> Custom run.
  3. Change the fields you want, e.g. limit 4 (the first 4 articles) and pair
     (tiny: random weights, seconds; qwen-coder-small: the real one); every
     other field keeps the deployment's value.
  4. Submit. The run's page shows its logs, batches and progress; when it
     completes, judge and then cost-report run (Runs lists them).
  Results go to db_path (data/sidecar.duckdb in this checkout by default).

The nightly schedule (02:00 UTC) is on while this runs.
Logs: {logs}/server.log, worker.log, gpu-workers.log.
Ctrl-C stops the worker, the server and any run in flight.
"""


def ui_command(
    port: int = typer.Option(4200, min=1, max=65535, help="Port of the Prefect API and UI on 127.0.0.1."),
) -> None:
    """Start a local Prefect server with its UI, deploy prefect.yaml and start its workers; Ctrl-C stops them."""
    from rich.console import Console

    console = Console()
    if not _port_free(port):
        typer.secho(f"error: 127.0.0.1:{port} is in use (another Prefect server?); stop it or pass --port",
                    fg="red", err=True)
        raise typer.Exit(1)
    env = _environment(port)
    api, ui = env["PREFECT_API_URL"], f"http://127.0.0.1:{port}"
    logs = Path(env["PREFECT_HOME"]) / "sidecar-ui"
    logs.mkdir(parents=True, exist_ok=True)
    started: list[_Script] = []
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with console.status("Starting the Prefect server (its first start sets up a database)"):
            started.append(server := _Script("server", env, logs, STOP_GRACE_S))
            _wait_until(lambda: _get(f"{api}/health") is not None, server, SERVER_START_TIMEOUT_S)
        console.print(f"[green]✓[/] Prefect server at {ui}, state in {env['PREFECT_HOME']}")
        with console.status("Creating the work pools and the GPU limits, deploying prefect.yaml"):
            started.append(deploy := _Script("deploy", env, logs, STOP_GRACE_S))
            _wait_until(lambda: not deploy.running(), deploy, DEPLOY_TIMEOUT_S)
            if deploy.process.returncode != 0:
                _fail(deploy, f"deploy.sh exited with status {deploy.process.returncode}")
            if _get(f"{api}/deployments/name/nightly/nightly") is None:
                _fail(deploy, "deploy.sh created no nightly/nightly deployment")
        console.print(f"[green]✓[/] Deployed nightly, nightly-shard, judge and cost-report from {REPO}/prefect.yaml")
        workers = []
        for pool, script, grace_s in WORKERS:
            with console.status(f"Starting the process workers of {pool}"):
                started.append(worker := _Script(script, env, logs, grace_s))
                workers.append(worker)
                _wait_until(lambda pool=pool: (_get(f"{api}/work_pools/{pool}") or {}).get("status") == "READY",
                            worker, WORKER_START_TIMEOUT_S)
            console.print(f"[green]✓[/] Workers of {pool} running flow runs in {REPO}")
        console.print(_instructions(port, logs), highlight=False, soft_wrap=True)
        while True:
            for script in (server, *workers):
                if not script.running():
                    _fail(script, f"the {script.name} stopped (status {script.process.returncode})")
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        # a second Ctrl-C must not cut the stopping short; it ends in SIGKILL if a process hangs
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with console.status("Stopping the workers, then the server"):
            for script in reversed(started):
                script.stop()
        if started:
            console.print("Stopped: nothing that sidecar ui started is running.")
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, previous)
