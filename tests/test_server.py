"""The OpenAI-compatible server on the tiny pair, through the real openai client and a real uvicorn on loopback."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import logging
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import httpx
import openai
import pytest
import torch
import uvicorn
from decoding import target_alone, target_alone_scored
from serving import serving
from typer.testing import CliRunner

from cli.main import app as cli_app
from server.app import create_app
from server.config import API_KEY_ENV, ServerConfig
from server.launcher import free_port, running_server
from server.service import ChatService
from server.stream import TextStream, full_text
from sidecar import HASHTAGS, SidecarEngine, SidecarRequest
from sidecar.decoding.acceptance import warp
from sidecar.errors import InputError
from sidecar.tasks.batch import SidecarBatch
from sidecar.tasks.prompts import encode, turn_bridge
from sidecar.tasks.task import SidecarTask

KEY = "sk-test-server-key"
MAX_BODY = 65536
BENCH = Path(__file__).resolve().parents[1] / "bench" / "server_load.py"
PROMPTS = [
    "The city council approved a new budget on Tuesday.",
    "Officials said the plan would add jobs at the plant.",
    "The president met leaders in Berlin, Moscow and Doha.",
    "Prices rose 3.5 percent in 2017.",
    "Public health experts warned about the new rules.",
    "Roads in the north of the state will be repaired.",
    "The team won its third game in a row.",
    "Leaders signed an agreement on climate and technology.",
    "1,200 workers lost their jobs at the factory.",
    "You are a concise assistant.",
]
TAGS_SPEC = {"name": "hashtags", "instruction": HASHTAGS.instruction, "max_tokens": 8, "parser": "hashtags"}


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    # A wide admission window, so that concurrent test requests reliably join the idle batch together.
    with running_server("tiny", api_key=KEY, max_batch=8, batch_wait_ms=50,
                        extra_args=["--max-body-bytes", str(MAX_BODY), "--dtype", "fp32"],
                        startup_timeout_s=300) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=120)


def ask(client: openai.OpenAI, prompt: str, **kwargs: object) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                          temperature=0, **kwargs)


def ask_streamed(client: openai.OpenAI, prompt: str, **kwargs: object) -> tuple[str, list]:
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], temperature=0, stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def post(base_url: str, body: bytes | dict, key: str | None = KEY, **kwargs: object) -> httpx.Response:
    headers = {"content-type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    content = json.dumps(body).encode() if isinstance(body, dict) else body
    return httpx.post(base_url + "/chat/completions", content=content, headers=headers, timeout=60, **kwargs)


def chat_prompt_ids(tiny, prompt: str) -> list[int]:
    tok = tiny.tokenizer
    rendered = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=False)
    return tok.encode(rendered, add_special_tokens=False)


def expected_greedy(tiny, prompt: str, max_tokens: int, stop: list[str] | None = None) -> tuple[str, str]:
    """(text, finish_reason) the server owes: the target's greedy answer to the chat prompt by HF ``generate``
    (not by the engine under test), cut before the first stop string it contains."""
    tokens = target_alone(tiny, chat_prompt_ids(tiny, prompt), max_tokens)
    text = tiny.tokenizer.decode(tokens, skip_special_tokens=True)
    cuts = [text.find(s) for s in stop or () if s in text]
    if cuts:
        return text[: min(cuts)], "stop"
    return text, "stop" if tokens and tokens[-1] in tiny.eos_token_ids else "length"


def stats(base_url: str, key: str | None = KEY) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.get(base_url.removesuffix("/v1") + "/stats", headers=headers)
    response.raise_for_status()
    return response.json()


# -- the happy paths --


def test_health_and_models(base_url: str, client: openai.OpenAI) -> None:
    health = httpx.get(base_url.removesuffix("/v1") + "/health")  # no key needed
    assert health.status_code == 200 and health.json()["model"] == "tiny"
    assert [m.id for m in client.models.list()] == ["tiny", "tiny/draft"]  # the draft scores prompts


def test_greedy_chat_is_the_targets_answer(client: openai.OpenAI, tiny) -> None:
    for prompt, max_tokens in [(PROMPTS[0], 40), (PROMPTS[2], 7)]:
        response = ask(client, prompt, max_tokens=max_tokens)
        text, finish = expected_greedy(tiny, prompt, max_tokens)
        assert response.choices[0].message.content == text
        assert response.choices[0].finish_reason == finish
        usage = response.usage
        assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= max_tokens
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        extra = usage.model_extra
        assert 0 <= extra["accepted_tokens"] <= extra["drafted_tokens"]


def test_streamed_text_equals_non_streamed_text(client: openai.OpenAI) -> None:
    for prompt in PROMPTS[:4]:
        whole = ask(client, prompt, max_tokens=48)
        text, chunks = ask_streamed(client, prompt, max_tokens=48, stream_options={"include_usage": True})
        assert text == whole.choices[0].message.content
        assert chunks[0].choices[0].delta.role == "assistant"
        assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
        finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finals == [whole.choices[0].finish_reason]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_string_cuts_streamed_and_plain_alike(client: openai.OpenAI, tiny) -> None:
    full = ask(client, PROMPTS[1], max_tokens=40).choices[0].message.content
    # two plain characters from the middle of the answer (the random tiny pair also emits broken bytes)
    stop = next(full[i : i + 2] for i in range(3, len(full) - 1) if "\ufffd" not in full[i : i + 2])
    expected = full[: full.find(stop)]
    response = ask(client, PROMPTS[1], max_tokens=40, stop=[stop])
    assert response.choices[0].message.content == expected
    assert response.choices[0].finish_reason == "stop"
    assert ask_streamed(client, PROMPTS[1], max_tokens=40, stop=stop)[0] == expected
    assert (expected, "stop") == expected_greedy(tiny, PROMPTS[1], 40, [stop])


def test_text_stream_waits_for_whole_characters_and_holds_back_stop_prefixes(tiny) -> None:
    tok = tiny.tokenizer
    text = "héllo wörld — ünïcode"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.encode()) // 2, "multi-byte characters should span several tokens here"
    stream = TextStream(tok)
    pieces = [stream.push([i]) for i in ids] + [stream.finish()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)

    stream = TextStream(tok, stop=["wör"])
    pieces = [stream.push([i]) for i in ids] + [stream.finish()]
    assert "".join(pieces) == "héllo " and stream.stopped
    assert not any(p.endswith("w") for p in pieces), "a possible start of the stop string must be held back"
    assert full_text(tok, ids, ["wör"]) == ("héllo ", True)


def test_sidecars_extension(client: openai.OpenAI, tiny) -> None:
    document = "The city council approved a new budget after a long debate about schools and roads."
    spec = dict(TAGS_SPEC, attend_document=True)
    response = client.chat.completions.create(
        model="tiny", temperature=0, max_tokens=24,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": document}],
        extra_body={"sidecars": [spec, {"name": "title", "instruction": "Then write a title.", "max_tokens": 6}]})
    body = response.to_dict()
    assert set(body["sidecars"]) == {"hashtags", "title"}
    assert response.model_extra["sidecars"] == body["sidecars"]
    tasks = [HASHTAGS.model_copy(update={"max_new_tokens": 8, "attend_document": True}),
             HASHTAGS.model_copy(update={"name": "title", "instruction": "Then write a title.", "max_new_tokens": 6,
                                         "parser": "text"})]
    # the main text is the target's greedy answer by HF generate, sidecars or not; the engine only builds the prompt
    prompt = SidecarEngine(tiny).prompts(SidecarRequest(document, "", "Be brief.", tasks))[0].token_ids
    expected = tiny.tokenizer.decode(target_alone(tiny, prompt, 24), skip_special_tokens=True)
    assert response.choices[0].message.content == expected
    # The sidecar text is not compared with a reference: it depends on how many main tokens the draft
    # had cached when the main output finished, i.e. on the speculation schedule (see the engine notes).
    for task in tasks:
        got = body["sidecars"][task.name]
        assert (got["parsed"], got["parse_error"]) == task.parse(got["text"])
        assert got["finish_reason"] in ("stop", "length")
        assert 0 < got["usage"]["completion_tokens"] <= task.max_new_tokens
        assert got["usage"]["total_tokens"] == got["usage"]["prompt_tokens"] + got["usage"]["completion_tokens"]
    # streamed: the same main text, the sidecars in chunks of their own after the finish_reason
    text, chunks = ask_streamed(client, document, max_tokens=24, extra_body={"sidecars": [TAGS_SPEC]})
    assert text == ask(client, document, max_tokens=24, extra_body={"sidecars": [TAGS_SPEC]}).choices[0].message.content
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(final) == 1 and "sidecars" not in final[0].model_extra
    assert list(chunks[-1].model_extra["sidecars"]) == ["hashtags"]


def test_sidecars_with_a_multi_message_chat(client: openai.OpenAI, tiny) -> None:
    """#41: earlier turns before the document (the last user message); the main text is the target's answer to
    the whole chat by HF generate."""
    turns = [("user", "What did the council do?"), ("assistant", "It met on Tuesday.")]
    document = "The city council approved a new budget after a long debate about schools and roads."
    messages = [{"role": "system", "content": "Be brief."}, *({"role": r, "content": c} for r, c in turns),
                {"role": "user", "content": document}]
    response = client.chat.completions.create(model="tiny", temperature=0, max_tokens=24, messages=messages,
                                              extra_body={"sidecars": [TAGS_SPEC]})
    task = HASHTAGS.model_copy(update={"max_new_tokens": 8})
    prompt = SidecarEngine(tiny).prompts(SidecarRequest(document, "", "Be brief.", [task], history=turns))[0]
    assert tiny.tokenizer.decode(prompt.token_ids) == tiny.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)
    expected = tiny.tokenizer.decode(target_alone(tiny, prompt.token_ids, 24), skip_special_tokens=True)
    assert response.choices[0].message.content == expected
    tags = response.model_extra["sidecars"]["hashtags"]
    assert (tags["parsed"], tags["parse_error"]) == task.parse(tags["text"])


def test_a_sidecar_s_bridge_is_set_per_sidecar(client: openai.OpenAI, tiny) -> None:
    """#41: ``bridge`` over HTTP is the text the draft continues from: its tokens join the sidecar's prompt,
    and a sidecar without one keeps the engine task's default: the chat template's turn boundary."""
    assert SidecarTask.model_fields["bridge"].default is None
    bridge = "\n\nHashtags for the summary above, each with a leading #: #"
    extra = {"sidecars": [TAGS_SPEC, {**TAGS_SPEC, "name": "bridged", "bridge": bridge}]}
    sidecars = ask(client, PROMPTS[0], max_tokens=16, extra_body=extra).model_extra["sidecars"]
    longer = len(encode(tiny.tokenizer, bridge)) - len(turn_bridge(tiny.tokenizer))
    assert longer > 0
    assert sidecars["bridged"]["usage"]["prompt_tokens"] == sidecars["hashtags"]["usage"]["prompt_tokens"] + longer


def sse_chunks(base_url: str, body: dict) -> list[dict | str]:
    """The stream's events in order: each chunk's JSON, then "[DONE]"."""
    headers = {"content-type": "application/json", "Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", base_url + "/chat/completions", json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    return [event if event == "[DONE]" else json.loads(event) for event in events]


def test_a_stream_finishes_its_main_output_before_its_sidecars(base_url: str, tiny) -> None:
    """#41: finish_reason follows the main output's last token at once; each sidecar follows in a chunk of its
    own (no choices, like the usage chunk), then usage, then [DONE]."""
    document = PROMPTS[0]
    specs = [TAGS_SPEC, {"name": "title", "instruction": "Then write a title.", "max_tokens": 6}]
    events = sse_chunks(base_url, {"model": "tiny", "temperature": 0, "max_tokens": 24, "stream": True,
                                   "messages": [{"role": "user", "content": document}], "sidecars": specs,
                                   "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    finish = next(i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["finish_reason"])
    main, after = chunks[: finish + 1], chunks[finish + 1 :]
    assert all(c["choices"] and "sidecars" not in c for c in main)
    assert all(c["choices"][0]["finish_reason"] is None for c in main[:-1])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in main)
    prompt = SidecarEngine(tiny).prompts(SidecarRequest(document, "", None, []))[0].token_ids
    tokens = target_alone(tiny, prompt, 24)
    assert text == tiny.tokenizer.decode(tokens, skip_special_tokens=True)
    assert main[-1]["choices"][0]["finish_reason"] == ("stop" if tokens[-1] in tiny.eos_token_ids else "length")
    *sidecars, usage = after
    assert [list(c["sidecars"]) for c in sidecars] == [["hashtags"], ["title"]]
    assert all(c["choices"] == [] for c in sidecars)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(tokens) and "sidecars" not in usage


def test_logprobs_as_openai_streamed_and_not(client: openai.OpenAI, tiny) -> None:
    response = ask(client, PROMPTS[0], max_tokens=20, logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    # the tokens HF ``generate`` chooses, each scored by the log softmax of the target's logits there
    tokens, log_softmax = target_alone_scored(tiny, chat_prompt_ids(tiny, PROMPTS[0]), 20)
    assert [e.token for e in content] == [tiny.tokenizer.decode([t]) for t in tokens]
    chosen = log_softmax[torch.arange(len(tokens)), tokens].tolist()
    assert [e.logprob for e in content] == pytest.approx(chosen, abs=1e-4)
    for entry, row in zip(content, log_softmax, strict=True):
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token  # greedy: the argmax
        top = row.topk(3)
        assert [t.token for t in entry.top_logprobs] == [tiny.tokenizer.decode([i]) for i in top.indices.tolist()]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
    # the bytes spell the text exactly, whatever the tokens' own strings show of a split character
    special = {tiny.tokenizer.decode([t]) for t in tiny.eos_token_ids}
    spelled = b"".join(bytes(e.bytes) for e in content if e.token not in special)
    assert spelled.decode(errors="replace") == response.choices[0].message.content

    text, chunks = ask_streamed(client, PROMPTS[0], max_tokens=20, logprobs=True, top_logprobs=3)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert text == response.choices[0].message.content
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    assert ask(client, PROMPTS[0], max_tokens=20).choices[0].logprobs is None


@pytest.mark.parametrize("extra", [{"top_logprobs": 2}, {"logprobs": False, "top_logprobs": 2},
                                   {"logprobs": True, "top_logprobs": 21}, {"logprobs": True, "top_logprobs": -1}])
def test_bad_logprobs_are_400(client: openai.OpenAI, extra: dict) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, PROMPTS[0], max_tokens=4, **extra)
    assert info.value.body["type"] == "invalid_request_error" and info.value.body["param"] == "top_logprobs"


def test_sidecars_with_logprobs(client: openai.OpenAI) -> None:
    document = "The city council approved a new budget after a long debate about schools and roads."
    kwargs = dict(max_tokens=12, logprobs=True, top_logprobs=2, extra_body={"sidecars": [TAGS_SPEC]})
    response = ask(client, document, **kwargs)
    assert len(response.choices[0].logprobs.content) == response.usage.completion_tokens
    tags = response.model_extra["sidecars"]["hashtags"]
    entries = tags["logprobs"]["content"]
    assert tags["logprobs"]["refusal"] is None and len(entries) == tags["usage"]["completion_tokens"]
    assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"] for e in entries)
    _text, chunks = ask_streamed(client, document, **kwargs)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in response.choices[0].logprobs.content]
    final = next(c.model_extra["sidecars"]["hashtags"] for c in chunks if not c.choices and "sidecars" in c.model_extra)
    assert len(final["logprobs"]["content"]) == final["usage"]["completion_tokens"] > 0
    assert "logprobs" not in ask(client, document, max_tokens=12,
                                 extra_body={"sidecars": [TAGS_SPEC]}).model_extra["sidecars"]["hashtags"]


# -- refusals --


def test_stats_show_the_device_time_ledger_balanced(base_url: str, client: openai.OpenAI) -> None:
    """Every forward the server ran is charged to a phase: the phases sum to the measured device seconds."""
    before = stats(base_url)["device"]
    ask(client, PROMPTS[0], max_tokens=12, extra_body={"sidecars": [{"name": "tags", "instruction": "Then tag it.",
                                                                       "max_tokens": 6}]})
    device = stats(base_url)["device"]
    assert device["forwards"] > before["forwards"] and device["measured_seconds"] > before["measured_seconds"]
    assert device["charged_seconds"] == pytest.approx(device["measured_seconds"], rel=0.01)
    phases = device["charged_seconds_by_phase"]
    assert sum(phases.values()) == pytest.approx(device["measured_seconds"], rel=0.01)
    assert phases["main"] > 0 and phases["sidecar"] > 0 and phases["instruction"] > 0


def test_stats_name_the_dtype_and_why(base_url: str) -> None:
    """``--dtype`` wins over the ``SIDECAR_DTYPE`` the test session sets, and /stats says so."""
    assert stats(base_url)["dtype"] == "fp32 (argument dtype=fp32)"


def test_stats_name_the_capture_mode_and_count_its_forwards(base_url: str, client: openai.OpenAI) -> None:
    """The capture mode the engine runs in, why, and each model's counters (#40), after a request."""
    ask(client, PROMPTS[0], max_tokens=8)
    capture = stats(base_url)["capture"]
    assert capture["mode"] == "eager" and capture["reason"] == "SIDECAR_CAPTURE=eager"  # as the tests pin it
    assert capture["counters"]["target"]["forwards"] > 0
    assert capture["counters"]["target"]["graph_breaks"] == 0 == capture["counters"]["target"]["recompiles"]
    # the steps the server's worker thread ran, with their reads of the device and host time
    assert capture["steps"]["steps"] > 0 and capture["steps"]["syncs_per_step"] >= 1
    assert capture["steps"]["host_ms_per_step"] > 0


def test_a_sidecar_s_usage_is_the_same_alone_and_batched(base_url: str, client: openai.OpenAI) -> None:
    """#34.9: a sidecar's prompt_tokens is what it attends to, whatever shares its batch (on 556d98e the
    catch-up fed before its decoding counted twice: 79 alone, 80 batched, for the same output)."""
    extra = {"sidecars": [{"name": "tags", "instruction": "Then output hashtags.", "max_tokens": 6}]}
    alone = ask(client, PROMPTS[0], max_tokens=30, extra_body=extra).model_extra["sidecars"]["tags"]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(ask, client, PROMPTS[0], max_tokens=30, extra_body=extra),
                   *(pool.submit(ask, client, p, max_tokens=n) for p, n in zip(PROMPTS[1:], (3, 11, 23), strict=False))]
        batched = futures[0].result().model_extra["sidecars"]["tags"]
        for future in futures[1:]:
            future.result()
    assert batched["text"] == alone["text"]
    assert batched["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"]


def test_wrong_or_missing_key_is_401(base_url: str) -> None:
    wrong = openai.OpenAI(base_url=base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    missing = post(base_url, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, key=None)
    assert missing.status_code == 401
    assert set(missing.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(base_url + "/models").status_code == 401


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"


@pytest.mark.parametrize(("body", "param"), [
    (b'{"model": "tiny", "messages": [', None),
    (b"[1, 2]", None),
    ({"model": "tiny"}, "messages"),
    ({"model": "tiny", "messages": []}, "messages"),
    ({"model": "tiny", "messages": "hi"}, "messages"),
    ({"model": "tiny", "messages": [{"role": "user", "content": 3}]}, "messages.0.content.str"),
    ({"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
    # outside int64, OpenAI's bound (2**64 and below -2**63 would also fail torch's generator in the worker)
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "seed": 2**64}, "seed"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "seed": 2**63}, "seed"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "seed": -(2**63) - 1}, "seed"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
    # what json.loads raises besides JSONDecodeError: RecursionError, and ValueError past the int digit limit
    pytest.param(b'{"model": "tiny", "messages": ' + b"[" * 50_000, None, id="deeply-nested"),
    pytest.param(b'{"model": "tiny", "seed": ' + b"1" * 5_000 + b"}", None, id="huge-integer"),
])
def test_malformed_requests_are_400(base_url: str, body: bytes | dict, param: str | None) -> None:
    response = post(base_url, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


@pytest.mark.parametrize(("sidecars", "messages", "param"), [
    ([{"name": "bad name!", "instruction": "x"}], None, "sidecars.0.name"),
    ([{"name": "t", "instruction": "   "}], None, "sidecars.0.instruction"),
    ([{"name": "t", "instruction": "x", "max_tokens": 5000}], None, "sidecars.0.max_tokens"),
    ([{"name": "t", "instruction": "x", "colour": "red"}], None, "sidecars.0.colour"),
    # the engine's name for max_tokens is an unknown field, named as sent (#41: it was named max_tokens)
    ([{"name": "t", "instruction": "x", "max_new_tokens": 5}], None, "sidecars.0.max_new_tokens"),
    ([{"name": "t", "instruction": "x", "parser": "yaml"}], None, "sidecars.0.parser"),
    ([{"name": "t", "instruction": "x", "stop": ["a", ""]}], None, "sidecars.0.stop"),
    ([TAGS_SPEC, TAGS_SPEC], None, "sidecars"),
    ([], None, "sidecars"),
    ("hashtags", None, "sidecars"),
    ([TAGS_SPEC], [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "messages"),
    ([TAGS_SPEC], [{"role": "system", "content": "a"}], "messages"),
    ([TAGS_SPEC], [{"role": "user", "content": "   "}], "messages"),
])
def test_bad_sidecar_specs_are_400(client: openai.OpenAI, sidecars: object, messages: list | None,
                                   param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=messages or [{"role": "user", "content": "doc"}],
                                       extra_body={"sidecars": sidecars})
    assert info.value.body["param"] == param


HI = [{"role": "user", "content": "hi"}]
SURROGATE = "\ud800"  # a lone UTF-16 surrogate: valid JSON ("\ud800"), not Unicode text


def local_port(response: httpx.Response) -> int:
    """The client-side port of the connection that carried ``response``: the same port means the same connection."""
    return response.extensions["network_stream"].get_extra_info("socket").getsockname()[1]


def assert_connection_survives(client: httpx.Client, url: str, after: httpx.Response, key: str | None) -> None:
    """Ten valid requests after ``after`` all succeed, each over the connection that carried ``after``."""
    port = local_port(after)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for _ in range(10):
        response = client.post(url + "/chat/completions", headers=headers,
                                json={"model": "tiny", "messages": HI, "max_tokens": 2, "temperature": 0})
        assert response.status_code == 200, response.text
        assert local_port(response) == port, "the server closed the keep-alive connection"


@pytest.mark.parametrize("fields", [
    {"messages": [{"role": "user", "content": f"hi {SURROGATE}"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]},
    {"messages": [{"role": "system", "content": SURROGATE}, *HI]},
    {"messages": [{"role": "user", "content": "hi", "name": SURROGATE}]},
    {"model": f"tiny{SURROGATE}"},
    {"stop": SURROGATE},
    {"stop": ["ok", f"x{SURROGATE}"]},
    {"sidecars": [{"name": "t", "instruction": f"tag it {SURROGATE}"}]},
    # an unknown field's name
    {"sidecars": [{"name": "t", "instruction": "tag it", SURROGATE: 1}]},
])
def test_a_lone_surrogate_is_400_and_the_connection_stays_open(base_url: str, fields: dict) -> None:
    body = {"model": "tiny", "messages": HI, "max_tokens": 2} | fields
    # one connection: a keep-alive client whose next requests must not find it closed
    with httpx.Client(timeout=60, limits=httpx.Limits(max_connections=1)) as http:
        bad = http.post(base_url + "/chat/completions", content=json.dumps(body).encode(),
                        headers={"content-type": "application/json", "Authorization": f"Bearer {KEY}"})
        assert bad.status_code == 400, bad.text
        error = bad.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"].startswith(next(iter(fields)))
        assert_connection_survives(http, base_url, bad, KEY)


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": "1"}, "max_tokens"),
    ({"max_tokens": 1.0}, "max_tokens"),
    ({"max_completion_tokens": True}, "max_completion_tokens"),
    ({"max_completion_tokens": "1"}, "max_completion_tokens"),
    ({"n": True}, "n"),
    ({"n": "1"}, "n"),
    ({"temperature": True}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"top_p": True}, "top_p"),
    ({"top_p": "1"}, "top_p"),
    ({"seed": True}, "seed"),
    ({"seed": "1"}, "seed"),
    ({"logprobs": 1}, "logprobs"),
    ({"logprobs": "true"}, "logprobs"),
    ({"logprobs": True, "top_logprobs": True}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": "1"}, "top_logprobs"),
    ({"stream": 1}, "stream"),
    ({"stream": "true"}, "stream"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"sidecars": [TAGS_SPEC | {"max_tokens": True}]}, "sidecars.0.max_tokens"),
    ({"sidecars": [TAGS_SPEC | {"max_tokens": "8"}]}, "sidecars.0.max_tokens"),
    ({"sidecars": [TAGS_SPEC | {"attend_document": 1}]}, "sidecars.0.attend_document"),
    ({"sidecars": [TAGS_SPEC | {"bridge": 5}]}, "sidecars.0.bridge"),
])
def test_numbers_and_flags_of_the_wrong_json_type_are_400(base_url: str, fields: dict, param: str) -> None:
    response = post(base_url, {"model": "tiny", "messages": HI, "max_tokens": 2} | fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_whole_numbers_are_valid_floats(base_url: str) -> None:
    response = post(base_url, {"model": "tiny", "messages": HI, "max_tokens": 2, "temperature": 1, "top_p": 1,
                               "seed": 5})
    assert response.status_code == 200, response.text


def test_a_bad_seed_fails_no_request_batched_with_it(base_url: str) -> None:
    # Greedy requests share a batch whatever their seed, so a seed the worker cannot use would fail them all.
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 4,
            "temperature": 0}
    with ThreadPoolExecutor(2) as pool:
        bad = pool.submit(post, base_url, body | {"seed": 2**64})
        good = pool.submit(post, base_url, body | {"seed": 7})
    assert bad.result().status_code == 400 and bad.result().json()["error"]["param"] == "seed"
    assert good.result().status_code == 200, good.result().text


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63)])
def test_int64_seeds_at_the_bounds_sample_with_sidecars(base_url: str, seed: int) -> None:
    # the sidecar rows draw from streams of their own under the request's seed (sidecar.decoding.randomness.draw_key)
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 4,
            "temperature": 0.8, "seed": seed, "sidecars": [TAGS_SPEC]}
    response = post(base_url, body)
    assert response.status_code == 200, response.text
    assert "hashtags" in response.json()["sidecars"]


@pytest.mark.parametrize("sampling", [{"top_p": 1e-300}, {"top_p": 5e-324}, {"temperature": 1e-300},
                                      {"temperature": 1e-300, "top_p": 1e-300}])
@pytest.mark.parametrize("sidecars", [None, [TAGS_SPEC]])
def test_vanishing_top_p_and_temperature_still_sample(base_url: str, sampling: dict, sidecars: list | None) -> None:
    # float32 rounds such values to 0: every token used to leave the nucleus, or logits / temperature overflowed
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[2]}], "max_tokens": 6,
            "temperature": 1.0, "seed": 3} | sampling | ({"sidecars": sidecars} if sidecars else {})
    response = post(base_url, body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_warp_keeps_the_most_likely_token_however_small_top_p() -> None:
    logits = torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(0))
    argmax = torch.nn.functional.one_hot(logits.argmax(-1), 50).float()
    for top_p in (1e-300, 1e-9):  # 1e-300 is 0 in float32; 1e-9 is not, and keeps only the top token anyway
        assert torch.equal(warp(logits, 1.0, top_p), argmax)


def test_stop_with_sidecars_ends_the_main_output_and_each_sidecar_has_its_own(client: openai.OpenAI, tiny) -> None:
    """#41: the request's stop ends the main output (the target's answer by HF generate, cut before it), and the
    sidecars continue from that output without the stop string: as from the same output ended by max_tokens.
    A sidecar's own stop cuts its text, which is parsed as cut."""
    tok = tiny.tokenizer
    prompt = SidecarEngine(tiny).prompts(SidecarRequest(PROMPTS[0], "", None, []))[0].token_ids
    tokens = target_alone(tiny, prompt, 40)
    full = tok.decode(tokens, skip_special_tokens=True)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected = full[: full.find(stop)]
    kept = max(k for k in range(len(tokens) + 1)
               if expected.startswith(tok.decode(tokens[:k], skip_special_tokens=True)))
    assert 0 < kept < len(tokens)
    spec = {"name": "tags", "instruction": "Then output hashtags.", "max_tokens": 8}
    stopped = ask(client, PROMPTS[0], max_tokens=40, stop=[stop], extra_body={"sidecars": [spec]})
    assert stopped.choices[0].message.content == expected and stopped.choices[0].finish_reason == "stop"
    ended = ask(client, PROMPTS[0], max_tokens=kept, extra_body={"sidecars": [spec]})
    assert ended.choices[0].message.content == tok.decode(tokens[:kept], skip_special_tokens=True)
    tags = stopped.model_extra["sidecars"]["tags"]
    assert tags["usage"]["prompt_tokens"] == ended.model_extra["sidecars"]["tags"]["usage"]["prompt_tokens"]

    text = tags["text"]
    assert len(text) >= 4
    own = text[len(text) // 2 : len(text) // 2 + 2]
    again = ask(client, PROMPTS[0], max_tokens=40, stop=[stop],
                extra_body={"sidecars": [spec | {"stop": own}]}).model_extra["sidecars"]["tags"]
    assert again["text"] == text[: text.find(own)] and again["finish_reason"] == "stop"
    task = SidecarTask(name="tags", instruction=spec["instruction"])
    assert (again["parsed"], again["parse_error"]) == task.parse(again["text"])


def test_over_context_prompt_and_max_tokens_are_400(base_url: str, client: openai.OpenAI) -> None:
    long_prompt = "city council " * 3000  # about 6000 tokens for a 4096-token context, within the body limit
    assert len(json.dumps(long_prompt)) < MAX_BODY
    for prompt, kwargs in [(long_prompt, {}), ("hi", {"max_tokens": 5000})]:
        with pytest.raises(openai.BadRequestError) as info:
            ask(client, prompt, **kwargs)
        assert info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        ask(client, long_prompt, extra_body={"sidecars": [TAGS_SPEC]})


def test_huge_body_is_413(base_url: str) -> None:
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * (2 * MAX_BODY)}]}
    response = post(base_url, big)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:  # no content-length: the server must count while reading
        yield json.dumps(big).encode()

    assert post(base_url, chunked()).status_code == 413  # type: ignore[arg-type]
    assert post(base_url, {"model": "tiny", "messages": [{"role": "user", "content": "still fine"}],
                           "max_tokens": 2}).status_code == 200


# -- batching --


def test_concurrent_requests_are_batched_and_answered_as_alone(base_url: str, client: openai.OpenAI) -> None:
    alone = {p: ask(client, p, max_tokens=m).choices[0].message.content
             for p, m in zip(PROMPTS, [24, 8, 40, 16, 32, 12, 24, 8, 40, 16], strict=True)}
    before = stats(base_url)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(
            lambda pm: ask(client, pm[0], max_tokens=pm[1]).choices[0].message.content,
            zip(PROMPTS, [24, 8, 40, 16, 32, 12, 24, 8, 40, 16], strict=True)))
    assert together == [alone[p] for p in PROMPTS]
    after = stats(base_url)
    sizes = {int(k): v - before["step_sizes"].get(k, 0) for k, v in after["step_sizes"].items()}
    assert max(size for size, count in sizes.items() if count > 0) > 1, after
    assert after["failed_steps"] == 0


def load_bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("server_load", BENCH)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "server_load", bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    return bench


def test_short_load_run_is_correct(base_url: str, monkeypatch) -> None:
    bench = load_bench(monkeypatch)

    async def run() -> dict:
        load = bench.LoadClient(base_url, "tiny", KEY, max_tokens=16)
        try:
            pool = bench.prompts(4)
            refs = await bench.references(load, pool)
            return await bench.run_load(load, pool, refs, concurrency=8, duration_s=3.0)
        finally:
            await load.aclose()

    report = asyncio.run(run())
    assert report["requests"] > 8 and report["ok"] > 0
    assert report["wrong"] == [], report
    assert not any(status.startswith("5") for status in report["status_counts"]), report["status_counts"]
    assert report["server"]["failed_steps"] == 0
    assert report["latency_ok_s"]["p50"] <= report["latency_ok_s"]["p99"]


def test_load_run_fails_on_wrong_answers_and_without_a_batching_speedup(monkeypatch) -> None:
    bench = load_bench(monkeypatch)

    def run(wrong: int = 0) -> dict:
        return {"wrong": [{"kind": "greedy", "status": 200}] * wrong, "server": {"failed_steps": 0}}

    assert bench.problems({"batched": run(), "unbatched": run(), "speedup_ok_per_s": 2.9}) == []
    assert bench.problems({"batched": run()}) == []  # an external server: nothing to compare with
    assert len(bench.problems({"batched": run(wrong=1), "unbatched": run(), "speedup_ok_per_s": 2.9})) == 1
    for speedup in (1.0, 0.6):
        [problem] = bench.problems({"batched": run(), "unbatched": run(), "speedup_ok_per_s": speedup})
        assert "did not raise valid requests per second" in problem


def test_mixed_load_run_is_correct_and_answers_short_requests_sooner(base_url: str, monkeypatch) -> None:
    bench = load_bench(monkeypatch)
    args = argparse.Namespace(prompts=4, long_tokens=32, short_tokens=4, concurrency=4, duration=4.0, seed=0)
    run = asyncio.run(bench.bench_mixed(base_url, "tiny", KEY, args))
    assert run["wrong"] == [] and run["short"]["ok"] > 0 and run["long"]["ok"] > 0, run
    assert run["long"]["mean_completion_tokens"] == 32 and run["short"]["mean_completion_tokens"] <= 4
    assert bench.mixed_problems({"runs": {"this checkout": run}}) == [], run


def test_mixed_load_run_fails_on_wrong_answers_and_on_short_requests_no_sooner_done(monkeypatch) -> None:
    bench = load_bench(monkeypatch)

    def run(short_p50: float, wrong: int = 0) -> dict:
        return {"wrong": [{"kind": "short", "status": 200}] * wrong, "short": {"latency_ok_s": {"p50": short_p50}},
                "long": {"latency_ok_s": {"p50": 2.0}}}

    assert bench.mixed_problems({"runs": {"new": run(0.5), "old": run(3.0)}}) == []
    [problem] = bench.mixed_problems({"runs": {"new": run(2.5), "old": run(0.5)}})
    assert "short requests did not finish sooner" in problem
    [problem] = bench.mixed_problems({"runs": {"new": run(0.5), "old": run(0.5, wrong=2)}})
    assert problem.startswith("old: 2 wrong")


# -- failures inside the worker, on an in-process server whose engine breaks --


@contextlib.contextmanager
def inprocess_server(engine: SidecarEngine, config: ServerConfig) -> Iterator[str]:
    with serving(create_app(engine, config)) as (url, _):
        yield f"{url}/v1"


@pytest.mark.servers
def test_worker_exception_is_a_500_without_traceback(tiny, monkeypatch, caplog) -> None:
    engine = SidecarEngine(tiny)
    secret = "internal detail 0xdeadbeef"

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError(secret)

    monkeypatch.setattr(SidecarBatch, "step", broken)
    with inprocess_server(engine, ServerConfig(model_name="tiny")) as url, caplog.at_level(logging.ERROR):
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            ask(client, "hi", max_tokens=4)
        assert info.value.body["type"] == "server_error"
        assert secret not in info.value.response.text and "Traceback" not in info.value.response.text
        with pytest.raises(openai.APIError) as streamed:
            ask_streamed(client, "hi", max_tokens=4)
        assert secret not in str(streamed.value)
        assert any(r.exc_info and secret in str(r.exc_info[1]) for r in caplog.records), "logged server-side"
        monkeypatch.undo()  # the worker survives and serves the next request
        assert ask(client, "hi", max_tokens=4).choices[0].message.content is not None


@pytest.mark.servers
def test_an_unexpected_error_is_a_500_and_the_connection_stays_open(tiny, monkeypatch, caplog) -> None:
    engine = SidecarEngine(tiny)
    secret = "internal detail 0xfeedface"
    job = ChatService.job

    def broken(self: ChatService, req: object, loop: object) -> object:
        if req.messages[0].text == "break":
            raise RuntimeError(secret)
        return job(self, req, loop)

    monkeypatch.setattr(ChatService, "job", broken)
    with (inprocess_server(engine, ServerConfig(model_name="tiny")) as url, caplog.at_level(logging.ERROR),
          httpx.Client(timeout=60, limits=httpx.Limits(max_connections=1)) as http):
        failed = http.post(url + "/chat/completions",
                           json={"model": "tiny", "messages": [{"role": "user", "content": "break"}]})
        assert failed.status_code == 500
        assert failed.json()["error"]["type"] == "server_error" and secret not in failed.text
        assert_connection_survives(http, url, failed, key=None)
        assert any(r.exc_info and secret in str(r.exc_info[1]) for r in caplog.records), "logged server-side"


def test_serve_refuses_an_unknown_pair() -> None:
    result = CliRunner().invoke(cli_app, ["serve", "--pair", "no-such-pair"])
    assert result.exit_code == 2 and "unknown pair" in result.output


@pytest.mark.parametrize(("host", "api_key", "insecure", "refused"), [
    ("0.0.0.0", None, False, True),
    ("0.0.0.0", "", False, True),
    ("::", None, False, True),
    ("192.0.2.7", None, False, True),
    ("0.0.0.0", KEY, False, False),
    ("0.0.0.0", None, True, False),
    ("127.0.0.1", None, False, False),
    ("127.0.0.2", None, False, False),
    ("::1", None, False, False),
    ("localhost", None, False, False),
])
def test_config_refuses_a_keyless_server_off_loopback(host: str, api_key: str | None, insecure: bool,
                                                      refused: bool) -> None:
    if refused:
        with pytest.raises(InputError, match="--insecure"):
            ServerConfig(model_name="tiny", host=host, api_key=api_key, insecure=insecure)
    else:
        assert ServerConfig(model_name="tiny", host=host, api_key=api_key, insecure=insecure).host == host


def test_serve_refuses_to_expose_a_keyless_server_unless_insecure(monkeypatch) -> None:
    bound: list[str] = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets=None: bound.append(server.config.host))
    serve = ["serve", "--pair", "tiny", "--host", "0.0.0.0", "--port", str(free_port())]
    refused = CliRunner().invoke(cli_app, serve, env={API_KEY_ENV: ""})
    assert refused.exit_code == 2 and bound == []
    [line] = refused.output.strip().splitlines()
    assert line.startswith("error: ") and "--insecure" in line and API_KEY_ENV in line
    assert CliRunner().invoke(cli_app, [*serve, "--insecure"], env={API_KEY_ENV: ""}).exit_code == 0
    assert CliRunner().invoke(cli_app, serve, env={API_KEY_ENV: KEY}).exit_code == 0
    assert bound == ["0.0.0.0", "0.0.0.0"]


@pytest.mark.servers
def test_full_queue_is_503_and_the_server_recovers(tiny, monkeypatch) -> None:
    engine = SidecarEngine(tiny)
    step = SidecarBatch.step
    entered, release = threading.Event(), threading.Event()

    def blocked(batch: SidecarBatch) -> object:
        entered.set()
        release.wait(30)
        return step(batch)

    monkeypatch.setattr(SidecarBatch, "step", blocked)
    config = ServerConfig(model_name="tiny", max_batch=1, batch_wait_ms=0, max_queue=1)
    with inprocess_server(engine, config) as url, ThreadPoolExecutor(2) as pool:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
        running = pool.submit(post, url, body, None)  # taken by the worker, which then blocks
        assert entered.wait(30)
        queued = pool.submit(post, url, body, None)  # fills the queue of one
        deadline = time.monotonic() + 30
        while stats(url, key=None)["queue_depth"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        refused = post(url, body, None)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "overloaded"
        release.set()
        assert running.result().status_code == 200 and queued.result().status_code == 200


@pytest.mark.servers
def test_a_server_at_gamma_zero_decodes_plainly_with_its_sidecars(tiny) -> None:
    """``sidecar serve --gamma 0``: the main text is the target's greedy answer, decoded without drafts, and the
    sidecar tasks still run on the draft, as at gamma 4; ``/metrics`` serves."""
    document = "The city council approved a new budget after a long debate about schools and roads."
    bodies, engines = [], [SidecarEngine(tiny, gamma=gamma) for gamma in (0, 4)]
    for engine in engines:
        with inprocess_server(engine, ServerConfig(model_name="tiny")) as url:
            client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
            response = ask(client, document, max_tokens=16, extra_body={"sidecars": [TAGS_SPEC]})
            bodies.append((response.choices[0].message.content,
                           response.model_extra["sidecars"]["hashtags"]["text"]))
            assert httpx.get(url.removesuffix("/v1") + "/metrics", timeout=30).status_code == 200
    assert bodies[0] == bodies[1]
    assert set(engines[0].decoder.controller.decisions) == {(0, "draft")}  # every step plain
