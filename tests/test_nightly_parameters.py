"""The nightly flow's parameters are NightlyParams's fields, each at the top level: what Prefect renders as the run
form, merges with a deployment's defaults one name at a time, and validates; prefect.yaml's nightly defaults and
the judge trigger's templates use those names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def deployments() -> dict[str, dict]:
    return {d["name"]: d for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]}


def test_the_flow_takes_each_field_at_the_top_level_with_its_description_default_and_bounds() -> None:
    from flows.nightly import NightlyParams, nightly

    schema = nightly.parameters.model_dump_for_openapi()
    fields = NightlyParams.model_fields
    assert list(schema["properties"]) == list(fields)
    assert "required" not in schema, "every field has a default: an empty form runs"
    for name, field in fields.items():
        assert schema["properties"][name]["description"] == field.description, name
    limit = schema["properties"]["limit"]
    assert (limit["default"], {"type": "integer", "minimum": 1} in limit["anyOf"]) == (None, True)
    assert schema["properties"]["batch_size"] | {"description": ""} == {
        "default": 8, "minimum": 1, "maximum": 1024, "type": "integer", "title": "batch_size", "position": 6,
        "description": ""}


def test_every_description_reads_the_same_in_the_forms_markdown() -> None:
    """The UI renders a description as Markdown: a ``<name>`` outside a code span is taken for an HTML tag and lost."""
    from flows.nightly import NightlyParams

    for name, field in NightlyParams.model_fields.items():
        assert "<" not in re.sub(r"`[^`]*`", "", field.description or ""), name


def test_a_value_a_field_refuses_is_one_clear_error_naming_the_field() -> None:
    from prefect.exceptions import ParameterTypeError

    from flows.nightly import nightly

    with pytest.raises(ParameterTypeError, match=r"limit: Input should be greater than or equal to 1"):
        nightly.validate_parameters({"limit": 0})
    assert nightly.validate_parameters({"limit": 4})["limit"] == 4


def test_prefect_yaml_gives_the_nightly_defaults_as_top_level_fields_and_the_judge_trigger_reads_them() -> None:
    from flows.nightly import NightlyParams

    nightly = deployments()["nightly"]
    params = NightlyParams.model_validate(nightly["parameters"])  # extra="forbid": every name is a field
    assert (params.pair, params.db_path, params.title_column) == ("qwen-coder-small", "data/sidecar.duckdb", "title")
    assert (params.shard_deployment, params.shards) == ("nightly-shard/nightly-shard", 2)
    [trigger] = deployments()["judge"]["triggers"]
    assert trigger["parameters"] == {"run_id": "{{ flow_run.name }}", "db_path": "{{ flow_run.parameters.db_path }}",
                                     "judge_pair": "{{ flow_run.parameters.pair }}"}
    assert {"db_path", "pair"} <= set(nightly["parameters"]), "the templates' names have values on every run"


def test_the_main_tasks_prompts_are_fields_with_the_summary_prompts_as_defaults_and_decide_the_run() -> None:
    from datetime import UTC, datetime

    from flows.nightly import NightlyParams
    from sidecar.tasks.prompts import DEFAULT_SYSTEM, SUMMARIZE_INSTRUCTION

    default = NightlyParams()
    assert (default.instruction, default.system) == (SUMMARIZE_INSTRUCTION, DEFAULT_SYSTEM)
    assert default.settings().instruction == SUMMARIZE_INSTRUCTION and default.settings().system == DEFAULT_SYSTEM
    assert NightlyParams(system="").settings().system is None, "'' is no system turn"
    day = datetime(2026, 12, 5, tzinfo=UTC)
    headline = NightlyParams(instruction="Write a one-line headline for the document.")
    terse = NightlyParams(system="You answer in one line.")
    assert len({p.resolved_run_id(day) for p in (default, headline, terse)}) == 3, "another prompt, another run"
    for params in (default, headline, terse):
        assert {k: params.resume_identity()[k] for k in ("instruction", "system")} == {
            "instruction": params.instruction, "system": params.system}
    given = deployments()["nightly"]["parameters"]
    assert (given["instruction"], given["system"]) == (SUMMARIZE_INSTRUCTION, DEFAULT_SYSTEM), "prefect.yaml's"


def test_prefect_yaml_gives_the_hashtags_task_as_the_nightly_sidecar_tasks() -> None:
    from flows.nightly import NightlyParams
    from sidecar.tasks.task import HASHTAGS

    assert NightlyParams.model_validate(deployments()["nightly"]["parameters"]).sidecar_tasks == [HASHTAGS]
