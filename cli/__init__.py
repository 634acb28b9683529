"""Entry points: the ``sidecar`` command line (``cli.main:app``), the top layer of the project."""
