"""Write the bad-input Parquet files used by tests/test_parquet.py.

    .venv/bin/python tests/data/make_bad_corpus.py

bad_corpus.parquet has columns id (string), article (binary, so that non-UTF-8 bytes can be stored) and
title; one row per kind of bad input plus good rows around them. no_text_column.parquet has the id but
calls its text column ``body``. Each row of ROWS carries the reject reason the reader must give (None for
a usable document); tests/test_parquet.py imports ROWS and checks the committed files against main().
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
BAD_CORPUS = HERE / "bad_corpus.parquet"
NO_TEXT_COLUMN = HERE / "no_text_column.parquet"

# Ten times a 32,768-token context at about four characters per token.
HUGE_CHARS = 10 * 32_768 * 4
# The limit the test reads with: any real article fits, the huge one does not.
MAX_CHARS = 100_000

GOOD_TEXT = "The council approved the new budget on Tuesday after a long debate about school funding."
HOSTILE_TEXT = "Quotes ' \" and '; DROP TABLE runs; -- plus unicode: Zürich, 東京, emoji 🙂, NUL \x00 inside."


def _huge_text() -> str:
    sentence = "A very long report keeps going, paragraph after paragraph, without ever ending. "
    return (sentence * (HUGE_CHARS // len(sentence) + 1))[:HUGE_CHARS]


# (row id, article bytes or None, title, expected reject reason)
ROWS: list[tuple[str | None, bytes | None, str | None, str | None]] = [
    ("good-1", GOOD_TEXT.encode(), "Budget approved", None),
    ("empty", b"", "Empty article", "empty"),
    ("whitespace", "  \n\t  \u00a0 ".encode(), "Only whitespace", "empty"),
    ("not-utf8", b"Caf\xe9 au lait \xff\xfe in Latin-1 bytes", "Bad bytes", "not_utf8"),
    ("good-1", b"A second row reusing an id already taken.", "Duplicate", "duplicate_id"),
    ("huge", _huge_text().encode(), "Ten contexts long", "too_long"),
    ("null-text", None, "No article", "null"),
    (None, GOOD_TEXT.encode(), "No id", "null"),
    ("good-hostile '; DROP TABLE runs; --", HOSTILE_TEXT.encode(), None, None),
    ("good-3", "Ein Bericht über Zürich mit Umlauten.".encode(), "Umlauts", None),
]


def main(out_dir: Path = HERE) -> None:
    ids, articles, titles, _ = zip(*ROWS, strict=True)
    table = pa.table(
        {"id": pa.array(ids, pa.string()), "article": pa.array(articles, pa.binary()),
         "title": pa.array(titles, pa.string())}
    )
    pq.write_table(table, out_dir / BAD_CORPUS.name, compression="zstd")
    pq.write_table(pa.table({"id": ["a", "b"], "body": ["first text", "second text"]}),
                   out_dir / NO_TEXT_COLUMN.name)
    print(f"wrote {BAD_CORPUS.name} ({table.num_rows} rows) and {NO_TEXT_COLUMN.name} to {out_dir}")


if __name__ == "__main__":
    main()
