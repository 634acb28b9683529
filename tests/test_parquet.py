"""storage.parquet.read_documents on the committed bad-input corpus and on CNN/DailyMail-shaped files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from storage import Database, Document, InputSchemaError
from storage.parquet import read_documents

DATA = Path(__file__).resolve().parent / "data"


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_bad_corpus", DATA / "make_bad_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bad = _load_generator()


def read_bad(**kwargs):
    return read_documents(bad.BAD_CORPUS, title_column="title", max_chars=bad.MAX_CHARS, **kwargs)


def test_committed_files_match_their_generator(tmp_path: Path) -> None:
    bad.main(tmp_path)
    for name in (bad.BAD_CORPUS.name, bad.NO_TEXT_COLUMN.name):
        assert pq.read_table(tmp_path / name).equals(pq.read_table(DATA / name)), name


def test_each_bad_row_gets_its_reason_and_good_rows_survive() -> None:
    documents, rejects = read_bad()
    assert len(documents) + len(rejects) == len(bad.ROWS)
    by_row = {d.row_index: (d.doc_id, None) for d in documents} | {r.row_index: (r.doc_id, r.reason) for r in rejects}
    for index, (row_id, article, _title, expected_reason) in enumerate(bad.ROWS):
        doc_id, reason = by_row[index]
        assert reason == expected_reason, f"row {index} ({row_id!r})"
        assert doc_id == row_id  # a null id stays None, no made-up name
        if expected_reason is None:
            [document] = [d for d in documents if d.row_index == index]
            assert document.text == article.decode("utf-8")  # kept byte for byte, NUL included

    assert [d.doc_id for d in documents] == ["good-1", "good-hostile '; DROP TABLE runs; --", "good-3"]
    assert documents[0].title == "Budget approved" and documents[1].title is None
    details = {r.reason: r.detail for r in rejects}
    assert str(bad.HUGE_CHARS) in details["too_long"] and str(bad.MAX_CHARS) in details["too_long"]
    assert "'good-1'" in details["duplicate_id"]
    assert {r.doc_id: r.text for r in rejects}["not-utf8"] is None


def test_without_max_chars_the_huge_document_is_kept() -> None:
    documents, rejects = read_documents(bad.BAD_CORPUS)
    assert "huge" in {d.doc_id for d in documents}
    assert "too_long" not in {r.reason for r in rejects}
    assert all(d.title is None for d in documents)


def test_limit_counts_usable_documents_and_keeps_the_rejects_met_on_the_way() -> None:
    documents, rejects = read_bad(limit=2)
    assert [d.doc_id for d in documents] == ["good-1", "good-hostile '; DROP TABLE runs; --"]
    assert [r.row_index for r in rejects] == [1, 2, 3, 4, 5, 6, 7]
    with pytest.raises(ValueError, match="limit"):
        read_bad(limit=0)


def test_a_missing_text_column_is_named_with_the_columns_that_exist() -> None:
    with pytest.raises(InputSchemaError) as caught:
        read_documents(bad.NO_TEXT_COLUMN)
    message = str(caught.value)
    assert "'article'" in message and "id, body" in message
    documents, rejects = read_documents(bad.NO_TEXT_COLUMN, text_column="body")
    assert [d.text for d in documents] == ["first text", "second text"] and rejects == []


def test_missing_id_and_title_columns_are_reported_together(tmp_path: Path) -> None:
    with pytest.raises(InputSchemaError) as caught:
        read_documents(bad.NO_TEXT_COLUMN, id_column="doc_id", text_column="body", title_column="headline")
    message = str(caught.value)
    assert "id column 'doc_id'" in message and "title column 'headline'" in message and "id, body" in message


def test_wrong_text_type_and_non_parquet_files_are_input_schema_errors(tmp_path: Path) -> None:
    numbers = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"id": ["a"], "article": [42]}), numbers)
    with pytest.raises(InputSchemaError, match="int64"):
        read_documents(numbers)
    not_parquet = tmp_path / "notes.parquet"
    not_parquet.write_text("id,article\n1,hello\n")
    with pytest.raises(InputSchemaError, match="not a readable Parquet file"):
        read_documents(not_parquet)
    with pytest.raises(FileNotFoundError):
        read_documents(tmp_path / "absent.parquet")


def test_cnn_dailymail_shaped_file_reads_with_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "cnn.parquet"
    pq.write_table(pa.table({"article": ["First story.", "Second story."], "highlights": ["h1", "h2"],
                             "id": ["0001d1a", "0002e2b"]}), path)
    documents, rejects = read_documents(path)
    assert [(d.doc_id, d.text) for d in documents] == [("0001d1a", "First story."), ("0002e2b", "Second story.")]
    assert rejects == []


def test_integer_ids_become_strings_and_duplicates_still_count(tmp_path: Path) -> None:
    path = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"id": [7, 8, 7], "article": ["a", "b", "c"]}), path)
    documents, rejects = read_documents(path)
    assert [d.doc_id for d in documents] == ["7", "8"]
    assert [(r.doc_id, r.reason) for r in rejects] == [("7", "duplicate_id")]


def test_documents_and_rejects_are_stored_with_their_reasons(tmp_path: Path) -> None:
    documents, rejects = read_bad()
    db = Database(tmp_path / "sidecar.duckdb")
    db.start_run("run-bad", {"input": str(bad.BAD_CORPUS)}, "tiny", "cpu", "cpu", 4, 2, code_version="test")
    db.record_documents("run-bad", documents, rejects)
    rows = db.query("SELECT row_index, status, reject_reason FROM documents WHERE run_id = ? ORDER BY row_index",
                    ["run-bad"])
    assert [r["reject_reason"] for r in rows] == [reason for *_, reason in bad.ROWS]
    assert [r["status"] for r in rows] == ["ok" if reason is None else "rejected" for *_, reason in bad.ROWS]


def test_empty_and_whitespace_ids_are_rejected_and_a_null_id_collides_with_no_real_id(tmp_path: Path) -> None:
    path = tmp_path / "ids.parquet"
    # row 3's null id was once stored as the placeholder "row:3", the real id of row 4
    pq.write_table(pa.table({"id": ["good", "", " \t\u00a0", None, "row:3"],
                             "article": ["Text one.", "Text two.", "Text three.", "Text four.", "Text five."]}), path)
    documents, rejects = read_documents(path)
    assert [(d.row_index, d.doc_id) for d in documents] == [(0, "good"), (4, "row:3")]
    assert [(r.row_index, r.doc_id, r.reason) for r in rejects] == [
        (1, "", "empty"), (2, " \t\u00a0", "empty"), (3, None, "null")]
    assert [r.detail for r in rejects] == ["id is empty or whitespace", "id is empty or whitespace", "id is null"]

    db = Database(tmp_path / "sidecar.duckdb")
    db.begin_run("run-ids", {}, "tiny", "cpu", "cpu", 4, 2, docs=documents, rejects=rejects, code_version="test")
    stored = db.query("SELECT row_index, doc_id, status FROM documents ORDER BY row_index")
    assert [(r["row_index"], r["doc_id"], r["status"]) for r in stored] == [
        (0, "good", "ok"), (1, "", "rejected"), (2, " \t\u00a0", "rejected"), (3, None, "rejected"),
        (4, "row:3", "ok")]
    assert db.query("SELECT count(*) AS n FROM documents WHERE doc_id = 'row:3'")[0]["n"] == 1


def test_the_database_refuses_usable_documents_with_blank_or_repeated_ids(tmp_path: Path) -> None:
    db = Database(tmp_path / "sidecar.duckdb")
    for docs, match in [([Document(" ", "Some text.", 0)], "row 0.*id"),
                        ([Document("a", "One.", 0), Document("a", "Two.", 1)], "'a'.*rows 0 and 1")]:
        with pytest.raises(ValueError, match=match):
            db.begin_run("run-ids", {}, "tiny", "cpu", "cpu", 4, 2, docs=docs, rejects=[], code_version="test")
    assert db.get_run("run-ids") is None


# -- JSON Lines and CSV --------------------------------------------------------------------------------------

ROWS = [{"id": "007", "article": "The council met on Tuesday.", "title": "Council"},
        {"id": "008", "article": "  ", "title": "Blank"},
        {"id": "007", "article": "Prices rose again.", "title": "Prices"},
        {"id": "009", "article": "Rain, then sun: a \"mixed\" week.\nSecond line.", "title": "Weather"}]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    import json

    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_csv(path: Path, rows: list[dict]) -> Path:
    import pyarrow.csv as pcsv

    pcsv.write_csv(pa.Table.from_pylist(rows), path)
    return path


def test_jsonl_and_csv_corpora_read_as_their_parquet_twin_does(tmp_path: Path) -> None:
    parquet = tmp_path / "news.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    expected = read_documents(parquet, title_column="title")
    assert [d.doc_id for d in expected[0]] == ["007", "009"]
    assert [(r.doc_id, r.reason) for r in expected[1]] == [("008", "empty"), ("007", "duplicate_id")]
    for path in (write_jsonl(tmp_path / "news.jsonl", ROWS), write_jsonl(tmp_path / "news.NDJSON", ROWS),
                 write_csv(tmp_path / "news.csv", ROWS)):
        assert read_documents(path, title_column="title") == expected, path
        assert read_documents(path, title_column="title", limit=1)[0] == expected[0][:1]


def test_a_csv_reads_its_id_and_text_columns_as_text(tmp_path: Path) -> None:
    path = tmp_path / "numbers.csv"
    path.write_text("doc,body\n007,42\n8,\n")
    documents, rejects = read_documents(path, id_column="doc", text_column="body")
    assert [(d.doc_id, d.text) for d in documents] == [("007", "42")]
    assert [(r.doc_id, r.reason) for r in rejects] == [("8", "empty")]


def test_without_an_id_column_each_rows_index_is_its_id(tmp_path: Path) -> None:
    rows = [{"article": f"Story {i}."} for i in range(2500)]  # more than one read batch
    documents, _ = read_documents(write_jsonl(tmp_path / "stories.jsonl", rows), id_column=None)
    assert [d.doc_id for d in documents[:2]] == ["0", "1"] and documents[-1].doc_id == "2499"
    assert all(d.doc_id == str(d.row_index) for d in documents)


def test_bad_jsonl_and_csv_corpora_are_input_schema_errors_naming_the_file(tmp_path: Path) -> None:
    from storage.parquet import check_corpus

    missing = write_csv(tmp_path / "news.csv", [{"doc": "a", "body": "text"}])
    with pytest.raises(InputSchemaError, match=r"has no id column 'id' and no text column 'article'.*doc, body"):
        check_corpus(missing)
    nested = write_jsonl(tmp_path / "nested.jsonl", [{"id": "a", "article": {"text": "x"}}])
    with pytest.raises(InputSchemaError, match=r"text column 'article' of .*nested\.jsonl has type struct"):
        read_documents(nested)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"id": "a", "article": "fine"}\n{"id": "b", "article": \n')
    with pytest.raises(InputSchemaError, match=r"broken\.jsonl is not a readable JSON Lines file"):
        read_documents(broken)
    # a type that changes after the first block is found while reading
    changing = write_jsonl(tmp_path / "changing.jsonl", [{"id": str(i), "article": "x" * 1000} for i in range(2000)]
                           + [{"id": "last", "article": 5}])
    with pytest.raises(InputSchemaError, match=r"changing\.jsonl is not a readable JSON Lines file"):
        read_documents(changing)
    (tmp_path / "news.xlsx").write_text("")
    with pytest.raises(InputSchemaError, match=r"\.parquet, \.jsonl, \.ndjson, \.csv file.*\.xlsx"):
        check_corpus(tmp_path / "news.xlsx")
    with pytest.raises(FileNotFoundError, match=r"absent\.jsonl"):
        check_corpus(tmp_path / "absent.jsonl")


def _strings(values: list[bytes | None], dtype: pa.DataType) -> pa.Array:
    """A string column holding exactly these bytes: a writer need not check that they are UTF-8."""
    return pa.array(values, pa.binary() if dtype == pa.string() else pa.large_binary()).view(dtype)


@pytest.mark.parametrize("dtype", [pa.string(), pa.large_string()], ids=["string", "large_string"])
@pytest.mark.parametrize("column", ["article", "id"])
def test_a_string_cell_that_is_not_utf8_is_that_rows_reject_and_the_rest_is_read(
        tmp_path: Path, dtype: pa.DataType, column: str) -> None:
    """pyarrow decodes a string column whole: one bad cell raised UnicodeDecodeError for the whole corpus."""
    cells = {"id": [b"a", b"b", b"c", b"d"], "article": [b"First text.", b"Second text.", b"Third.", b"Fourth."],
             "title": [b"One", b"Two \xff title", b"Three", None]}
    cells[column][1] = b"caf\xe9 \xff\xfe latin-1"
    path = tmp_path / "bad_strings.parquet"
    pq.write_table(pa.table({name: _strings(values, dtype) for name, values in cells.items()}), path)

    documents, rejects = read_documents(path, title_column="title")
    assert [d.doc_id for d in documents] == ["a", "c", "d"]
    assert [d.text for d in documents] == ["First text.", "Third.", "Fourth."]
    [reject] = rejects
    assert (reject.reason, reject.row_index, reject.detail) == ("not_utf8", 1, f"{column} bytes are not UTF-8")
    # what could be read is kept: the text of a row whose id is bad, none of a bad text
    assert (reject.doc_id, reject.text) == ((None, "Second text.") if column == "id" else ("b", None))


def test_a_title_that_is_not_utf8_keeps_its_row(tmp_path: Path) -> None:
    path = tmp_path / "bad_title.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "article": ["One.", "Two."],
                             "title": _strings([b"Fine", b"Bad \xff title"], pa.string())}), path)
    documents, rejects = read_documents(path, title_column="title")
    assert rejects == [] and [d.title for d in documents] == ["Fine", "Bad \ufffd title"]


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
@pytest.mark.parametrize("column", ["article", "id"])
def test_a_jsonl_or_csv_cell_that_is_not_utf8_is_that_rows_reject_as_in_parquet(
        tmp_path: Path, suffix: str, column: str) -> None:
    """pyarrow's CSV reader refused the whole file at a string cell that is not UTF-8, and its JSON reader's
    string column raised UnicodeDecodeError for the whole corpus; now it is that row's reject."""
    cells = {"id": [b"a", b"b", b"c"], "article": [b"First text.", b"Second text.", b"Third caf\xc3\xa9."],
             "title": [b"One", b"Two \xff title", b"Three"]}
    cells[column][1] = b"caf\xe9 \xff\xfe latin-1"
    rows = list(zip(cells["id"], cells["article"], cells["title"], strict=True))
    path = tmp_path / f"bad{suffix}"
    if suffix == ".csv":
        path.write_bytes(b"id,article,title\n" + b"".join(b",".join(row) + b"\n" for row in rows))
    else:
        path.write_bytes(b"".join(b'{"id": "%s", "article": "%s", "title": "%s"}\n' % row for row in rows))

    documents, rejects = read_documents(path, title_column="title")
    assert [(d.doc_id, d.text) for d in documents] == [("a", "First text."), ("c", "Third café.")]
    [reject] = rejects
    assert (reject.reason, reject.row_index, reject.detail) == ("not_utf8", 1, f"{column} bytes are not UTF-8")
    assert (reject.doc_id, reject.text) == ((None, "Second text.") if column == "id" else ("b", None))
    assert reject.title == "Two \ufffd title"
