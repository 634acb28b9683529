"""``sidecar serve``: the OpenAI-compatible server over a model pair, until interrupted."""

from __future__ import annotations

import logging

import typer

from server.config import API_KEY_ENV
from sidecar.settings import DTYPE_HELP


def serve_command(
    pair: str = typer.Option("qwen-coder-small", help="Model pair: tiny, qwen-coder-small, ... or TARGET,DRAFT."),
    host: str = typer.Option("127.0.0.1", help="Address to bind; the default keeps the server on loopback."),
    port: int = typer.Option(8000, min=1, max=65535, help="TCP port."),
    api_key: str | None = typer.Option(None, envvar=API_KEY_ENV, show_default=False,
                                       help="Require 'Authorization: Bearer <key>' (prefer the env variable)."),
    # the bounds of these five are ServerConfig's, checked before the pair loads
    max_batch: int = typer.Option(8, help="Most requests decoded together (1-4096); others join as slots free."),
    batch_wait_ms: float = typer.Option(5.0, help="How long the first request to an idle server waits for "
                                                  "others to share its prefill (0-60000)."),
    gamma: int = typer.Option(4, min=0, help="Most tokens drafted per step (0: plain decoding, the draft model "
                                             "running the sidecar tasks only)."),
    max_body_bytes: int = typer.Option(1 << 20, help="Larger request bodies get 413 (1 KiB-1 GiB)."),
    max_queue: int = typer.Option(256, help="Requests waiting beyond this get 503 (1-1000000)."),
    prompt_cache: bool = typer.Option(True, "--prompt-cache/--no-prompt-cache",
                                      help="Keep recently scored prompts' keys and values per model, so a prompt "
                                           "sharing their leading tokens forwards only the rest."),
    prompt_cache_mib: int = typer.Option(256, help="Most MiB of keys and values the prompt cache holds per model, "
                                                   "least recently used out first (1-1048576)."),
    model_name: str | None = typer.Option(None, help="Served model id; default the pair name."),
    dtype: str | None = typer.Option(None, help=DTYPE_HELP),
    insecure: bool = typer.Option(False, "--insecure",
                                  help="Serve a non-loopback --host without an API key: anyone who reaches the "
                                       "port can use the model. Without this flag that is refused (exit code 2)."),
) -> None:
    """Serve the pair over an OpenAI-compatible API (chat completions, streaming, sidecar tasks)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from server.launcher import serve

    # a setting out of bounds, an unknown pair or a refused keyless host raises its own error, which
    # cli.errors turns into one line
    serve(pair, host, port, api_key=api_key, max_batch=max_batch, batch_wait_ms=batch_wait_ms, gamma=gamma,
          max_body_bytes=max_body_bytes, max_queue=max_queue, model_name=model_name, insecure=insecure, dtype=dtype,
          prompt_cache=prompt_cache, prompt_cache_mib=prompt_cache_mib)
