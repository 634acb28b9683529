"""``sidecar ui`` end to end: it starts a Prefect server, deploys prefect.yaml and starts its workers. A nightly run
made in a real browser on the deployment's Run -> Custom run form (headless Chromium, tests/browser.py), with only
the document limit, the pair and the paths changed, completes with the deployment's other parameters, and judge and
cost report after it; so does one created through the REST API with only those fields; SIGTERM then stops
everything the command started. Screenshots of the filled form and the completed run go to test-artifacts/.

Both runs are made on one `sidecar ui` (the module's ``ui``): starting it, its server, the deploys and the workers
costs some 40 s of CPU, which a second start would pay again for nothing either test checks. The SIGTERM test
stops it, so it comes last."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from browser import artifacts_dir, headless_chromium

from storage import Database

REPO = Path(__file__).resolve().parents[1]
FAILED = {"FAILED", "CRASHED", "CANCELLED"}

# `sidecar ui` starts a server, deploys and a worker, then a whole nightly run: ~3 minutes on a busy CPU
pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.timeout(600)]
TEXTS = ["The city council approved a new budget on Tuesday after a long debate about schools.",
         "Officials said the plan would add jobs at the plant in the north of the state.",
         "A storm closed roads across the county and left thousands without power overnight."]


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
    """The nightly run and the judge and cost-report runs its completion set off (those given its run id: the
    server may hold other runs' chains), once all three are Completed."""
    runs = {"nightly": get(f"{api}/flow_runs/{nightly_run_id}")}
    downstream = {get(f"{api}/deployments/name/{name}/{name}")["id"]: name for name in ("judge", "cost-report")}
    found = httpx.post(f"{api}/flow_runs/filter", timeout=10,
                       json={"flow_runs": {"deployment_id": {"any_": list(downstream)}}}).raise_for_status().json()
    mine = [run for run in found if run["parameters"].get("run_id") == runs["nightly"]["name"]]
    runs |= {downstream[run["deployment_id"]]: run for run in mine}
    states = {name: run["state"]["type"] for name, run in runs.items()}
    assert not FAILED & set(states.values()), f"{states}\n{logs()}"
    return runs if len(runs) == 3 and set(states.values()) == {"COMPLETED"} else None


@dataclass
class Ui:
    """A running `sidecar ui`: its process, its API and UI addresses, its PREFECT_HOME and a reader of its logs."""

    process: subprocess.Popen
    url: str
    home: Path
    logs: Callable[[], str]

    @property
    def api(self) -> str:
        return f"{self.url}/api"

    def wait_for(self, done: Callable[[], Any], timeout_s: float) -> Any:
        return wait_for(done, self.process, self.logs, timeout_s)


@contextlib.contextmanager
def sidecar_ui(tmp_path: Path) -> Iterator[Ui]:
    """`sidecar ui` on a free port with its own PREFECT_HOME, once both pools' workers are ready; whatever it
    started is killed afterwards, also when the test fails."""
    home, port = tmp_path / "prefect", free_port()
    # the worker polls every 2 s instead of 10: each of the three flow runs starts sooner
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")} | {
        "PREFECT_HOME": str(home), "PYTHONPATH": str(REPO), "PREFECT_WORKER_QUERY_SECONDS": "2"}
    out = tmp_path / "ui.log"

    def logs() -> str:
        workers = [home / "sidecar-ui" / f"{name}.log" for name in ("worker", "gpu-workers")]
        return out.read_text(errors="replace") + "".join(w.read_text(errors="replace")[-5000:] for w in workers
                                                         if w.exists())

    with out.open("wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "cli", "ui", "--port", str(port)], cwd=tmp_path, env=env,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    ui = Ui(process, f"http://127.0.0.1:{port}", home, logs)
    try:
        # the command starts the workers once prefect.yaml is deployed
        ui.wait_for(lambda: all((get(f"{ui.api}/work_pools/{pool}") or {}).get("status") == "READY"
                                for pool in ("sidecar-control", "sidecar-gpu")), 600)
        yield ui
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        for left in processes_with(home):
            left.kill()


@pytest.fixture(scope="module")
def ui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ui]:
    """The module's `sidecar ui`, whichever of its tests runs first."""
    with sidecar_ui(tmp_path_factory.mktemp("ui")) as started:
        yield started


def write_corpus(path: Path) -> Path:
    pq.write_table(pa.table({"id": ["a", "b", "c"], "title": ["Budget", "Jobs", "Storm"], "article": TEXTS}), path)
    return path


def assert_completed_with_judge_and_cost_report(runs: dict[str, dict], db_path: Path) -> None:
    """The chain's runs got the nightly run's id and database, and DuckDB holds the run's 2 documents and costs."""
    run_id = runs["nightly"]["name"]
    assert runs["judge"]["parameters"] == {"run_id": run_id, "db_path": str(db_path), "judge_pair": "tiny"}
    assert runs["cost-report"]["parameters"] == {"run_id": run_id, "db_path": str(db_path)}
    db = Database(db_path)
    assert db.get_run(run_id)["status"] == "completed"
    assert sorted(row["doc_id"] for row in db.results(run_id)) == ["a", "b"]
    assert {row["title"] for row in db.query("SELECT title FROM documents WHERE run_id = ?", [run_id])} == {
        "Budget", "Jobs"}, "the deployment's title_column was kept"
    assert db.query("SELECT count(*) AS n FROM costs WHERE run_id = ?", [run_id])[0]["n"] > 0


def runs_of(api: str, deployment_id: str) -> list[dict]:
    return httpx.post(f"{api}/flow_runs/filter", timeout=10, json={
        "flow_runs": {"deployment_id": {"any_": [deployment_id]}}}).raise_for_status().json()


def form_field(driver: Any, name: str) -> Any:
    """The run form's block of parameter ``name``: its label, description, type switch and input."""
    from selenium.webdriver.common.by import By

    return driver.find_element(By.XPATH, f"//span[contains(@class, 'schema-form-property__label')]"
                                         f"[normalize-space(.)='{name} (Optional)']/ancestor::div[contains("
                                         f"concat(' ', normalize-space(@class), ' '), ' schema-form-property ')][1]")


def type_into(element: Any, text: str) -> None:
    from selenium.webdriver.common.keys import Keys

    element.send_keys(Keys.CONTROL, "a")
    element.send_keys(Keys.DELETE)
    element.send_keys(text)


def fill_the_form(driver: Any, fields: dict[str, str]) -> None:
    """Type each value into its field as a user does; a field whose default is None is switched to its type first."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    for name, value in fields.items():
        block = WebDriverWait(driver, 120).until(lambda d, name=name: form_field(d, name))
        # the type switch of a field that may be None ("int | None"): its other button
        switch = ".//div[contains(@class, 'p-button-group')]/button"
        if block.find_elements(By.XPATH, f"{switch}[@aria-selected='true'][normalize-space(.)='None']"):
            block.find_element(By.XPATH, f"{switch}[normalize-space(.)!='None']").click()
        entry = WebDriverWait(driver, 30).until(
            lambda d, name=name: form_field(d, name).find_element(By.CSS_SELECTOR, "textarea, input"))
        type_into(entry, value)


SUBMITS = 3


def submit(driver: Any, submitted: Callable[[], list[dict]], ui: Ui) -> list[dict]:
    """Click Submit until the run exists, as a user does after an error: Prefect's SQLite-backed API answers a
    write it finds the database locked for with 503, which its Python client retries and the UI shows as an error
    ("Oops. Something went wrong"). At most SUBMITS clicks; returns the runs the form created."""
    from selenium.webdriver.common.by import By

    def error_toasts() -> list[Any]:
        # an error toast's icon, in its toast
        return driver.find_elements(By.XPATH, "//*[contains(@class, 'p-toast__icon--error')]/..")

    errors: list[str] = []
    for _ in range(SUBMITS):
        before = len(error_toasts())
        button = driver.find_element(By.XPATH, "//button[@type='submit'][normalize-space(.)='Submit']")
        driver.execute_script("arguments[0].click();", button)  # an earlier error's toast may lie over it

        def answered(before: int = before) -> list[dict] | str | None:
            return submitted() or (" / ".join(t.text for t in toasts[before:]) if len(
                toasts := error_toasts()) > before else None)

        outcome = ui.wait_for(answered, timeout_s=60)
        if isinstance(outcome, list):
            return outcome
        errors.append(outcome)
    raise AssertionError(f"the form's Submit made no run in {SUBMITS} tries: {errors}\n{ui.logs()}")


def test_a_run_submitted_from_the_custom_run_form_in_a_browser_completes_with_its_judge_and_cost_report(
        ui: Ui, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from flows.nightly_params import NightlyParams

    artifacts = artifacts_dir()
    corpus, db_path = write_corpus(tmp_path / "news.parquet"), tmp_path / "sidecar.duckdb"
    # the document limit and the tiny pair, as the user; the paths, so the run touches no checkout file
    changed = {"corpus": str(corpus), "limit": "2", "pair": "tiny", "max_new_tokens": "8", "db_path": str(db_path)}
    with headless_chromium(1280, 1800) as driver:
        nightly = get(f"{ui.api}/deployments/name/nightly/nightly")
        assert nightly is not None, ui.logs()
        driver.get(f"{ui.url}/deployments/deployment/{nightly['id']}")
        # Run (top right) -> Custom run
        WebDriverWait(driver, 120).until(lambda d: d.find_element(By.XPATH, "//button[normalize-space(.)='Run']"))\
            .click()
        WebDriverWait(driver, 30).until(lambda d: d.find_element(By.XPATH, "//*[normalize-space(.)='Custom run']"))\
            .click()
        # the form's page, its fields filled with the deployment's parameters (handed over in the URL)
        WebDriverWait(driver, 60).until(lambda d: urlparse(d.current_url).path.endswith("/run"))
        fill_the_form(driver, changed)
        driver.execute_script("arguments[0].scrollIntoView({block: 'start'})", form_field(driver, "corpus"))
        assert driver.save_screenshot(str(artifacts / "ui_custom_run_form_filled.png"))

        def submitted() -> list[dict]:
            return [run for run in runs_of(ui.api, nightly["id"]) if run["parameters"].get("corpus") == str(corpus)]

        [started] = submit(driver, submitted, ui)
        runs = ui.wait_for(lambda: completed_chain(ui.api, started["id"], ui.logs), timeout_s=600)
        # the fields typed in, and every other parameter as the deployment gives it (the form sends them all)
        assert NightlyParams.model_validate(runs["nightly"]["parameters"]) == NightlyParams.model_validate(
            nightly["parameters"] | {"corpus": str(corpus), "limit": 2, "pair": "tiny", "max_new_tokens": 8,
                                     "db_path": str(db_path)})
        assert_completed_with_judge_and_cost_report(runs, db_path)

        driver.get(f"{ui.url}/runs/flow-run/{started['id']}")
        WebDriverWait(driver, 60).until(lambda d: d.find_element(By.XPATH, "//*[normalize-space(.)='Completed']"))
        assert driver.save_screenshot(str(artifacts / "ui_nightly_run_completed.png"))


def test_a_nightly_run_from_the_ui_form_completes_and_sigterm_stops_everything(ui: Ui, tmp_path: Path) -> None:
    """Last in the module: it stops the module's ``ui``."""
    nightly = get(f"{ui.api}/deployments/name/nightly/nightly")
    assert nightly is not None, ui.logs()
    corpus, db_path = write_corpus(tmp_path / "news.parquet"), tmp_path / "sidecar.duckdb"
    # the fields changed; the server keeps the deployment's other parameters
    changed = {"corpus": str(corpus), "pair": "tiny", "limit": 2, "max_new_tokens": 8, "db_path": str(db_path)}
    started = httpx.post(f"{ui.api}/deployments/{nightly['id']}/create_flow_run", timeout=10,
                         json={"parameters": changed}).raise_for_status().json()
    runs = ui.wait_for(lambda: completed_chain(ui.api, started["id"], ui.logs), timeout_s=600)
    assert runs["nightly"]["parameters"] == nightly["parameters"] | changed
    assert_completed_with_judge_and_cost_report(runs, db_path)

    started_processes = psutil.Process(ui.process.pid).children(recursive=True)
    commands = [" ".join(p.cmdline()) for p in started_processes]
    assert any("server start" in c for c in commands) and any("worker start" in c for c in commands), commands
    ui.process.send_signal(signal.SIGTERM)
    assert ui.process.wait(timeout=180) == 0, ui.logs()
    assert [p for p in started_processes if alive(p)] == []
    assert processes_with(ui.home) == []
