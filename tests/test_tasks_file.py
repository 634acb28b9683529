"""Sidecar tasks from a YAML or JSON file (``--tasks`` on nightly, demo and generate): what a task may say, and
errors that name the file, the task and the field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from typer.testing import CliRunner

from sidecar.errors import InputError
from sidecar.tasks.task import HASHTAGS, SidecarTask
from sidecar.tasks.tasks_file import load_tasks

REPO = Path(__file__).resolve().parents[1]
TASKS = [
    {"name": "headline", "instruction": "Write a one-line headline for the document.", "max_new_tokens": 24},
    {"name": "topic", "instruction": "Give the topic: politics, business, sports, science or culture.",
     "attend_document": True},
    {"name": "hashtags", "instruction": "Then output 3-5 short hashtags for the summary.", "parser": "hashtags",
     "bridge": "\n\n"},
]


def write(path: Path, tasks: object) -> Path:
    path.write_text(json.dumps(tasks) if path.suffix == ".json" else yaml.safe_dump(tasks))
    return path


def test_a_task_refuses_a_field_it_does_not_know_and_names_it() -> None:
    with pytest.raises(ValidationError) as raised:
        SidecarTask(name="headline", instruction="Write a headline.", max_tokens=16)
    [error] = raised.value.errors()
    assert (error["loc"], error["type"]) == (("max_tokens",), "extra_forbidden")


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_a_tasks_file_is_a_list_of_tasks_in_order(tmp_path: Path, suffix: str) -> None:
    tasks = load_tasks(write(tmp_path / f"tasks{suffix}", TASKS))
    assert [t.name for t in tasks] == ["headline", "topic", "hashtags"]
    assert tasks[0].max_new_tokens == 24 and tasks[1].attend_document and tasks[2].parser == "hashtags"
    assert tasks[0].bridge is None, "a field left out keeps its default"
    assert tasks[2].model_dump() == HASHTAGS.model_dump() | {"max_new_tokens": 32}


@pytest.mark.parametrize(("content", "fragments"), [
    ([TASKS[0], TASKS[1] | {"max_tokens": 8}], ["task 2 of 2 ('topic')", "unknown field 'max_tokens'",
                                                 "max_new_tokens"]),
    ([{"name": "headline"}], ["task 1 of 1 ('headline')", "field 'instruction' is missing"]),
    ([TASKS[0] | {"max_new_tokens": 0}], ["task 1 of 1", "field 'max_new_tokens'", "greater than or equal to 1"]),
    ([TASKS[0] | {"name": "a headline"}], ["task 1 of 1 ('a headline')", "field 'name'", "pattern"]),
    ([TASKS[0] | {"parser": "json"}], ["field 'parser'", "'hashtags' or 'text'"]),
    ([TASKS[0], "topic"], ["task 2 of 2", "a mapping of fields, got str"]),
    ([TASKS[0], TASKS[0]], ["tasks 1 and 2 are both named 'headline'"]),
    ({"name": "headline", "instruction": "x"}, ["expected a non-empty list of tasks, got dict"]),
    ([], ["expected a non-empty list of tasks, got list"]),
])
def test_a_bad_task_is_one_error_naming_the_file_the_task_and_the_field(tmp_path: Path, content: object,
                                                                         fragments: list[str]) -> None:
    path = write(tmp_path / "tasks.yaml", content)
    with pytest.raises(InputError) as raised:
        load_tasks(path)
    message = str(raised.value)
    assert message.startswith(f"tasks file {path}") and "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message


def test_a_file_that_is_not_yaml_or_json_or_not_there_is_refused_by_name(tmp_path: Path) -> None:
    broken = tmp_path / "tasks.json"
    broken.write_text('[{"name": "headline",')
    with pytest.raises(InputError, match=re.escape(f"tasks file {broken} is not valid JSON")):
        load_tasks(broken)
    (tmp_path / "tasks.yaml").write_text("- name: [headline\n")
    with pytest.raises(InputError, match="is not valid YAML"):
        load_tasks(tmp_path / "tasks.yaml")
    (tmp_path / "tasks.toml").write_text("")
    with pytest.raises(InputError, match=r"give a \.yaml, \.yml or \.json file, not \.toml"):
        load_tasks(tmp_path / "tasks.toml")
    with pytest.raises(FileNotFoundError, match=r"missing\.yaml"):
        load_tasks(tmp_path / "missing.yaml")


@pytest.mark.parametrize("command", ["nightly", "demo"])
def test_nightly_and_demo_refuse_a_bad_tasks_file_with_one_line_before_anything_is_written(
        tmp_path: Path, command: str) -> None:
    from cli.main import app

    tasks = write(tmp_path / "tasks.yaml", [TASKS[0] | {"max_tokens": 8}])
    db = tmp_path / "sidecar.duckdb"
    result = CliRunner().invoke(app, [command, "--pair", "tiny", "--db", str(db), "--tasks", str(tasks)])
    assert result.exit_code == 2, result.output
    [line] = result.output.strip().splitlines()[-1:]
    assert line.startswith("error: tasks file") and "task 1 of 1 ('headline')" in line and "'max_tokens'" in line
    assert not db.exists()
