"""The layers of pyproject.toml's import-linter contracts hold, and a planted violation breaks them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from storage import Database

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sidecar", "storage", "pipeline", "server", "study", "flows", "cli", "vocab")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

# lint-imports and Python in subprocesses
pytestmark = pytest.mark.servers


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    # the dev extras that `make test` installs hold it: none is a failure, not a skip
    assert LINT_IMPORTS.exists(), "import-linter is not installed: pip install -e '.[dev]'"
    # a fresh interpreter whose path starts at `root`, so that it analyses that tree's packages
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, capture_output=True, text=True, timeout=300,
                          env={"PATH": str(LINT_IMPORTS.parent), "PYTHONPATH": str(root)})


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the packages' sources and pyproject.toml, to plant violations in."""
    root = tmp_path_factory.mktemp("layers")
    shutil.copy(ROOT / "pyproject.toml", root)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__", "*.json"))
    return root


def plant(tree: Path, module: str, line: str) -> Path:
    path = tree / module
    path.write_text(path.read_text() + f"\n{line}\n")
    return path


def test_the_contracts_hold_on_this_tree() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(("module", "line", "contract"), [
    ("sidecar/tasks/task.py", "import flows.nightly", "Layers"),
    ("sidecar/tasks/task.py", "import prefect", "The engine library imports no orchestration"),
    ("sidecar/decoding/acceptance.py", "import openai", "The engine library imports no orchestration"),
    ("sidecar/runtime/forward.py", "import sidecar.decoding.sampling", "Inside the engine"),
    ("sidecar/decoding/lookup.py", "import sidecar.tasks.prompts", "Inside the engine"),
    ("sidecar/models/tiny.py", "import sidecar.runtime.kv_cache", "Inside the engine"),
    ("sidecar/runtime/transfers.py", "import study.leakage", "Layers"),
    ("vocab/modes.py", "import storage", "Layers"),
    ("vocab/modes.py", "import torch", "The shared vocabulary is a leaf"),
    ("storage/parquet.py", "import torch", "Storage imports no model code"),
    ("storage/parquet.py", "import study.cost", "Layers"),
    ("study/leakage.py", "import pipeline.windows", "Layers"),
    ("study/leakage.py", "import prefect", "plain Python"),
    ("pipeline/windows.py", "from prefect import task", "plain Python"),
    ("server/config.py", "import duckdb", "hold no SQL client"),
    ("flows/cost_report.py", "import duckdb", "Flows hold no SQL"),
    ("server/config.py", "import cli.main", "Layers"),
])
def test_a_planted_violation_breaks_its_contract(tree: Path, module: str, line: str, contract: str) -> None:
    path = tree / module
    original = path.read_text()
    plant(tree, module, line)
    try:
        result = lint_imports(tree)
    finally:
        path.write_text(original)
    assert result.returncode != 0, result.stdout
    broken = [block for block in result.stdout.split("\n\n") if "BROKEN" in block]
    assert any(contract in block for block in broken), result.stdout


def loaded(module: str, of: set[str]) -> list[str]:
    """Which of the top-level packages ``of`` a fresh interpreter has loaded after importing ``module``."""
    code = f"import sys, {module}; print(sorted(set({sorted(of)!r}) & {{m.split('.')[0] for m in sys.modules}}))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.replace("'", "\""))


def test_the_command_line_starts_without_the_heavy_libraries() -> None:
    # `sidecar --help` and the light commands must not pay for torch, Prefect or DuckDB (seconds each).
    assert loaded("cli.main", {"torch", "transformers", "prefect", "duckdb", "fastapi"}) == []


def test_storage_loads_no_model_code_at_run_time() -> None:
    # it shares the mode names with the library (vocab.modes), not the library's torch
    assert loaded("storage", {"torch", "transformers", "prefect"}) == []


def test_the_deployed_flows_import_without_the_model_libraries() -> None:
    # `prefect deploy`, the UI's parameter forms and the command line import the flows only to read them (their
    # parameters): torch and transformers (seconds) load where a flow decodes, the judge's openai client and the
    # report's matplotlib (most of a second each) where a judge asks and a report draws, not with their modules
    deployments = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
    modules = sorted({d["entrypoint"].split(":")[0].removesuffix(".py").replace("/", ".") for d in deployments})
    assert "flows.nightly" in modules and "flows.judge" in modules, modules
    assert loaded(", ".join(modules), {"torch", "transformers", "openai", "matplotlib"}) == [], modules


def test_a_sharded_parent_on_a_deployment_plans_and_supervises_its_shards_without_torch() -> None:
    # a sharded run's parent holds no model: it counts tokens to cut its shards, keeps the documents a shard found
    # over the context, launches the shards' deployment runs and ingests their parts, before and while they run;
    # with the tiny pair (every sharded run of the tests, on the deployments' workers too) none of it needs torch
    # (seconds on a busy machine)
    code = ("import sys; from flows.nightly import nightly; from flows.shard_deployments import ShardDeployments; "
            "from flows.shard_supervisor import ShardSupervisor; "
            "from pipeline import RunCounts, keep_over_context, plan_shards, token_counts; "
            "from sidecar.models.pair_tokenizer import load_tokenizer; "
            "ids = load_tokenizer('tiny')(['a budget'], add_special_tokens=False)['input_ids']; "
            "print(len(ids[0]) > 0, 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["True", "False"], result.stdout + result.stderr


def test_the_cost_report_of_a_tiny_run_runs_without_the_model_libraries(prefect_api, tmp_path: Path) -> None:
    # the cost-report flow runs in a process of its own after every run, on the tests' deployments too: it reads
    # the measurements and projects the run's draft from its config's shapes (the tiny pair's too), none of which
    # needs torch or transformers (seconds on a busy machine)
    from tests.test_report import stored_run

    db_path = tmp_path / "sidecar.duckdb"
    stored_run(db_path, pair="tiny")
    code = ("import sys; from flows.cost_report import cost_report; "
            f"cost_report(db_path={str(db_path)!r}, run_id='run-1'); "
            "print('loaded:', sorted({'torch', 'transformers'} & {m.split('.')[0] for m in sys.modules}))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=os.environ | prefect_api | {"PYTHONPATH": str(ROOT)})
    assert "loaded: []" in result.stdout.splitlines(), result.stdout + result.stderr
    # it projected the tiny pair's draft, which is where torch came in
    projected = Database(db_path).query("SELECT DISTINCT pair FROM cost_estimates WHERE source = 'projected'")
    assert {"pair": "tiny (bfloat16)"} in projected, projected


def test_a_sharded_parent_on_its_own_processes_finds_its_slots_without_torch_where_no_gpu_can_be() -> None:
    # `sidecar nightly --workers N` holds no model: it gives each shard process its GPU, or without one its share
    # of the cores; torch (seconds on a busy machine) loads only to count the GPUs where a driver may show some
    code = ("import sys; from flows.shard_processes import ShardProcesses; "
            "slots = ShardProcesses(2, 'http://127.0.0.1:9/api', embedded=True); slots.environment(1); "
            "print(int(bool(slots.gpus)), int('torch' in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    found_gpus, torch_loaded = (bool(int(word)) for word in result.stdout.split())
    assert found_gpus or not torch_loaded, "a parent that found no GPU loaded torch"


def test_a_judge_serving_its_pair_names_the_accelerator_it_holds_without_torch_where_no_gpu_can_be() -> None:
    # the judge flow serves its pair from a `sidecar serve` process and holds the device by its name meanwhile:
    # torch (seconds on a busy machine) loads to name it only where a driver may show a GPU
    code = ("import sys; from flows.accelerator import holding_accelerator; "
            "from sidecar.models.devices import accelerator_id, visible_gpus; "
            "name, torch_loaded = accelerator_id(), 'torch' in sys.modules; "
            "print(name, int(bool(visible_gpus())), int(torch_loaded))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    name, found_gpus, torch_loaded = result.stdout.split()
    assert found_gpus == "1" or (name, torch_loaded) == ("cpu", "0"), result.stdout
