"""How an error ends the ``sidecar`` command: a user's error is one ``error:`` line on stderr and an exit code
from the table below; anything else is a bug and keeps its traceback (exit code 1).

The mapping lives here once, in the root command group, so a command raises the library's own error and
never catches it to print and exit. Exit codes:

====  ============================================================================================
0     done
1     the work ran but did not complete (the judge flow, or a flow after ``nightly``, ended failed; a
      sharded ``nightly`` ended with documents no shard attempt finished, named in the error line),
      or an unexpected error: a bug, printed with its traceback
2     bad input or usage: an unknown option or a bad value (typer's own usage errors), a missing input
      file, an input without the columns asked for, a ``--run-id`` that is not a plain name or names
      no run or another run (another corpus or other decisive settings), an unknown model pair, bad
      cost-model inputs, a model fetch that failed, a ``--results-uri`` that cannot hold part files
3     the database cannot be used: ``--db`` is a directory, not a DuckDB file, under a regular file or
      where nothing may be written, or it has a newer schema than this sidecar knows
4     busy: another process held the database's lock through every retry (``--lock-wait-s``), runs this
      run id (``--run-wait-s``) or holds the accelerator (``--device-wait-s``); a later retry can work
====  ============================================================================================
"""

from __future__ import annotations

import logging
import sys

import click
import typer
from typer.core import TyperGroup

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_DATABASE_UNUSABLE = 3
EXIT_BUSY = 4

# (defining module, class, exit code): the first match wins, so a subclass comes before its base. Classes
# are named, not imported, so that ``import cli.main`` loads no DuckDB or pydantic: an exception of a class
# whose module was never imported cannot have been raised.
USER_ERRORS: tuple[tuple[str, str, int], ...] = (
    ("storage.errors", "DatabaseLockedError", EXIT_BUSY),
    ("storage.errors", "LockHeldError", EXIT_BUSY),
    ("storage.errors", "DatabaseOpenError", EXIT_DATABASE_UNUSABLE),
    ("storage.errors", "SchemaTooNewError", EXIT_DATABASE_UNUSABLE),
    ("storage.errors", "RunMismatchError", EXIT_BAD_INPUT),
    ("storage.errors", "InputSchemaError", EXIT_BAD_INPUT),
    ("storage.errors", "UnknownRunError", EXIT_BAD_INPUT),
    ("storage.errors", "InvalidRunIdError", EXIT_BAD_INPUT),
    ("storage.errors", "ResultsLocationError", EXIT_BAD_INPUT),
    ("sidecar.errors", "InputError", EXIT_BAD_INPUT),
    ("sidecar.errors", "PairError", EXIT_BAD_INPUT),
    ("study.cost.errors", "CostInputError", EXIT_BAD_INPUT),
    ("sidecar.models.fetch", "FetchError", EXIT_BAD_INPUT),
    ("pydantic_core._pydantic_core", "ValidationError", EXIT_BAD_INPUT),
    ("builtins", "FileNotFoundError", EXIT_BAD_INPUT),
    ("flows.shard_supervisor", "IncompleteRunError", EXIT_FAILED),
)

# Prefect's flow and task engines log a failed run's exception with its traceback
_PREFECT_RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


def _loaded_class(module: str, name: str) -> type | None:
    loaded = sys.modules.get(module)
    return getattr(loaded, name, None) if loaded is not None else None


def exit_code(exc: BaseException) -> int | None:
    """The exit code of ``exc`` when it is a user's error, None when it is not (a bug)."""
    for module, name, code in USER_ERRORS:
        cls = _loaded_class(module, name)
        if cls is not None and isinstance(exc, cls):
            return code
    return None


def error_line(exc: BaseException) -> str:
    """``exc`` as the one line the command prints."""
    validation_error = _loaded_class("pydantic_core._pydantic_core", "ValidationError")
    if validation_error is not None and isinstance(exc, validation_error):
        text = "; ".join(f"{'.'.join(map(str, e['loc'])) or exc.title}: {e['msg']}" for e in exc.errors())
    else:
        text = str(exc)
    return "error: " + " ".join(text.split())


class _UserErrorsWithoutTraceback(logging.Filter):
    """Drops the traceback from the log record of a user's error, keeping the record's line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None and exit_code(record.exc_info[1]) is not None:
            record.exc_info = None
            record.exc_text = None
        return True


_FILTER = _UserErrorsWithoutTraceback()


class SidecarGroup(TyperGroup):
    """The root command group: runs the command, and ends a user's error with its line and exit code."""

    def invoke(self, ctx: click.Context) -> object:
        # Loggers made now keep their filters when Prefect configures logging on import.
        for name in _PREFECT_RUN_LOGGERS:
            logger = logging.getLogger(name)
            if _FILTER not in logger.filters:
                logger.addFilter(_FILTER)
        try:
            return super().invoke(ctx)
        except Exception as exc:
            code = exit_code(exc)
            if code is None:
                raise
            typer.secho(error_line(exc), fg="red", err=True)
            raise typer.Exit(code) from exc
