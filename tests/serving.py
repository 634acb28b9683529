"""A FastAPI app on a real uvicorn in a thread of the test process, and request bodies for it."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from server.launcher import free_port


@contextlib.contextmanager
def serving(app: FastAPI) -> Iterator[tuple[str, threading.Thread]]:
    """``app`` on loopback: (base URL, the thread that runs its event loop)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "in-process server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", thread
    finally:
        server.should_exit = True
        thread.join(30)


def chat(prompt: str, **fields: object) -> dict:
    """A greedy chat-completions body for the tiny pair with one user message."""
    return {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "temperature": 0, **fields}
