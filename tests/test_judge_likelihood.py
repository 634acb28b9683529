"""The likelihood method, driven through the real openai client against an ``httpx.MockTransport`` endpoint
that answers the legacy completions route with the prompt's log probabilities (``echo``)."""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Callable

import httpx
import openai
import pytest

from study.judge import JudgeConfig, JudgeItem
from study.judge.answers import JudgeAnswerError
from study.judge.games import Redactor
from study.judge.likelihood import NoPromptLogprobsError, scorer_text, tag_likelihood
from study.judge.likelihood_run import (
    LikelihoodResult,
    TagScore,
    likelihood_reliability,
    score_documents,
    unavailable_reason,
)

BASE_URL = "http://judge.test/v1"
API_KEY = "sk-test-0123456789abcdef"
NAMED, UNNAMED, PROSE = -0.5, -3.0, -1.0
TOPICS = ["budget", "flood", "election", "vaccine", "strike", "harvest"]


def config(**overrides: object) -> JudgeConfig:
    return JudgeConfig.model_validate({"model": "judge-test", "base_url": BASE_URL, "api_key": API_KEY,
                                       "retries": 1, "backoff_base_s": 0.0, "controls": 20} | overrides)


class EchoEndpoint:
    """``/v1/completions`` with ``echo``: one token per word with its leading spaces; a token holding '#'
    gets log probability NAMED when its word appears in the prompt before the tags, else UNNAMED; every
    other token PROSE, the first None. Requests are kept, thread-safely."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self._lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        with self._lock:
            self.requests.append(body | {"path": request.url.path})
        prompt = body["prompt"]
        context = prompt.split(" #", 1)[0]
        tokens, logprobs, offsets = [], [], []
        for match in re.finditer(r"\s*\S+", prompt):
            token = match.group()
            word = token.strip().lstrip("#")
            logprobs.append(None if not tokens else
                            (NAMED if word in context else UNNAMED) if "#" in token else PROSE)
            tokens.append(token)
            offsets.append(match.start())
        choice = {"index": 0, "text": prompt, "finish_reason": "length",
                  "logprobs": {"tokens": tokens, "token_logprobs": logprobs, "text_offset": offsets,
                               "top_logprobs": None}}
        return httpx.Response(200, json={"id": "cmpl-test", "object": "text_completion", "created": 0,
                                         "model": body["model"], "choices": [choice]})


def client(handler) -> openai.OpenAI:
    return openai.OpenAI(base_url=BASE_URL, api_key=API_KEY, max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(handler)))


def topical_items(count: int) -> list[JudgeItem]:
    """Summaries that name their own sidecar tags; the standalone tags are named by none."""
    return [JudgeItem(doc_id=f"doc-{i}", summary=f"- A story about the {TOPICS[i]} and the {TOPICS[i]}s.",
                      sidecar_tags=[TOPICS[i], f"{TOPICS[i]}s"], standalone_tags=["news", "today"])
            for i in range(count)]


@pytest.mark.parametrize("version", ["tags-l1", "tags-l2"])
def test_a_tag_sets_likelihood_is_the_mean_over_the_tokens_from_where_the_tags_start(version: str) -> None:
    endpoint = EchoEndpoint()
    summary = "- The flood closed the river road."

    scored = tag_likelihood(client(endpoint), "pair/draft", summary, ["flood", "drought", "river"], version)

    # " #flood" and " #river" are named before the tags, " #drought" is not; no prose token is counted
    assert scored.tokens == 3 and scored.mean_logprob == pytest.approx((NAMED + UNNAMED + NAMED) / 3)
    [request] = endpoint.requests
    assert request["path"] == "/v1/completions"
    assert (request["model"], request["echo"], request["logprobs"], request["max_tokens"]) == (
        "pair/draft", True, 0, 0)
    text, start = scorer_text(summary, ["flood", "drought", "river"], version)
    assert request["prompt"] == text and text[start:] == " #flood #drought #river"


def test_pmi_compares_the_tags_after_the_own_summary_with_after_another_documents() -> None:
    """By hand, doc-0 (budget) against its baseline doc-1 (flood): its sidecar tags score NAMED after its own
    summary and UNNAMED after doc-1's, a PMI of 2.5; the standalone tags UNNAMED after both, 0."""
    endpoint = EchoEndpoint()
    items = topical_items(4)
    cfg = config()

    results = score_documents(items, cfg, client(endpoint), "judge-test", "tags-l2", Redactor([]))

    first = results[0]
    assert first.baseline_doc_id == "doc-1" and first.foil_doc_id == "doc-1"
    assert first.score("main", "sidecar").pmi == pytest.approx(NAMED - UNNAMED)
    assert first.score("main", "standalone").pmi == pytest.approx(0.0)
    assert first.difference("main") == pytest.approx(2.5) and first.verdict == "sidecar"
    # easy: doc-1's tags [flood, floods] are UNNAMED after doc-0's summary, NAMED after doc-1's: -2.5
    assert first.difference("control") == pytest.approx(2.5 - (UNNAMED - NAMED))
    # hard: [budget, flood]: mean (NAMED + UNNAMED) / 2 after either summary, a PMI of 0
    assert first.score("hard", "mixed").tags == ["budget", "flood"]
    assert first.difference("hard") == pytest.approx(2.5)
    assert first.difference("null") == pytest.approx(0.0)  # the same tokens reversed
    # every distinct (summary, tag set) is asked once: 5 tag sets after 2 summaries
    assert len(endpoint.requests) == 4 * 10
    assert all(r["model"] == "judge-test" for r in endpoint.requests)

    ladder = likelihood_reliability(results, cfg)
    assert ladder.trusted and ladder.verdict == "sidecar" and ladder.margin == cfg.likelihood_floor
    assert (ladder.easy.passed, ladder.hard.passed, ladder.null.passed) == (4, 4, 4)
    assert ladder.auc == 1.0 and ladder.easy.mean == pytest.approx(5.0)


def test_a_scorer_that_cannot_tell_the_summaries_apart_is_unreliable() -> None:
    """Log probabilities that ignore the summary: every PMI is 0, every control inside the margin."""
    def blind(request: httpx.Request) -> httpx.Response:
        response = EchoEndpoint()(request)
        body = response.json()
        logprobs = body["choices"][0]["logprobs"]
        logprobs["token_logprobs"] = [None] + [PROSE] * (len(logprobs["tokens"]) - 1)
        return httpx.Response(200, json=body)

    results = score_documents(topical_items(4), config(), client(blind), "judge-test", "tags-l1", Redactor([]))

    ladder = likelihood_reliability(results, config())
    assert (ladder.easy.passed, ladder.null.passed) == (0, 4) and not ladder.trusted
    assert ladder.verdict == "UNRELIABLE" and all(r.verdict == "tie" for r in results)


@pytest.mark.parametrize("respond", [
    pytest.param(lambda _r: httpx.Response(404, json={"error": {"message": "Not Found"}}), id="no-route"),
    pytest.param(lambda _r: httpx.Response(400, json={"error": {"message": "echo is not supported"}}), id="refused"),
    pytest.param(lambda _r: httpx.Response(200, json={
        "id": "c", "object": "text_completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "text": "", "finish_reason": "length", "logprobs": None}]}), id="no-logprobs"),
])
def test_an_endpoint_without_prompt_logprobs_makes_the_method_unavailable_with_its_reason(respond) -> None:
    items = topical_items(2)
    with pytest.raises(NoPromptLogprobsError):
        tag_likelihood(client(respond), "m", items[0].summary, ["a"], "tags-l1")

    reason = unavailable_reason(items[0], config(), client(respond), "m", "tags-l1", Redactor([API_KEY]))

    assert reason and ("HTTP" in reason or "no log probabilities" in reason) and API_KEY not in reason


def test_an_endpoint_that_scores_answers_the_probe() -> None:
    assert unavailable_reason(topical_items(1)[0], config(), client(EchoEndpoint()), "m", "tags-l1",
                              Redactor([])) is None


def test_a_malformed_reply_is_that_scores_error_and_the_other_scores_stand() -> None:
    def offsets_short(request: httpx.Request) -> httpx.Response:
        body = EchoEndpoint()(request).json()
        if "today" in json.loads(request.content)["prompt"]:
            body["choices"][0]["logprobs"]["text_offset"].pop()
        return httpx.Response(200, json=body)

    with pytest.raises(JudgeAnswerError, match="differ in length"):
        tag_likelihood(client(offsets_short), "m", "- text", ["today"], "tags-l1")
    [result, _] = score_documents(topical_items(2), config(), client(offsets_short), "m", "tags-l1", Redactor([]))
    assert "differ in length" in result.score("main", "standalone").error
    assert result.score("main", "sidecar").pmi == pytest.approx(2.5) and result.verdict == "error"


def test_the_scorers_are_every_prompt_with_the_judge_and_the_second_model() -> None:
    assert config().scorers == [("judge-test", "tags-l1"), ("judge-test", "tags-l2")]
    assert config(likelihood_model="pair/draft", likelihood_prompts=("tags-l2",)).scorers == [
        ("judge-test", "tags-l2"), ("pair/draft", "tags-l2")]
    with pytest.raises(ValueError, match="unknown likelihood_prompts"):
        config(likelihood_prompts=("nope",))


def test_a_caller_that_cannot_take_a_result_stops_the_documents_still_queued() -> None:
    endpoint = EchoEndpoint()

    def refuse(_result) -> None:
        raise OSError("the database is gone")  # as a failed commit of the first scored document

    with pytest.raises(OSError, match="database is gone"):
        score_documents(topical_items(6), config(concurrency=1, controls=0), client(endpoint), "m", "tags-l1",
                        Redactor([]), refuse)
    assert len(endpoint.requests) == 4  # the first document's two tag sets after two summaries, nothing after


def ladder_results(null_differences: list[float], easy: float = 3.0) -> list[LikelihoodResult]:
    """One result per null difference: own tags ``easy`` nats per token above the foil's, sides tied."""
    def scores(kind: str, sides: tuple[str, str], difference: float) -> list[TagScore]:
        return [TagScore(kind=kind, side=sides[0], tags=["a"], given_own=difference, given_baseline=0.0),
                TagScore(kind=kind, side=sides[1], tags=["b"], given_own=0.0, given_baseline=0.0)]

    return [LikelihoodResult(doc_id=f"doc-{i}", verdict="tie", scores=[
        *scores("main", ("sidecar", "standalone"), 0.0), *scores("control", ("own", "other"), easy),
        *scores("null", ("original", "reversed"), null)]) for i, null in enumerate(null_differences)]


def test_the_null_rung_ties_within_twice_its_own_noise_and_fails_on_documents_outside_it() -> None:
    # reordering moves a likelihood by up to half a nat per token on real news: a noise every document shares
    shared = ladder_results([0.5, -0.4, 0.3, -0.5, 0.45, -0.35, 0.2, -0.3, 0.4, -0.25])
    ladder = likelihood_reliability(shared, config())
    rms = (sum(d * d for d in [0.5, -0.4, 0.3, -0.5, 0.45, -0.35, 0.2, -0.3, 0.4, -0.25]) / 10) ** 0.5
    assert ladder.margin == pytest.approx(2 * rms) and ladder.null_band == ladder.margin
    assert (ladder.easy.passed, ladder.null.passed) == (10, 10) and ladder.trusted
    # two documents whose order moves their likelihood far beyond the others': the null rung fails (8 of 10)
    outliers = likelihood_reliability(ladder_results([0.01] * 8 + [2.0, -2.0]), config())
    assert outliers.null.passed == 8 and not outliers.trusted and outliers.verdict == "UNRELIABLE"
    assert "UNRELIABLE" in outliers.line() and f"null within {outliers.margin:.3f}" in outliers.line()
    # noise as large as the controls' separation: the easy rung cannot clear the margin it sets
    noisy = likelihood_reliability(ladder_results([2.0, -2.0] * 5, easy=3.0), config())
    assert noisy.easy.passed == 0 and not noisy.trusted


def logprob_at(value: float, where: str) -> Callable[[httpx.Request], httpx.Response]:
    """The echo endpoint with ``value`` as the log probability of the first tag token (``where`` "tag") or of
    the first prompt token after the first (``where`` "prompt"); json writes NaN and Infinity as Python reads
    them."""
    def respond(request: httpx.Request) -> httpx.Response:
        body = EchoEndpoint()(request).json()
        logprobs = body["choices"][0]["logprobs"]
        index = next(i for i, t in enumerate(logprobs["tokens"]) if "#" in t) if where == "tag" else 1
        logprobs["token_logprobs"][index] = value
        return httpx.Response(200, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    return respond


@pytest.mark.parametrize("where", ["tag", "prompt"])
@pytest.mark.parametrize("value", [-math.inf, math.inf, math.nan, -1e308, -1e5, 0.5, 1e308],
                         ids=["-inf", "inf", "nan", "-1e308", "-1e5", "0.5", "1e308"])
def test_a_log_probability_that_is_not_finite_or_not_in_minus_1e4_to_0_is_refused_naming_its_field(
        value: float, where: str) -> None:
    with pytest.raises(JudgeAnswerError, match=r"token_logprobs\.\d+: .*a log probability must"):
        tag_likelihood(client(logprob_at(value, where)), "m", "- The flood.", ["flood", "river"], "tags-l1")


def test_the_floor_of_a_log_probability_is_minus_1e4_and_an_endpoints_floor_of_minus_9999_is_read() -> None:
    scored = tag_likelihood(client(logprob_at(-9999.0, "tag")), "m", "- The flood.", ["flood"], "tags-l1")
    assert scored.mean_logprob == -9999.0


def test_huge_log_probabilities_fail_their_scores_only_and_the_pass_goes_on() -> None:
    """Two tag tokens of -1e308 overflowed ``math.fsum`` and crashed the pass; now they are that score's error."""
    items = topical_items(3)

    def huge_for_today(request: httpx.Request) -> httpx.Response:
        body = EchoEndpoint()(request).json()
        if "today" in json.loads(request.content)["prompt"] and items[1].summary in json.loads(request.content)[
                "prompt"]:
            logprobs = body["choices"][0]["logprobs"]
            logprobs["token_logprobs"] = [lp if lp is None or "#" not in t else -1e308
                                          for t, lp in zip(logprobs["tokens"], logprobs["token_logprobs"],
                                                           strict=True)]
        return httpx.Response(200, json=body)

    results = score_documents(items, config(), client(huge_for_today), "m", "tags-l1", Redactor([]))
    # doc-1's summary is doc-0's baseline too: both standalone scores fail, the rest stand
    assert [r.verdict for r in results] == ["error", "error", "sidecar"]
    assert all("a log probability must" in r.score("main", "standalone").error for r in results[:2])
    assert all(r.score("main", "sidecar").pmi == pytest.approx(2.5) for r in results)
