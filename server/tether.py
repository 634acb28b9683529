"""Child processes that end with this process, however it ends (``kill -9`` included).

A tether is a small watcher process (this file, run as a script) that blocks reading a pipe whose only
writer is this process. The kernel closes that pipe when this process ends, whatever ends it; the watcher
then stops the child (SIGTERM, SIGKILL after a grace period). Unlike a parent-death signal
(``PR_SET_PDEATHSIG``), it needs no code in the child between fork and exec, so it also holds children that
a library starts, and it does not fire when merely the thread that started the child ends.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass


@dataclass
class Tether:
    """The watcher of one child; :meth:`release` lets the child go (call it once the child is stopped)."""

    child_pid: int
    watcher: subprocess.Popen[bytes]

    def release(self) -> None:
        if self.watcher.poll() is None:
            # killed rather than told through its pipe, which would make it stop the child
            self.watcher.kill()
        self.watcher.wait()
        if self.watcher.stdin is not None:
            self.watcher.stdin.close()


def tether(child_pid: int, grace_s: float = 5.0) -> Tether:
    """Stop process ``child_pid`` when this process ends: SIGTERM, then SIGKILL after ``grace_s``."""
    # The pipe's write end is not inheritable (PEP 446): no other child can keep it open. A session of its
    # own keeps the watcher out of signals sent to this process's group (a Ctrl-C in the terminal).
    watcher = subprocess.Popen([sys.executable, "-I", "-S", __file__, str(child_pid), str(grace_s)],
                               stdin=subprocess.PIPE, start_new_session=True)
    return Tether(child_pid, watcher)


def _watch(pid: int, grace_s: float) -> None:
    """The watcher: wait for the parent to end, then stop ``pid``."""
    # A pidfd names the child itself, so no signal reaches another process that later reuses its PID.
    try:
        handle: int | None = os.pidfd_open(pid)
    except (AttributeError, OSError):
        handle = None

    def send(sig: int) -> None:
        if handle is not None:
            signal.pidfd_send_signal(handle, sig)
        else:
            os.kill(pid, sig)

    def ended(timeout_s: float) -> bool:
        if handle is not None:
            return bool(select.select([handle], [], [], timeout_s)[0])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.05)
        return False

    sys.stdin.buffer.read()  # returns when the parent ends
    try:
        send(signal.SIGTERM)
        if not ended(grace_s):
            send(signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    _watch(int(sys.argv[1]), float(sys.argv[2]))
