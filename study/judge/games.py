"""One game: the judge sees two tag sets (or two outputs of another sidecar task, with its instruction) for a
summary, in positions A and B, and answers which fits better.

A game's retries of an unusable answer change the request, because asking the same greedy request again
gets the same answer: first a larger budget (text: twice the tokens; probability: eight tokens and the
top 20 alternatives), then sampling at ``SAMPLING_TEMPERATURE`` with a new seed per retry. A failed call
(a timeout, a 5xx) is asked again as it was.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, JsonValue

from study.judge.answers import Choice, JudgeAnswerError, ask, letter_probabilities, parse_judge_answer
from study.judge.config import JudgeConfig
from study.judge.prompts import JudgeMode, render_prompt

if TYPE_CHECKING:
    import openai

logger = logging.getLogger("study.judge")

REDACTED = "**********"
# Stored error texts are for humans reading an artifact; a whole HTML error page is not.
MAX_ERROR_CHARS = 500
# What is kept of an answer and its reason: a verdict fits in a few hundred characters, while an endpoint
# that ignores max_tokens can send megabytes per game. A longer text keeps its start and says it was cut.
MAX_ANSWER_CHARS = 4000
CUT_MARKER = " [cut: {total:,} characters in all, the first {kept:,} kept]"
SAMPLING_TEMPERATURE = 0.7
PROBE_TOP_LOGPROBS = 5
RETRY_TOP_LOGPROBS = 20  # the most the OpenAI API returns

# the comparison and the control ladder's rungs (study.judge.controls): ``control`` is the easy rung
GameKind = Literal["main", "control", "hard", "null"]
Winner = Literal["sidecar", "standalone", "own", "other", "mixed", "original", "reversed", "tie"]
# (the subject side, the side it is compared with) per kind: the sidecar's tags against the standalone
# tagger's, a document's own tags against another document's, against its own with about half replaced
# by another document's, a tag set against itself reversed
SIDES: dict[GameKind, tuple[Winner, Winner]] = {
    "main": ("sidecar", "standalone"),
    "control": ("own", "other"),
    "hard": ("own", "mixed"),
    "null": ("original", "reversed"),
}


class GameResult(BaseModel):
    """One of the two position-swapped games of a document: game 1 shows the subject side as A, game 2 as B."""

    game: Literal[1, 2]
    # where the kind's subject side (the sidecar's tags, a document's own tags, the original order) was shown
    sidecar_position: Literal["A", "B"]
    # the endpoint's answer, secrets redacted, cut to MAX_ANSWER_CHARS (see ``capped``); so is the reason
    raw_answer: str | None
    choice: Choice | None
    # ``choice`` translated from a position to the side that held it
    winner: Winner | None
    reason: str | None
    error: str | None
    attempts: int
    # Wall time of the game, retries and backoff included.
    latency_s: float
    kind: GameKind = "main"
    # probability mode: the judge's probabilities of answering A and B, as the endpoint gave them
    p_a: float | None = None
    p_b: float | None = None

    @property
    def sides(self) -> tuple[Winner, Winner]:
        """The sides shown as A and B."""
        subject, other = SIDES[self.kind]
        return (subject, other) if self.sidecar_position == "A" else (other, subject)

    @property
    def p_first(self) -> float | None:
        """Probability mode: the probability of choosing the set shown first, normalised over A and B."""
        if self.p_a is None or self.p_b is None or self.p_a + self.p_b == 0:
            return None
        return self.p_a / (self.p_a + self.p_b)

    @property
    def subject_score(self) -> float | None:
        """How much the game favours the subject side: its normalised probability, or in the text mode
        1 (it won), 0.5 (tie), 0 (the other side won); None without an answer."""
        p_first = self.p_first
        if p_first is not None:
            return p_first if self.sidecar_position == "A" else 1 - p_first
        if self.winner is None:
            return None
        return 1.0 if self.winner == SIDES[self.kind][0] else 0.5 if self.winner == "tie" else 0.0

    @property
    def first_shown_score(self) -> float | None:
        """How much the game favours the set shown first, in the same terms as ``subject_score``."""
        score = self.subject_score
        return score if score is None or self.sidecar_position == "A" else 1 - score


def backoff_seconds(retry: int, base_s: float, max_s: float) -> float:
    """Delay before retry number ``retry`` (1-based): exponential, capped, plus up to 50% jitter so that
    concurrent workers hitting the same overloaded endpoint do not retry in lockstep."""
    delay = min(max_s, base_s * 2 ** (retry - 1))
    return delay + random.uniform(0, delay / 2)


def request_options(mode: JudgeMode, config: JudgeConfig, answer_failures: int) -> dict[str, Any]:
    """The request after ``answer_failures`` unusable answers; see the module docstring."""
    if mode == "probability":
        options: dict[str, Any] = {"max_tokens": 1, "temperature": 0, "logprobs": True,
                                   "top_logprobs": PROBE_TOP_LOGPROBS}
        if answer_failures >= 1:
            options |= {"max_tokens": 8, "top_logprobs": RETRY_TOP_LOGPROBS}
    else:
        options = {"max_tokens": config.max_tokens * (2 if answer_failures >= 1 else 1), "temperature": 0}
    if answer_failures >= 2:
        options |= {"temperature": SAMPLING_TEMPERATURE, "seed": answer_failures - 1}
    return options


def is_retryable(exc: Exception) -> bool:
    import openai  # imported when the judge asks, not with the flows that import study.judge

    if isinstance(exc, JudgeAnswerError | openai.APIConnectionError):  # timeouts are connection errors
        return True
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code == 429 or exc.status_code >= 500
    return False


def capped(text: str, limit: int = MAX_ANSWER_CHARS) -> str:
    """``text``, or its first ``limit`` characters followed by ``CUT_MARKER``."""
    if len(text) <= limit:
        return text
    return text[:limit] + CUT_MARKER.format(total=len(text), kept=limit)


class Redactor:
    """Removes known secrets from text before it is logged or stored: endpoints can echo the key."""

    def __init__(self, secrets: Sequence[str]) -> None:
        self._secrets = [secret for secret in secrets if secret]

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, REDACTED)
        return text


def play_game(doc_id: str, summary: str, kind: GameKind, game: Literal[1, 2],
              tags: tuple[JsonValue, JsonValue], client: openai.OpenAI, config: JudgeConfig,
              redact: Redactor, instruction: str | None = None) -> GameResult:
    """Ask one game, retrying what failed; ``tags`` is (the subject side's, the other side's) outputs, judged in
    the prompt's task form when ``instruction`` is given."""
    import openai  # imported when the judge asks, not with the flows that import study.judge

    subject_tags, other_tags = tags
    sidecar_position: Literal["A", "B"] = "A" if game == 1 else "B"
    tags_a, tags_b = (subject_tags, other_tags) if game == 1 else (other_tags, subject_tags)
    messages = render_prompt(summary, tags_a, tags_b, config.prompt_version, instruction)
    subject, other = SIDES[kind]
    mode = config.mode
    max_attempts = config.retries + 1
    started = time.perf_counter()
    attempt = answer_failures = 0
    while True:
        attempt += 1
        raw_answer: str | None = None
        try:
            reply = ask(client, config, messages, **request_options(mode, config, answer_failures))
            raw_answer = reply.text
            if mode == "probability":
                p_a, p_b = letter_probabilities(reply)
                choice: Choice = "A" if p_a > p_b else "B" if p_b > p_a else "tie"
                reason = None
            else:
                answer = parse_judge_answer(raw_answer)
                choice, reason, p_a, p_b = answer.winner, capped(redact(answer.reason)), None, None
        except (openai.OpenAIError, JudgeAnswerError) as exc:
            error = redact(f"{type(exc).__name__}: {exc}")[:MAX_ERROR_CHARS]
            will_retry = is_retryable(exc) and attempt < max_attempts
            logger.warning("judge doc %s %s game %d attempt %d/%d failed (%s): %s", doc_id, kind, game, attempt,
                           max_attempts, "retrying" if will_retry else "giving up", error)
            if will_retry:
                answer_failures += isinstance(exc, JudgeAnswerError)
                time.sleep(backoff_seconds(attempt, config.backoff_base_s, config.backoff_max_s))
                continue
            return GameResult(
                game=game, kind=kind, sidecar_position=sidecar_position,
                raw_answer=None if raw_answer is None else capped(redact(raw_answer)), choice=None, winner=None,
                reason=None, error=error, attempts=attempt, latency_s=time.perf_counter() - started)
        winner: Winner = "tie" if choice == "tie" else subject if choice == sidecar_position else other
        return GameResult(
            game=game, kind=kind, sidecar_position=sidecar_position, raw_answer=capped(redact(raw_answer)),
            choice=choice, winner=winner, reason=reason, error=None, attempts=attempt,
            latency_s=time.perf_counter() - started, p_a=p_a, p_b=p_b)
