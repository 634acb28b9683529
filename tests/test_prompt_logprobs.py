"""Scoring prompts through the server: legacy completions with ``echo`` and ``logprobs``, vLLM's chat
``prompt_logprobs``, and the ``<served name>/draft`` model id, against the tiny models run by transformers."""

from __future__ import annotations

import json
import unicodedata
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from serving import serving

from server.app import create_app
from server.config import ServerConfig
from server.launcher import running_server
from server.logprobs import LogprobFormatter, text_offsets
from sidecar import SidecarEngine, SpeculativeDecoder
from sidecar.decoding.scoring import PromptLogprob
from sidecar.tasks.prompts import chat_prompt

KEY = "sk-test-scoring-key"
TEXT = "The city council approved a new budget on Tuesday after a long debate about schools."
CONTEXT, CONTINUATION = "The president met leaders in Berlin,", " Moscow and Doha."
# a chat prompt the tiny target answers past 160 tokens
LONG = "The city council approved a new budget on Tuesday after a long debate about schools and roads."
# byte-level BPE splits these characters' bytes across tokens
ACCENTED = "Prices rose 3.5 percent in Zürich — and in Doha."
# text the tokenizer (NFC, as Qwen2's) does not take as it is: decomposed accents, combining marks that do not
# compose, characters outside the BMP, and a mix as a news row holds it
NOT_NFC = {
    "decomposed": unicodedata.normalize("NFD", "Café owners in Zürich and Malmö protested, Señor Núñez said."),
    "combining": "The x\u0301\u0302 and q\u0323\u0307 marks, then a\u0308\u0301 again.",
    # U+1D15E and U+2F800 are astral and change under NFC (to two astral characters, to U+4E3D)
    "astral": "Fans cheered \U0001F600\U0001F389 as \U0001D15E and \U0002F800 and \U0001D400 scored e\u0301.",
    "mixed": "Re\u0301sume\u0301 \U0001F600 of the Zu\u0308rich co\u0302te\u0301 \u2014 e\u0301te\u0301 \U0001F389.",
}


@pytest.fixture(scope="module")
def base_url() -> str:
    with running_server("tiny", api_key=KEY, max_batch=8, batch_wait_ms=20, extra_args=["--dtype", "fp32"],
                        startup_timeout_s=300) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=120)


def reference(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """log_softmax in float32 of the logits at every prompt position, by transformers' own forward: [n, V]."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def prompt_reference(model: torch.nn.Module, ids: list[int]) -> list[float]:
    """Each token's logprob after the tokens before it (the first has none)."""
    logp = reference(model, ids)
    return [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def score(client: openai.OpenAI, prompt: str, model: str = "tiny", logprobs: int = 1):
    return client.completions.create(model=model, prompt=prompt, echo=True, logprobs=logprobs, max_tokens=0)


def post(base_url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base_url}/{route}", content=json.dumps(body), timeout=60,
                      headers={"content-type": "application/json", "Authorization": f"Bearer {KEY}"})


def test_models_list_the_draft_for_scoring(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["tiny", "tiny/draft"]


def test_echo_scores_every_prompt_token_as_the_target_does(client: openai.OpenAI, tiny) -> None:
    response = score(client, TEXT)
    choice = response.choices[0]
    ids = tiny.tokenizer.encode(TEXT, add_special_tokens=False)
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(ids), 0)
    logprobs = choice.logprobs
    assert logprobs.tokens == [tiny.tokenizer.decode([i]) for i in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx(prompt_reference(tiny.target, ids), abs=1e-4)
    best = reference(tiny.target, ids).max(-1).values
    for i, top in enumerate(logprobs.top_logprobs[1:], 1):
        # the token itself and the most likely one (the same when the model's best guess was right)
        assert top[logprobs.tokens[i]] == pytest.approx(logprobs.token_logprobs[i], abs=1e-6)
        assert max(top.values()) == pytest.approx(best[i - 1].item(), abs=1e-4) and len(top) <= 2
    offsets = [*logprobs.text_offset, len(TEXT)]
    assert [TEXT[offsets[i] : offsets[i + 1]] for i in range(len(ids))] == logprobs.tokens


def test_text_offset_finds_a_continuation_as_a_judge_does(client: openai.OpenAI, tiny) -> None:
    """The judge's use: the continuation's tokens are those that start at or after the context's end."""
    logprobs = score(client, CONTEXT + CONTINUATION, logprobs=0).choices[0].logprobs
    start = next(i for i, offset in enumerate(logprobs.text_offset) if offset >= len(CONTEXT))
    context_ids = tiny.tokenizer.encode(CONTEXT, add_special_tokens=False)
    ids = tiny.tokenizer.encode(CONTEXT + CONTINUATION, add_special_tokens=False)
    assert ids[: len(context_ids)] == context_ids and start == len(context_ids)
    assert sum(logprobs.token_logprobs[start:]) == pytest.approx(sum(prompt_reference(tiny.target, ids)[start - 1 :]),
                                                                 abs=1e-3)
    assert all(len(top) == 1 for top in logprobs.top_logprobs[1:])  # logprobs 0: the token itself only


def test_text_offset_of_split_characters_points_at_their_start(client: openai.OpenAI) -> None:
    logprobs = score(client, ACCENTED).choices[0].logprobs
    offsets = [*logprobs.text_offset, len(ACCENTED)]
    assert offsets == sorted(offsets) and offsets[0] == 0
    pieces = [ACCENTED[offsets[i] : offsets[i + 1]] for i in range(len(logprobs.tokens))]
    assert "".join(pieces) == ACCENTED
    assert all(piece == token for piece, token in zip(pieces, logprobs.tokens, strict=True)
               if not token.startswith("bytes:"))
    # a character split over three tokens: offsets before it, at it (its first byte starts no whole character)
    assert text_offsets([b"a", "ü".encode()[:1], "ü".encode()[1:], b"b"]) == [0, 1, 1, 2]


def legacy_token(tokenizer, token_id: int) -> str:
    """A token as OpenAI's legacy completions spell it: its text, or ``bytes:\\xNN`` for bytes that are not
    UTF-8 alone."""
    raw = LogprobFormatter(tokenizer).token(token_id)[1]
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def test_legacy_tokens_of_split_characters_are_their_bytes_and_never_share_a_key(tiny) -> None:
    """The pieces of split characters all decode to U+FFFD: keyed by text, they overwrote each other."""
    formatter = LogprobFormatter(tiny.tokenizer)
    ids = tiny.tokenizer.encode("Zürich \U0001F600 — é", add_special_tokens=False)
    pieces = [i for i in ids if "\ufffd" in tiny.tokenizer.decode([i])]
    assert len(set(pieces)) >= 4
    entry = PromptLogprob(ids[0], -1.0, 1, tuple((token, -1.0 - n) for n, token in enumerate(dict.fromkeys(pieces))))
    legacy = formatter.legacy([ids[0], ids[0]], [None, entry], [0, 0])
    [top] = legacy["top_logprobs"][1:]
    assert len(top) == len(set(pieces)) + 1  # every alternative and the token itself
    assert {key for key in top if key.startswith("bytes:")} == {
        "bytes:" + "".join(f"\\x{b:02x}" for b in formatter.token(t)[1]) for t in set(pieces)}
    assert "bytes:\\xc3" in top and "bytes:\\xf0" in top  # the first bytes of ü and of the emoji


def test_legacy_top_logprobs_from_the_server_give_every_alternative_a_key_of_its_own(client: openai.OpenAI) -> None:
    text = ACCENTED + " \U0001F600\U0001F389 Malmö, Señor Núñez, 東京."
    logprobs = score(client, text, logprobs=5).choices[0].logprobs
    for token, top in zip(logprobs.tokens[1:], logprobs.top_logprobs[1:], strict=True):
        assert len(top) >= 5 and token in top  # five alternatives, none overwritten, and the token itself
        assert not any("\ufffd" in key for key in top)
        for key in (k for k in top if k.startswith("bytes:")):
            raw = bytes(int(h, 16) for h in key.removeprefix("bytes:").split("\\x")[1:])
            with pytest.raises(UnicodeDecodeError):
                raw.decode("utf-8")


def assert_offsets_index(text: str, ids: list[int], offsets: list[int], tokenizer) -> None:
    """What the tokens before each token spell (as the tokenizer normalises text: NFC) is the characters of
    ``text`` before its offset, and at most up to the next token's: a token that starts inside a character,
    or inside what characters normalise to (U+1D15E is two, e and U+0301 one), points at where they start."""
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] < len(text)
    spelled = LogprobFormatter(tokenizer)
    for i, offset in enumerate(offsets):
        # only the last character can be incomplete: "ignore" drops just its bytes
        before = bytes(b for token in ids[:i] for b in spelled.token(token)[1]).decode("utf-8", errors="ignore")
        following = min([o for o in offsets if o > offset] + [len(text)])
        up_to, through = (unicodedata.normalize("NFC", text[:end]) for end in (offset, following))
        assert before.startswith(up_to) and through.startswith(before), (i, offset, up_to, before)


@pytest.mark.parametrize("name", sorted(NOT_NFC))
def test_text_offset_indexes_the_echoed_text_whatever_its_normalisation(client: openai.OpenAI, tiny,
                                                                         name: str) -> None:
    """lm-evaluation-harness slices the echoed text at text_offset: offsets of the tokenizer's NFC bytes
    pointed too early into decomposed text (-6.595 scored against -8.185 for the right span)."""
    text = NOT_NFC[name]
    assert unicodedata.normalize("NFC", text) != text
    choice = score(client, text).choices[0]
    ids = tiny.tokenizer.encode(text, add_special_tokens=False)
    assert choice.text == text and len(choice.logprobs.text_offset) == len(ids)
    assert_offsets_index(text, ids, choice.logprobs.text_offset, tiny.tokenizer)


@pytest.mark.parametrize("name", sorted(NOT_NFC))
def test_a_continuation_after_text_not_in_nfc_is_found_as_a_judge_finds_it(client: openai.OpenAI, tiny,
                                                                           name: str) -> None:
    context = NOT_NFC[name]
    logprobs = score(client, context + CONTINUATION, logprobs=0).choices[0].logprobs
    start = next(i for i, offset in enumerate(logprobs.text_offset) if offset >= len(context))
    context_ids = tiny.tokenizer.encode(context, add_special_tokens=False)
    ids = tiny.tokenizer.encode(context + CONTINUATION, add_special_tokens=False)
    assert ids[: len(context_ids)] == context_ids and start == len(context_ids)
    assert tiny.tokenizer.decode(ids[start:]) == CONTINUATION


def test_generated_tokens_start_after_the_echoed_prompt_as_sent(client: openai.OpenAI, tiny) -> None:
    text = NOT_NFC["mixed"]
    choice = client.completions.create(model="tiny", prompt=text, echo=True, logprobs=1, max_tokens=4,
                                       temperature=0).choices[0]
    prompt = len(tiny.tokenizer.encode(text, add_special_tokens=False))
    assert choice.text.startswith(text) and choice.logprobs.text_offset[prompt] == len(text)


@pytest.mark.parametrize("batched", [False, True])
def test_a_prompt_of_token_ids_scores_as_its_text(client: openai.OpenAI, tiny, batched: bool) -> None:
    """lm-evaluation-harness sends token ids by default, in a list of prompts."""
    ids = tiny.tokenizer.encode(TEXT, add_special_tokens=False)
    as_ids = client.completions.create(model="tiny", prompt=[ids] if batched else ids, echo=True, logprobs=1,
                                       max_tokens=0).choices[0]
    as_text = score(client, TEXT).choices[0]
    assert as_ids.text == TEXT and as_ids.logprobs == as_text.logprobs


def test_the_draft_id_scores_with_the_draft(client: openai.OpenAI, tiny) -> None:
    ids = tiny.tokenizer.encode(TEXT, add_special_tokens=False)
    drafted = score(client, TEXT, model="tiny/draft")
    assert drafted.model == "tiny/draft"
    draft = drafted.choices[0].logprobs.token_logprobs[1:]
    assert draft == pytest.approx(prompt_reference(tiny.draft, ids), abs=1e-4)
    assert draft != pytest.approx(prompt_reference(tiny.target, ids), abs=1e-3)


def continued_chat(tiny, reply: str) -> tuple[list[dict], list[int]]:
    """A chat that ends inside the assistant's ``reply``, and its ids as transformers renders it."""
    messages = [{"role": "user", "content": "Summarize the budget debate."}, {"role": "assistant", "content": reply}]
    rendered = tiny.tokenizer.apply_chat_template(messages, continue_final_message=True, add_generation_prompt=False,
                                                  tokenize=False)
    return messages, tiny.tokenizer.encode(rendered, add_special_tokens=False)


@pytest.mark.parametrize(("model", "top"), [("tiny", 0), ("tiny", 3), ("tiny/draft", 0)])
def test_chat_prompt_logprobs_score_the_templated_prompt(client: openai.OpenAI, tiny, model: str, top: int) -> None:
    messages, ids = continued_chat(tiny, "The council approved a budget")
    assert chat_prompt(tiny.tokenizer, messages, add_generation_prompt=False, continue_final_message=True) == ids
    response = client.chat.completions.create(
        model=model, messages=messages, max_tokens=1, temperature=0,
        extra_body={"prompt_logprobs": top, "continue_final_message": True, "add_generation_prompt": False})
    entries = response.model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    logp = reference(tiny.draft if model == "tiny/draft" else tiny.target, ids)
    for i, entry in enumerate(entries[1:], 1):
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(logp[i - 1, ids[i]].item(), abs=1e-4)
        assert own["rank"] == int((logp[i - 1] > logp[i - 1, ids[i]]).sum()) + 1
        assert own["decoded_token"] == tiny.tokenizer.decode([ids[i]])
        best = logp[i - 1].topk(top).indices.tolist()
        assert set(entry) == {str(t) for t in [ids[i], *best]}
        assert [entry[str(t)]["rank"] for t in best] == list(range(1, top + 1))
    assert response.usage.completion_tokens == 1


def test_echo_with_generation_scores_prompt_and_completion(client: openai.OpenAI, tiny) -> None:
    ids = tiny.tokenizer.encode(TEXT, add_special_tokens=False)
    out = SpeculativeDecoder(tiny).generate([ids], 6)[0]
    response = client.completions.create(model="tiny", prompt=TEXT, echo=True, logprobs=2, max_tokens=6,
                                         temperature=0)
    choice = response.choices[0]
    assert choice.text == TEXT + tiny.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    whole = ids + out.token_ids
    assert choice.logprobs.tokens == [legacy_token(tiny.tokenizer, i) for i in whole]
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(prompt_reference(tiny.target, whole), abs=1e-4)
    assert choice.logprobs.text_offset[len(ids)] == len(TEXT)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(ids), 6)
    plain = client.completions.create(model="tiny", prompt=[TEXT], max_tokens=6, temperature=0).choices[0]
    assert (plain.text, plain.logprobs) == (choice.text[len(TEXT) :], None)


@pytest.mark.parametrize(("route", "body", "param"), [
    ("completions", {"model": "tiny", "prompt": "hi", "echo": True, "logprobs": 6, "max_tokens": 0}, "logprobs"),
    ("completions", {"model": "tiny", "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, None),
    ("completions", {"model": "tiny", "echo": True, "max_tokens": 0}, "prompt"),
    ("completions", {"model": "tiny", "prompt": "", "echo": True, "max_tokens": 0}, "prompt"),
    ("completions", {"model": "tiny", "prompt": ["a", "b"], "echo": True, "max_tokens": 0}, "prompt"),
    ("completions", {"model": "tiny", "prompt": [[1, 2], [3]], "echo": True, "max_tokens": 0}, "prompt"),
    ("completions", {"model": "tiny", "prompt": [1, -2], "echo": True, "max_tokens": 0}, "prompt"),
    ("completions", {"model": "tiny", "prompt": [[1, 99_999]], "echo": True, "max_tokens": 0}, "prompt"),
    ("completions", {"model": "tiny", "prompt": [1, "a"], "echo": True, "max_tokens": 0}, "prompt.str"),
    ("completions", {"model": "tiny", "prompt": "hi", "stream": True}, "stream"),
    ("completions", {"model": "tiny/draft", "prompt": "hi", "max_tokens": 4}, "model"),
    ("completions", {"model": "tiny", "prompt": "city council " * 3000, "echo": True, "max_tokens": 0}, "prompt"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 6},
     "prompt_logprobs"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "assistant", "content": "hi"}],
                          "continue_final_message": True}, None),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                          "continue_final_message": True, "add_generation_prompt": False}, None),
    ("chat/completions", {"model": "tiny/draft", "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("chat/completions", {"model": "tiny/draft", "messages": [{"role": "user", "content": "hi"}],
                          "prompt_logprobs": 0, "max_tokens": 5}, "model"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 0,
                          "stream": True}, "prompt_logprobs"),
])
def test_bad_scoring_requests_are_400(base_url: str, route: str, body: dict, param: str | None) -> None:
    response = post(base_url, route, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_metrics_count_scoring_requests(base_url: str, client: openai.OpenAI) -> None:
    def counts() -> tuple[float, float, float]:
        response = httpx.get(base_url.removesuffix("/v1") + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        samples = {(s.name, tuple(s.labels.values())): s.value
                   for family in text_string_to_metric_families(response.text) for s in family.samples}
        return (samples[("sidecar:requests_total", ("ok",))], samples[("sidecar:requests_total", ("4xx",))],
                samples[("sidecar:prompt_tokens_total", ())])

    before = counts()
    scored = score(client, TEXT, model="tiny/draft")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", echo=True, logprobs=6, max_tokens=0)
    assert counts() == (before[0] + 1, before[1] + 1, before[2] + scored.usage.prompt_tokens)


def test_an_unknown_model_is_404_on_completions(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="tiny/other", prompt="hi", echo=True, max_tokens=0)
    assert info.value.body["code"] == "model_not_found"


def test_scoring_leaves_concurrent_generations_as_they_are_alone(base_url: str, client: openai.OpenAI) -> None:
    """Scoring runs between the batch's steps on its worker: rows decoding meanwhile write the same tokens."""
    long = {"model": "tiny", "messages": [{"role": "user", "content": LONG}], "max_tokens": 160, "temperature": 0}
    seeded = {**long, "max_tokens": 40, "temperature": 1, "seed": 7}
    alone = [post(base_url, "chat/completions", body).json()["choices"][0] for body in (long, seeded)]
    assert alone[0]["finish_reason"] == "length", "the long answer must run to its limit"
    scored_alone = [score(client, TEXT, model).choices[0].logprobs.token_logprobs for model in ("tiny", "tiny/draft")]
    pieces: list[str] = []
    scores = None
    with ThreadPoolExecutor(2) as pool, httpx.stream(
            "POST", f"{base_url}/chat/completions", json={**long, "stream": True}, timeout=300,
            headers={"Authorization": f"Bearer {KEY}"}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            pieces.append(json.loads(line.removeprefix("data: "))["choices"][0]["delta"].get("content") or "")
            if scores is None and any(pieces):  # the long answer is decoding: score, and sample beside it
                sampled = pool.submit(post, base_url, "chat/completions", seeded)
                scores = pool.submit(lambda: [score(client, TEXT, model).choices[0].logprobs.token_logprobs
                                              for model in ["tiny", "tiny/draft"] * 3])
        scored_while_decoding = scores is not None and scores.done()
    assert scored_while_decoding, "the scores, asked for after the long answer began, came before its end"
    assert "".join(pieces) == alone[0]["message"]["content"]
    assert sampled.result().json()["choices"][0]["message"]["content"] == alone[1]["message"]["content"]
    assert scores.result() == scored_alone * 3


def test_prompts_sharing_a_prefix_reuse_it_and_score_as_alone(base_url: str, client: openai.OpenAI, tiny) -> None:
    """The worker's prefix cache: the second prompt forwards only what follows the shared summary; the
    numbers are a whole forward's, and the /stats and /metrics counters say what was reused."""
    def cache_stats() -> tuple[dict, float]:
        headers = {"Authorization": f"Bearer {KEY}"}
        counters = httpx.get(base_url.removesuffix("/v1") + "/stats", headers=headers).json()["prompt_cache"]
        metrics = httpx.get(base_url.removesuffix("/v1") + "/metrics", headers=headers).text
        reused = next(s.value for family in text_string_to_metric_families(metrics) for s in family.samples
                      if s.name == "sidecar:prompt_cache_reused_tokens_total" and s.labels == {"model": "target"})
        return counters["target"], reused

    summary = LONG + " Tags:"
    texts = [summary + " #budget #roads", summary + " #schools #council #vote"]
    first, second = (tiny.tokenizer.encode(text, add_special_tokens=False) for text in texts)
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert shared >= 16
    score(client, texts[0], logprobs=0)
    before, reused_before = cache_stats()
    echoed = score(client, texts[1], logprobs=0).choices[0].logprobs
    after, reused_after = cache_stats()
    assert after["hits"] - before["hits"] == 1 and after["misses"] == before["misses"]
    assert after["reused_tokens"] - before["reused_tokens"] == shared - 1 == reused_after - reused_before
    assert after["forwarded_tokens"] - before["forwarded_tokens"] == len(second) - shared + 1
    assert echoed.token_logprobs[1:] == pytest.approx(prompt_reference(tiny.target, second), abs=1e-4)


@pytest.mark.servers
def test_without_the_prompt_cache_every_prompt_is_forwarded_whole(tiny) -> None:
    """``prompt_cache`` off (``sidecar serve --no-prompt-cache``): the worker keeps no prefix cache, so a prompt
    sharing its summary with the one before forwards every token; ``/stats`` has no ``prompt_cache`` models
    and ``/metrics`` no ``sidecar:prompt_cache_*`` samples."""
    summary = LONG + " Tags:"
    texts = [summary + " #budget #roads", summary + " #schools #council #vote"]
    forwarded: list[int] = []
    hook = tiny.target.get_input_embeddings().register_forward_hook(lambda _, args, __: forwarded.append(
        args[0].numel()))
    try:
        with serving(create_app(SidecarEngine(tiny), ServerConfig(model_name="tiny", prompt_cache=False))) as (url, _):
            echoed = [httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": text, "echo": True, "logprobs": 0, "max_tokens": 0}).json()
                for text in texts]
            stats = httpx.get(f"{url}/stats", timeout=60).json()
            metrics = httpx.get(f"{url}/metrics", timeout=60).text
    finally:
        hook.remove()
    prompts = [tiny.tokenizer.encode(text, add_special_tokens=False) for text in texts]
    assert forwarded == [len(prompt) for prompt in prompts]
    for body, prompt in zip(echoed, prompts, strict=True):
        assert body["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(
            prompt_reference(tiny.target, prompt), abs=1e-4)
    assert stats["prompt_cache"] == {}
    assert not [s for family in text_string_to_metric_families(metrics) for s in family.samples
                if s.name.startswith("sidecar:prompt_cache_")]
