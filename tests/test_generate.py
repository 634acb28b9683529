"""``sidecar generate`` in-process on the tiny pair: the tasks of a tasks file, and inputs from a text file or a
JSON Lines or CSV corpus, each output with its id."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from typer.testing import CliRunner

TASKS = [
    {"name": "headline", "instruction": "Write a one-line headline for the document.", "max_new_tokens": 4},
    {"name": "topic", "instruction": "Give the topic: politics, business, sports, science or culture.",
     "max_new_tokens": 4},
]


def test_generate_runs_each_task_of_the_file_and_prints_them(tmp_path: Path) -> None:
    from cli.main import app

    inputs = tmp_path / "inputs.txt"
    inputs.write_text("The council approved the budget on Tuesday.\nPrices rose again in March.\n")
    tasks = tmp_path / "tasks.yaml"
    tasks.write_text(yaml.safe_dump(TASKS))
    result = CliRunner().invoke(app, ["generate", "--input", str(inputs), "--pair", "tiny", "--max-new-tokens", "6",
                                      "--tasks", str(tasks), "--json"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    assert [sorted(row["sidecars"]) for row in rows] == [["headline", "topic"]] * 2
    table = CliRunner().invoke(app, ["generate", "--input", str(inputs), "--pair", "tiny", "--max-new-tokens", "6",
                                     "--tasks", str(tasks)], terminal_width=200)
    assert table.exit_code == 0 and "headline" in table.output and "topic" in table.output, table.output


def test_generate_reads_a_jsonl_or_csv_corpus_and_prints_each_outputs_id(tmp_path: Path) -> None:
    from cli.main import app

    rows = [{"key": "k-7", "body": "The council approved the budget."}, {"key": "k-9", "body": "Prices rose."}]
    jsonl = tmp_path / "inputs.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows))
    csv = tmp_path / "inputs.csv"
    csv.write_text("key,body\nk-7,The council approved the budget.\nk-9,Prices rose.\n")
    for path in (jsonl, csv):
        result = CliRunner().invoke(app, ["generate", "--input", str(path), "--column", "body", "--id-column", "key",
                                          "--pair", "tiny", "--max-new-tokens", "4", "--no-hashtags", "--json"])
        assert result.exit_code == 0, result.output
        assert [json.loads(line)["id"] for line in result.output.splitlines() if line.startswith("{")] == [
            "k-7", "k-9"]
    text = tmp_path / "inputs.txt"
    text.write_text("First input.\n\nThird line.\n")
    result = CliRunner().invoke(app, ["generate", "--input", str(text), "--pair", "tiny", "--max-new-tokens", "4",
                                      "--no-hashtags", "--json"])
    assert [json.loads(line)["id"] for line in result.output.splitlines() if line.startswith("{")] == ["1", "3"]


def test_generate_shows_a_constrained_tasks_json_value_in_its_table(tmp_path: Path) -> None:
    """A JSON-schema task's value (here an integer) is no string: the table refused to render it."""
    from cli.main import app

    inputs = tmp_path / "inputs.txt"
    inputs.write_text("The council approved the budget on Tuesday.\n")
    tasks = tmp_path / "tasks.json"
    tasks.write_text(json.dumps([{"name": "digit", "instruction": "Give one digit.", "max_new_tokens": 4,
                                  "json_schema": {"type": "integer", "minimum": 0, "maximum": 9}}]))
    args = ["generate", "--input", str(inputs), "--pair", "tiny", "--max-new-tokens", "4", "--tasks", str(tasks)]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    [row] = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    value = row["sidecars"]["digit"]["parsed"]
    assert isinstance(value, int) and 0 <= value <= 9, row
    table = CliRunner().invoke(app, args, terminal_width=200)
    assert table.exit_code == 0, table.output
    assert "digit" in table.output and f"│ {value} " in table.output, table.output


def test_generate_at_gamma_zero_decodes_plainly_with_the_sidecar_and_refuses_a_negative_gamma(tmp_path: Path) -> None:
    from cli.main import app

    inputs = tmp_path / "inputs.txt"
    inputs.write_text("The council approved the budget on Tuesday.\nPrices rose again in March.\n")
    args = ["generate", "--input", str(inputs), "--pair", "tiny", "--max-new-tokens", "6", "--json"]
    plain, speculative = (CliRunner().invoke(app, [*args, "--gamma", gamma]) for gamma in ("0", "4"))
    assert plain.exit_code == 0 and speculative.exit_code == 0, plain.output + speculative.output
    rows, rows_speculative = ([json.loads(line) for line in r.output.splitlines() if line.startswith("{")]
                              for r in (plain, speculative))
    assert [row["stats"]["drafted"] for row in rows] == [0, 0]
    assert [(row["text"], row["sidecars"]["hashtags"]["text"]) for row in rows] == [
        (row["text"], row["sidecars"]["hashtags"]["text"]) for row in rows_speculative]
    assert CliRunner().invoke(app, [*args, "--gamma", "-1"]).exit_code == 2
