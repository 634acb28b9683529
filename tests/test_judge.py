"""The LLM judge, driven through the real openai client against an ``httpx.MockTransport`` endpoint."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import zlib
from collections.abc import Callable

import httpx
import openai
import pytest
from pydantic import ValidationError

from study import judge
from study.judge import (
    GameResult,
    JudgeAnswerError,
    JudgeConfig,
    JudgeConfigError,
    JudgeItem,
    JudgeResult,
    backoff_seconds,
    final_verdict,
    judge_pairs,
    make_judge_client,
    parse_judge_answer,
    summarize_judgements,
)
from study.judge import games as judge_games
from study.judge.likelihood import scorer_text
from study.judge.tasks import not_judged_reason

BASE_URL = "http://judge.test/v1"
API_KEY = "sk-test-0123456789abcdef"
GOOD_TAG = "#good"

Handler = Callable[[httpx.Request], httpx.Response]


def make_config(**overrides: object) -> JudgeConfig:
    # No backoff sleeps in tests; retries=2 keeps attempt counts small but still shows retrying. The text mode
    # without controls unless a test asks for them: the probability mode and the controls have tests of their own.
    values: dict[str, object] = {
        "model": "judge-test",
        "base_url": BASE_URL,
        "api_key": API_KEY,
        "retries": 2,
        "backoff_base_s": 0.0,
        "timeout_s": 5.0,
        "prompt_version": "tags-v1",
        "controls": 0,
    }
    values.update(overrides)
    return JudgeConfig.model_validate(values)


def make_client(handler: Handler) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=BASE_URL, api_key=API_KEY, http_client=httpx.Client(transport=httpx.MockTransport(handler))
    )


def completion(content: str | None, refusal: str | None = None) -> httpx.Response:
    message = {"role": "assistant", "content": content, "refusal": refusal}
    return httpx.Response(
        200,
        json={
            "id": "chatcmpl-test",
            "object": "chat.completion",
            "created": 0,
            "model": "judge-test",
            "choices": [{"index": 0, "finish_reason": "stop", "message": message}],
        },
    )


def reply(body: object) -> httpx.Response:
    """A 200 whose JSON body is ``body``, whatever its shape."""
    return httpx.Response(200, json=body)


def json_bytes(content: bytes) -> httpx.Response:
    """A 200 declared as JSON whose body is ``content`` as is."""
    return httpx.Response(200, content=content, headers={"content-type": "application/json"})


def verdict_json(winner: str) -> str:
    return json.dumps({"winner": winner, "reason": "because"})


def shown_tag_sets(request: httpx.Request) -> tuple[list[str], list[str]]:
    """The tag sets the prompt shows in positions A and B."""
    user_message = json.loads(request.content)["messages"][-1]["content"]
    lines = dict(line.split(": ", 1) for line in user_message.splitlines() if line.startswith("Tag set "))
    return json.loads(lines["Tag set A"]), json.loads(lines["Tag set B"])


class CountingHandler:
    """Answers every request with ``respond`` and counts the requests, thread-safely."""

    def __init__(self, respond: Handler) -> None:
        self.respond = respond
        self.requests: list[httpx.Request] = []
        self._lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        with self._lock:
            self.requests.append(request)
        return self.respond(request)


def always(content: str) -> CountingHandler:
    return CountingHandler(lambda _request: completion(content))


def content_winner(request: httpx.Request) -> str:
    """A position-blind judgement: whichever set holds GOOD_TAG, else a tie."""
    tags_a, tags_b = shown_tag_sets(request)
    return "A" if GOOD_TAG in tags_a else "B" if GOOD_TAG in tags_b else "tie"


def follows_content(request: httpx.Request) -> httpx.Response:
    return completion(verdict_json(content_winner(request)))


def item(doc_id: str = "doc-1", sidecar: list[str] | None = None, standalone: list[str] | None = None) -> JudgeItem:
    return JudgeItem(
        doc_id=doc_id,
        summary="- A factory in Oklahoma closes.\n- 300 workers lose their jobs.",
        sidecar_tags=["#factory", "#jobs"] if sidecar is None else sidecar,
        standalone_tags=["#oklahoma", "#layoffs"] if standalone is None else standalone,
    )


def game(number: int, winner: str | None) -> GameResult:
    return GameResult(
        game=number,
        sidecar_position="A" if number == 1 else "B",
        raw_answer=None,
        choice=None,
        winner=winner,
        reason=None,
        error=None if winner else "APITimeoutError: Request timed out.",
        attempts=1,
        latency_s=0.1,
    )


# --- answer parsing ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "winner"),
    [
        ('{"winner": "A", "reason": "more specific"}', "A"),
        ('\n  {"winner": "B", "reason": "faithful"}  \n', "B"),
        ('```json\n{"winner": "tie", "reason": "same"}\n```', "tie"),
        ('```\n{"winner": "A", "reason": "x"}\n```\n', "A"),
        ('{"winner": "B"}', "B"),
        ('{"winner": "A", "reason": "x", "notes": {"reason": "inner keys", "winner": "in any order"}}', "A"),
    ],
)
def test_parse_accepts_json_object_bare_or_fenced(text: str, winner: str) -> None:
    assert parse_judge_answer(text).winner == winner


@pytest.mark.parametrize(
    "text",
    [
        None,
        "",
        "   \n",
        "A",
        "Tag set A is better.",
        'Sure! {"winner": "A", "reason": "x"}',
        '```json\n{"winner": "A"}\n```\nI picked A because it is specific.',
        '{"reason": "no winner given"}',
        '{"winner": "C", "reason": "x"}',
        '{"winner": "a", "reason": "lower case is not the asked format"}',
        '{"winner": null}',
        '["A"]',
        "I'm sorry, but I can't help with that.",
        '{"reason": "the reason before the verdict", "winner": "A"}',
        '{"winner": "A", "reason": "x", "winner": "B"}',
        '{"winner": "A", "reason": {"not": "a string"}}',
        "[" * 100_000,
        '{"winner": "A", "n": ' + "1" * 5_000 + "}",
    ],
    ids=lambda text: repr(text)[:40],
)
def test_parse_rejects_anything_but_a_verdict_object(text: str | None) -> None:
    with pytest.raises(JudgeAnswerError):
        parse_judge_answer(text)


# --- verdict rules ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("first", "second", "expected"),
    [
        ("sidecar", "sidecar", "sidecar"),
        ("standalone", "standalone", "standalone"),
        ("tie", "tie", "tie"),
        ("sidecar", "standalone", "tie"),
        ("standalone", "sidecar", "tie"),
        ("sidecar", "tie", "tie"),
        ("tie", "standalone", "tie"),
        (None, "sidecar", "error"),
        ("tie", None, "error"),
    ],
)
def test_final_verdict_needs_both_games_to_agree(first: str | None, second: str | None, expected: str) -> None:
    assert final_verdict([game(1, first), game(2, second)]) == expected


def test_judge_that_always_answers_a_yields_order_inconsistent_ties() -> None:
    handler = always(verdict_json("A"))
    items = [item(f"doc-{i}") for i in range(3)]

    results = judge_pairs(items, make_config(), make_client(handler))

    assert [r.verdict for r in results] == ["tie"] * 3
    for result in results:
        assert [g.choice for g in result.games] == ["A", "A"]
        assert [g.winner for g in result.games] == ["sidecar", "standalone"]
        assert result.order_consistent is False
    summary = summarize_judgements(results)
    assert (summary.ties, summary.inconsistent, summary.order_consistency_rate) == (3, 3, 0.0)


def test_content_following_judge_yields_wins_for_the_better_side() -> None:
    handler = CountingHandler(follows_content)
    items = [
        item("sidecar-better", sidecar=[GOOD_TAG, "#jobs"]),
        item("standalone-better", standalone=[GOOD_TAG, "#layoffs"]),
        item("neither"),
    ]

    results = judge_pairs(items, make_config(), make_client(handler))

    assert [r.doc_id for r in results] == ["sidecar-better", "standalone-better", "neither"]
    assert [r.verdict for r in results] == ["sidecar", "standalone", "tie"]
    sidecar_games = results[0].games
    assert [(g.game, g.sidecar_position, g.choice) for g in sidecar_games] == [(1, "A", "A"), (2, "B", "B")]
    assert all(r.order_consistent for r in results)
    # Game 1 shows the sidecar's tags as A, game 2 as B.
    shown = sorted((shown_tag_sets(r) for r in handler.requests), key=lambda ab: ab[0] != [GOOD_TAG, "#jobs"])
    assert shown[0] == ([GOOD_TAG, "#jobs"], ["#oklahoma", "#layoffs"])
    body = json.loads(handler.requests[0].content)
    assert body["model"] == "judge-test"
    assert body["temperature"] == 0
    assert "Oklahoma closes" in body["messages"][-1]["content"]
    summary = summarize_judgements(results)
    assert (summary.wins, summary.losses, summary.ties, summary.order_consistency_rate) == (1, 1, 1, 1.0)


def test_both_games_tie_is_a_consistent_tie() -> None:
    results = judge_pairs([item()], make_config(), make_client(always(verdict_json("tie"))))

    assert results[0].verdict == "tie"
    assert results[0].order_consistent is True


def test_fenced_json_answer_is_accepted() -> None:
    handler = CountingHandler(lambda request: completion(f"```json\n{verdict_json(content_winner(request))}\n```"))

    results = judge_pairs([item(sidecar=[GOOD_TAG])], make_config(), make_client(handler))

    assert results[0].verdict == "sidecar"
    assert [g.attempts for g in results[0].games] == [1, 1]
    assert results[0].games[0].raw_answer.startswith("```json")


# --- errors and retries -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "respond",
    [
        pytest.param(lambda _r: completion("not json at all"), id="garbage"),
        pytest.param(lambda _r: completion("Tag set A fits the summary better."), id="prose"),
        pytest.param(lambda _r: completion(""), id="empty"),
        pytest.param(lambda _r: completion(None, refusal="I can't judge this."), id="refusal-field"),
        pytest.param(lambda _r: completion("I'm sorry, but I can't help with that."), id="refusal-prose"),
        pytest.param(lambda _r: completion('{"winner": "both", "reason": "x"}'), id="invalid-winner"),
        pytest.param(lambda _r: httpx.Response(200, text="<html>gateway</html>"), id="not-a-completion"),
        pytest.param(lambda _r: completion('{"reason": "x", "winner": "A"}'), id="reason-first"),
        pytest.param(lambda _r: completion("[" * 100_000), id="deeply-nested-answer"),
        # 200 replies of the wrong shape: the openai client hands them over unvalidated
        pytest.param(lambda _r: reply({"choices": "x"}), id="choices-not-a-list"),
        pytest.param(lambda _r: reply({"choices": []}), id="no-choices"),
        pytest.param(lambda _r: reply({"choices": [None]}), id="null-choice"),
        pytest.param(lambda _r: reply({"choices": [{"message": None}]}), id="null-message"),
        pytest.param(lambda _r: reply({"choices": [{"message": {"content": {"winner": "A"}}}]}), id="object-content"),
        pytest.param(lambda _r: reply({"choices": [{"message": {"content": ["A"]}}]}), id="list-content"),
        pytest.param(lambda _r: reply([1, 2]), id="json-array"),
        # bodies declared as JSON that the client's json.loads cannot decode
        pytest.param(lambda _r: json_bytes(b'{"choices": [{"message": '), id="truncated-json"),
        pytest.param(lambda _r: json_bytes(b'{"choices": "\xff"}'), id="not-utf8"),
        pytest.param(lambda _r: json_bytes(b"[" * 100_000), id="deeply-nested-body"),
    ],
)
def test_unusable_answers_are_errors_after_all_retries(respond: Handler) -> None:
    handler = CountingHandler(respond)
    config = make_config(retries=2)

    results = judge_pairs([item()], config, make_client(handler))

    result = results[0]
    assert result.verdict == "error"
    assert [g.attempts for g in result.games] == [3, 3]
    assert len(handler.requests) == 6
    assert all(g.winner is None and g.error and "JudgeAnswerError" in g.error for g in result.games)
    summary = summarize_judgements(results)
    assert (summary.errors, summary.ties, summary.judged) == (1, 0, 0)
    assert summary.order_consistency_rate is None


@pytest.mark.parametrize("status", [500, 503, 429])
def test_transient_status_then_success_succeeds_on_retry(status: int) -> None:
    calls = iter(range(1_000))

    def respond(_request: httpx.Request) -> httpx.Response:
        if next(calls) == 0:
            return httpx.Response(status, json={"error": {"message": "busy"}})
        return completion(verdict_json("tie"))

    results = judge_pairs([item()], make_config(), make_client(CountingHandler(respond)))

    assert results[0].verdict == "tie"
    assert [g.attempts for g in results[0].games] == [2, 1]
    assert all(g.error is None for g in results[0].games)


def test_answer_garbage_then_valid_succeeds_on_retry() -> None:
    answers = iter(["no idea", verdict_json("A"), verdict_json("B")])
    handler = CountingHandler(lambda _r: completion(next(answers)))

    results = judge_pairs([item()], make_config(), make_client(handler))

    assert results[0].verdict == "sidecar"
    assert [g.attempts for g in results[0].games] == [2, 1]


@pytest.mark.parametrize(
    ("transport_error", "error_name"),
    [(httpx.ReadTimeout("timed out"), "APITimeoutError"), (httpx.ConnectError("refused"), "APIConnectionError")],
)
def test_transport_failures_are_errors_after_all_retries(transport_error: Exception, error_name: str) -> None:
    def respond(_request: httpx.Request) -> httpx.Response:
        raise transport_error

    handler = CountingHandler(respond)

    results = judge_pairs([item()], make_config(retries=1), make_client(handler))

    assert results[0].verdict == "error"
    assert [g.attempts for g in results[0].games] == [2, 2]
    assert len(handler.requests) == 4
    assert all(g.error.startswith(error_name) for g in results[0].games)


@pytest.mark.parametrize("status", [401, 400, 404])
def test_client_errors_other_than_429_are_not_retried(status: int) -> None:
    handler = CountingHandler(lambda _r: httpx.Response(status, json={"error": {"message": "nope"}}))

    results = judge_pairs([item()], make_config(retries=3), make_client(handler))

    assert results[0].verdict == "error"
    assert [g.attempts for g in results[0].games] == [1, 1]
    assert len(handler.requests) == 2
    assert str(status) in results[0].games[0].error


def test_given_client_is_used_without_its_own_retries_and_with_config_timeout() -> None:
    handler = CountingHandler(lambda _r: httpx.Response(500, json={"error": {"message": "down"}}))
    client_with_retries = openai.OpenAI(
        base_url=BASE_URL,
        api_key=API_KEY,
        max_retries=5,
        http_client=httpx.Client(transport=httpx.MockTransport(handler)),
    )

    results = judge_pairs([item()], make_config(retries=1, timeout_s=7.5), client_with_retries)

    assert len(handler.requests) == 4  # 2 games x (1 + 1 retry), none of the client's 5
    assert handler.requests[0].extensions["timeout"]["read"] == 7.5
    # an endpoint that never answers decides nothing: an error, never a tie
    assert results[0].verdict == "error"
    assert all(g.winner is None and g.error.startswith("InternalServerError") for g in results[0].games)
    assert (summarize_judgements(results).errors, summarize_judgements(results).ties) == (1, 0)


def test_backoff_grows_exponentially_with_bounded_jitter() -> None:
    for retry, base in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0)]:
        delays = [backoff_seconds(retry, base_s=1.0, max_s=30.0) for _ in range(50)]
        assert all(base <= d <= 1.5 * base for d in delays)
        assert len(set(delays)) > 1
    assert backoff_seconds(10, base_s=1.0, max_s=5.0) <= 7.5


def test_backoff_sleeps_between_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(judge_games.time, "sleep", slept.append)
    handler = CountingHandler(lambda _r: httpx.Response(503, json={"error": {"message": "busy"}}))

    judge_pairs([item()], make_config(retries=3, backoff_base_s=0.5, backoff_max_s=10.0), make_client(handler))

    # 3 sleeps per game, before retries 1, 2, 3; none after the final attempt.
    assert len(slept) == 6
    first_game = slept[:3]
    for delay, base in zip(first_game, [0.5, 1.0, 2.0], strict=True):
        assert base <= delay <= 1.5 * base


# --- concurrency and skipping -----------------------------------------------------------------------


def test_concurrent_requests_never_exceed_concurrency() -> None:
    concurrency = 3
    state = threading.Condition()
    in_flight = 0
    peak = 0

    def respond(_request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, peak
        with state:
            in_flight += 1
            peak = max(peak, in_flight)
            state.notify_all()
            # Hold requests until the pool could be full, so an unbounded pool would overshoot.
            state.wait_for(lambda: in_flight >= concurrency, timeout=0.2)
        time.sleep(0.01)
        with state:
            in_flight -= 1
        return completion(verdict_json("tie"))

    items = [item(f"doc-{i}") for i in range(10)]
    results = judge_pairs(items, make_config(concurrency=concurrency), make_client(CountingHandler(respond)))

    assert [r.doc_id for r in results] == [f"doc-{i}" for i in range(10)]
    assert peak == concurrency


@pytest.mark.parametrize(
    ("sidecar", "standalone", "reason"),
    [
        ([], ["#a"], "no sidecar tags"),
        (["#a"], None, "no standalone tags"),
        (None, [], "no sidecar and no standalone tags"),
    ],
)
def test_items_missing_tags_are_skipped_without_a_request(
    sidecar: list[str] | None, standalone: list[str] | None, reason: str
) -> None:
    handler = CountingHandler(follows_content)
    missing = JudgeItem(doc_id="missing", summary="s", sidecar_tags=sidecar, standalone_tags=standalone)

    results = judge_pairs([missing, item("full")], make_config(), make_client(handler))

    assert len(handler.requests) == 2  # only the full item's two games
    assert (results[0].verdict, results[0].skip_reason, results[0].games) == ("skipped", reason, [])
    assert results[1].verdict == "tie"
    summary = summarize_judgements(results)
    assert (summary.total, summary.judged, summary.skipped, summary.order_consistency_rate) == (2, 1, 1, 1.0)


# --- summary ----------------------------------------------------------------------------------------


def test_summary_counts_and_markdown() -> None:
    def result(doc_id: str, first: str | None, second: str | None) -> JudgeResult:
        games = [game(1, first), game(2, second)]
        return JudgeResult(doc_id=doc_id, games=games, verdict=final_verdict(games))

    results = [
        result("w1", "sidecar", "sidecar"),
        result("w2", "sidecar", "sidecar"),
        result("l1", "standalone", "standalone"),
        result("t1", "tie", "tie"),
        result("t2", "sidecar", "standalone"),
        result("e1", "tie", None),
        JudgeResult(doc_id="s1", games=[], verdict="skipped", skip_reason="no sidecar tags"),
    ]

    summary = summarize_judgements(results, make_config())

    assert (summary.wins, summary.losses, summary.ties, summary.errors, summary.skipped) == (2, 1, 2, 1, 1)
    assert (summary.total, summary.judged, summary.inconsistent) == (7, 5, 1)
    assert summary.order_consistency_rate == pytest.approx(4 / 5)
    assert summary.error_docs == {"e1": "game 2: APITimeoutError: Request timed out."}
    markdown = summary.to_markdown()
    assert "| sidecar better | 2 |" in markdown
    assert "| of which order-inconsistent | 1 |" in markdown
    assert "80.0%" in markdown
    assert "| e1 | game 2: APITimeoutError: Request timed out. |" in markdown
    assert "judge-test" in markdown and "tags-v1" in markdown
    assert "source study's numbers, not ours: on 100 CNN/DailyMail articles" in markdown
    assert "86 ties, the other 14 split 9-5" in markdown


def test_summary_of_nothing_has_no_rate() -> None:
    summary = summarize_judgements([])
    assert (summary.total, summary.order_consistency_rate) == (0, None)
    assert "n/a" in summary.to_markdown()


def test_tasks_the_judge_cannot_score_are_named_not_judged_beside_the_judged_ones() -> None:
    games = [game(1, "sidecar"), game(2, "sidecar")]
    judged = summarize_judgements([JudgeResult(doc_id="w1", games=games, verdict=final_verdict(games))],
                                  make_config())
    reason = "every document of its control sample (3) has the same sidecar output"
    markdown = judged.model_copy(update={"not_judged": {"headline": reason}}).to_markdown()
    assert f"Not judged: task headline is not judged: {reason}." in markdown
    # nothing judged and a task that cannot be: not judged, not UNRELIABLE
    alone = summarize_judgements([]).model_copy(update={"not_judged": {"headline": "no tags"}})
    assert alone.reliability_line() == "Not judged: task headline is not judged: no tags."
    assert "UNRELIABLE" not in alone.to_markdown() and alone.verdict_line() == "none, not judged"
    assert summarize_judgements([]).reliability_line().startswith("UNRELIABLE")


# --- configuration and secrets ----------------------------------------------------------------------


def test_unknown_prompt_version_is_rejected() -> None:
    with pytest.raises(ValidationError, match="prompt_version"):
        make_config(prompt_version="tags-v0")


@pytest.mark.parametrize("field", ["timeout_s", "backoff_base_s", "backoff_max_s", "likelihood_floor"])
@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_a_setting_that_is_not_finite_is_refused_naming_it(field: str, value: float) -> None:
    """A lone lower bound (``gt=0``, ``ge=0``) lets infinity through, and an infinite timeout waits for ever."""
    with pytest.raises(ValidationError, match=field):
        make_config(**{field: value})


def test_api_key_from_env_prefers_sidecar_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai")
    monkeypatch.setenv("SIDECAR_JUDGE_API_KEY", "sk-sidecar")
    assert make_config(api_key=None).resolved_api_key().get_secret_value() == "sk-sidecar"
    monkeypatch.delenv("SIDECAR_JUDGE_API_KEY")
    assert make_config(api_key=None).resolved_api_key().get_secret_value() == "sk-openai"
    assert make_config().resolved_api_key().get_secret_value() == API_KEY


def test_api_key_missing_everywhere_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in judge.API_KEY_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(JudgeConfigError, match="SIDECAR_JUDGE_API_KEY"):
        make_judge_client(make_config(api_key=None))


def test_api_key_never_appears_in_repr_logs_or_results(caplog: pytest.LogCaptureFixture) -> None:
    # A misbehaving endpoint echoes the key back in errors and in an answer.
    responses = iter(
        [
            httpx.Response(500, json={"error": {"message": f"upstream rejected key {API_KEY}"}}),
            completion(f"my key is {API_KEY}"),
            completion(verdict_json("A")),
            httpx.Response(401, json={"error": {"message": f"Incorrect API key provided: {API_KEY}"}}),
        ]
    )
    handler = CountingHandler(lambda _r: next(responses))
    config = make_config(api_key=API_KEY, retries=2)
    client = make_judge_client(config, http_client=httpx.Client(transport=httpx.MockTransport(handler)))

    with caplog.at_level(logging.DEBUG, logger="study.judge"):
        results = judge_pairs([item()], config, client)
    summary = summarize_judgements(results, config)

    assert handler.requests[0].headers["authorization"] == f"Bearer {API_KEY}"  # the key is really used
    assert results[0].games[1].error.startswith("AuthenticationError")
    assert "**********" in results[0].games[1].error
    assert "upstream rejected key" in caplog.text
    exposed = [
        repr(config),
        str(config),
        config.model_dump_json(),
        caplog.text,
        json.dumps([r.model_dump(mode="json") for r in results]),
        summary.model_dump_json(),
        summary.to_markdown(),
    ]
    for text in exposed:
        assert API_KEY not in text


# --- probability mode -------------------------------------------------------------------------------


def letters_completion(p_a: float, p_b: float, content: str = "A",
                       extra: list[tuple[str, float]] = ()) -> httpx.Response:
    """A completion whose one token has ``A`` and ``B`` (and ``extra``) among its top log probabilities."""
    top = [{"token": "A", "logprob": math.log(p_a)}, {"token": "B", "logprob": math.log(p_b)}]
    top += [{"token": token, "logprob": math.log(p)} for token, p in extra]
    token = {"token": content, "logprob": top[0]["logprob"] if content == "A" else top[1]["logprob"],
             "top_logprobs": top}
    body = {"id": "chatcmpl-test", "object": "chat.completion", "created": 0, "model": "judge-test",
            "choices": [{"index": 0, "finish_reason": "length", "logprobs": {"content": [token]},
                         "message": {"role": "assistant", "content": content}}]}
    return httpx.Response(200, json=body)


def probability_config(**overrides: object) -> JudgeConfig:
    return make_config(**({"prompt_version": "tags-p1", "controls": 20} | overrides))


def topical_items(count: int) -> list[JudgeItem]:
    """Documents whose summaries name their own sidecar tags, so a judge that reads can tell them apart."""
    topics = ["budget", "flood", "election", "vaccine", "strike", "harvest"]
    return [JudgeItem(doc_id=f"doc-{i}", summary=f"- A story about the {topics[i]} and the {topics[i]}s.",
                      sidecar_tags=[topics[i], f"{topics[i]}s"], standalone_tags=["news", "today"])
            for i in range(count)]


def topical_judge(noise: float = 0.0, first_bias: float = 0.1, step: float = 0.15) -> CountingHandler:
    """P(A) from how many of each set's tags the summary names (``step`` per tag), plus a pull towards the
    first position and ``noise`` that depends on the prompt only (the same prompt always gets the same answer)."""

    def respond(request: httpx.Request) -> httpx.Response:
        user = json.loads(request.content)["messages"][-1]["content"]
        summary = user.split("<<<", 1)[1].split(">>>", 1)[0]
        tags_a, tags_b = shown_tag_sets(request)
        named = sum(t in summary for t in tags_a) - sum(t in summary for t in tags_b)
        jitter = (zlib.crc32(user.encode()) % 1000 / 999 - 0.5) * 2 * noise
        p_a = min(0.99, max(0.01, 0.5 + step * named + first_bias + jitter))
        return letters_completion(p_a * 0.9, (1 - p_a) * 0.9)

    return CountingHandler(respond)


def test_a_judge_that_always_answers_a_prefers_nothing_and_its_run_is_unreliable() -> None:
    handler = CountingHandler(lambda _r: letters_completion(math.exp(-1e-4), math.exp(-9.5)))
    items = topical_items(5)

    results = judge_pairs(items, probability_config(), make_client(handler))

    assert all(r.preference == pytest.approx(0.5) for r in results)
    assert [r.verdict for r in results] == ["tie"] * 5
    assert all(r.foil_doc_id is not None and len(r.games_of("control")) == 2 for r in results)
    summary = summarize_judgements(results, probability_config())
    assert summary.control_accuracy == 0.0  # every control exactly even: none clears the margin
    assert summary.position_bias == pytest.approx(1.0, abs=1e-3)
    assert summary.reliable is False
    assert "UNRELIABLE" in summary.to_markdown() and "measure nothing" in summary.to_markdown()
    first = json.loads(handler.requests[0].content)
    assert (first["logprobs"], first["top_logprobs"], first["max_tokens"], first["temperature"]) == (True, 5, 1, 0)
    assert first["messages"][-1]["content"].endswith("Answer with one letter: A or B")


def test_a_judge_that_reads_the_tags_passes_its_controls_and_its_preference_is_debiased() -> None:
    items = topical_items(6)
    items[0] = items[0].model_copy(update={"standalone_tags": ["budget", "news"]})  # one tag named: still worse

    results = judge_pairs(items, probability_config(), make_client(topical_judge(first_bias=0.15)))

    summary = summarize_judgements(results, probability_config())
    assert summary.control_accuracy == 1.0 and summary.control_documents == 6 and summary.reliable
    assert summary.position_bias > 0.6  # the pull towards A is measured ...
    # ... and cancelled: the sidecar names two tags, the standalone none (one for doc-0): 0.5 + 0.15 * 2
    assert [r.preference for r in results] == pytest.approx([0.65] + [0.8] * 5)
    assert all(r.verdict == "sidecar" for r in results)
    assert summary.mean_preference == pytest.approx((0.65 + 5 * 0.8) / 6)
    low, high = summary.preference_ci
    assert low <= summary.mean_preference <= high
    assert summary.preference_ci == summarize_judgements(results, probability_config()).preference_ci  # seeded
    assert "Reliable (pairwise): controls cleared the margin 0.020 in 6 of 6 documents" in summary.to_markdown()
    # the foils are a derangement of the sample: nobody's own tags, each document's tags used once
    foils = {r.doc_id: r.foil_doc_id for r in results}
    assert all(doc != foil for doc, foil in foils.items()) and sorted(foils.values()) == sorted(foils)


def test_a_judge_whose_controls_sit_inside_the_margin_is_unreliable() -> None:
    """Every control favours the own tags, by 0.01: inside the run's margin of 0.02 (the floor), so no better
    than a tie. Counting any control above 0.5 as right called this judge reliable."""
    items = topical_items(6)

    results = judge_pairs(items, probability_config(), make_client(topical_judge(first_bias=0.1, step=0.005)))

    summary = summarize_judgements(results, probability_config())
    controls = [judge.preference(r.games_of("control")) for r in results]
    assert all(0.5 < c < 0.5 + summary.margin for c in controls) and summary.margin == pytest.approx(0.02)
    assert summary.control_documents == 6 and summary.control_accuracy == 0.0
    assert summary.reliable is False and summary.reliability.easy.mean == pytest.approx(0.01)
    assert summary.reliability.auc == 1.0  # the ranking is right; the separation is what is missing
    assert "UNRELIABLE (pairwise): controls cleared the margin 0.020 in 0 of 6 documents" in summary.to_markdown()


def test_hard_tags_replace_about_half_of_the_own_tags_in_place() -> None:
    assert judge.hard_tags(["a", "b", "c", "d", "e"], ["x", "b", "y", "z"]) == ["a", "x", "c", "y", "e"]
    assert judge.hard_tags(["a", "b"], ["b"]) is None  # no foil tag differs: nothing to replace
    assert judge.hard_tags(["a"], ["x"]) is None  # one tag: replacing it is the easy rung


def test_the_ladder_is_played_per_document_and_a_null_rung_that_does_not_tie_leaves_no_verdict() -> None:
    items = topical_items(6)
    trusted = summarize_judgements(judge_pairs(items, probability_config(), make_client(topical_judge())),
                                   probability_config())
    assert trusted.reliable and trusted.reliability.verdict == "sidecar"
    assert "Verdict of the run: the sidecar's tags are better (pairwise" in trusted.to_markdown()
    ladder = trusted.reliability
    # the hard rung: the own pair of named tags against one named and one foil tag: 0.5 + 0.15
    assert (ladder.hard.passed, ladder.hard.documents, ladder.hard.mean) == (6, 6, pytest.approx(0.15))
    assert (ladder.null.passed, ladder.null.documents) == (6, 6)

    # noise that depends on the prompt: the null games of reordered tags no longer tie
    results = judge_pairs(items, probability_config(), make_client(topical_judge(noise=0.2)))
    noisy = summarize_judgements(results, probability_config())
    assert noisy.reliability.null.share < 0.9 and not noisy.reliable
    assert noisy.reliability.verdict == "UNRELIABLE"
    assert "Verdict of the run: none, UNRELIABLE" in noisy.to_markdown()


def test_the_margin_is_calibrated_from_the_null_games_of_the_run() -> None:
    items = topical_items(6)
    margins = []
    for noise in (0.03, 0.2):
        results = judge_pairs(items, probability_config(), make_client(topical_judge(noise=noise)))
        summary = summarize_judgements(results, probability_config())
        nulls = [judge.preference(r.games_of("null")) for r in results]
        assert len(nulls) == 6 and all(n is not None for n in nulls)
        assert summary.margin == pytest.approx(max(0.02, *(abs(n - 0.5) for n in nulls)))
        margins.append(summary.margin)
    assert margins[0] < margins[1]
    assert margins[1] > 0.05


def test_a_preference_within_the_margin_is_a_tie() -> None:
    def game(number: int, p_first: float, kind: str = "main") -> GameResult:
        return GameResult(game=number, kind=kind, sidecar_position="A" if number == 1 else "B", raw_answer="A",
                          choice="A", winner=None, reason=None, error=None, attempts=1, latency_s=0.0,
                          p_a=p_first, p_b=1 - p_first)

    slightly = [game(1, 0.56), game(2, 0.5)]  # 0.53
    assert judge.preference(slightly) == pytest.approx(0.53)
    assert judge.preference_verdict(slightly, margin=0.05) == "tie"
    assert judge.preference_verdict(slightly, margin=0.02) == "sidecar"
    assert judge.preference_verdict([game(1, 0.2), game(2, 0.6)], margin=0.05) == "standalone"
    assert judge.calibrated_margin([0.5, 0.51, None], floor=0.02) == 0.02
    assert judge.calibrated_margin([0.44, 0.51], floor=0.02) == pytest.approx(0.06)


@pytest.mark.parametrize(("top", "expected"), [
    ([("A", 0.6), ("B", 0.3)], (0.6, 0.3)),
    ([(" A", 0.4), ("a", 0.1), (" b", 0.2), ("The", 0.3)], (0.5, 0.2)),
    ([("A", 0.7), ("Sure", 0.2)], (0.7, 0.0)),
])
def test_letter_probabilities_tolerate_spaces_and_case(top: list[tuple[str, float]],
                                                       expected: tuple[float, float]) -> None:
    reply = judge.answers.Reply("A", [{token: math.log(p) for token, p in top}])
    assert judge.letter_probabilities(reply) == pytest.approx(expected)


def test_letter_probabilities_read_the_first_position_that_holds_a_letter() -> None:
    reply = judge.answers.Reply("Answer: B", [{"Answer": math.log(0.9)}, {":": -0.1}, {" B": math.log(0.8)}])
    assert judge.letter_probabilities(reply) == pytest.approx((0.0, 0.8))
    with pytest.raises(JudgeAnswerError, match="no answer letter"):
        judge.letter_probabilities(judge.answers.Reply("x", [{"x": 0.0}]))


@pytest.mark.parametrize("logprob", [float("nan"), 1000.0, float("inf"), 0.5, -float("inf"), -1e308, -1e5],
                         ids=["nan", "1000", "inf", "0.5", "-inf", "-1e308", "-1e5"])
def test_a_malformed_log_probability_is_that_games_error_and_the_other_documents_are_judged(logprob: float) -> None:
    items = topical_items(3)
    reads = topical_judge()

    def respond(request: httpx.Request) -> httpx.Response:
        if items[1].summary not in json.loads(request.content)["messages"][-1]["content"]:
            return reads(request)
        body = json.loads(letters_completion(0.6, 0.3).content)
        token = body["choices"][0]["logprobs"]["content"][0]  # the letter A, chosen and first among the top
        token["logprob"] = token["top_logprobs"][0]["logprob"] = logprob
        return json_bytes(json.dumps(body).encode())  # json.dumps writes NaN and Infinity as Python reads them

    results = judge_pairs(items, probability_config(controls=0), make_client(CountingHandler(respond)))

    assert [r.verdict for r in results] == ["sidecar", "error", "sidecar"]
    bad = results[1].games
    assert all(g.p_a is None and g.p_b is None and g.raw_answer == "A" for g in bad)
    assert all(g.error.startswith("JudgeAnswerError") and "not a log probability" in g.error for g in bad)
    summary = summarize_judgements(results, probability_config(controls=0))
    assert (summary.wins, summary.errors) == (2, 1) and list(summary.error_docs) == ["doc-1"]


# --- retries change the request ---------------------------------------------------------------------


def request_knobs(request: httpx.Request) -> tuple:
    body = json.loads(request.content)
    return tuple(body.get(key) for key in ("max_tokens", "temperature", "seed", "top_logprobs"))


def test_text_retries_of_an_unparseable_answer_ask_for_more_tokens_then_sample_with_new_seeds() -> None:
    handler = always('{"winner": "A", "reas')  # cut mid-JSON, as a small budget cuts it

    results = judge_pairs([item()], make_config(retries=3, max_tokens=100), make_client(handler))

    assert results[0].verdict == "error"
    first_game = [request_knobs(r) for r in handler.requests[:4]]
    assert first_game == [(100, 0, None, None), (200, 0, None, None), (200, 0.7, 1, None), (200, 0.7, 2, None)]
    assert len(set(first_game)) == 4  # no retry repeats a request


def test_probability_retries_widen_the_alternatives_then_sample() -> None:
    no_letter = always("x")  # a reply without log probabilities

    results = judge_pairs([item()], probability_config(retries=2, controls=0), make_client(no_letter))

    assert results[0].verdict == "error" and "no log probabilities" in results[0].games[0].error
    assert [request_knobs(r) for r in no_letter.requests[:3]] == [(1, 0, None, 5), (8, 0, None, 20), (8, 0.7, 1, 20)]


def test_transport_failures_are_asked_again_unchanged() -> None:
    calls = iter(range(1_000))

    def respond(_request: httpx.Request) -> httpx.Response:
        if next(calls) == 0:
            return httpx.Response(503, json={"error": {"message": "busy"}})
        return completion(verdict_json("tie"))

    handler = CountingHandler(respond)
    judge_pairs([item()], make_config(), make_client(handler))
    assert request_knobs(handler.requests[0]) == request_knobs(handler.requests[1])


# --- which mode a run uses --------------------------------------------------------------------------


def test_an_endpoint_with_logprobs_keeps_the_probability_mode() -> None:
    handler = CountingHandler(lambda _r: letters_completion(0.6, 0.3))
    detection = judge.detect_prompt_version(item(), probability_config(), make_client(handler))
    assert detection.prompt_version == "tags-p1" and "Probability mode" in detection.note
    assert len(handler.requests) == 1


@pytest.mark.parametrize("respond", [
    pytest.param(lambda _r: completion('{"winner": "A"}'), id="no-logprobs-in-the-reply"),
    pytest.param(lambda _r: httpx.Response(400, json={"error": {"message": "logprobs are not supported"}}),
                 id="refused-400"),
    pytest.param(lambda _r: httpx.Response(422, json={"detail": "logprobs are not supported"}), id="refused-422"),
])
def test_an_endpoint_without_logprobs_falls_back_to_the_text_mode_and_says_so(respond: Handler) -> None:
    detection = judge.detect_prompt_version(item(), probability_config(), make_client(CountingHandler(respond)))
    assert detection.prompt_version == judge.TEXT_FALLBACK == "tags-v1"
    assert "text mode" in detection.note and "log probabilities" in detection.note


def test_a_probe_that_cannot_connect_decides_nothing_and_a_text_prompt_needs_no_probe() -> None:
    def respond(_request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    handler = CountingHandler(respond)
    detection = judge.detect_prompt_version(item(), probability_config(retries=1), make_client(handler))
    assert detection.prompt_version == "tags-p1" and "unconfirmed" in detection.note
    assert len(handler.requests) == 2
    silent = CountingHandler(follows_content)
    assert judge.detect_prompt_version(item(), make_config(), make_client(silent)).prompt_version == "tags-v1"
    assert silent.requests == []


# --- controls and statistics ------------------------------------------------------------------------


def test_control_foils_are_a_derangement_that_skips_identical_tags() -> None:
    docs = [("a", ["x", "y"]), ("b", ["y", "x"]), ("c", ["z"]), ("d", ["w"])]
    foils = judge.control_foils(docs, limit=20)
    assert {doc: foil.doc_id for doc, foil in foils.items()} == {"a": "c", "b": "c", "c": "d", "d": "a"}
    assert set(judge.control_foils(docs, limit=2)) == set()  # a and b have the same set: no control
    assert judge.control_foils(docs[:1], limit=20) == {}
    assert judge.null_tags(["x", "y"]) == ["y", "x"] and judge.null_tags(["x"]) is None


def test_any_tasks_output_is_reordered_for_its_null_game_only_where_reordering_changes_it() -> None:
    assert judge.null_tags("Storm hits coast; thousands flee, roads close") == (
        "roads close; thousands flee, Storm hits coast")
    assert judge.null_tags("Flood warning - river rises") == "river rises - Flood warning"
    assert list(judge.null_tags({"person": "Ann", "place": "Oslo"}).items()) == [("place", "Oslo"), ("person", "Ann")]
    # one part, one key, a number: nothing to reorder, no null game
    assert [judge.null_tags(value) for value in ("politics", "Council passes budget", {"a": 1}, 3)] == [None] * 4
    # reordered tags are the same tags; an object is the same whatever the order of its keys
    docs = [("a", {"k": 1, "j": 2}), ("b", {"j": 2, "k": 1}), ("c", "x")]
    assert {doc: foil.doc_id for doc, foil in judge.control_foils(docs, limit=20).items()} == {
        "a": "c", "b": "c", "c": "a"}
    assert judge.hard_tags("a, b", "c, d") is None  # the hard rung is for lists


def test_whether_a_task_can_be_judged_is_read_from_its_outputs() -> None:
    def items(outputs: list[object]) -> list[JudgeItem]:
        return [JudgeItem(doc_id=f"d{i}", summary="s", sidecar_tags=o, standalone_tags="x", task="t",
                          instruction="Name the topic.") for i, o in enumerate(outputs)]

    one_label = not_judged_reason(items(["politics"] * 4), controls=20)
    assert one_label is not None and one_label.startswith('every document of its control sample (4) has the same '
                                                          'sidecar output ("politics"), so there is no control')
    words = not_judged_reason(items(["politics", "sport", "politics"]), controls=20)
    assert words is not None and "the null rung" in words  # labels of one word: nothing measures the noise
    assert not_judged_reason(items(["politics, local", "sport, national"]), controls=20) is None
    assert not_judged_reason(items([None, "sport, local", "politics, local"]), controls=20) is None
    assert "nothing to compare" in (not_judged_reason(items([None, None]), controls=20) or "")
    assert not_judged_reason(items(["politics"] * 2), controls=0) is None  # no ladder asked for


def test_the_scorer_and_the_pairwise_judge_name_another_tasks_instruction() -> None:
    text, start = scorer_text("The flood.", "Flood, river", "tags-l1", "Write a headline.")
    assert text == "Summary:\nThe flood.\n\nWrite a headline.\nAnswer: Flood, river" and text[start:] == " Flood, river"
    assert scorer_text("The flood.", ["flood"], "tags-l1")[0].endswith("Hashtags: #flood")  # tags as before
    system, user = (m["content"] for m in judge.render_prompt("The flood.", "A", {"b": 1}, "tags-p1", "Write {x}."))
    assert "The instruction: Write {x}." in system and "Output A: \"A\"\nOutput B: {\"b\": 1}" in user


def test_text_mode_controls_count_both_games_for_the_own_tags() -> None:
    items = topical_items(3)

    def reads_tags(request: httpx.Request) -> httpx.Response:
        user = json.loads(request.content)["messages"][-1]["content"]
        tags_a, tags_b = shown_tag_sets(request)
        score = sum(t in user.split(">>>")[0] for t in tags_a) - sum(t in user.split(">>>")[0] for t in tags_b)
        return completion(verdict_json("A" if score > 0 else "B" if score < 0 else "tie"))

    results = judge_pairs(items, make_config(controls=20), make_client(CountingHandler(reads_tags)))
    summary = summarize_judgements(results, make_config(controls=20))
    assert (summary.mode, summary.control_documents, summary.control_accuracy, summary.reliable) == (
        "text", 3, 1.0, True)
    assert summary.margin is None and all(r.preference is None for r in results)
    # every rung is played in the text mode too; a judge that reads the tags calls each null game a tie
    assert all(len(r.games_of(kind)) == 2 for r in results for kind in ("control", "hard", "null"))
    ladder = summary.reliability
    assert (ladder.easy.passed, ladder.hard.passed, ladder.null.passed) == (3, 3, 3)

    always_a = judge_pairs(items, make_config(controls=20), make_client(always(verdict_json("A"))))
    summary = summarize_judgements(always_a, make_config(controls=20))
    # both games of a control must pick the own tags: a judge that always answers A clears none
    assert (summary.control_accuracy, summary.position_bias, summary.reliable) == (0.0, 1.0, False)


def test_bootstrap_interval_is_seeded_and_brackets_the_mean() -> None:
    values = [0.4, 0.45, 0.5, 0.55, 0.7, 0.52]
    interval = judge.bootstrap_ci(values, resamples=500, seed=3)
    assert interval == judge.bootstrap_ci(values, resamples=500, seed=3)
    assert interval[0] < sum(values) / len(values) < interval[1]
    assert interval != judge.bootstrap_ci(values, resamples=500, seed=4)
    assert judge.bootstrap_ci([0.5]) is None


HOSTILE_ANSWER_CHARS = 5 * 1024 * 1024


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param("x" * HOSTILE_ANSWER_CHARS, id="garbage"),
        pytest.param(json.dumps({"winner": "A", "reason": "r" * HOSTILE_ANSWER_CHARS}), id="verdict-with-huge-reason"),
    ],
)
def test_a_hostile_endpoints_huge_answers_are_stored_cut_and_say_so(answer: str, tmp_path) -> None:
    from flows.judge import judge_settings, judgement_records
    from storage import Database

    config = make_config(retries=0)
    results = judge_pairs([item()], config, make_client(always(answer)))
    assert all(g.reason is None or len(g.reason) < 20_000 for g in results[0].games)
    db = Database(tmp_path / "sidecar.duckdb")
    db.start_run("run", {}, pair="tiny", device="cpu", gpu_type=None, gamma=4, batch_size=1)
    db.write_judgements("run", judgement_records(results[0], config), judge_settings(config))

    stored = [row["raw_answer"] for row in db.query("SELECT raw_answer FROM judgement_games ORDER BY game")]
    assert len(stored) == 2
    for raw in stored:
        assert len(raw) < 20_000  # a few KB of the 5 MB
        kept = judge_games.MAX_ANSWER_CHARS
        assert raw[:kept] == answer[:kept]
        # the stored text says it was cut, and how long the answer was
        assert "cut" in raw[kept:] and f"{len(answer):,}" in raw[kept:]


def test_a_caller_that_cannot_take_a_result_stops_the_documents_still_queued() -> None:
    handler = always(verdict_json("tie"))

    def refuse(_result: JudgeResult) -> None:
        raise OSError("the database is gone")  # as a failed commit of the first judged document

    with pytest.raises(OSError, match="database is gone"):
        judge_pairs([item(f"doc-{i}") for i in range(6)], make_config(concurrency=1), make_client(handler), refuse)
    # the first document's two games, and nothing queued after it: one thread, so nothing else was started
    assert len(handler.requests) == 2
