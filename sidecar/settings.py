"""Process-wide settings, read from the environment (``SIDECAR_*``)."""

from __future__ import annotations

from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SIDECAR_")

    home: Path = Path.home() / ".cache" / "sidecar"


def sidecar_home() -> Path:
    return Settings().home
