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
