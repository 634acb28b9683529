"""What the judge answered: a JSON verdict (text mode) or the probabilities of the letters A and B
(probability mode), read from a chat completion whose shape is checked before use."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from study.judge.config import JudgeConfig
from vocab.numbers import NumberError, logprob

if TYPE_CHECKING:
    import openai

Choice = Literal["A", "B", "tie"]
LETTERS = ("A", "B")


class JudgeAnswerError(ValueError):
    """The judge's answer is not the verdict the prompt asks for (prose, bad winner, empty, refusal, no letter)."""


class NoLogprobsError(JudgeAnswerError):
    """A reply without the log probabilities the probability mode reads."""


class JudgeAnswer(BaseModel):
    """The JSON object the judge must answer with in the text mode."""

    winner: Choice
    reason: str = ""


# The parts of a chat completion the judge reads. The openai client builds its ``ChatCompletion`` from a
# 200 reply without validating it, so any JSON shape (``"choices": "x"``, a null message, an object as
# content) arrives as attributes of whatever type; these models check them before use.
class _Model(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class _TopLogprob(_Model):
    token: str
    # checked by ``letter_probabilities``, its one reader, so that a game refused for it keeps its raw answer
    logprob: float


class _TokenLogprob(_TopLogprob):
    top_logprobs: list[_TopLogprob] | None = None


class _Logprobs(_Model):
    content: list[_TokenLogprob] | None = None


class _ReplyMessage(_Model):
    content: str | None = None
    refusal: str | None = None


class _ReplyChoice(_Model):
    message: _ReplyMessage
    logprobs: _Logprobs | None = None


class _Reply(_Model):
    choices: list[_ReplyChoice] = Field(min_length=1)


@dataclass(frozen=True)
class Reply:
    """The judge's text, and per generated token its alternatives as ``{token: logprob}`` (None when the
    endpoint returned no log probabilities)."""

    text: str
    alternatives: list[dict[str, float]] | None


def problems(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())


Shape = TypeVar("Shape", bound=BaseModel)


def validated_reply(request: Callable[[], object], kind: type, shape: type[Shape], what: str) -> Shape:
    """The endpoint's reply to ``request``, checked to be a ``kind`` (the client's type) and validated as
    ``shape``; ``JudgeAnswerError`` saying the response is not ``what`` otherwise. The client's own HTTP errors
    pass through."""
    try:
        reply = request()
    # The client decodes a reply declared as JSON with json.loads and lets its errors through: a truncated or
    # mis-encoded body is a ValueError (JSONDecodeError, UnicodeDecodeError), a deeply nested one a RecursionError.
    except (ValueError, RecursionError) as exc:
        raise JudgeAnswerError(f"response body is not JSON: {type(exc).__name__}: {exc}") from exc
    if not isinstance(reply, kind):
        # The client hands back a plain string when a 200 response is not declared as JSON.
        raise JudgeAnswerError(f"response is not {what}: {str(reply)[:200]!r}")
    try:
        return shape.model_validate(reply)
    except ValidationError as exc:
        raise JudgeAnswerError(f"response is not {what}: {problems(exc)}") from None


def ask(client: openai.OpenAI, config: JudgeConfig, messages: list[dict[str, str]], **options: Any) -> Reply:
    """The judge's reply to ``messages`` with the request ``options``; ``JudgeAnswerError`` for a reply
    that holds none."""
    # imported when the judge asks, not with the flows that import study.judge
    from openai.types.chat import ChatCompletion

    choice = validated_reply(lambda: client.chat.completions.create(model=config.model, messages=messages,
                                                                    **options),
                             ChatCompletion, _Reply, "a chat completion").choices[0]
    if choice.message.refusal:
        raise JudgeAnswerError(f"judge refused: {choice.message.refusal}")
    tokens = None if choice.logprobs is None else choice.logprobs.content
    alternatives = None if not tokens else [
        {top.token: top.logprob for top in token.top_logprobs or []} | {token.token: token.logprob} for token in tokens]
    return Reply(choice.message.content or "", alternatives)


def letter_probabilities(reply: Reply) -> tuple[float, float]:
    """(P(A), P(B)) at the first generated token whose alternatives hold an answer letter, as the endpoint
    gave them (not normalised). Spellings with leading spaces or in lower case count for their letter; a
    letter missing from the alternatives counts 0. A reply any of whose log probabilities is not one (NaN,
    infinite, above 0, below -1e4: ``vocab.numbers.logprob``) is no answer: ``JudgeAnswerError``, so that it
    fails this game only."""
    if reply.alternatives is None:
        raise NoLogprobsError("the reply has no log probabilities")
    for position, alternatives in enumerate(reply.alternatives):
        for token, value in alternatives.items():
            try:
                logprob(f"logprobs.content.{position} top log probability of the token {token!r}", value)
            except NumberError as exc:
                raise JudgeAnswerError(f"{value!r} for the token {token!r} is not a log probability: {exc}") from None
    for alternatives in reply.alternatives:
        found = {letter: 0.0 for letter in LETTERS}
        for token, value in alternatives.items():
            letter = token.strip().upper()
            if letter in found:
                found[letter] += math.exp(value)
        if any(found.values()):
            return min(found["A"], 1.0), min(found["B"], 1.0)
    raise JudgeAnswerError(f"no answer letter among the top log probabilities of the reply {reply.text[:200]!r}")


_FENCED = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL | re.IGNORECASE)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` hook: a repeated key would let the last ``winner`` silently override the first."""
    keys = [key for key, _ in pairs]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise ValueError(f"repeated key(s) {', '.join(map(repr, repeated))}")
    return dict(pairs)


def parse_judge_answer(text: str | None) -> JudgeAnswer:
    """Parse the judge's text answer: one JSON object, optionally inside a ```json fence, nothing else, with
    ``winner`` as its first key."""
    if text is None or not text.strip():
        raise JudgeAnswerError("empty answer")
    body = text.strip()
    fenced = _FENCED.fullmatch(body)
    if fenced:
        body = fenced.group(1)
    try:
        payload = json.loads(body, object_pairs_hook=_unique_keys)
    # ValueError: malformed JSON, a repeated key, an integer past Python's digit limit; RecursionError: nesting
    # deeper than the interpreter's stack.
    except (ValueError, RecursionError) as exc:
        raise JudgeAnswerError(f"answer is not a strict JSON object: {exc}") from exc
    if not isinstance(payload, dict):
        raise JudgeAnswerError(f"answer is JSON {type(payload).__name__}, not an object")
    # The prompt asks for the winner before the reason so that the verdict is not written to fit a reason
    # already given; an answer in another order did not follow the prompt.
    if "winner" in payload and next(iter(payload)) != "winner":
        raise JudgeAnswerError(f"answer does not start with the winner: keys {list(payload)}")
    try:
        return JudgeAnswer.model_validate(payload)
    except ValidationError as exc:
        raise JudgeAnswerError(f"answer has no valid verdict: {problems(exc)}") from None
