"""The ``sidecar`` command: one typer app, each command group in a module of its own.

Commands import what they need when they run, so ``sidecar --help`` and the light commands do not load
torch, Prefect or DuckDB. A user's error ends the command with one line and an exit code of ``cli.errors``.
"""

from __future__ import annotations

import typer

from cli.corpus import corpus_app
from cli.cost import cost_app
from cli.errors import SidecarGroup
from cli.generate import generate
from cli.judge import judge_command
from cli.models import models_app
from cli.pipeline import pipeline_app
from cli.serve import serve_command
from cli.ui import ui_command

app = typer.Typer(cls=SidecarGroup, no_args_is_help=True,
                  help="Batched speculative decoding with sidecar tasks on the draft model.")
app.add_typer(models_app, name="models")
app.add_typer(corpus_app, name="corpus")
app.command("generate")(generate)
app.add_typer(cost_app, name="cost")
app.command("serve")(serve_command)
app.command("judge")(judge_command)
app.command("ui")(ui_command)
app.add_typer(pipeline_app)  # sidecar nightly, sidecar demo
