"""A run id is a name, never a path: every entry refuses one that is not a plain name, and every file kept per
run is named by the run's key (``storage.run_keys``), so no id can steer a file outside its directory."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

UNSAFE = ["../../x", "/tmp/elsewhere", "a/b", "..", ".hidden", "", "tab\there", "x" * 201]


@pytest.mark.parametrize("run_id", ["all-runs", "../../x", "/tmp/elsewhere", "a/b", ".."])
def test_the_cost_report_of_any_run_is_a_directory_of_its_own_under_cost_report(run_id: str, tmp_path: Path) -> None:
    from flows.cost_report import report_dir

    db = tmp_path / "sidecar.duckdb"
    out = report_dir(db, run_id)
    assert out.parent == tmp_path / "cost_report" and out.name not in ("", ".", "..")
    assert out != report_dir(db, None)  # a run named all-runs does not overwrite the all-runs report


@pytest.mark.parametrize("run_id", UNSAFE)
def test_nightly_parameters_refuse_a_run_id_that_is_not_a_plain_name(run_id: str) -> None:
    from flows.nightly_params import NightlyParams

    with pytest.raises(ValidationError, match="run id"):
        NightlyParams(run_id=run_id)
    assert NightlyParams(run_id="nightly-20261201-abc_1.2").run_id == "nightly-20261201-abc_1.2"


def test_the_cost_report_and_judge_flows_refuse_an_unsafe_run_id(tmp_path: Path) -> None:
    from flows.cost_report import cost_report
    from flows.judge import judge
    from storage.errors import InvalidRunIdError

    db = str(tmp_path / "sidecar.duckdb")
    with pytest.raises(InvalidRunIdError, match="run id"):
        cost_report.fn(db_path=db, run_id="../../x")
    with pytest.raises(InvalidRunIdError, match="run id"):
        judge.fn(run_id="/tmp/x", db_path=db, base_url="http://127.0.0.1:9/v1", judge_model="m")
    assert not (tmp_path / "cost_report").exists()


@pytest.mark.parametrize("command", [["nightly", "--corpus", "missing.parquet", "--pair", "tiny"],
                                     ["judge", "--base-url", "http://127.0.0.1:9/v1", "--model", "m"]])
def test_the_cli_refuses_an_unsafe_run_id_with_one_line_and_exit_2(command: list[str], tmp_path: Path) -> None:
    from cli.main import app

    result = CliRunner().invoke(app, [*command, "--db", str(tmp_path / "sidecar.duckdb"), "--run-id", "../../x"])
    assert result.exit_code == 2, result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith("error: ") and "run id" in line and "'../../x'" in line, line
    assert list(tmp_path.iterdir()) == []
