"""``sidecar ui`` end to end: it starts a Prefect server, deploys prefect.yaml and starts a worker; a nightly run
created through the REST API as the UI's Custom run form creates it completes, with judge and cost report after
it; SIGTERM then stops everything the command started."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from storage import Database

REPO = Path(__file__).resolve().parents[1]
FAILED = {"FAILED", "CRASHED", "CANCELLED"}

# `sidecar ui` starts a server, deploys and a worker, then a whole nightly run: ~2 minutes on a busy CPU
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> Any:
    try:
        response = httpx.get(url, timeout=10)
    except httpx.TransportError:
        return None
    return response.json() if response.status_code == 200 else None


def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def processes_with(home: Path) -> list[psutil.Process]:
    """The live processes whose environment holds ``PREFECT_HOME=home``: what the command started."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("PREFECT_HOME") == str(home) and alive(process):
                found.append(process)
        except psutil.Error:
            pass
    return found


def wait_for(done: Callable[[], Any], ui: subprocess.Popen, logs: Callable[[], str], timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (result := done()):
        assert ui.poll() is None, f"sidecar ui exited with {ui.returncode}\n{logs()}"
        assert time.monotonic() < deadline, f"not done after {timeout_s} s\n{logs()}"
        time.sleep(1)
    return result


def completed_chain(api: str, nightly_run_id: str, logs: Callable[[], str]) -> dict[str, dict] | None:
    """The nightly run and the judge and cost-report runs its completion set off, once all three are Completed."""
    runs = {"nightly": get(f"{api}/flow_runs/{nightly_run_id}")}
    downstream = {get(f"{api}/deployments/name/{name}/{name}")["id"]: name for name in ("judge", "cost-report")}
    found = httpx.post(f"{api}/flow_runs/filter", timeout=10,
                       json={"flow_runs": {"deployment_id": {"any_": list(downstream)}}}).raise_for_status().json()
    runs |= {downstream[run["deployment_id"]]: run for run in found}
    states = {name: run["state"]["type"] for name, run in runs.items()}
    assert not FAILED & set(states.values()), f"{states}\n{logs()}"
    return runs if len(runs) == 3 and set(states.values()) == {"COMPLETED"} else None


def test_a_nightly_run_from_the_ui_form_completes_and_sigterm_stops_everything(tmp_path: Path) -> None:
    home, port = tmp_path / "prefect", free_port()
    api = f"http://127.0.0.1:{port}/api"
    # the worker polls every 2 s instead of 10: each of the three flow runs starts sooner
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")} | {
        "PREFECT_HOME": str(home), "PYTHONPATH": str(REPO), "PREFECT_WORKER_QUERY_SECONDS": "2"}
    out = tmp_path / "ui.log"

    def logs() -> str:
        workers = [home / "sidecar-ui" / f"{name}.log" for name in ("worker", "gpu-workers")]
        return out.read_text(errors="replace") + "".join(w.read_text(errors="replace")[-5000:] for w in workers
                                                         if w.exists())

    with out.open("wb") as log:
        ui = subprocess.Popen([sys.executable, "-m", "cli", "ui", "--port", str(port)], cwd=tmp_path, env=env,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # the command starts the worker once prefect.yaml is deployed
        wait_for(lambda: all((get(f"{api}/work_pools/{pool}") or {}).get("status") == "READY"
                             for pool in ("sidecar-control", "sidecar-gpu")), ui, logs, 600)
        nightly = get(f"{api}/deployments/name/nightly/nightly")
        assert nightly is not None, logs()
        corpus, db_path = tmp_path / "news.parquet", tmp_path / "sidecar.duckdb"
        pq.write_table(pa.table({"id": ["a", "b", "c"], "title": ["Budget", "Jobs", "Storm"], "article": [
            "The city council approved a new budget on Tuesday after a long debate about schools.",
            "Officials said the plan would add jobs at the plant in the north of the state.",
            "A storm closed roads across the county and left thousands without power overnight."]}), corpus)
        # the fields changed; the server keeps the deployment's other parameters
        changed = {"corpus": str(corpus), "pair": "tiny", "limit": 2, "max_new_tokens": 8, "db_path": str(db_path)}
        started = httpx.post(f"{api}/deployments/{nightly['id']}/create_flow_run", timeout=10,
                             json={"parameters": changed}).raise_for_status().json()
        runs = wait_for(lambda: completed_chain(api, started["id"], logs), ui, logs, timeout_s=600)

        run_id = runs["nightly"]["name"]
        assert runs["judge"]["parameters"] == {"run_id": run_id, "db_path": str(db_path), "judge_pair": "tiny"}
        assert runs["cost-report"]["parameters"] == {"run_id": run_id, "db_path": str(db_path)}
        db = Database(db_path)
        assert db.get_run(run_id)["status"] == "completed"
        assert sorted(row["doc_id"] for row in db.results(run_id)) == ["a", "b"]
        assert db.query("SELECT count(*) AS n FROM costs WHERE run_id = ?", [run_id])[0]["n"] > 0

        started_processes = psutil.Process(ui.pid).children(recursive=True)
        commands = [" ".join(p.cmdline()) for p in started_processes]
        assert any("server start" in c for c in commands) and any("worker start" in c for c in commands), commands
        ui.send_signal(signal.SIGTERM)
        assert ui.wait(timeout=180) == 0, logs()
        assert [p for p in started_processes if alive(p)] == []
        assert processes_with(home) == []
    finally:
        if ui.poll() is None:
            os.killpg(ui.pid, signal.SIGKILL)
            ui.wait()
        for process in processes_with(home):
            process.kill()
