"""The ``--run-id`` option's check: a run id that is not a plain name ends the command before any work, with
``storage.run_keys.check_run_id``'s error (one ``error:`` line, exit 2, see ``cli.errors``)."""

from __future__ import annotations


def checked_run_id(run_id: str | None) -> str | None:
    # imported here: ``import cli.main`` stays light (see cli.errors)
    from storage.run_keys import check_run_id

    return None if run_id is None else check_run_id(run_id)
