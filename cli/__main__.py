"""``python -m cli``: the ``sidecar`` command without its console script."""

from cli.main import app

app(prog_name="sidecar")
