"""How a server runs: its served model id, where it listens, auth, batching and request limits.

Every setting is checked when the config is made, before a model loads, within finite bounds: an endless
batch wait or an unbounded queue would not be refused later, it would stop the batch worker (a pydantic
``ValidationError``, one line and exit 2 from ``sidecar serve``). A server without a key answers anyone
who can reach its port, so a keyless config is refused on any address that is not loopback unless
``insecure`` says that this is meant (``InputError``).
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from sidecar.errors import InputError

# the environment variable that holds the key clients must send as ``Authorization: Bearer <key>``
API_KEY_ENV = "SIDECAR_API_KEY"
DEFAULT_MAX_TOKENS = 256


def is_loopback(host: str) -> bool:
    """True if every address ``host`` names is a loopback address; a name that does not resolve is not."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(address).is_loopback for address in addresses)


class ServerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    model_name: str = Field(min_length=1)
    api_key: str | None = None
    host: str = "127.0.0.1"
    # serve without a key on a non-loopback address: anyone who reaches the port can use the model
    insecure: bool = False
    # Requests decoded together: the running batch's slots. A request joins at the first step with a free slot.
    max_batch: int = Field(8, ge=1, le=4096)
    # How long the first request to reach an idle worker waits for others to share its prefill; a running
    # batch never waits, new requests join it at its next step.
    batch_wait_ms: float = Field(5.0, ge=0, le=60_000)
    max_body_bytes: int = Field(1 << 20, ge=1024, le=1 << 30)
    # Requests waiting for the worker; beyond this the server answers 503 instead of queueing forever.
    max_queue: int = Field(256, ge=1, le=1_000_000)
    # The prompt-scoring prefix cache of each model (``sidecar.decoding.prefix_cache``): on or off, as vLLM's
    # --enable-prefix-caching and SGLang's --disable-radix-cache, and the MiB of keys and values it may hold
    # per model (least recently used out first), kept on the device beside the batch's KV caches.
    prompt_cache: bool = True
    prompt_cache_mib: int = Field(256, ge=1, le=1 << 20)

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        # after the bounds, and outside pydantic, so that it stays an InputError naming --insecure
        if not self.api_key and not self.insecure and not is_loopback(self.host):
            raise InputError(f"refusing to serve on {self.host} without an API key, which would let anyone who "
                             f"reaches the port use it: set {API_KEY_ENV}, or pass --insecure if that is meant")
