"""The likelihood of a tag set, or of any task's output: the judge model's mean log probability of its tokens
after a scorer prompt that holds a summary (the main output) and, for a task other than tag lists, the task's
instruction, read through the OpenAI API's legacy completions route.

The request echoes the prompt with its log probabilities and generates nothing
(``echo=True, logprobs=0, max_tokens=0``); the reply's ``choices[0].logprobs`` lists ``tokens``,
``token_logprobs`` (the first is None: nothing precedes it) and ``text_offset``, each token's first
character in the prompt. The tags' tokens are those that start at or after the character where the tags
start. Scorer prompts are versioned (``study.judge.prompts.SCORER_PROMPTS``) and every score keeps the
version it used.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, JsonValue, Strict

from study.judge.answers import JudgeAnswerError, validated_reply
from study.judge.prompts import SCORER_PROMPTS
from vocab.numbers import logprob

if TYPE_CHECKING:
    import openai

# A prompt token's log probability, checked as the reply is read: finite and in [-1e4, 0]
# (``vocab.numbers.logprob``), so that no infinity, NaN or absurd value reaches the mean, a score or DuckDB
# (two of -1e308 overflow ``math.fsum``).
Logprob = Annotated[float, Strict(), AfterValidator(lambda value: logprob("a log probability", value))]


class NoPromptLogprobsError(JudgeAnswerError):
    """The endpoint gives no log probabilities of a prompt's tokens: no such route, or a reply without them."""


class _Model(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class _EchoLogprobs(_Model):
    tokens: list[str]
    token_logprobs: list[Logprob | None]
    text_offset: list[int]


class _EchoChoice(_Model):
    logprobs: _EchoLogprobs | None = None


class _EchoReply(_Model):
    choices: list[_EchoChoice] = Field(min_length=1)


@dataclass(frozen=True)
class TagLikelihood:
    """The mean log probability per token of a tag set after a prompt, and over how many tokens."""

    mean_logprob: float
    tokens: int


def render_tags(tags: list[str]) -> str:
    """The tags as a tagger writes them: ``#a #b``, each after a space."""
    return "".join(f" #{tag.lstrip('#')}" for tag in tags)


def render_output(output: JsonValue) -> str:
    """Any other task's output as its scorer sees it: a string as it is (trimmed), any other value as JSON."""
    return output.strip() if isinstance(output, str) else json.dumps(output, ensure_ascii=False)


def stored_output(output: JsonValue) -> list[str]:
    """The output as ``judgement_scores.tags`` keeps it: a list of strings (tags) itself, else its rendering as
    the one element."""
    if isinstance(output, list) and all(isinstance(item, str) for item in output):
        return list(output)  # type: ignore[arg-type]
    return [render_output(output)]


def scorer_text(summary: str, tags: JsonValue, prompt_version: str,
                instruction: str | None = None) -> tuple[str, int]:
    """The text to score and the character where its output starts: the hashtag form for tags (``instruction``
    None), else the task form, the output after a space."""
    prompt = SCORER_PROMPTS[prompt_version]
    if instruction is None:
        before = prompt.before_tags.format(summary=summary.strip())
        return before + render_tags(tags), len(before)  # type: ignore[arg-type]
    before = prompt.before_output.format(summary=summary.strip(), instruction=instruction.strip())
    return f"{before} {render_output(tags)}", len(before)


def tag_likelihood(client: openai.OpenAI, model: str, summary: str, tags: JsonValue,
                   prompt_version: str, instruction: str | None = None) -> TagLikelihood:
    """Ask ``model`` for the log probabilities of the scorer text and average those of the output's tokens.

    ``NoPromptLogprobsError`` when the route is missing or refused (HTTP 404, 400) or the reply has no
    prompt log probabilities; ``JudgeAnswerError`` for a reply of the wrong shape or values."""
    import openai  # imported when the judge asks, not with the flows that import study.judge
    from openai.types import Completion

    text, start = scorer_text(summary, tags, prompt_version, instruction)
    try:
        choice = validated_reply(
            lambda: client.completions.create(model=model, prompt=text, echo=True, logprobs=0, max_tokens=0),
            Completion, _EchoReply, "a completion").choices[0]
    except (openai.NotFoundError, openai.BadRequestError) as exc:
        raise NoPromptLogprobsError(f"HTTP {exc.status_code} on /completions with echo and logprobs: "
                                    f"{exc.message}") from exc
    if choice.logprobs is None or not choice.logprobs.tokens:
        raise NoPromptLogprobsError("the reply has no log probabilities of the prompt's tokens")
    echoed = choice.logprobs
    if not len(echoed.tokens) == len(echoed.token_logprobs) == len(echoed.text_offset):
        raise JudgeAnswerError("tokens, token_logprobs and text_offset differ in length")
    tagged = [lp for lp, offset in zip(echoed.token_logprobs, echoed.text_offset, strict=True) if offset >= start]
    if not tagged:
        raise JudgeAnswerError(f"no token starts at or after character {start}, where the tags start")
    if any(lp is None for lp in tagged):
        raise JudgeAnswerError(f"a tag token has no log probability: {tagged}")
    return TagLikelihood(math.fsum(tagged) / len(tagged), len(tagged))  # type: ignore[arg-type]
