"""Process-wide settings, read from the environment (``SIDECAR_*``)."""

from __future__ import annotations

from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SIDECAR_")

    home: Path = Path.home() / ".cache" / "sidecar"
    # where runs take the lock of the accelerator they use; processes that share a device must share
    # this folder (default: ``home``/locks, per user)
    lock_dir: Path | None = None
    # prefill every batch in one forward, as on an accelerator, instead of the CPU's groups of rows
    one_prefill_forward: bool = False
    # the Prefect global concurrency limit a run holds a slot of while its pair is loaded: one per GPU on a
    # pool of several (a worker per GPU sets ``gpu-<host>-<index>``), ``gpu`` for a single-GPU server
    gpu_limit: str = "gpu"


def sidecar_home() -> Path:
    return Settings().home


def lock_dir() -> Path:
    """``$SIDECAR_LOCK_DIR``, else ``locks`` under the sidecar home."""
    settings = Settings()
    return settings.lock_dir or settings.home / "locks"
