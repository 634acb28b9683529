"""A throwaway Prefect home for a benchmark process, set before Prefect is imported."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def throwaway_prefect_home(prefix: str) -> Path:
    """Point ``PREFECT_HOME`` at a fresh temporary directory, with analytics off, time for the embedded API to
    start and no ``PREFECT_API_URL``: each benchmark gets its own embedded API, never a server it happens to
    see. Call it before anything imports Prefect, which reads these settings once."""
    home = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ["PREFECT_HOME"] = str(home)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.pop("PREFECT_API_URL", None)
    return home
