"""Issue #41's user, end to end: their own tasks file (a headline, a topic from five labels, entities as JSON),
their own JSONL corpus with its own column names, their own main instruction, one `sidecar nightly` run with
its judge and cost report; then each task's outputs by SQL, and a judge verdict and a cost verdict per task.

The tiny random pair writes nonsense, so what this proves is the plumbing and the constraints (every
constrained output parses whatever the model prefers, given a limit its schema fits in: four strings of at
most 12 characters and the JSON around them, one character a token at worst), not the verdicts' meaning:
tests/test_real_judge.py and docs/tasks.md do that on the real pair.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

pytestmark = [pytest.mark.slow, pytest.mark.servers]

TOPICS = ["politics", "business", "sport", "science", "weather"]
HEADLINE = r"[A-Z][a-z]{2,12}( [a-z]{2,12}){2,5}"
TASKS = f"""\
- name: headline
  instruction: Then write a one-line headline for the summary.
  max_new_tokens: 24
  regex: '{HEADLINE}'
- name: topic
  instruction: Then name the summary's topic.
  max_new_tokens: 8
  choices: [{", ".join(TOPICS)}]
- name: entities
  instruction: Then list the people and places the summary names, as JSON.
  max_new_tokens: 128
  json_schema:
    type: object
    properties:
      people: {{type: array, items: {{type: string, maxLength: 12}}, maxItems: 2}}
      places: {{type: array, items: {{type: string, maxLength: 12}}, maxItems: 2}}
    required: [people, places]
    additionalProperties: false
"""
ARTICLES = [
    "The council of Lyon voted on Monday to close the old bridge after engineers found cracks in two piers.",
    "Shares of the shipping firm fell by a fifth when it said that fuel costs had doubled since the spring.",
    "A storm brought heavy rain to the north coast overnight, and the ferry to the islands stayed in port.",
]
INSTRUCTION = "List the document's two main facts, one per line."


def test_own_tasks_on_an_own_jsonl_corpus_with_an_own_instruction_in_one_nightly_run(
        prefect_api, tmp_path: Path) -> None:
    from cli.main import app
    from storage import Database

    tasks = tmp_path / "tasks.yaml"
    tasks.write_text(TASKS)
    corpus = tmp_path / "mine.jsonl"
    corpus.write_text("".join(json.dumps({"key": f"n{i}", "body": text}) + "\n" for i, text in enumerate(ARTICLES)))
    db_path = tmp_path / "mine.duckdb"
    done = CliRunner().invoke(app, [
        "nightly", "--corpus", str(corpus), "--id-column", "key", "--text-column", "body", "--pair", "tiny",
        "--db", str(db_path), "--max-new-tokens", "8", "--instruction", INSTRUCTION, "--tasks", str(tasks)])
    assert done.exit_code == 0, done.output

    # each task's outputs, by SQL over the run's database
    with duckdb.connect(str(db_path), read_only=True) as con:
        [(run_id, identity)] = con.execute("SELECT run_id, identity FROM runs").fetchall()
        rows = con.execute("SELECT task, mode, doc_id, parsed, parse_error FROM sidecar_outputs "
                           "ORDER BY task, mode, doc_id").fetchall()
    assert json.loads(identity)["instruction"] == INSTRUCTION
    assert [(t, m, d) for t, m, d, _, _ in rows] == [
        (task, mode, f"n{i}") for task in ("entities", "headline", "topic") for mode in ("sidecar", "standalone")
        for i in range(len(ARTICLES))]
    # every constrained output parses, in every mode
    assert all(error is None and parsed is not None for *_, parsed, error in rows), rows
    values = {(task, mode, doc): json.loads(parsed) for task, mode, doc, parsed, _ in rows}
    assert all(re.fullmatch(HEADLINE, v) for (task, *_), v in values.items() if task == "headline"), values
    assert all(v in TOPICS for (task, *_), v in values.items() if task == "topic"), values
    entities = [v for (task, *_), v in values.items() if task == "entities"]
    assert all(set(v) == {"people", "places"} and all(isinstance(x, str) for xs in v.values() for x in xs)
               for v in entities), entities

    # a judge verdict per task: judged, unreliable or not judged, each with its reason where it has no verdict
    verdicts = Database(db_path).judge_verdicts(run_id)
    assert set(verdicts) == {"entities", "headline", "topic"}, verdicts
    for task, verdict in verdicts.items():
        assert verdict["status"] in ("judged", "unreliable", "not judged"), (task, verdict)
        assert verdict["status"] == "judged" or verdict["reason"], (task, verdict)

    # a cost verdict per task, each in its task's words
    [markdown] = tmp_path.rglob("cost_report.md")  # the run's one report
    section = markdown.read_text().split("## Verdict per sidecar task\n", 1)[1].split("\n## ", 1)[0]
    for task, noun in (("entities", "entity"), ("headline", "headline"), ("topic", "topic")):
        assert f"| {task} |" in section and f"a sidecar {noun} token costs" in section, section
