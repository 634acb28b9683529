"""``sidecar generate``: prompts from a file through the engine, outputs and statistics out."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from sidecar.settings import DTYPE_HELP
from sidecar.tasks.prompts import DEFAULT_SYSTEM, SUMMARIZE_INSTRUCTION

if TYPE_CHECKING:
    from sidecar.tasks.rows import SidecarOutput
    from sidecar.tasks.task import SidecarTask


def read_inputs(path: str, column: str, id_column: str | None, limit: int | None) -> list[tuple[str, str]]:
    """(id, prompt) pairs: from a corpus file's text column (Parquet, JSON Lines or CSV, by extension; ids from
    ``id_column``, else each row's index), or one per non-empty line of a text file (its line number the id)."""
    from storage.corpus_files import FORMATS

    if Path(path).suffix.lower() in FORMATS:
        from storage.parquet import read_documents

        documents, rejects = read_documents(path, id_column=id_column, text_column=column, limit=limit)
        for reject in rejects:
            typer.secho(f"skipped row {reject.row_index} ({reject.doc_id}): {reject.reason}", fg="yellow", err=True)
        return [(d.doc_id, d.text) for d in documents]
    lines = []
    # line by line as bytes: a line that is not UTF-8 is skipped and named, as a corpus row is, not the file
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as exc:
                typer.secho(f"skipped line {number}: not_utf8 ({exc.reason} at byte {exc.start})", fg="yellow",
                            err=True)
                continue
            if line:
                lines.append((str(number), line))
    return lines[:limit] if limit else lines


def _shown(task: SidecarTask, output: SidecarOutput) -> str:
    """A sidecar output in the table: its parsed value (hashtags joined, a JSON-schema task's value as JSON),
    else its raw text."""
    import json

    if output.parsed is None:
        return output.text.strip() or "-"
    if task.parser == "hashtags" and task.constraint is None:
        return ", ".join(output.parsed)
    return output.parsed if isinstance(output.parsed, str) else json.dumps(output.parsed, ensure_ascii=False)


def generate(
    input_path: str = typer.Option(..., "--input", help="A corpus file (.parquet, .jsonl or .csv: its text column) "
                                   "or a text file, one input per line."),
    column: str = typer.Option("article", help="Text column of a corpus file."),
    id_column: str | None = typer.Option(None, help="Id column of a corpus file (default: the row's index; a text "
                                         "file's inputs are known by their line numbers)."),
    limit: int | None = typer.Option(None, min=1, help="Use only the first N inputs."),
    pair: str = typer.Option("qwen-coder-small", help="Model pair: tiny, qwen-coder-small, qwen2.5-7b or T,D."),
    dtype: str | None = typer.Option(None, help=DTYPE_HELP),
    instruction: str = typer.Option(SUMMARIZE_INSTRUCTION, help="Main instruction after each input ('' for none)."),
    system: str = typer.Option(DEFAULT_SYSTEM, help="The system prompt before each input ('' for none)."),
    hashtags: bool = typer.Option(True, help="Run the hashtags sidecar on the draft after the main output."),
    tasks: str | None = typer.Option(None, help="A .yaml or .json list of sidecar tasks (docs/tasks.md) in place "
                                     "of the hashtags task."),
    max_chars: int = typer.Option(3000, help="Cut each input to this many characters (the source study's 3,000)."),
    max_new_tokens: int = typer.Option(64, min=1),
    gamma: int = typer.Option(4, min=0, help="Most tokens drafted per step (0: plain decoding, the draft model "
                                             "running the sidecar tasks only)."),
    batch_size: int = typer.Option(8, min=1),
    temperature: float = typer.Option(0.0, min=0.0),
    seed: int | None = typer.Option(None),
    draft_int8: bool = typer.Option(False, help="Quantize the draft to int8 (CPU): faster drafting, output unchanged; "
                                    "hashtags come from the quantized draft."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object per input instead of a table."),
) -> None:
    """Run inputs through the speculative engine (and its sidecar) and print outputs and statistics."""
    import json

    from rich.console import Console
    from rich.table import Table

    from sidecar import HASHTAGS, SidecarEngine, SidecarRequest, load_pair
    from sidecar.tasks.tasks_file import load_tasks

    sidecars = load_tasks(tasks) if tasks else [HASHTAGS] if hashtags else []
    inputs = read_inputs(input_path, column, id_column, limit)
    ids, texts = [i for i, _ in inputs], [t[:max_chars] for _, t in inputs]
    if not texts:
        typer.secho("error: no inputs", fg="red", err=True)
        raise typer.Exit(2)
    engine = SidecarEngine(load_pair(pair, dtype=dtype, draft_int8=draft_int8), gamma=gamma, max_batch=batch_size)
    requests = [SidecarRequest(t, instruction, system or None, sidecars=sidecars) for t in texts]
    results = engine.run(requests, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                         batch_size=batch_size)
    if as_json:
        for doc_id, result in zip(ids, results, strict=True):
            typer.echo(json.dumps({"id": doc_id, "text": result.main.text, "finish_reason": result.main.finish_reason,
                                   "stats": result.main.stats.as_dict(),
                                   "sidecars": {k: {"text": v.text, "parsed": v.parsed, "stats": v.stats.as_dict()}
                                                for k, v in result.sidecars.items()}}))
        return
    table = Table("id", "output", *(t.name for t in sidecars), "tokens", "accepted/drafted", "tok/fwd",
                  show_lines=True)
    for doc_id, result in zip(ids, results, strict=True):
        st = result.main.stats
        table.add_row(doc_id, result.main.text, *(_shown(t, result.sidecars[t.name]) for t in sidecars),
                      str(st.new_tokens), f"{st.accepted}/{st.drafted}", f"{st.tokens_per_target_forward:.2f}")
    Console().print(table)
    tokens = sum(r.main.stats.new_tokens for r in results)
    wall = max(r.main.stats.wall_seconds for r in results)
    typer.echo(f"{tokens} main tokens; acceptance {sum(r.main.stats.accepted for r in results)}/"
               f"{sum(r.main.stats.drafted for r in results)}; gamma decisions {engine.decoder.controller.decisions}")
    typer.echo(f"longest batch wall time {wall:.1f}s")
