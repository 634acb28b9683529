"""The judge's prompt versions, and the likelihood scorer's; verdicts are only comparable within one version
(and task), so callers store it.

Each version has two forms: the hashtag form, which compares tag lists, and the task form, which names the task's
instruction and compares any other task's outputs (shown as JSON). A task whose outputs are tag lists (parser
``hashtags``) is judged in the hashtag form, so runs judged before tasks had forms read the same prompts.

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
_TASK_CRITERIA = (
    "You evaluate outputs that follow an instruction about a text. The instruction: {instruction} You compare two "
    "outputs for the same text and decide which one follows the instruction better for this text: faithful to "
    "what the text states (no names, places or claims it does not contain), specific rather than generic, and in "
    "the form the instruction asks for. The order in which the outputs are shown says nothing about their quality."
)
_TASK_SHOWN = ("Text:\n<<<\n{summary}\n>>>\n\nInstruction: {instruction}\n\nOutput A: {tags_a}\nOutput B: "
               "{tags_b}\n\n")


@dataclass(frozen=True)
class Prompt:
    system: str
    user: str
    mode: JudgeMode
    # the task form: ``{instruction}`` is the task's instruction
    task_system: str
    task_user: str


PROMPTS: dict[str, Prompt] = {
    "tags-v1": Prompt(
        system=_CRITERIA + " If neither set is clearly better, the answer is a tie. You answer with one JSON "
        "object and nothing else.",
        user=_SHOWN + "Which tag set fits the summary better? Reply with exactly one JSON object, the winner first "
        'and then a one-sentence reason: {{"winner": "A" | "B" | "tie", "reason": "..."}}',
        mode="text",
        task_system=_TASK_CRITERIA + " If neither output is clearly better, the answer is a tie. You answer with "
        "one JSON object and nothing else.",
        task_user=_TASK_SHOWN + "Which output follows the instruction better for this text? Reply with exactly one "
        'JSON object, the winner first and then a one-sentence reason: {{"winner": "A" | "B" | "tie", "reason": '
        '"..."}}',
    ),
    # no tie to answer: a tie is a preference within the run's calibrated margin of 0.5
    "tags-p1": Prompt(
        system=_CRITERIA + " You answer with one letter and nothing else.",
        user=_SHOWN + "Which tag set fits the summary better? Answer with one letter: A or B",
        mode="probability",
        task_system=_TASK_CRITERIA + " You answer with one letter and nothing else.",
        task_user=_TASK_SHOWN + "Which output follows the instruction better for this text? Answer with one letter: "
        "A or B",
    ),
}
DEFAULT_PROMPT_VERSION = "tags-p1"
# what a probability prompt falls back to on an endpoint that returns no log probabilities
TEXT_FALLBACK = "tags-v1"


@dataclass(frozen=True)
class ScorerPrompt:
    """The text before the tags; ``{summary}`` is replaced by the summary. It ends in a visible character, so
    that no token joins its end with the space that starts the tags. ``before_output`` is the task form, before
    any other task's output, with ``{instruction}`` too."""

    before_tags: str
    before_output: str
    # how this wording relates to the taggers' instruction ("Then output 3-5 short hashtags for the summary.",
    # sidecar.tasks.task.HASHTAGS; the standalone tagger's drops the "Then")
    note: str


# The likelihood method's scorer prompts (study.judge.likelihood). A scorer can favour the tagger whose prompt it
# resembles, so one version is worded like the taggers' instruction and one unlike either.
SCORER_PROMPTS: dict[str, ScorerPrompt] = {
    "tags-l1": ScorerPrompt(
        before_tags="Summary:\n{summary}\n\nWrite 3-5 short hashtags for this summary.\nHashtags:",
        before_output="Summary:\n{summary}\n\n{instruction}\nAnswer:",
        note="worded like the taggers' instruction, after the summary as the standalone tagger sees it"),
    "tags-l2": ScorerPrompt(
        before_tags="A news desk files each story under a few topic labels.\n\nStory: {summary}\n\nFiled under:",
        before_output="A news desk asks this of each story: {instruction}\n\nStory: {summary}\n\nThe desk wrote:",
        note="unlike either tagger: no instruction, no chat turn, the summary called a story, no tag count (another "
             "task: its instruction as a desk's request before the story)"),
}
DEFAULT_SCORER_PROMPTS = ("tags-l1", "tags-l2")


def render_prompt(summary: str, tags_a: object, tags_b: object, prompt_version: str,
                  instruction: str | None = None) -> list[dict[str, str]]:
    """The chat messages of a game: the hashtag form, or with ``instruction`` the task form."""
    prompt = PROMPTS[prompt_version]
    system, user = (prompt.system, prompt.user) if instruction is None else (prompt.task_system, prompt.task_user)
    # JSON shows exactly which strings each side produced, whatever their '#' or spacing.
    content = user.format(
        summary=summary.strip(),
        instruction=(instruction or "").strip(),
        tags_a=json.dumps(tags_a, ensure_ascii=False),
        tags_b=json.dumps(tags_b, ensure_ascii=False),
    )
    return [{"role": "system", "content": system.format(instruction=(instruction or "").strip())},
            {"role": "user", "content": content}]
