"""``sidecar judge``: the judge flow on a finished run, on an embedded Prefect API in this process.

Without ``--base-url`` the flow serves ``--judge-pair`` on loopback as the judge; with it, any
OpenAI-compatible endpoint, its key from ``SIDECAR_JUDGE_API_KEY`` or ``OPENAI_API_KEY``. The summary
printed is the flow's markdown artifact: verdicts, mean preference with its interval, the controls and
whether the run is reliable.
"""

from __future__ import annotations

import typer

from cli.errors import exit_code
from cli.run_ids import checked_run_id
from flows.embedded import embedded_prefect


def judge_command(
    run_id: str = typer.Option(..., callback=checked_run_id,
                               help="The run whose sidecar and standalone tags are compared."),
    db: str = typer.Option("data/sidecar.duckdb", help="Results database (DuckDB)."),
    base_url: str | None = typer.Option(None, help="OpenAI-compatible endpoint (default: serve --judge-pair)."),
    model: str | None = typer.Option(None, help="The endpoint's model id; required with --base-url."),
    judge_pair: str = typer.Option("qwen-coder-small", help="Model pair served as the judge without --base-url."),
    controls: int = typer.Option(20, min=0, help="Documents that also get control games."),
    threshold: float = typer.Option(0.9, min=0, max=1, help="Share of easy controls clearing the margin and of null "
                                    "controls tying below which a method is UNRELIABLE."),
    likelihood_prompt: list[str] = typer.Option(["tags-l1", "tags-l2"], help="Scorer prompts of the likelihood "
                                                "method (repeat the option; 'none' for no likelihood method)."),
    likelihood_model: str | None = typer.Option(None, help="A second model that scores by likelihood, e.g. the "
                                                "pair's draft: '<model>/draft'."),
) -> None:
    """Judge a finished run's sidecar tags against its standalone tags, with controls, and print the summary."""
    if base_url is not None and not model:
        typer.secho("error: --model is required with --base-url (the endpoint's model id)", fg="red", err=True)
        raise typer.Exit(2)
    # entered before Prefect is imported: its settings read the environment once
    with embedded_prefect():
        from flows.judge import judge

        state = judge(run_id=run_id, judge_model=model, base_url=base_url, judge_pair=judge_pair, db_path=db,
                      controls=controls, threshold=threshold, return_state=True,
                      likelihood_prompts=tuple(p for p in likelihood_prompt if p != "none"),
                      likelihood_model=likelihood_model)
        if not state.is_completed():
            failure = state.result(raise_on_failure=False)
            if isinstance(failure, Exception) and exit_code(failure) is not None:
                raise failure  # a user's error (a bad --db ...): its own line and exit code
            typer.secho(f"error: the judge flow ended {state.name}: {state.message}", fg="red", err=True)
            raise typer.Exit(1)
        summary = state.result()
    typer.echo(summary.to_markdown())
