"""Stop strings: found where decoding the whole output after each token finds them, at a cost linear in the
output, capped in the API, and searched off the event loop."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator, Sequence

import httpx
import pytest
from fastapi import FastAPI
from serving import chat, serving

from server.app import create_app
from server.config import ServerConfig
from server.stream import TextStream
from sidecar import SidecarEngine, SpeculativeDecoder
from sidecar.decoding.stops import MAX_STOP_CHARS, MAX_STOP_STRINGS, TokenStops

TEXTS = ["héllo wörld — ünïcode 日本語", "The city council approved a new budget.", "aaaa abab aabaab <|im_end|> x"]


def random_ids(tok, rng: random.Random, n: int) -> list[int]:
    """Token ids as a model may emit them: pieces of real text, stray bytes (partial characters), specials."""
    ids: list[int] = []
    while len(ids) < n:
        if rng.random() < 0.5:
            ids += tok.encode(rng.choice(TEXTS), add_special_tokens=False)[: rng.randint(1, 6)]
        else:
            ids.append(rng.randrange(len(tok)))
    return ids[:n]


def random_stops(tok, rng: random.Random, ids: list[int]) -> list[str]:
    """Stop strings cut from the decoded text (so they span token boundaries) plus a few that rarely occur."""
    text = tok.decode(ids)
    stops = []
    for _ in range(rng.randint(1, MAX_STOP_STRINGS)):
        if rng.random() < 0.7 and len(text) > 1:
            start = rng.randrange(len(text) - 1)
            stops.append(text[start : start + rng.randint(1, 6)])
        else:
            stops.append("".join(rng.choice("abö ") for _ in range(rng.randint(1, 4))))
    return stops


def reference_first_stop(tok, ids: list[int], stops: Sequence[str]) -> int | None:
    """The index of the first token after which the decoded output holds a stop string: decode it all each time."""
    return next((k for k in range(len(ids)) if any(s in tok.decode(ids[: k + 1]) for s in stops)), None)


def test_token_stops_find_what_decoding_everything_finds(tiny) -> None:
    tok, rng = tiny.tokenizer, random.Random(0)
    for _ in range(150):
        ids = random_ids(tok, rng, rng.randint(1, 40))
        stops = random_stops(tok, rng, ids)
        expected = reference_first_stop(tok, ids, stops)
        scanner, got, fed = TokenStops(tok, stops), None, 0
        while fed < len(ids) and got is None:  # in steps of a few tokens, as the engine commits them
            step = ids[fed : fed + rng.randint(1, 5)]
            k = scanner.first(step)
            got = None if k is None else fed + k
            fed += len(step)
        assert got == expected, (ids, stops)


class ReferenceStream:
    """What a stream releases, computed from the whole text after every push: the text grows to the full
    decode whenever that ends in a whole character; it is released up to the first stop string, less a tail
    that may be the start of one."""

    def __init__(self, tok, stops: Sequence[str]) -> None:
        self.tok, self.stops, self.ids, self.text, self.sent, self.stopped = tok, tuple(stops), [], "", 0, False

    def push(self, ids: list[int], final: bool = False) -> str:
        if self.stopped:
            return ""
        self.ids += ids
        full = self.tok.decode(self.ids, skip_special_tokens=True)
        if final or not full.endswith("\ufffd"):
            self.text = full
        end = len(self.text)
        hits = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
        if hits:
            end, self.stopped = min(hits), True
        elif not final:
            end -= max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        end = max(end, self.sent)
        chunk, self.sent = self.text[self.sent : end], end
        return chunk


def test_text_stream_releases_what_searching_the_whole_text_releases(tiny) -> None:
    tok, rng = tiny.tokenizer, random.Random(1)
    for _ in range(150):
        ids = random_ids(tok, rng, rng.randint(1, 40))
        stops = random_stops(tok, rng, ids) if rng.random() < 0.9 else []
        stream, reference, fed = TextStream(tok, stops), ReferenceStream(tok, stops), 0
        got, expected = [], []
        while fed < len(ids):
            step = ids[fed : fed + rng.randint(1, 5)]
            fed += len(step)
            got.append(stream.push(step))
            expected.append(reference.push(step))
        got.append(stream.finish())
        expected.append(reference.push([], final=True))
        assert (got, stream.stopped) == (expected, reference.stopped), (ids, stops)


@pytest.mark.timeout(120)
def test_text_stream_cost_does_not_grow_with_stop_length_or_output(tiny) -> None:
    # four 240k-character stop strings that the output keeps almost matching: searching the whole text
    # and every prefix of every stop string on each push took minutes
    tok = tiny.tokenizer
    ids = tok.encode("a" * 3000, add_special_tokens=False)
    stream = TextStream(tok, ["a" * 240_000 + tail for tail in "bcde"])
    started = time.perf_counter()
    pieces = [stream.push([i]) for i in ids]
    assert "".join(pieces) == "" and stream.finish() == "a" * 3000
    assert time.perf_counter() - started < 60  # about a second; minutes when quadratic


def test_engine_decodes_each_token_a_bounded_number_of_times_for_stop_strings(tiny, monkeypatch) -> None:
    tok = tiny.tokenizer
    prompts = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    free = SpeculativeDecoder(tiny).generate(prompts, max_new_tokens=80)
    assert all(o.finish_reason == "length" for o in free), "the prompts should decode to the limit"
    # a stop string from late in the first row's output; most of its characters span token boundaries
    text = tok.decode(free[0].token_ids)
    stop_text = text[len(text) * 3 // 4 :][:3]
    decoded, decode = [], tok.decode

    def counting(ids: list[int], *args: object, **kwargs: object) -> str:
        decoded.append(len(ids))
        return decode(ids, *args, **kwargs)

    monkeypatch.setattr(tok, "decode", counting)
    outs = SpeculativeDecoder(tiny).generate(prompts, max_new_tokens=80, stop=[stop_text, "never here"])
    monkeypatch.undo()
    for free_out, out in zip(free, outs, strict=True):
        cut = reference_first_stop(tok, free_out.token_ids, [stop_text, "never here"])
        expected = free_out.token_ids if cut is None else free_out.token_ids[: cut + 1]
        assert out.token_ids == expected
        assert out.finish_reason == ("length" if cut is None else "stop")
    assert outs[0].finish_reason == "stop"
    new_tokens = sum(len(o.token_ids) for o in outs)
    # each output's final decode reads it once; the stop search a few tokens per token, not the whole output
    # about 5 here: the output's final decode, and a stop search that decodes a token or two per token;
    # decoding the whole output after each token reads ~n/2 per token (40 here)
    assert sum(decoded) <= 8 * new_tokens, (sum(decoded), new_tokens)


# -- the server --


@pytest.fixture(scope="module")
def tiny_server(tiny) -> Iterator[tuple[str, FastAPI, threading.Thread]]:
    app = create_app(SidecarEngine(tiny), ServerConfig(model_name="tiny"))
    with serving(app) as (url, loop_thread):
        yield url, app, loop_thread


@pytest.mark.parametrize(("stop", "accepted"), [
    (["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS, True),
    (["x" * (MAX_STOP_CHARS + 1)], False),
    ("x" * (MAX_STOP_CHARS + 1), False),
    (["x" * 240_000] * 4, False),
    (["x"] * (MAX_STOP_STRINGS + 1), False),
])
def test_stop_strings_beyond_the_caps_are_400(tiny_server, stop: object, accepted: bool) -> None:
    url = tiny_server[0]
    response = httpx.post(url + "/v1/chat/completions", json=chat("hi", max_tokens=4, stop=stop), timeout=60)
    if accepted:
        assert response.status_code == 200
    else:
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "stop"


def test_health_answers_while_a_request_with_the_largest_stop_strings_streams(tiny_server) -> None:
    url = tiny_server[0]
    # stop strings the output keeps almost matching, so every push holds text back and searches
    stop = ["\ufffd" * (MAX_STOP_CHARS - 1) + tail for tail in "wxyz"]
    latencies: list[float] = []
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120,
                      json=chat("The city council approved a new budget on Tuesday.", max_tokens=300, stop=stop,
                                stream=True)) as response:
        assert response.status_code == 200
        for n, _ in enumerate(response.iter_lines()):
            if n % 20 == 0:
                started = time.perf_counter()
                assert httpx.get(url + "/health", timeout=30).status_code == 200
                latencies.append(time.perf_counter() - started)
    assert latencies and max(latencies) < 2.0, latencies  # generous on a loaded machine; milliseconds when idle


def test_no_tokenizer_work_runs_on_the_event_loop(tiny_server, monkeypatch) -> None:
    url, app, loop_thread = tiny_server
    tokenizer = app.state.service.tokenizer
    threads: list[str] = []
    for name in ("encode", "decode", "apply_chat_template", "convert_ids_to_tokens"):
        method = getattr(tokenizer, name)

        def recording(*args: object, _method=method, **kwargs: object) -> object:
            threads.append(threading.current_thread().name)
            return _method(*args, **kwargs)

        monkeypatch.setattr(tokenizer, name, recording)
    body = chat("Prices rose 3.5 percent in 2017.", max_tokens=24, stop=["zz"], logprobs=True, top_logprobs=2)
    assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    with httpx.stream("POST", url + "/v1/chat/completions", json=body | {"stream": True}, timeout=60) as response:
        assert response.status_code == 200 and list(response.iter_lines())
    assert threads, "the service tokenizes and detokenizes with its own tokenizer"
    assert loop_thread.name not in threads, "tokenizer work ran on the event loop"
