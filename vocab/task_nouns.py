"""What a sidecar task's output tokens are called in the report and the demo: a noun from the task's name.

``hashtags`` writes tags, so its tokens are "tag tokens"; any other task's are named after it, its name read as
words and its last word made singular ("headline tokens", "entity tokens" for ``entities``). The figures of a
run with several tasks together count every task's output: "output tokens".
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# tasks whose output has a shorter name than the task
NOUNS = {"hashtags": "tag", "tags": "tag"}
MANY = "output"  # several tasks' tokens together


def _singular(word: str) -> str:
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "y"
    if word.endswith("s") and not word.endswith(("ss", "us", "is")) and len(word) > 3:
        return word[:-1]
    return word


def token_noun(task: str) -> str:
    """The noun before "token" for ``task``'s output: "tag" for hashtags, "headline" for headline."""
    if task in NOUNS:
        return NOUNS[task]
    words = [w for w in re.split(r"[\s_\-.]+", task.strip().lower()) if w]
    if not words:
        return MANY
    return " ".join([*words[:-1], _singular(words[-1])])


def tokens_noun(tasks: Iterable[str]) -> str:
    """The noun for the tokens of ``tasks`` counted together: one task's own noun, else "output"; hashtags (the
    default task) when none is named."""
    nouns = sorted({token_noun(t) for t in tasks})
    if not nouns:
        return NOUNS["hashtags"]
    return nouns[0] if len(nouns) == 1 else MANY
