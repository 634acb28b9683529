"""Third-party clients, unmodified, against a real ``sidecar serve`` on the tiny pair (#41 item 8): the OpenAI
client's structured output with a pydantic model, LangChain's ``ChatOpenAI`` (``with_structured_output``
included), and lm-evaluation-harness's ``local-completions`` loglikelihood and ``local-chat-completions``
generation through its model classes. The tiny pair writes random text, so structured output is checked by
what the constraint guarantees: it parses into the model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from langchain_openai import ChatOpenAI
from lm_eval.api.instance import Instance
from lm_eval.models.api_models import JsonChatStr
from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI
from pydantic import BaseModel, Field

from server.launcher import running_server

KEY = "sk-test-clients-key"
PROMPT = "The city council approved a new budget on Tuesday."


class City(BaseModel):
    # bounded, so that the tiny model's random text ends within max_tokens
    city: str = Field(max_length=12)
    year: int = Field(ge=1900, le=2100)


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with running_server("tiny", api_key=KEY, batch_wait_ms=0, extra_args=["--dtype", "fp32"],
                        startup_timeout_s=300) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=120)


def plain_answer(client: openai.OpenAI, max_tokens: int = 16) -> str:
    response = client.chat.completions.create(model="tiny", temperature=0, max_tokens=max_tokens,
                                              messages=[{"role": "user", "content": PROMPT}])
    return response.choices[0].message.content


# -- the OpenAI client --


def test_the_openai_client_s_parse_returns_the_pydantic_model(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(model="tiny", temperature=0, max_tokens=64, response_format=City,
                                               messages=[{"role": "user", "content": PROMPT}])
    message = completion.choices[0].message
    assert isinstance(message.parsed, City), message.content
    assert message.parsed == City.model_validate_json(message.content)


def test_the_openai_client_s_sampled_structured_outputs_parse(client: openai.OpenAI) -> None:
    for seed in range(3):
        completion = client.chat.completions.parse(model="tiny", temperature=1.0, seed=seed, max_tokens=64,
                                                   response_format=City,
                                                   messages=[{"role": "user", "content": PROMPT}])
        assert isinstance(completion.choices[0].message.parsed, City)


# -- LangChain --


def chat_model(base_url: str, **fields: object) -> ChatOpenAI:
    return ChatOpenAI(model="tiny", base_url=base_url, api_key=KEY, temperature=0, max_retries=0, timeout=120,
                      **fields)


def test_langchain_s_chat_openai_answers_as_the_openai_client(base_url: str, client: openai.OpenAI) -> None:
    llm = chat_model(base_url, max_tokens=16)
    assert llm.invoke(PROMPT).content == plain_answer(client)
    assert "".join(chunk.content for chunk in llm.stream(PROMPT)) == plain_answer(client)


@pytest.mark.parametrize("strict", [None, True])
def test_langchain_s_structured_output_returns_the_pydantic_model(base_url: str, strict: bool | None) -> None:
    structured = chat_model(base_url, max_tokens=64).with_structured_output(City, method="json_schema",
                                                                            strict=strict)
    assert isinstance(structured.invoke(PROMPT), City)


# -- lm-evaluation-harness --


@pytest.fixture
def harness_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # how its local models send a key


def test_lm_eval_local_completions_loglikelihood_is_the_targets(base_url: str, tiny, tmp_path: Path,
                                                                harness_key: None) -> None:
    """Its loglikelihood request (token ids, ``echo``, ``logprobs`` 1, ``max_tokens`` 1) scores the
    continuation as the tiny target does, and says whether it is the greedy one."""
    tiny.tokenizer.save_pretrained(tmp_path)  # the harness loads its tokenizer by name: a local one, offline
    lm = LocalCompletionsAPI(base_url=f"{base_url}/completions", model="tiny", tokenizer_backend="huggingface",
                             tokenizer=str(tmp_path), max_retries=1)
    pairs = [(PROMPT, " The mayor said"), ("Prices rose", " 3.5 percent in 2017")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    results = lm.loglikelihood(requests)
    for (context, continuation), (logprob, greedy) in zip(pairs, results, strict=True):
        whole = tiny.tokenizer.encode(context + continuation, add_special_tokens=False)
        start = len(tiny.tokenizer.encode(context, add_special_tokens=False))
        with torch.no_grad():
            scores = torch.log_softmax(tiny.target(torch.tensor([whole])).logits[0].float(), -1)
        wanted = scores[start - 1 : -1].gather(-1, torch.tensor(whole[start:])[:, None])[:, 0]
        assert logprob == pytest.approx(float(wanted.sum()), abs=1e-3)
        assert greedy == bool((scores[start - 1 : -1].argmax(-1) == torch.tensor(whole[start:])).all())


def test_lm_eval_local_chat_completions_generates_the_chat_answer(base_url: str, client: openai.OpenAI,
                                                                  harness_key: None) -> None:
    """Its generation request (messages, ``max_tokens``, ``stop`` from ``until``, ``seed``, temperature 0)
    answers as the chat route does for the same request."""
    lm = LocalChatCompletion(base_url=f"{base_url}/chat/completions", model="tiny", max_retries=1)
    chat = JsonChatStr(json.dumps([{"role": "user", "content": PROMPT}]))
    request = Instance("generate_until", {}, (chat, {"until": ["\n\n"], "max_gen_toks": 16}), 0)
    [generated] = lm.generate_until([request])
    expected = client.chat.completions.create(model="tiny", temperature=0, max_tokens=16, stop=["\n\n"], seed=1234,
                                              messages=[{"role": "user", "content": PROMPT}])
    assert generated == expected.choices[0].message.content and generated
