"""`python -m bench.llama_cpp`: its one row follows the timings it is given, and without llama_cpp installed it
says so in one line, measures nothing and exits 0 (so `make bench` runs on). Needs no llama_cpp, no model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from bench import common
from bench import llama_cpp as bench


def article(engine_tokens: int, engine_wall_s: float, llama_tokens: int, llama_prefill_s: float,
            llama_decode_s: float, same: bool = False) -> dict:
    return {"engine_tokens": engine_tokens, "engine_wall_s": engine_wall_s, "engine_prefill_s": 0.5,
            "llama_tokens": llama_tokens, "llama_prefill_s": llama_prefill_s, "llama_decode_s": llama_decode_s,
            "llama_wall_s": llama_prefill_s + llama_decode_s, "engine_token_ids": [1, 2] if same else [1, 3],
            "llama_token_ids": [1, 2]}


def test_the_row_is_tokens_per_second_of_each_over_all_articles_and_their_ratio() -> None:
    articles = [article(64, 4.0, 64, 1.0, 7.0, same=True), article(32, 4.0, 32, 1.0, 3.0)]
    row = bench.summary(articles)
    assert row["engine_tps"] == pytest.approx(96 / 8.0)
    assert row["llama_tps"] == pytest.approx(96 / 12.0)
    assert row["ratio"] == pytest.approx(12.0 / 8.0)
    assert row["llama_prefill_s"] == pytest.approx(1.0)
    assert row["llama_decode_tps"] == pytest.approx((96 - 2) / 10.0)  # each first token came from its prefill
    assert row["identical"] == 1
    # a slower engine lowers the ratio in proportion; a slower llama.cpp raises it
    slower = bench.summary([article(64, 8.0, 64, 1.0, 7.0), article(32, 8.0, 32, 1.0, 3.0)])
    assert slower["ratio"] == pytest.approx(row["ratio"] / 2)
    assert bench.summary([article(64, 4.0, 64, 2.0, 14.0), article(32, 4.0, 32, 2.0, 6.0)])["ratio"] == \
        pytest.approx(row["ratio"] * 2)


def test_the_table_shows_the_row_and_says_the_weights_differ() -> None:
    row = bench.summary([article(64, 4.0, 64, 1.0, 7.0)])
    args = argparse.Namespace(threads=2, articles=1, chars=800, max_new_tokens=64)
    env = {"device": "CPU Test", "dtype": "bfloat16"}
    text = bench.markdown(row, args, env, "quick sizes", "Q4_K_M")
    table = [line for line in text.splitlines() if line.startswith("| batch 1 |")]
    assert table == ["| batch 1 | 16 | 8 | 2 | 0.5 | 1 | 9 |"]
    assert "Q4_K_M GGUF (4-bit weights" in text and "dequantized to bfloat16" in text
    assert "0 of 1 identical" in text


def test_without_llama_cpp_it_says_so_in_one_line_and_measures_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp now fails, installed or not
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(bench, "load_pair", lambda *a, **k: pytest.fail("loaded a model with nothing to compare"))
    bench.main(["--quick", "--allow-dirty"])
    assert capsys.readouterr().out.splitlines() == [bench.NOT_INSTALLED]
    assert list(tmp_path.iterdir()) == []
