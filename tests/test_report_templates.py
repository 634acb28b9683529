"""The cost report's Jinja2 templates: one text, rendered as markdown and as HTML, that fails loudly on a missing
value and escapes what it is given in HTML only."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest
from jinja2 import UndefinedError
from test_report import drafts, row, stored_run

from study.report import write_cost_report
from study.report.render import render


def paragraphs(markdown: str) -> list[str]:
    return [b for b in markdown.split("\n\n") if b and not b.startswith(("#", "|", "- ", "!["))]


def test_a_report_from_a_stored_run_says_its_key_sentences_in_both_files(tmp_path: Path) -> None:
    db = stored_run(tmp_path / "sidecar.duckdb", pair="qwen2.5-7b", dtype="bf16 (default on CUDA: bf16)")
    report = write_cost_report(db.throughput("run-1"), tmp_path / "report", draft_config=drafts,
                               acceptance=db.request_acceptance("run-1"))  # fmt: skip
    markdown = report.markdown
    for sentence in (
        "Is a sidecar tag token cheaper than one from a standalone deployment of the same draft model?",
        "| NVIDIA H200 | measured | qwen2.5-7b | 25.0% cheaper | – | – | – |",
        "Measured: 3 throughput rows from 1 run(s) on NVIDIA H200 in bf16 (default on CUDA: bf16) with pair(s) "
        "qwen2.5-7b. Projected: a roofline",
        "NVIDIA H200: measured at batch 2, a sidecar tag token costs 25.0% less than a standalone tagger's: 10.71 "
        "vs 14.29 device ms per tag token",
        "| NVIDIA H200 | qwen2.5-7b | 2 | sidecar | total, 14 tag tokens | 150 | 10.71 |",
        "at batch 2, 32, 64 and 128 (the measured batch 2, and 32-128, the batch sizes nightly jobs run on GPUs)",
        "| NVIDIA H200 | qwen2.5-7b | sidecar | 2 | 0.25 | 0.5 | 0.75 |",
    ):
        assert sentence in markdown
    # one line per paragraph, however the template wraps it, and one blank line between blocks
    assert "\n\n\n" not in markdown and not re.search(r"^ | $", markdown, flags=re.MULTILINE)
    # the page says the same paragraphs, in the same order
    page = report.html_path.read_text(encoding="utf-8")
    assert [html.unescape(p) for p in re.findall(r"<p>(.*?)</p>", page)] == paragraphs(markdown)
    assert re.findall(r"<h2>(.+?)</h2>", page) == re.findall(r"^## (.+)$", markdown, flags=re.MULTILINE)


def test_values_are_escaped_in_html_and_in_markdown_cells(tmp_path: Path) -> None:
    odd = "GPU <b>x</b> | y"
    report = write_cost_report([row(odd, "sidecar", "sidecar", 4, 40, 4.0), row(odd, "standalone", "sidecar", 4, 40,
                                                                                  5.0)], tmp_path)  # fmt: skip
    assert "| GPU <b>x</b> \\| y | measured |" in report.markdown
    page = report.html_path.read_text(encoding="utf-8")
    assert "<b>x</b>" not in page and "<td>GPU &lt;b&gt;x&lt;/b&gt; | y</td>" in page


def test_a_value_the_template_names_but_is_not_given_stops_the_report() -> None:
    with pytest.raises(UndefinedError, match="'view' is undefined"):
        render("cost_report.j2", "markdown", data=None, pair="p", gamma=4)
