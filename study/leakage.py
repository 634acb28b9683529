"""Leakage: tags that carry facts found only in the document, not in the summary they describe.

A tag should describe the summary. When the tagger can see the document it may instead name a place, a
person or a number that the summary left out; that is a leak. This module finds the document-only
terms (proper names and numbers) and checks tags against them.

Names are capitalised words that are not merely sentence-initial and never occur in lowercase in the
document. Words in common English use ("Court", "President", "Friday") are capitalised in news as parts
of titles and dates; alone they are not facts of this document, so a name's single words count only
when they are rare in English (word frequency from ``wordfreq``). The cut-off is a trade-off: it drops
"Court" and "Friday" but also a common country name such as "Iran" (Zipf 4.6). The whole multi-word name always
counts, and so does every stretch of two or more of its words ("johnkelly" from "Secretary John Kelly").

The standalone tagger sees only the summary, so whatever it "leaks" is a false positive of this
heuristic (a coincidence with world knowledge): its rate is the floor against which the sidecar's
conditions should be read.
"""

from __future__ import annotations

import re
from functools import cache

# wordfreq Zipf scale: 6 is "the"-like, 3 is about once per million words. Common title words (court,
# president, secretary, department) sit above 4.5; place and person names of one article mostly below.
COMMON_WORD_ZIPF = 4.5
# a capitalised word that opens a sentence is a name only if rarer still ("Protecting ..." is 4.3)
SENTENCE_START_ZIPF = 4.0
MIN_TERM_CHARS = 3

_SENTENCE_BREAK = re.compile(r"(?<=[.!?:;])\s+|\n+")
_TOKEN = re.compile(r"[A-Za-z][A-Za-z'’.-]*[A-Za-z]|[A-Za-z]|\d[\d,.]*\d|\d")


def normalise(text: str) -> str:
    """Lowercase, without spaces or punctuation: how parsed hashtags are compared."""
    return re.sub(r"[\W_]+", "", text.lower())


@cache
def _zipf(word: str) -> float:
    from wordfreq import zipf_frequency

    return zipf_frequency(word, "en")


def _is_capitalised(token: str) -> bool:
    return token[:1].isupper()


def document_only_terms(document: str, summary: str) -> set[str]:
    """Normalised names and numbers (>= 2 digits) that occur in the document but not in the summary."""
    lowercase_words = {t for t in _TOKEN.findall(document) if t[:1].islower()}
    candidates: list[str] = []
    for sentence in _SENTENCE_BREAK.split(document):
        tokens = _TOKEN.findall(sentence.lstrip("\"'“‘(["))
        run: list[str] = []
        for position, token in enumerate([*tokens, ""]):
            if token[:1].isdigit() and len(re.sub(r"\D", "", token)) >= 2:
                candidates.append(token)
            name_like = _is_capitalised(token) and token.lower() not in lowercase_words
            if name_like and (position > 0 or _zipf(token.lower()) < SENTENCE_START_ZIPF):
                run.append(token)
                continue
            if run:
                candidates += [w for w in run if _zipf(w.lower()) < COMMON_WORD_ZIPF]
                # every stretch of two or more words of a name ("Capitol Hill", "John Kelly")
                candidates += [" ".join(run[i:j]) for i in range(len(run)) for j in range(i + 2, len(run) + 1)]
                run = []
    summary_norm = normalise(summary)
    terms = set()
    for candidate in candidates:
        norm = normalise(candidate)
        if len(norm) >= MIN_TERM_CHARS and norm not in summary_norm:
            terms.add(norm)
    return terms


def leaked_terms(tag: str, terms: set[str]) -> list[str]:
    """Document-only terms a tag contains (tags are normalised: '#NewYork' -> 'newyork')."""
    norm = normalise(tag)
    return sorted(t for t in terms if t in norm)


def leak_rate(tag_lists: list[list[str] | None], terms: list[set[str]]) -> tuple[float, int]:
    """(share of tags that contain a document-only term, number of tags); unparsed outputs have no tags."""
    leaked = total = 0
    for tags, doc_terms in zip(tag_lists, terms, strict=True):
        for tag in tags or []:
            total += 1
            leaked += bool(leaked_terms(tag, doc_terms))
    return (leaked / total if total else 0.0), total
