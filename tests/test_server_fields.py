"""Every OpenAI request field of the chat and completions routes is honoured or refused by name, never ignored
(#41): a real ``sidecar serve`` on the tiny pair, answers compared with HF ``generate`` on the tiny target."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from decoding import target_alone
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from server.launcher import running_server
from server.schema import ChatCompletionRequest, CompletionRequest, OutputConstraint
from sidecar.tasks.prompts import chat_prompt

KEY = "sk-test-fields-key"
PROMPT = "The city council approved a new budget on Tuesday."
MAX_TOKENS = 12
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with running_server("tiny", api_key=KEY, batch_wait_ms=0, extra_args=["--dtype", "fp32"],
                        startup_timeout_s=300) as url:
        yield url


def post(base_url: str, route: str, fields: dict) -> httpx.Response:
    base = ({"messages": [{"role": "user", "content": PROMPT}]} if route == "chat/completions"
            else {"prompt": PROMPT})
    body = {"model": "tiny", "temperature": 0, "max_tokens": MAX_TOKENS, **base, **fields}
    return httpx.post(f"{base_url}/{route}", content=json.dumps(body), timeout=60,
                      headers={"content-type": "application/json", "Authorization": f"Bearer {KEY}"})


def expected_text(tiny, route: str) -> str:
    """The target's greedy answer by HF ``generate``: to the templated chat, or to the raw prompt."""
    tok = tiny.tokenizer
    prompt = (chat_prompt(tok, [{"role": "user", "content": PROMPT}]) if route == "chat/completions"
              else tok.encode(PROMPT, add_special_tokens=False))
    return tok.decode(target_alone(tiny, prompt, MAX_TOKENS), skip_special_tokens=True)


def test_every_field_of_the_openai_client_is_declared() -> None:
    """A field the client can send is declared, so that it is honoured or refused by name: a new field in a
    newer client fails here until it is classified (the server refuses it as unknown meanwhile)."""
    chat = set(chat_params.CompletionCreateParamsBase.__annotations__) | {"stream"}
    legacy = set(completion_params.CompletionCreateParamsBase.__annotations__) | {"stream"}
    assert chat - set(ChatCompletionRequest.model_fields) == set()
    assert legacy - set(CompletionRequest.model_fields) == set()


# fields that cannot change the answer, or values that ask for what the server does anyway
ACCEPTED_CHAT = [
    {"user": "u-1"}, {"metadata": {"team": "news"}}, {"service_tier": "auto"}, {"prompt_cache_key": "k"},
    {"prompt_cache_options": {"mode": "implicit"}}, {"prompt_cache_retention": "24h"}, {"safety_identifier": "s"},
    {"parallel_tool_calls": True}, {"store": False}, {"tool_choice": "none"}, {"modalities": ["text"]},
    {"frequency_penalty": 0}, {"presence_penalty": 0.0}, {"logit_bias": {}}, {"n": 1},
    {"response_format": {"type": "text"}}, {"max_completion_tokens": MAX_TOKENS},
]
ACCEPTED_COMPLETIONS = [
    {"user": "u-1"}, {"best_of": 1}, {"n": 1}, {"frequency_penalty": 0}, {"logit_bias": {}}, {"suffix": ""},
    {"response_format": {"type": "text"}},
]


@pytest.mark.parametrize(("route", "fields"), [("chat/completions", f) for f in ACCEPTED_CHAT]
                         + [("completions", f) for f in ACCEPTED_COMPLETIONS], ids=lambda x: str(x)[:40])
def test_accepted_fields_leave_the_answer_the_targets(base_url: str, tiny, route: str, fields: dict) -> None:
    response = post(base_url, route, fields)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    text = choice["message"]["content"] if route == "chat/completions" else choice["text"]
    assert text == expected_text(tiny, route)


REFUSED_CHAT = [
    ({"n": 2}, "n"), ({"frequency_penalty": 0.5}, "frequency_penalty"), ({"presence_penalty": -1}, "presence_penalty"),
    ({"logit_bias": {"5": 10}}, "logit_bias"), ({"store": True}, "store"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"), ({"tool_choice": "auto"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"), ({"function_call": "auto"}, "function_call"),
    ({"modalities": ["text", "audio"]}, "modalities"), ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"verbosity": "low"}, "verbosity"), ({"web_search_options": {}}, "web_search_options"),
    ({"moderation": {"policy": {"output": {"mode": "block"}}}}, "moderation"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
    ({"messages": [{"role": "user", "content": PROMPT, "name": "ann"}]}, "messages.0.name"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "tool_calls": [{}]}]},
     "messages.1.tool_calls"),
    # unknown fields, vLLM's among them, are refused by their own name
    ({"top_k": 5}, "top_k"), ({"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
    ({"messages": [{"role": "user", "content": PROMPT, "weight": 1}]}, "messages.0.weight"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
]
REFUSED_COMPLETIONS = [
    ({"best_of": 2}, "best_of"), ({"n": 3}, "n"), ({"suffix": "end"}, "suffix"), ({"stream": True}, "stream"),
    ({"presence_penalty": 0.3}, "presence_penalty"), ({"logit_bias": {"5": -100}}, "logit_bias"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"top_k": 5}, "top_k"),
]


@pytest.mark.parametrize(("route", "fields", "param"), [("chat/completions", *r) for r in REFUSED_CHAT]
                         + [("completions", *r) for r in REFUSED_COMPLETIONS], ids=lambda x: str(x)[:40])
def test_unsupported_fields_are_400_naming_them(base_url: str, route: str, fields: dict, param: str) -> None:
    response = post(base_url, route, fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert param.rsplit(".", 1)[-1] in error["message"]


def test_two_constraints_are_400_naming_the_second(base_url: str) -> None:
    response = post(base_url, "chat/completions", {"guided_choice": ["a"], "guided_regex": "a"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "guided_regex"
    assert "one output constraint" in response.json()["error"]["message"]


def test_a_malformed_response_format_is_400_naming_it(base_url: str) -> None:
    for fields in ({"response_format": {"type": "yaml"}}, {"response_format": {"type": "json_schema"}},
                   {"guided_json": "{not json"}, {"guided_choice": []}):
        response = post(base_url, "chat/completions", fields)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"].split(".")[0] == next(iter(fields))


def test_constraints_parse_into_one_typed_constraint() -> None:
    """The constraint the engine enforces, whichever field spelled it (tests/test_server_constraints.py)."""

    def parsed(fields: dict) -> OutputConstraint | None:
        return ChatCompletionRequest.model_validate(
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}).constraint

    assert parsed({}) is None and parsed({"response_format": {"type": "text"}}) is None
    assert parsed({"response_format": {"type": "json_object"}}) == OutputConstraint(
        "response_format", json_schema={"type": "object"})
    schema_path = "response_format.json_schema.schema"
    assert parsed({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}}) \
        == OutputConstraint("response_format", json_schema=SCHEMA, lenient=True, path=schema_path)
    assert parsed({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA,
                                                                              "strict": True}}}) \
        == OutputConstraint("response_format", json_schema=SCHEMA, path=schema_path)
    assert parsed({"guided_json": json.dumps(SCHEMA)}) == OutputConstraint("guided_json", json_schema=SCHEMA)
    assert parsed({"guided_choice": ["a", "b"]}) == OutputConstraint("guided_choice", choices=("a", "b"))
    assert parsed({"guided_regex": "a+"}) == OutputConstraint("guided_regex", regex="a+")
