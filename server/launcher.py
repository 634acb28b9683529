"""Running the server: ``serve`` in this process, ``running_server`` as ``python -m cli serve`` in a child.

A child started by ``running_server`` is stopped when its context exits, however it exits, and when this
process ends, ``kill -9`` included (``server.tether``). Model code and
the web framework load only inside ``serve``, so a caller that only starts a child stays light.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from server.config import API_KEY_ENV, ServerConfig, is_loopback
from server.tether import Tether, tether
from sidecar.errors import InputError

logger = logging.getLogger(__name__)


def serve(pair_name: str, host: str = "127.0.0.1", port: int = 8000, *, api_key: str | None = None,
          max_batch: int = 8, batch_wait_ms: float = 5.0, gamma: int = 4, max_body_bytes: int = 1 << 20,
          max_queue: int = 256, model_name: str | None = None, insecure: bool = False,
          dtype: str | None = None, prompt_cache: bool = True, prompt_cache_mib: int = 256) -> None:
    """Check the config, bind the port, load the pair, then serve it until interrupted.

    Without a key, only a loopback ``host`` is served unless ``insecure`` (``ServerConfig`` raises ``InputError``).
    """
    import uvicorn

    from server.app import create_app
    from sidecar.models.loading import load_pair
    from sidecar.tasks.engine import SidecarEngine

    # the config and the port first: a refused config or a taken port fails before minutes of model loading
    config = ServerConfig(model_name=model_name or pair_name, api_key=api_key or None, host=host, insecure=insecure,
                          max_batch=max_batch, batch_wait_ms=batch_wait_ms, max_body_bytes=max_body_bytes,
                          max_queue=max_queue, prompt_cache=prompt_cache, prompt_cache_mib=prompt_cache_mib)
    with bind(host, port) as sock:
        pair = load_pair(pair_name, dtype=dtype)
        engine = SidecarEngine(pair, gamma=gamma, max_batch=config.max_batch)
        logger.info("serving pair %s (%s) as model %r on %s:%d (auth %s)", pair_name, pair.dtype_report,
                    config.model_name, host, port, "on" if config.api_key else "off")
        if not config.api_key and not is_loopback(host):
            logger.warning("--insecure: no API key on %s; anyone who reaches port %d can use the model", host, port)
        server = uvicorn.Server(uvicorn.Config(create_app(engine, config), host=host, port=port, log_level="info"))
        server.run(sockets=[sock])


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` as uvicorn binds one, not listening yet (a client that comes while
    the models load is refused, not left waiting); a port that is taken raises ``InputError`` naming it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    # as uvicorn: a port whose old connections linger in TIME_WAIT is free
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise InputError(f"cannot serve on {host}:{port}: {(exc.strerror or str(exc)).lower()}; stop what holds "
                         "the port or pass another --port") from None
    return sock


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _log_tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:]


@contextlib.contextmanager
def running_server(pair_name: str = "qwen-coder-small", *, api_key: str | None = None,
                   model_name: str | None = None, max_batch: int = 8, batch_wait_ms: float = 5.0, gamma: int = 4,
                   extra_args: Sequence[str] = (), startup_timeout_s: float = 600.0,
                   log_path: Path | None = None, checkout: Path | None = None) -> Iterator[str]:
    """Run ``sidecar serve`` in a subprocess on a free loopback port; yields its OpenAI base URL (``.../v1``).

    The key travels in the environment, not on the command line where ``ps`` would show it. The server's
    output goes to ``log_path`` (a temporary file by default). The server is stopped on exit. ``checkout``
    runs the server of another checkout of this repository instead (a benchmark's baseline, say): the child
    works in that directory, with it on ``PYTHONPATH``.
    """
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    if api_key:
        env[API_KEY_ENV] = api_key
    if checkout is not None:
        env["PYTHONPATH"] = str(checkout)
    with contextlib.ExitStack() as stack:
        if log_path is None:
            log_path = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sidecar-serve-"))) / "server.log"
        # Another process can take the free port before the server binds it; then try another one.
        for attempt in range(3):
            port = free_port()
            args = ["serve", "--pair", pair_name, "--host", "127.0.0.1", "--port", str(port), "--max-batch",
                    str(max_batch), "--batch-wait-ms", str(batch_wait_ms), "--gamma", str(gamma), *extra_args]
            if model_name:
                args += ["--model-name", model_name]
            with log_path.open("ab") as log:
                proc = subprocess.Popen([sys.executable, "-m", "cli", *args], stdout=log, stderr=subprocess.STDOUT,
                                        env=env, cwd=checkout)
            stack.callback(_stop, proc, tether(proc.pid))
            if _wait_healthy(proc, port, startup_timeout_s, log_path):
                break
            if "address already in use" not in _log_tail(log_path).lower() or attempt == 2:
                raise RuntimeError(f"sidecar serve exited with code {proc.returncode}:\n{_log_tail(log_path)}")
        yield f"http://127.0.0.1:{port}/v1"


def _wait_healthy(proc: subprocess.Popen, port: int, timeout_s: float, log_path: Path) -> bool:
    """True once /health answers; False if the process exits first."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    return True
            time.sleep(0.2)
    raise TimeoutError(f"sidecar serve did not become healthy within {timeout_s:.0f}s:\n{_log_tail(log_path)}")


def _stop(proc: subprocess.Popen, watcher: Tether) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # uvicorn finishes open requests, then exits
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    watcher.release()
