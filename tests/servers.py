"""Tests that start servers or processes carry the ``servers`` marker, so that ``make test-fast`` (``-m "not real and
not slow and not servers"``) runs none: ``SERVER_FIXTURES`` marks the tests that use a fixture that starts one, and
``refuse_servers``, applied in a run that deselects ``servers``, makes an unmarked test that starts one fail
saying so, instead of quietly making the fast run slow."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# fixtures that start a server (a Prefect API, `sidecar serve`, uvicorn in a thread): conftest marks every test that
# uses one, directly or through another fixture
SERVER_FIXTURES = frozenset({"prefect_server", "prefect_api", "base_url", "tiny_server"})
# programs whose start is a process a fast run must not wait for: Python and the venv's commands (our CLIs,
# prefect, lint-imports), the repository's scripts, a browser
BROWSERS = frozenset({"chromium", "chromedriver", "chrome"})


class UnmarkedServer(RuntimeError):
    """A test not marked ``servers`` started a server or a process."""


def starts_a_process(program: str) -> bool:
    """Whether running ``program`` (a command's first word) starts a process the ``servers`` marker is for."""
    path = Path(program)
    if path.name in BROWSERS or path.name.startswith("python"):
        return True
    return path.is_relative_to(Path(sys.executable).parent) or path.is_relative_to(REPO)


def compiling() -> bool:
    """Whether the caller is torch's compiler: inductor starts short Python helpers of its own (its CPU ISA probe
    loads a freshly built library in one), part of a compile a fast test may do, not a server it starts."""
    frame = sys._getframe(2)
    while frame is not None:
        if f"{Path('torch', '_inductor')}" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def refuse_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Until the test ends, listening on a socket or starting a process ``starts_a_process`` names raises
    ``UnmarkedServer``; other commands (git, a linter) still run."""
    popen_init = subprocess.Popen.__init__

    def listen(self, *args):
        raise UnmarkedServer("this test starts a server: mark it `servers` (tests/servers.py)")

    def checked_popen(self, args, *rest, **kwargs):
        program = args if isinstance(args, str | Path) else args[0]
        if starts_a_process(str(program).split()[0] if kwargs.get("shell") else str(program)) and not compiling():
            raise UnmarkedServer(f"this test starts {program}: mark it `servers` (tests/servers.py)")
        popen_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(socket.socket, "listen", listen)
    monkeypatch.setattr(subprocess.Popen, "__init__", checked_popen)
