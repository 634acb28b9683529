"""The judge's prompt versions, and the likelihood scorer's; verdicts are only comparable within one version,
so callers store it.

A version fixes its answer mode too: ``probability`` prompts ask for one letter and are read from the
letters' log probabilities, ``text`` prompts ask for a JSON verdict and are read from the text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

JudgeMode = Literal["probability", "text"]

_CRITERIA = (
    "You evaluate hashtags written for a short summary. You compare two tag sets for the same summary "
    "and decide which one fits the summary better: on topic, faithful to what the summary states (no "
    "names, places or claims the summary does not contain), specific rather than generic, and not "
    "redundant. The order in which the sets are shown says nothing about their quality."
)
_SHOWN = "Summary:\n<<<\n{summary}\n>>>\n\nTag set A: {tags_a}\nTag set B: {tags_b}\n\n"


@dataclass(frozen=True)
class Prompt:
    system: str
    user: str
    mode: JudgeMode


PROMPTS: dict[str, Prompt] = {
    "tags-v1": Prompt(
        system=_CRITERIA + " If neither set is clearly better, the answer is a tie. You answer with one JSON "
        "object and nothing else.",
        user=_SHOWN + "Which tag set fits the summary better? Reply with exactly one JSON object, the winner first "
        'and then a one-sentence reason: {{"winner": "A" | "B" | "tie", "reason": "..."}}',
        mode="text",
    ),
    # no tie to answer: a tie is a preference within the run's calibrated margin of 0.5
    "tags-p1": Prompt(
        system=_CRITERIA + " You answer with one letter and nothing else.",
        user=_SHOWN + "Which tag set fits the summary better? Answer with one letter: A or B",
        mode="probability",
    ),
}
DEFAULT_PROMPT_VERSION = "tags-p1"
# what a probability prompt falls back to on an endpoint that returns no log probabilities
TEXT_FALLBACK = "tags-v1"


@dataclass(frozen=True)
class ScorerPrompt:
    """The text before the tags; ``{summary}`` is replaced by the summary. It ends in a visible character, so
    that no token joins its end with the space that starts the tags."""

    before_tags: str
    # how this wording relates to the taggers' instruction ("Then output 3-5 short hashtags for the summary.",
    # sidecar.tasks.task.HASHTAGS; the standalone tagger's drops the "Then")
    note: str


# The likelihood method's scorer prompts (study.judge.likelihood). A scorer can favour the tagger whose prompt it
# resembles, so one version is worded like the taggers' instruction and one unlike either.
SCORER_PROMPTS: dict[str, ScorerPrompt] = {
    "tags-l1": ScorerPrompt(
        before_tags="Summary:\n{summary}\n\nWrite 3-5 short hashtags for this summary.\nHashtags:",
        note="worded like the taggers' instruction, after the summary as the standalone tagger sees it"),
    "tags-l2": ScorerPrompt(
        before_tags="A news desk files each story under a few topic labels.\n\nStory: {summary}\n\nFiled under:",
        note="unlike either tagger: no instruction, no chat turn, the summary called a story, no tag count"),
}
DEFAULT_SCORER_PROMPTS = ("tags-l1", "tags-l2")


def render_prompt(summary: str, tags_a: list[str], tags_b: list[str], prompt_version: str) -> list[dict[str, str]]:
    prompt = PROMPTS[prompt_version]
    # JSON lists show exactly which strings each tagger produced, whatever their '#' or spacing.
    content = prompt.user.format(
        summary=summary.strip(),
        tags_a=json.dumps(tags_a, ensure_ascii=False),
        tags_b=json.dumps(tags_b, ensure_ascii=False),
    )
    return [{"role": "system", "content": prompt.system}, {"role": "user", "content": content}]
