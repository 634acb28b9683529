"""Prefect's embedded API server, tethered to this process: it ends when this process ends, ``kill -9``
included, instead of listening on its port for as long as the machine runs.

Without ``PREFECT_API_URL`` Prefect starts the API in a subprocess (``SubprocessASGIServer``) the first time
a client needs it, from whichever thread that is, and stops it only from an ``atexit`` hook. Prefect looks
that server up under the key ``None`` of ``SubprocessASGIServer._instances`` (its own test harness
registers its server the same way); an instance of the subclass below registered there first is the one
Prefect starts, and each server process it starts gets a tether (``server.tether``).
"""

from __future__ import annotations

import subprocess
from typing import Any

from prefect.server.api.server import SubprocessASGIServer

from server.tether import Tether, tether


class TetheredServer(SubprocessASGIServer):
    """Prefect's ephemeral API server, each of whose processes is stopped when this process ends."""

    _tether: Tether | None = None

    def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
        process = super()._run_uvicorn_command()
        # Prefect starts another process when the first one's port was taken; that one has exited
        self._release()
        self._tether = tether(process.pid)
        return process

    def stop(self) -> None:
        super().stop()
        self._release()

    def _release(self) -> None:
        if self._tether is not None:
            self._tether.release()
            self._tether = None


def tether_embedded_server() -> None:
    """Make the embedded API server that Prefect starts in this process a :class:`TetheredServer`; nothing
    once Prefect has its server already (tethered, or started before this was called)."""
    if None not in SubprocessASGIServer._instances:
        TetheredServer()  # registers itself under the key None, where Prefect looks
