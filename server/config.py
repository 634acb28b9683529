"""How a server runs: its served model id, auth, batching and request limits."""

from __future__ import annotations

from dataclasses import dataclass

# the environment variable that holds the key clients must send as ``Authorization: Bearer <key>``
API_KEY_ENV = "SIDECAR_API_KEY"
DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_batch: int = 8
    batch_wait_ms: float = 5.0
    max_body_bytes: int = 1 << 20
    # Requests waiting for the worker; beyond this the server answers 503 instead of queueing forever.
    max_queue: int = 256
