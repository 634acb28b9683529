"""LLM-judge comparison of sidecar hashtags against a standalone tagger's hashtags.

Each document is judged twice with the tag sets' positions swapped, because LLM judges favour a position;
only a preference that survives the swap counts as a win. Calls go through the official ``openai``
client to any OpenAI-compatible endpoint, with our own retry loop (the client's retries are switched off
so that unparseable answers and transport errors share one retry budget and one attempt count).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, Literal

import httpx
import openai
from openai.types.chat import ChatCompletion
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

logger = logging.getLogger(__name__)

API_KEY_ENV_VARS = ("SIDECAR_JUDGE_API_KEY", "OPENAI_API_KEY")
REDACTED = "**********"
# Stored error texts are for humans reading an artifact; a whole HTML error page is not.
MAX_ERROR_CHARS = 500

Choice = Literal["A", "B", "tie"]
Side = Literal["sidecar", "standalone", "tie"]
Verdict = Literal["sidecar", "standalone", "tie", "error", "skipped"]

_SYSTEM_V1 = (
    "You evaluate hashtags written for a short summary. You compare two tag sets for the same summary "
    "and decide which one fits the summary better: on topic, faithful to what the summary states (no "
    "names, places or claims the summary does not contain), specific rather than generic, and not "
    "redundant. The order in which the sets are shown says nothing about their quality. If neither set "
    "is clearly better, the answer is a tie. You answer with one JSON object and nothing else."
)
_USER_V1 = (
    "Summary:\n<<<\n{summary}\n>>>\n\n"
    "Tag set A: {tags_a}\n"
    "Tag set B: {tags_b}\n\n"
    "Which tag set fits the summary better? Reply with exactly one JSON object, the winner first and then "
    'a one-sentence reason: {{"winner": "A" | "B" | "tie", "reason": "..."}}'
)
# Verdicts are only comparable within one prompt version; callers store the version next to the verdicts.
PROMPTS: dict[str, tuple[str, str]] = {"tags-v1": (_SYSTEM_V1, _USER_V1)}


class JudgeConfigError(ValueError):
    """A judge configuration that cannot be used, such as one with no API key to be found."""


class JudgeAnswerError(ValueError):
    """The judge's answer is not the JSON verdict the prompt asks for (prose, bad winner, empty, refusal)."""


class JudgeConfig(BaseModel):
    """Where and how to ask the judge. The API key is a ``SecretStr``: masked in repr, logs and dumps."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    base_url: str | None = None
    api_key: SecretStr | None = None
    concurrency: int = Field(default=4, ge=1)
    # Retries after the first attempt, so a game makes at most ``retries + 1`` calls.
    retries: int = Field(default=3, ge=0)
    timeout_s: float = Field(default=60.0, gt=0)
    prompt_version: str = "tags-v1"
    backoff_base_s: float = Field(default=1.0, ge=0)
    backoff_max_s: float = Field(default=30.0, ge=0)
    max_tokens: int = Field(default=200, ge=16)

    @field_validator("prompt_version")
    @classmethod
    def _known_prompt_version(cls, version: str) -> str:
        if version not in PROMPTS:
            raise ValueError(f"unknown prompt_version {version!r}; known: {sorted(PROMPTS)}")
        return version

    def resolved_api_key(self) -> SecretStr:
        """The key to call the judge with: ``api_key``, else the first of ``SIDECAR_JUDGE_API_KEY`` /
        ``OPENAI_API_KEY`` that is set. (The judge flow reads a Prefect Secret block into ``api_key``.)"""
        if self.api_key is not None:
            return self.api_key
        for name in API_KEY_ENV_VARS:
            value = os.environ.get(name)
            if value:
                return SecretStr(value)
        raise JudgeConfigError(
            "no judge API key: set api_key (the judge flow: api_key_secret_block) or one of "
            f"{', '.join(API_KEY_ENV_VARS)} (any non-empty value for a server that does not check keys)"
        )


class JudgeItem(BaseModel):
    doc_id: str
    summary: str
    sidecar_tags: list[str] | None
    standalone_tags: list[str] | None


class JudgeAnswer(BaseModel):
    """The JSON object the judge must answer with."""

    winner: Choice
    reason: str = ""


# The parts of a chat completion the judge reads. The openai client builds its ``ChatCompletion`` from a
# 200 reply without validating it, so any JSON shape (``"choices": "x"``, a null message, an object as
# content) arrives as attributes of whatever type; these models check them before use.
class _ReplyMessage(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    content: str | None = None
    refusal: str | None = None


class _ReplyChoice(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    message: _ReplyMessage


class _Reply(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    choices: list[_ReplyChoice] = Field(min_length=1)


class GameResult(BaseModel):
    """One of the two position-swapped games of a document."""

    game: Literal[1, 2]
    sidecar_position: Literal["A", "B"]
    raw_answer: str | None
    choice: Choice | None
    # ``choice`` translated from a position to the side that held it.
    winner: Side | None
    reason: str | None
    error: str | None
    attempts: int
    # Wall time of the game, retries and backoff included.
    latency_s: float


class JudgeResult(BaseModel):
    doc_id: str
    games: list[GameResult]
    verdict: Verdict
    skip_reason: str | None = None

    @property
    def order_consistent(self) -> bool | None:
        """Whether both games named the same side; None when the document was not fully judged."""
        if self.verdict in ("error", "skipped"):
            return None
        return self.games[0].winner == self.games[1].winner


class JudgeSummary(BaseModel):
    total: int
    judged: int
    wins: int
    losses: int
    ties: int
    # Ties that come from the two games disagreeing rather than both answering tie.
    inconsistent: int
    errors: int
    skipped: int
    order_consistency_rate: float | None
    model: str | None = None
    prompt_version: str | None = None
    error_docs: dict[str, str] = Field(default_factory=dict)

    def to_markdown(self) -> str:
        rate = "n/a" if self.order_consistency_rate is None else f"{self.order_consistency_rate:.1%}"
        lines = ["# Sidecar vs standalone hashtags (LLM judge)", ""]
        if self.model or self.prompt_version:
            lines += [f"Judge `{self.model}`, prompt `{self.prompt_version}`.", ""]
        lines += [
            "| outcome | documents |",
            "|---|---:|",
            f"| sidecar better | {self.wins} |",
            f"| standalone better | {self.losses} |",
            f"| tie | {self.ties} |",
            f"| of which order-inconsistent | {self.inconsistent} |",
            f"| error | {self.errors} |",
            f"| skipped (missing tags) | {self.skipped} |",
            f"| total | {self.total} |",
            "",
            f"Order consistency (both games agree, over {self.judged} judged documents): {rate}.",
            "",
            "For comparison, the source study's numbers, not ours: on 100 CNN/DailyMail articles its LLM judge "
            "reported 86 ties, the other 14 split 9-5.",
        ]
        if self.error_docs:
            lines += ["", "## Errors", "", "| doc | error |", "|---|---|"]
            lines += [
                f"| {doc_id} | {error.replace('|', '/').replace(chr(10), ' ')} |"
                for doc_id, error in self.error_docs.items()
            ]
        return "\n".join(lines) + "\n"


def make_judge_client(config: JudgeConfig, http_client: httpx.Client | None = None) -> openai.OpenAI:
    """An OpenAI client for the judge endpoint; the client's own retries are off (``judge_pairs`` retries)."""
    return openai.OpenAI(
        base_url=config.base_url,
        api_key=config.resolved_api_key().get_secret_value(),
        timeout=config.timeout_s,
        max_retries=0,
        http_client=http_client,
    )


_FENCED = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL | re.IGNORECASE)


def _problems(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` hook: a repeated key would let the last ``winner`` silently override the first."""
    keys = [key for key, _ in pairs]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise ValueError(f"repeated key(s) {', '.join(map(repr, repeated))}")
    return dict(pairs)


def parse_judge_answer(text: str | None) -> JudgeAnswer:
    """Parse the judge's answer: one JSON object, optionally inside a ```json fence, nothing else, with
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
        raise JudgeAnswerError(f"answer has no valid verdict: {_problems(exc)}") from None


def render_prompt(summary: str, tags_a: list[str], tags_b: list[str], prompt_version: str) -> list[dict[str, str]]:
    system, user = PROMPTS[prompt_version]
    # JSON lists show exactly which strings each tagger produced, whatever their '#' or spacing.
    content = user.format(
        summary=summary.strip(),
        tags_a=json.dumps(tags_a, ensure_ascii=False),
        tags_b=json.dumps(tags_b, ensure_ascii=False),
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": content}]


def backoff_seconds(retry: int, base_s: float, max_s: float) -> float:
    """Delay before retry number ``retry`` (1-based): exponential, capped, plus up to 50% jitter so that
    concurrent workers hitting the same overloaded endpoint do not retry in lockstep."""
    delay = min(max_s, base_s * 2 ** (retry - 1))
    return delay + random.uniform(0, delay / 2)


def final_verdict(games: Sequence[GameResult]) -> Verdict:
    """A side wins only if both games pick it; any disagreement is a tie; any failed game is an error."""
    if any(game.winner is None for game in games):
        return "error"
    first, second = (game.winner for game in games)
    return first if first == second else "tie"


def _is_retryable(exc: Exception) -> bool:
    if isinstance(exc, JudgeAnswerError | openai.APIConnectionError):  # timeouts are connection errors
        return True
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code == 429 or exc.status_code >= 500
    return False


class _Redactor:
    """Removes known secrets from text before it is logged or stored: endpoints can echo the key."""

    def __init__(self, secrets: Sequence[str]) -> None:
        self._secrets = [secret for secret in secrets if secret]

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, REDACTED)
        return text


def _ask(client: openai.OpenAI, config: JudgeConfig, messages: list[dict[str, str]]) -> str:
    """The text the judge answers ``messages`` with; ``JudgeAnswerError`` for a reply that holds none."""
    try:
        completion = client.chat.completions.create(
            model=config.model, messages=messages, temperature=0, max_tokens=config.max_tokens
        )
    # The client decodes a reply declared as JSON with json.loads and lets its errors through: a truncated or
    # mis-encoded body is a ValueError (JSONDecodeError, UnicodeDecodeError), a deeply nested one a RecursionError.
    except (ValueError, RecursionError) as exc:
        raise JudgeAnswerError(f"response body is not JSON: {type(exc).__name__}: {exc}") from exc
    if not isinstance(completion, ChatCompletion):
        # The client hands back a plain string when a 200 response is not declared as JSON.
        raise JudgeAnswerError(f"response is not a chat completion: {str(completion)[:200]!r}")
    try:
        message = _Reply.model_validate(completion).choices[0].message
    except ValidationError as exc:
        raise JudgeAnswerError(f"response is not a chat completion: {_problems(exc)}") from None
    if message.refusal:
        raise JudgeAnswerError(f"judge refused: {message.refusal}")
    return message.content or ""


def _play_game(
    item: JudgeItem,
    game: Literal[1, 2],
    tags: tuple[list[str], list[str]],
    client: openai.OpenAI,
    config: JudgeConfig,
    redact: _Redactor,
) -> GameResult:
    """Ask one game, retrying transient failures; ``tags`` is (sidecar, standalone)."""
    sidecar_tags, standalone_tags = tags
    sidecar_position: Literal["A", "B"] = "A" if game == 1 else "B"
    tags_a, tags_b = (sidecar_tags, standalone_tags) if game == 1 else (standalone_tags, sidecar_tags)
    messages = render_prompt(item.summary, tags_a, tags_b, config.prompt_version)
    max_attempts = config.retries + 1
    started = time.perf_counter()
    attempt = 0
    while True:
        attempt += 1
        raw_answer: str | None = None
        try:
            raw_answer = _ask(client, config, messages)
            answer = parse_judge_answer(raw_answer)
        except (openai.OpenAIError, JudgeAnswerError) as exc:
            error = redact(f"{type(exc).__name__}: {exc}")[:MAX_ERROR_CHARS]
            will_retry = _is_retryable(exc) and attempt < max_attempts
            logger.warning(
                "judge doc %s game %d attempt %d/%d failed (%s): %s",
                item.doc_id,
                game,
                attempt,
                max_attempts,
                "retrying" if will_retry else "giving up",
                error,
            )
            if will_retry:
                time.sleep(backoff_seconds(attempt, config.backoff_base_s, config.backoff_max_s))
                continue
            return GameResult(
                game=game,
                sidecar_position=sidecar_position,
                raw_answer=None if raw_answer is None else redact(raw_answer),
                choice=None,
                winner=None,
                reason=None,
                error=error,
                attempts=attempt,
                latency_s=time.perf_counter() - started,
            )
        winner: Side = {"tie": "tie", sidecar_position: "sidecar"}.get(answer.winner, "standalone")
        return GameResult(
            game=game,
            sidecar_position=sidecar_position,
            raw_answer=redact(raw_answer),
            choice=answer.winner,
            winner=winner,
            reason=redact(answer.reason),
            error=None,
            attempts=attempt,
            latency_s=time.perf_counter() - started,
        )


def _skip_reason(item: JudgeItem) -> str:
    sides = {"sidecar": item.sidecar_tags, "standalone": item.standalone_tags}
    return "no " + " and no ".join(side for side, tags in sides.items() if not tags) + " tags"


def judge_pairs(items: list[JudgeItem], config: JudgeConfig, client: openai.OpenAI | None = None,
                on_result: Callable[[JudgeResult], None] | None = None) -> list[JudgeResult]:
    """Judge every item in two position-swapped games; results come back in the order of ``items``.

    Documents run concurrently on at most ``config.concurrency`` threads, one request in flight per
    thread. A given ``client`` is used with ``config.timeout_s`` and its own retries switched off.
    ``on_result`` hears each document's result as it is done, in the calling thread.
    """
    if client is None:
        client = make_judge_client(config)
    else:
        client = client.with_options(timeout=config.timeout_s, max_retries=0)
    known_secrets = [client.api_key if isinstance(client.api_key, str) else ""]
    if config.api_key is not None:
        known_secrets.append(config.api_key.get_secret_value())
    redact = _Redactor(known_secrets)

    def judge_one(item: JudgeItem) -> JudgeResult:
        if not item.sidecar_tags or not item.standalone_tags:
            skip_reason = _skip_reason(item)
            logger.info("judge doc %s skipped: %s", item.doc_id, skip_reason)
            return JudgeResult(doc_id=item.doc_id, games=[], verdict="skipped", skip_reason=skip_reason)
        tags = (item.sidecar_tags, item.standalone_tags)
        games = [_play_game(item, game, tags, client, config, redact) for game in (1, 2)]
        return JudgeResult(doc_id=item.doc_id, games=games, verdict=final_verdict(games))

    logger.info(
        "judging %d documents with %s (prompt %s, concurrency %d)",
        len(items),
        config.model,
        config.prompt_version,
        config.concurrency,
    )
    if not items:
        return []
    workers = min(config.concurrency, len(items))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="judge") as pool:
        futures = {pool.submit(judge_one, item): index for index, item in enumerate(items)}
        results: list[JudgeResult | None] = [None] * len(items)
        for future in as_completed(futures):
            results[futures[future]] = result = future.result()
            if on_result is not None:
                on_result(result)
    return [r for r in results if r is not None]


def summarize_judgements(results: Sequence[JudgeResult], config: JudgeConfig | None = None) -> JudgeSummary:
    """Counts of verdicts; ``order_consistency_rate`` is over documents judged without error."""
    verdicts = [result.verdict for result in results]
    judged = [result for result in results if result.order_consistent is not None]
    consistent = sum(1 for result in judged if result.order_consistent)
    return JudgeSummary(
        total=len(results),
        judged=len(judged),
        wins=verdicts.count("sidecar"),
        losses=verdicts.count("standalone"),
        ties=verdicts.count("tie"),
        inconsistent=len(judged) - consistent,
        errors=verdicts.count("error"),
        skipped=verdicts.count("skipped"),
        order_consistency_rate=consistent / len(judged) if judged else None,
        model=None if config is None else config.model,
        prompt_version=None if config is None else config.prompt_version,
        error_docs={
            result.doc_id: "; ".join(f"game {g.game}: {g.error}" for g in result.games if g.error)
            for result in results
            if result.verdict == "error"
        },
    )
