"""bench.constraint_libraries on the tiny tokenizer: the project's library (llguidance) measured, its mask
restored by a rollback for every kind of constraint."""

from __future__ import annotations

from bench.constraint_libraries import KINDS, measure
from sidecar.models.tiny import tiny_tokenizer


def test_llguidance_is_measured_for_every_kind_and_rolls_back():
    tokenizer = tiny_tokenizer()
    out = measure("llguidance", tokenizer, vocab=len(tokenizer) + 40)
    assert out["library"] == "llguidance" and out["tokenizer_s"] >= 0
    for kind, _ in KINDS:
        assert out[f"{kind}_rollback_ok"] is True
        assert 0 <= out[f"{kind}_fill_ms_median"] <= out[f"{kind}_fill_ms_max"]
