"""The control ladder: games whose right answer is known, played in every run beside the real comparison.

The first ``limit`` documents climb it. Easy (stored as kind ``control``): their own sidecar tags against
the sidecar tags of the next document in that sample (a fixed derangement: a cyclic shift, passing over a
document whose tags are the same set), so the judge should prefer the own tags. Hard: the own tags against
the same tags with about half replaced by that document's, which the judge should still prefer. Null: the
own tags against the same tags reversed, whose true preference is even, so the judge must call it a tie.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Foil:
    """The document whose sidecar tags a control game shows against a document's own."""

    doc_id: str
    tags: list[str]


def control_foils(docs: Sequence[tuple[str, list[str]]], limit: int) -> dict[str, Foil]:
    """Per document id of the first ``limit`` of ``docs`` (id, sidecar tags), its foil; a document whose
    tags equal every other's in the sample gets none, and a sample of one has no control at all."""
    sample = list(docs[:limit])
    foils: dict[str, Foil] = {}
    for index, (doc_id, tags) in enumerate(sample):
        for shift in range(1, len(sample)):
            foil_id, foil_tags = sample[(index + shift) % len(sample)]
            if set(foil_tags) != set(tags):
                foils[doc_id] = Foil(foil_id, foil_tags)
                break
    return foils


def null_tags(tags: list[str]) -> list[str] | None:
    """The same tags in reversed order, or None when reversing changes nothing (one tag, a palindrome):
    such a game would ask the same prompt twice and measure nothing."""
    flipped = list(reversed(tags))
    return flipped if flipped != tags else None


def hard_tags(tags: list[str], foil: list[str]) -> list[str] | None:
    """``tags`` with every second one (the 2nd, 4th, ...) replaced by the next of ``foil``'s tags that is not
    among them: about half replaced, in place so that position does not give the foil's tags away. None when
    nothing can be replaced (one tag, or no foil tag that differs)."""
    spare = iter([tag for tag in foil if tag not in tags])
    mixed = [next(spare, tag) if index % 2 else tag for index, tag in enumerate(tags)]
    return mixed if mixed != tags else None
