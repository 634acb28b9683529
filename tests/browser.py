"""Headless Chromium for the tests that look at a page as a user does (the cost report, Prefect's run form).

Debian's ``chromium`` driven by Selenium through Debian's ``chromedriver`` (``make browser`` installs both on a
root machine with apt-get). The driver is given by an explicit Service path, so Selenium Manager never runs and
nothing is fetched: the browser and its driver come from the same Debian release and match. Without them a test
is skipped, saying why. Screenshots go under ``$SIDECAR_TEST_ARTIFACTS`` (default: ``test-artifacts/`` at the
repository root).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
# --no-sandbox: CI containers run as root, where Chromium's sandbox cannot start; the pages are our own.
# The rest keep it off the network it cannot reach here (updates, sync, first-run pages) and off a GPU.
FLAGS = ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run")


def artifacts_dir() -> Path:
    path = Path(os.environ.get("SIDECAR_TEST_ARTIFACTS") or REPO / "test-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def headless_chromium(width: int, height: int) -> Iterator[Any]:
    """A Selenium driver of a fresh headless Chromium profile with a ``width`` x ``height`` window; the test is
    skipped, saying why, where Chromium or its driver is missing; Selenium is in the dev extras, so `make test`
    has it and its absence is a failure."""
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("no chromium and chromedriver on PATH: `make browser` installs Debian's (as root, with apt-get)")
    assert importlib.util.find_spec("selenium") is not None, "selenium is not installed: pip install -e '.[dev]'"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for argument in (*FLAGS, f"--window-size={width},{height}", f"--user-data-dir={profile}"):
            options.add_argument(argument)
        driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
        try:
            yield driver
        finally:
            driver.quit()
