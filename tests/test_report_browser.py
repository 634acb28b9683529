"""The cost report's HTML page in a real browser (headless Chromium, tests/browser.py): every plot loads and the
verdict is on the first screen, kept as a screenshot under ``$SIDECAR_TEST_ARTIFACTS`` (default:
``test-artifacts/``). Without Chromium the tests are skipped, saying why.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from browser import artifacts_dir, headless_chromium

# The measurements test_report.py feeds the report through storage: one run, sidecar and standalone tagging.
from test_report import drafts, stored_run

from study.report import CostReport, write_cost_report

pytestmark = pytest.mark.servers  # a headless browser

WIDTH, HEIGHT = 1280, 800  # a typical laptop window

USD_PLOT_ALT = "$ per 1M tag tokens, sidecar vs standalone, per GPU type"
IMAGES_JS = "return Array.from(document.images, i => ({alt: i.alt, complete: i.complete, width: i.naturalWidth}));"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with headless_chromium(WIDTH, HEIGHT) as driver:
        yield driver


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> CostReport:
    root = tmp_path_factory.mktemp("browser")
    db = stored_run(root / "sidecar.duckdb", pair="qwen2.5-7b")
    return write_cost_report(db.query("SELECT * FROM throughput"), root / "report", draft_config=drafts,
                             acceptance=db.request_acceptance("run-1"))  # fmt: skip


def broken_images(driver: Any) -> list[str]:
    """The alt text of every image on the loaded page that did not decode to a picture."""
    return [i["alt"] for i in driver.execute_script(IMAGES_JS) if not (i["complete"] and i["width"] > 0)]


def test_every_plot_loads(browser: Any, report: CostReport) -> None:
    browser.get(report.html_path.as_uri())
    images = browser.execute_script(IMAGES_JS)
    assert len(images) == len(report.plot_paths)
    assert broken_images(browser) == []


def test_the_page_leads_with_the_verdict_table_and_its_plot(browser: Any, report: CostReport) -> None:
    from selenium.webdriver.common.by import By

    browser.get(report.html_path.as_uri())
    viewport = browser.execute_script("return window.innerHeight;")
    assert viewport >= HEIGHT * 0.8  # the first screen is the window's, less at most the browser's own bars
    assert browser.find_element(By.XPATH, "(//table)[1]/preceding::h2[1]").text == "Verdict per GPU type"
    table = browser.execute_script(
        "const t = document.querySelector('table'), row = t.querySelector('tbody tr');"
        "return {top: t.getBoundingClientRect().top, first_row_bottom: row.getBoundingClientRect().bottom};"
    )
    # the table starts, and its first verdict can be read, without scrolling
    assert 0 <= table["top"] < table["first_row_bottom"] <= viewport
    # one picture comes before the method text, the $ plot, and it starts on the first screen too
    before_method = browser.find_elements(By.XPATH, "//h2[.='What this report compares']/preceding::img")
    assert [img.get_attribute("alt") for img in before_method] == [USD_PLOT_ALT]
    assert browser.execute_script("return arguments[0].getBoundingClientRect().top;", before_method[0]) < viewport
    screenshot = artifacts_dir() / "cost_report_first_screen.png"
    assert browser.save_screenshot(str(screenshot)) and screenshot.stat().st_size > 0


def test_a_broken_plot_is_caught(browser: Any, report: CostReport, tmp_path: Path) -> None:
    """The check above can fail: a page with a corrupt embedded PNG and a missing file has two broken images."""
    page = report.html_path.read_text(encoding="utf-8")
    page = page.replace('src="data:image/png;base64,', 'src="missing.png" data-was="', 1)
    page = page.replace("data:image/png;base64,", "data:image/png;base64,AAAA", 1)
    broken = tmp_path / "broken.html"
    broken.write_text(page, encoding="utf-8")
    browser.get(broken.as_uri())
    assert len(broken_images(browser)) == 2
