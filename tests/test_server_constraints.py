"""Output constraints over HTTP (#41 item 4): ``response_format`` (``json_object``, ``json_schema``) and vLLM's
``guided_choice``/``guided_regex``/``guided_json`` constrain the main output, a sidecar spec's ``choices``/
``regex``/``json_schema`` its sidecar. A real ``sidecar serve`` on the tiny pair: greedy constrained output
equals the tiny target's own constrained greedy decoding (``decoding.constrained_greedy``), and parses."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
import regex
from decoding import constrained_greedy
from serving import serving

from server.app import create_app
from server.config import ServerConfig
from server.launcher import running_server
from sidecar.decoding import constraints
from sidecar.decoding.constraints import constraint_from, json_schema_constraint, token_space
from sidecar.models.tiny import tiny_pair
from sidecar.tasks.engine import SidecarEngine
from sidecar.tasks.prompts import chat_prompt

KEY = "sk-test-constraints-key"
PROMPT = "The city council approved a new budget on Tuesday."
LIMIT = 48
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
        "required": ["city", "year"], "additionalProperties": False}
CHOICES = ["sport", "politics", "science", "business"]
PATTERN = r"[0-9]{3}-[a-z]{2,5}"

# (request fields, the engine's constraint the output must equal constrained target-only decoding under)
CASES = {
    "guided_choice": ({"guided_choice": CHOICES}, constraint_from(choices=CHOICES)),
    "guided_regex": ({"guided_regex": PATTERN}, constraint_from(pattern=PATTERN)),
    "guided_json": ({"guided_json": CITY}, constraint_from(json_schema=CITY)),
    "guided_json text": ({"guided_json": json.dumps(CITY)}, constraint_from(json_schema=CITY)),
    "json_schema strict": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "city", "schema": CITY, "strict": True}}}, constraint_from(json_schema=CITY)),
    "json_schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}},
                    json_schema_constraint(CITY, lenient=True)),
    "json_object": ({"response_format": {"type": "json_object"}}, constraint_from(json_schema={"type": "object"})),
}


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with running_server("tiny", api_key=KEY, batch_wait_ms=0, extra_args=["--dtype", "fp32"],
                        startup_timeout_s=300) as url:
        yield url


def post(base_url: str, route: str, fields: dict, **body: object) -> httpx.Response:
    base = ({"messages": [{"role": "user", "content": PROMPT}]} if route == "chat/completions"
            else {"prompt": PROMPT})
    payload = {"model": "tiny", "temperature": 0, "max_tokens": LIMIT, **base, **fields, **body}
    return httpx.post(f"{base_url}/{route}", content=json.dumps(payload), timeout=120,
                      headers={"content-type": "application/json", "Authorization": f"Bearer {KEY}"})


def space(pair):
    return token_space(pair.tokenizer, pair.target.get_output_embeddings().out_features, pair.eos_token_ids)


def expected(tiny, route: str, constraint) -> tuple[str, bool]:
    """(the tiny target's constrained greedy output, by whole recomputes and a mask before each choice, as
    text; whether it ended within ``LIMIT``)."""
    tok = tiny.tokenizer
    prompt = (chat_prompt(tok, [{"role": "user", "content": PROMPT}]) if route == "chat/completions"
              else tok.encode(PROMPT, add_special_tokens=False))
    tokens = constrained_greedy(tiny.target, space(tiny), constraint, prompt, LIMIT)
    return tok.decode(tokens, skip_special_tokens=True), tokens[-1] in tiny.eos_token_ids


def parses(text: str, fields: dict) -> None:
    if "guided_choice" in fields:
        assert text in fields["guided_choice"]
    elif "guided_regex" in fields:
        assert regex.fullmatch(fields["guided_regex"], text), text
    else:
        value = json.loads(text)
        fmt = fields.get("response_format", {})
        schema = {"type": "object"} if fmt.get("type") == "json_object" else CITY
        jsonschema.validate(value, schema)


@pytest.mark.parametrize("route", ["chat/completions", "completions"])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_constrained_output_is_the_targets_and_parses(base_url: str, tiny, route: str, case: str) -> None:
    fields, constraint = CASES[case]
    response = post(base_url, route, fields)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    text = choice["message"]["content"] if route == "chat/completions" else choice["text"]
    reference, ended = expected(tiny, route, constraint)
    assert text == reference and choice["finish_reason"] == ("stop" if ended else "length")
    if case == "json_object":  # any object: the tiny model's random text fills one to the limit
        assert text.startswith("{")
        return
    assert ended, "the reference ran out of tokens: raise LIMIT"
    parses(text, fields)


def test_a_constrained_stream_is_the_whole_answer(base_url: str) -> None:
    fields = CASES["guided_json"][0]
    whole = post(base_url, "chat/completions", fields).json()["choices"][0]["message"]["content"]
    pieces, finishes = [], []
    with httpx.stream("POST", f"{base_url}/chat/completions", timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", "temperature": 0, "max_tokens": LIMIT, "stream": True, **fields,
                            "messages": [{"role": "user", "content": PROMPT}]}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    pieces.append(choice["delta"].get("content") or "")
                    finishes.append(choice["finish_reason"])
    assert "".join(pieces) == whole and finishes[-1] == "stop"
    parses(whole, fields)


def test_sampled_constrained_outputs_parse(base_url: str) -> None:
    for seed in range(4):
        for fields, _ in CASES.values():
            response = post(base_url, "chat/completions", fields, temperature=1.0, seed=seed)
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            if choice["finish_reason"] == "stop":  # a sampled string may run to the limit
                parses(choice["message"]["content"], fields)


@pytest.mark.parametrize(("fields", "param"), [
    ({"guided_regex": "(?<=a)b"}, "guided_regex"),  # look-behind: no automaton enforces it
    ({"guided_regex": "("}, "guided_regex"),
    ({"guided_json": {"type": "nope"}}, "guided_json"),
    ({"guided_json": {"type": "string", "format": "no-such-format"}}, "guided_json"),
    ({"guided_choice": ["a", "a"]}, "guided_choice"),
    ({"guided_choice": [""]}, "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
     "response_format.json_schema.schema"),
    # strict: a keyword the engine cannot enforce is refused, not dropped
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "string", "format": "no-such-format"}}}},
     "response_format.json_schema.schema"),
])
@pytest.mark.parametrize("route", ["chat/completions", "completions"])
def test_a_constraint_that_cannot_be_enforced_is_400_naming_its_field(base_url: str, route: str, fields: dict,
                                                                       param: str) -> None:
    response = post(base_url, route, fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error


def test_a_non_strict_schema_leaves_what_cannot_be_enforced(base_url: str) -> None:
    """OpenAI's strict false (or absent): the schema guides the output; an unknown format is not enforced."""
    schema = {"type": "string", "format": "no-such-format", "maxLength": 6}
    response = post(base_url, "chat/completions", {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert response.status_code == 200, response.text
    assert isinstance(json.loads(response.json()["choices"][0]["message"]["content"]), str)


def test_sidecars_take_constraints_and_their_outputs_parse(base_url: str) -> None:
    sidecars = [
        {"name": "topic", "instruction": "Then name the topic.", "choices": CHOICES, "max_tokens": 8},
        {"name": "code", "instruction": "Then give a code.", "regex": PATTERN, "max_tokens": 16},
        {"name": "place", "instruction": "Then give the place as JSON.", "json_schema": CITY, "max_tokens": 40},
        {"name": "free", "instruction": "Then say anything.", "max_tokens": 8},
    ]
    response = post(base_url, "chat/completions", {"guided_choice": ["yes", "no"]}, max_tokens=8,
                    sidecars=sidecars)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["message"]["content"] in ("yes", "no")
    out = body["sidecars"]
    assert out["topic"]["parse_error"] is None and out["topic"]["parsed"] in CHOICES
    assert out["code"]["parse_error"] is None and regex.fullmatch(PATTERN, out["code"]["parsed"])
    assert out["place"]["parse_error"] is None and out["place"]["parsed"] == json.loads(out["place"]["text"])
    jsonschema.validate(out["place"]["parsed"], CITY)


@pytest.mark.parametrize(("spec", "param"), [
    ({"regex": "(?<=a)b"}, "sidecars.0.regex"), ({"json_schema": {"type": 3}}, "sidecars.0.json_schema"),
    ({"choices": []}, "sidecars.0.choices"),
])
def test_a_sidecar_s_bad_constraint_is_400_naming_it(base_url: str, spec: dict, param: str) -> None:
    sidecars = [{"name": "s", "instruction": "Then say it.", **spec}]
    response = post(base_url, "chat/completions", {}, sidecars=sidecars)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.servers
def test_the_token_space_is_built_at_startup() -> None:
    """Before the first request: built by it instead, it would stall the batch (2-6 s for Qwen)."""
    pair = tiny_pair()
    pair = dataclasses.replace(pair, tokenizer=copy.deepcopy(pair.tokenizer))  # one no earlier test has wrapped
    app = create_app(SidecarEngine(pair), ServerConfig(model_name="tiny"))
    assert pair.tokenizer not in constraints._SPACES
    with serving(app) as (url, _):
        built = dict(constraints._SPACES[pair.tokenizer])
        assert list(built) == [(pair.target.get_output_embeddings().out_features, tuple(sorted(pair.eos_token_ids)))]
        response = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "tiny", "temperature": 0, "max_tokens": 8, "guided_choice": ["yes", "no"],
            "messages": [{"role": "user", "content": PROMPT}]})
        assert response.status_code == 200, response.text
        # the request's rows used the space built at startup: no other was made
        assert constraints._SPACES[pair.tokenizer] == built
