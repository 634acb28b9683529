"""The control ladder: games whose right answer is known, played in every run beside the real comparison.

The first ``limit`` documents climb it, for any sidecar task (a task's output is its parsed JSON value: the
hashtag task's a list of tags, a headline's a string, a JSON task's an object). Easy (stored as kind
``control``): their own sidecar output against the sidecar output of the next document in that sample (a
fixed derangement: a cyclic shift, passing over a document whose output is the same), so the judge should
prefer the own output. Hard (lists only): the own tags against the same tags with about half replaced by that
document's, which the judge should still prefer. Null: the own output against itself reordered, whose true
preference is even, so the judge must call it a tie: a list reversed, an object's keys in reverse order, a
text's parts (split at ", ", "; ", ": ", " - ") in reverse order. An output with nothing to reorder (one tag,
a one-word label, a one-phrase headline) has no null game.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import JsonValue


@dataclass(frozen=True)
class Foil:
    """The document whose sidecar output a control game shows against a document's own."""

    doc_id: str
    tags: JsonValue


def same_output(a: JsonValue, b: JsonValue) -> bool:
    """Whether two outputs say the same: lists as sets of their items (reordered tags are the same tags), any
    other value by its JSON, keys sorted."""
    if isinstance(a, list) and isinstance(b, list):
        return {canonical_output(item) for item in a} == {canonical_output(item) for item in b}
    return canonical_output(a) == canonical_output(b)


def canonical_output(value: JsonValue) -> str:
    """The output as JSON with sorted keys: one text per meaning of an object, for comparing and caching."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def control_foils(docs: Sequence[tuple[str, JsonValue]], limit: int) -> dict[str, Foil]:
    """Per document id of the first ``limit`` of ``docs`` (id, sidecar output), its foil; a document whose
    output equals every other's in the sample gets none, and a sample of one has no control at all."""
    sample = list(docs[:limit])
    foils: dict[str, Foil] = {}
    for index, (doc_id, tags) in enumerate(sample):
        for shift in range(1, len(sample)):
            foil_id, foil_tags = sample[(index + shift) % len(sample)]
            if not same_output(foil_tags, tags):
                foils[doc_id] = Foil(foil_id, foil_tags)
                break
    return foils


# where a text output's parts meet: a comma, semicolon or colon and the space after it, or a spaced dash
_PARTS = re.compile(r"([,;:]\s+|\s+[-\u2013\u2014]\s+)")


def null_tags(tags: JsonValue) -> JsonValue:
    """The same output reordered (see the module docstring), or None when reordering changes nothing (one tag,
    a palindrome, a one-part text, a number): such a game would ask the same prompt twice and measure nothing."""
    flipped: JsonValue
    if isinstance(tags, list):
        flipped = list(reversed(tags))
    elif isinstance(tags, dict):
        flipped = dict(reversed(list(tags.items())))
    elif isinstance(tags, str):
        pieces = _PARTS.split(tags.strip())
        parts, joints = pieces[::2], pieces[1::2]
        if len(parts) < 2:
            return None
        flipped = "".join(part + joint for part, joint in zip(reversed(parts), [*joints, ""], strict=True))
    else:
        return None
    # order-sensitive JSON: an object with its keys reversed is equal as a dict, not as text shown to a judge
    return flipped if json.dumps(flipped, ensure_ascii=False) != json.dumps(tags, ensure_ascii=False) else None


def hard_tags(tags: JsonValue, foil: JsonValue) -> JsonValue:
    """For lists: ``tags`` with every second one (the 2nd, 4th, ...) replaced by the next of ``foil``'s tags that
    is not among them: about half replaced, in place so that position does not give the foil's tags away. None
    when nothing can be replaced (one tag, or no foil tag that differs), and for any output that is not a list
    (the hard rung is reported, not required)."""
    if not isinstance(tags, list) or not isinstance(foil, list):
        return None
    spare = iter([tag for tag in foil if tag not in tags])
    mixed = [next(spare, tag) if index % 2 else tag for index, tag in enumerate(tags)]
    return mixed if mixed != tags else None
