"""The leakage heuristic: document-only names and numbers, and tags that contain them."""

from __future__ import annotations

from study.leakage import document_only_terms, leak_rate, leaked_terms

DOCUMENT = (
    "The carmaker will close its engine plant in Wolfsburg next year, the company said on Friday. "
    "About 1,200 workers at the plant will lose their jobs. Protecting jobs was the union's first demand, "
    "said Secretary Anna Kowalczyk, who met managers at the District Court of Lower Saxony. "
    "The court has not ruled. Officials declined to comment."
)
SUMMARY = "A carmaker will close an engine plant next year; the union wants to protect jobs."


def test_document_only_names_and_numbers_are_found():
    terms = document_only_terms(DOCUMENT, SUMMARY)
    assert {"wolfsburg", "1200", "kowalczyk", "annakowalczyk", "saxony", "lowersaxony"} <= terms
    # common words capitalised as titles, dates or sentence starts are not facts of this document
    assert not {"friday", "secretary", "protecting", "the", "officials", "court", "about"} & terms


def test_terms_in_the_summary_are_not_document_only():
    terms = document_only_terms(DOCUMENT, SUMMARY + " It is in Wolfsburg.")
    assert "wolfsburg" not in terms


def test_tags_containing_a_document_only_term_leak():
    terms = document_only_terms(DOCUMENT, SUMMARY)
    assert leaked_terms("#WolfsburgPlant", terms) == ["wolfsburg"]
    assert leaked_terms("#jobs", terms) == []
    rate, count = leak_rate([["wolfsburg", "jobs", "plantclosure"], None], [terms, terms])
    assert count == 3 and abs(rate - 1 / 3) < 1e-9
