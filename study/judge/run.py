"""Judge many documents: main games and the control ladder's games, in a bounded thread pool.

The null games come first, so that in the probability mode the run's margin is known when each
document's verdict is; :func:`detect_prompt_version` decides the mode per run from one probe call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, TypeVar

from pydantic import JsonValue

from study.judge.answers import JudgeAnswerError, ask
from study.judge.config import JudgeConfig, make_judge_client
from study.judge.controls import control_foils, hard_tags, null_tags
from study.judge.games import (
    MAX_ERROR_CHARS,
    GameKind,
    GameResult,
    Redactor,
    backoff_seconds,
    is_retryable,
    logger,
    play_game,
    request_options,
)
from study.judge.prompts import PROMPTS, TEXT_FALLBACK, render_prompt
from study.judge.results import JudgeItem, JudgeResult, has_output
from study.judge.scoring import calibrated_margin, final_verdict, preference, preference_verdict

if TYPE_CHECKING:
    import openai

In = TypeVar("In")
Out = TypeVar("Out")
# an endpoint that refuses a request field answers with one of these
_REFUSED_STATUSES = (400, 404, 422)


@dataclass(frozen=True)
class Detection:
    """The prompt version a run uses, and why."""

    prompt_version: str
    note: str


def client_and_redactor(config: JudgeConfig, client: openai.OpenAI | None) -> tuple[openai.OpenAI, Redactor]:
    if client is None:
        client = make_judge_client(config)
    else:
        client = client.with_options(timeout=config.timeout_s, max_retries=0)
    known_secrets = [client.api_key if isinstance(client.api_key, str) else ""]
    if config.api_key is not None:
        known_secrets.append(config.api_key.get_secret_value())
    return client, Redactor(known_secrets)


def detect_prompt_version(item: JudgeItem, config: JudgeConfig, client: openai.OpenAI | None = None) -> Detection:
    """Whether the endpoint returns log probabilities, asked once with ``item``'s first game.

    A text prompt is kept without a call. A probability prompt is kept when the reply carries log
    probabilities; an endpoint that refuses them (HTTP 400, 404, 422) or answers without them gets the
    text fallback. A probe that keeps failing otherwise (no connection, 5xx) decides nothing: the prompt is
    kept and its games will fail the same way.
    """
    import openai  # imported when the judge asks, not with the flows that import study.judge

    if config.mode == "text":
        return Detection(config.prompt_version, f"Text mode: prompt {config.prompt_version} asks for a JSON verdict.")
    client, redact = client_and_redactor(config, client)
    messages = render_prompt(item.summary, item.sidecar_tags, item.standalone_tags, config.prompt_version,
                             item.instruction)
    fallback = f"the text mode (prompt {TEXT_FALLBACK}) for this run"
    failure: Exception | None = None
    for attempt in range(1, config.retries + 2):
        try:
            reply = ask(client, config, messages, **request_options("probability", config, 0))
        except openai.APIStatusError as exc:
            if exc.status_code in _REFUSED_STATUSES:
                error = redact(f"HTTP {exc.status_code}: {exc.message}")[:MAX_ERROR_CHARS]
                return Detection(TEXT_FALLBACK, f"The endpoint refused log probabilities ({error}): {fallback}.")
            failure = exc
        except (openai.OpenAIError, JudgeAnswerError) as exc:
            failure = exc
        else:
            if reply.alternatives is None:
                return Detection(TEXT_FALLBACK, f"The endpoint returned no log probabilities: {fallback}.")
            return Detection(config.prompt_version, f"Probability mode: prompt {config.prompt_version}, read from "
                             "the answer letters' log probabilities.")
        if not is_retryable(failure) or attempt > config.retries:
            break
        time.sleep(backoff_seconds(attempt, config.backoff_base_s, config.backoff_max_s))
    error = redact(f"{type(failure).__name__}: {failure}")[:MAX_ERROR_CHARS]
    return Detection(config.prompt_version, f"Probability mode (prompt {config.prompt_version}), unconfirmed: the "
                     f"probe call failed ({error}).")


def judge_pairs(items: list[JudgeItem], config: JudgeConfig, client: openai.OpenAI | None = None,
                on_result: Callable[[JudgeResult], None] | None = None) -> list[JudgeResult]:
    """Judge every item in two position-swapped games; results come back in the order of ``items``.

    The first ``config.controls`` items with both tag sets also climb the control ladder: easy, hard and null games
    (the null games also calibrate the margin of every probability verdict). Documents run concurrently on at most
    ``config.concurrency`` threads, one request in flight per thread. A given ``client`` is used with
    ``config.timeout_s`` and its own retries switched off. ``on_result`` hears each document's result as it is done,
    in the calling thread; a queued document starts only after a finished one's result was taken, so when
    ``on_result`` raises, no queued document is judged."""
    client, redact = client_and_redactor(config, client)
    judgeable = [item for item in items if item.comparable]
    foils = control_foils([(item.doc_id, item.sidecar_tags) for item in judgeable], config.controls)
    probability = config.mode == "probability"

    def play(item: JudgeItem, kind: GameKind, tags: tuple[JsonValue, JsonValue]) -> list[GameResult]:
        return [play_game(item.doc_id, item.summary, kind, game, tags, client, config, redact, item.instruction)
                for game in (1, 2)]

    logger.info("judging %d documents with %s (prompt %s, %s mode, %d with controls, concurrency %d)", len(items),
                config.model, config.prompt_version, PROMPTS[config.prompt_version].mode, len(foils),
                config.concurrency)
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=min(config.concurrency, len(items)), thread_name_prefix="judge") as pool:
        nulls = [(item, flipped) for item in judgeable[:config.controls]
                 if (flipped := null_tags(item.sidecar_tags)) is not None]
        played = pool.map(lambda pair: play(pair[0], "null", (pair[0].sidecar_tags, pair[1])), nulls)
        null_games = {item.doc_id: games for (item, _), games in zip(nulls, played, strict=True)}
        margin = calibrated_margin([preference(games) for games in null_games.values()], config.margin_floor)

        def judge_one(item: JudgeItem) -> JudgeResult:
            if not item.comparable:
                sides = {"sidecar": item.sidecar_tags, "standalone": item.standalone_tags}
                what = " tags" if item.instruction is None else " output"
                missing = [side for side, tags in sides.items() if not has_output(tags)]
                skip_reason = "no " + " and no ".join(missing) + what
                logger.info("judge doc %s skipped: %s", item.doc_id, skip_reason)
                return JudgeResult(doc_id=item.doc_id, games=[], verdict="skipped", skip_reason=skip_reason)
            games = play(item, "main", (item.sidecar_tags, item.standalone_tags))
            controls = list(null_games.get(item.doc_id, []))
            foil = foils.get(item.doc_id)
            if foil is not None:
                controls += play(item, "control", (item.sidecar_tags, foil.tags))
                if (mixed := hard_tags(item.sidecar_tags, foil.tags)) is not None:
                    controls += play(item, "hard", (item.sidecar_tags, mixed))
            verdict = preference_verdict(games, margin) if probability else final_verdict(games)
            return JudgeResult(doc_id=item.doc_id, games=games, verdict=verdict,
                               preference=preference(games) if probability else None, controls=controls,
                               foil_doc_id=None if foil is None else foil.doc_id)

        return in_turn(pool, items, judge_one, config.concurrency, on_result)


def in_turn(pool: ThreadPoolExecutor, items: Sequence[In], work: Callable[[In], Out], width: int,
            on_result: Callable[[Out], None] | None) -> list[Out]:
    """``work`` on every item on ``pool``, at most ``width`` at a time; results in the order of ``items``, each
    heard by ``on_result`` in the calling thread as it is done. A queued item starts only when a finished one's
    result was taken: when the caller cannot take one (its commit failed), no queued item is worked on as
    lost work."""
    queued = iter(enumerate(items))
    running = {pool.submit(work, item): index for index, item in islice(queued, width)}
    results: list[Out | None] = [None] * len(items)
    while running:
        done, _ = wait(running, return_when=FIRST_COMPLETED)
        for future in done:
            results[running.pop(future)] = result = future.result()
            if on_result is not None:
                on_result(result)
            for index, item in islice(queued, 1):
                running[pool.submit(work, item)] = index
    return [r for r in results if r is not None]
