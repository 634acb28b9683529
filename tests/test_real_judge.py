"""The offline pair served as the judge (`sidecar serve`) on real news: its likelihood method tells a
document's own tags from another document's, and a document's own headline from another's when asked by the
headline task's instruction, through the official `openai` client.

The tags are each article's own title words, so the known answer of every rung holds by construction: easy
(another article's tags) must lose by more than the margin, null (the same tags reversed) must tie. The
judge is the one the judge flow serves by default; its first scorer prompt, the one worded unlike either
tagger's instruction (``tags-l2``), and the pair's draft as the second judge.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from server.launcher import running_server
from study.judge.config import JudgeConfig
from study.judge.controls import null_tags
from study.judge.likelihood_run import likelihood_reliability, score_by_likelihood
from study.judge.results import JudgeItem

# the 1.5B served on a CPU, two scorer models, six documents: a few minutes on a busy machine
pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.servers, pytest.mark.timeout(1200)]

DOCUMENTS = 6
PAIR = "qwen-coder-small"


def title_tags(title: str) -> list[str]:
    """Up to four of the title's longest words, in title order: tags that belong to this article alone."""
    words = list(dict.fromkeys(w.lower() for w in re.findall(r"[A-Za-z]{4,}", title)))
    longest = set(sorted(words, key=len, reverse=True)[:4])
    return [w for w in words if w in longest]


@pytest.fixture(scope="module")
def items(news_parquet: Path) -> list[JudgeItem]:
    table = pq.read_table(news_parquet, columns=["title", "article"]).slice(0, 40).to_pylist()
    rows = [r for r in table if r["title"] and len(title_tags(r["title"])) >= 3][:DOCUMENTS]
    assert len(rows) == DOCUMENTS
    # the article's lead stands in for its summary; sidecar and standalone carry the same tags (a tie)
    return [JudgeItem(doc_id=f"doc-{i}", summary=r["article"][:400], sidecar_tags=title_tags(r["title"]),
                      standalone_tags=title_tags(r["title"])) for i, r in enumerate(rows)]


@pytest.fixture(scope="module")
def judge_url() -> Iterator[str]:
    # fp32: in bf16 on a CPU without AMX (the 2-core AMD EPYC, where auto picks bf16 by 14.2 vs 16.5 ms) the null
    # rung failed 1 of 6 documents (reversed tags scored beyond the 0.531 margin), on main 17d8c31 as on
    # later commits: the judge then reports itself UNRELIABLE, as it should; this test checks the method
    with running_server(PAIR, model_name=PAIR, extra_args=["--dtype", "fp32"]) as url:
        yield url


@pytest.mark.parametrize("model", [PAIR, f"{PAIR}/draft"])
def test_the_served_pair_scores_a_documents_own_tags_above_anothers_beyond_its_margin(
        items: list[JudgeItem], judge_url: str, model: str) -> None:
    config = JudgeConfig(model=PAIR, base_url=judge_url, api_key="unused", controls=DOCUMENTS, concurrency=1,
                         timeout_s=300)
    outcome = score_by_likelihood(items, config, model, "tags-l2")
    assert outcome.unavailable is None and len(outcome.results) == DOCUMENTS
    quality = likelihood_reliability(outcome.results, config)
    # every easy control clears the margin, every null ties: the method is trusted on this run
    assert quality.easy.documents == DOCUMENTS and quality.easy.passed == DOCUMENTS, quality.line()
    assert quality.null.documents == DOCUMENTS and quality.null.passed == DOCUMENTS, quality.line()
    assert quality.trusted and quality.auc is not None and quality.auc > 0.9
    # the two sides carry the same tags: their difference is exactly nothing, a tie
    assert all(r.difference("main") == 0.0 and r.verdict == "tie" for r in outcome.results)


HEADLINE = "Write a one-line headline for the summary."


@pytest.fixture(scope="module")
def headline_items(news_parquet: Path) -> list[JudgeItem]:
    """The article's own title as its headline, in the task form: titles in two parts ("X: Y", "X, Y"), so that
    every document has a null game (the parts swapped)."""
    table = pq.read_table(news_parquet, columns=["title", "article"]).slice(0, 80).to_pylist()
    rows = [r for r in table if r["title"] and null_tags(r["title"].strip()) is not None][:DOCUMENTS]
    assert len(rows) == DOCUMENTS
    return [JudgeItem(doc_id=f"doc-{i}", summary=r["article"][:400], sidecar_tags=r["title"].strip(),
                      standalone_tags=r["title"].strip(), task="headline", instruction=HEADLINE)
            for i, r in enumerate(rows)]


def test_the_served_pair_scores_a_documents_own_headline_above_anothers_asked_by_the_tasks_instruction(
        headline_items: list[JudgeItem], judge_url: str) -> None:
    # the draft as scorer: the task form's wording is what this proves (the default scorer is proven on tags
    # above), and the 0.5B scores in a third of the 1.5B's time
    scorer = f"{PAIR}/draft"
    config = JudgeConfig(model=scorer, base_url=judge_url, api_key="unused", controls=DOCUMENTS, concurrency=1,
                         timeout_s=300)
    outcome = score_by_likelihood(headline_items, config, scorer, "tags-l2")
    assert outcome.unavailable is None and len(outcome.results) == DOCUMENTS
    quality = likelihood_reliability(outcome.results, config)
    assert quality.easy.documents == DOCUMENTS and quality.easy.passed == DOCUMENTS, quality.line()
    assert quality.null.documents == DOCUMENTS and quality.null.passed == DOCUMENTS, quality.line()
    assert quality.trusted and quality.auc is not None and quality.auc > 0.9
    print(quality.line())
