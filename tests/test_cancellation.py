"""A request nobody waits for leaves its batch at the next step; the rows that stay decode as if it had finished."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serving import chat, serving

from server.app import create_app
from server.config import ServerConfig
from server.stream import full_text
from sidecar import HASHTAGS, SidecarEngine, SidecarRequest, SpeculativeDecoder
from sidecar.decoding.rows import GenerationOutput
from sidecar.tasks.batch import SidecarBatch
from sidecar.tasks.rows import DocumentResult

DOCS = [
    "The city council approved a new budget on Tuesday after a long debate about schools and roads.",
    "Prices rose 3.5 percent in 2017 while 1,200 workers lost their jobs at the factory in Berlin.",
    "The president met leaders in Moscow and Doha.",
]


def chat_ids(tiny, prompt: str) -> list[int]:
    tok = tiny.tokenizer
    rendered = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=False)
    return tok.encode(rendered, add_special_tokens=False)


class CancelAfter:
    """Cancels row ``row`` once it has ``tokens`` tokens; counts the tokens every row receives."""

    def __init__(self, row: int, tokens: int) -> None:
        self.row, self.tokens, self.seen = row, tokens, {}

    def on_tokens(self, row: int, ids: list[int], _: object) -> None:
        self.seen[row] = self.seen.get(row, 0) + len(ids)

    def __call__(self, row: int) -> bool:
        return row == self.row and self.seen.get(row, 0) >= self.tokens


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_cancelled_row_leaves_and_the_others_are_unchanged(tiny, adaptive: bool, prefill_forwards) -> None:
    prompts = [chat_ids(tiny, d) for d in DOCS]
    alone = SpeculativeDecoder(tiny, gamma=3, adaptive=adaptive).generate(prompts, max_new_tokens=40)
    cancel = CancelAfter(row=1, tokens=5)
    outs = SpeculativeDecoder(tiny, gamma=3, adaptive=adaptive).generate(
        prompts, max_new_tokens=40, on_tokens=cancel.on_tokens, cancelled=cancel)
    assert outs[1].finish_reason == "cancelled"
    # checked between steps: the row has at most one step's tokens (pending + gamma) beyond the threshold
    assert 5 <= len(outs[1].token_ids) == cancel.seen[1] < 5 + 3 + 1
    assert outs[1].token_ids == alone[1].token_ids[: len(outs[1].token_ids)]
    for i in (0, 2):
        assert (outs[i].token_ids, outs[i].finish_reason) == (alone[i].token_ids, alone[i].finish_reason)


@pytest.mark.slow
def test_a_cancelled_row_leaves_a_compiled_batch_and_the_others_are_unchanged() -> None:
    """In ``compile`` mode too (a one-layer pair of its own: compiling is slow on a CPU): the batch narrows to a
    smaller bucket when the row leaves, and the rows that stay write what they wrote with nobody cancelled."""
    from sidecar.models.tiny import tiny_pair

    pair = tiny_pair(layers=1)
    prompts = [chat_ids(pair, d) for d in DOCS]
    decoder = SpeculativeDecoder(pair, gamma=3, adaptive=False, capture="compile")
    alone = decoder.generate(prompts, max_new_tokens=40)
    cancel = CancelAfter(row=1, tokens=5)
    outs = decoder.generate(prompts, max_new_tokens=40, on_tokens=cancel.on_tokens, cancelled=cancel)
    assert pair.capture_mode == "compile" and outs[1].finish_reason == "cancelled"
    assert 5 <= len(outs[1].token_ids) == cancel.seen[1] < 5 + 3 + 1
    assert outs[1].token_ids == alone[1].token_ids[: len(outs[1].token_ids)]
    for i in (0, 2):
        assert (outs[i].token_ids, outs[i].finish_reason) == (alone[i].token_ids, alone[i].finish_reason)


def test_a_cancelled_request_gets_no_sidecars_and_the_others_are_unchanged(tiny) -> None:
    engine = SidecarEngine(tiny, gamma=3, adaptive=False)
    requests = [SidecarRequest(d, sidecars=[HASHTAGS]) for d in DOCS]
    alone = engine.run(requests, max_new_tokens=24)
    cancel = CancelAfter(row=0, tokens=3)
    results = engine.run(requests, max_new_tokens=24, on_tokens=cancel.on_tokens, cancelled=cancel)
    assert results[0].main.finish_reason == "cancelled" and results[0].sidecars == {}
    for i in (1, 2):
        assert results[i].main.token_ids == alone[i].main.token_ids
        assert results[i].sidecars["hashtags"].token_ids == alone[i].sidecars["hashtags"].token_ids


class RecordedSteps:
    """What every running batch of sidecar requests does from now on: its main outputs by the index the server
    gave its request (the order requests joined), and the rows live in each of its decoding steps."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.outputs: dict[int, GenerationOutput] = {}
        self.batches: list[SidecarBatch] = []
        step = SidecarBatch.step

        def recording(batch: SidecarBatch) -> list[tuple[int, DocumentResult]]:
            if batch not in self.batches:
                self.batches.append(batch)
            done = step(batch)
            self.outputs.update((index, result.main) for index, result in done)
            return done

        monkeypatch.setattr(SidecarBatch, "step", recording)

    @property
    def most_live(self) -> int:
        return max((s.live for batch in self.batches for s in batch.trace.steps), default=0)


@pytest.mark.servers
def test_a_client_that_drops_its_stream_stops_its_decoding(tiny, monkeypatch) -> None:
    engine = SidecarEngine(tiny)
    recorded = RecordedSteps(monkeypatch)
    dropped_prompt, kept_prompt, limit = DOCS[0], DOCS[1], 1000
    # a wide admission window, so that both requests reliably join the idle batch together
    app = create_app(engine, ServerConfig(model_name="tiny", batch_wait_ms=1000))
    with serving(app) as (url, _), ThreadPoolExecutor(1) as pool:
        endpoint = url + "/v1/chat/completions"
        with httpx.stream("POST", endpoint, json=chat(dropped_prompt, max_tokens=limit, stream=True),
                          timeout=300) as response:
            kept = pool.submit(httpx.post, endpoint, json=chat(kept_prompt, max_tokens=60), timeout=300)
            contents = 0
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    contents += bool(json.loads(line.removeprefix("data: "))["choices"][0]["delta"].get("content"))
                if contents == 3:
                    break  # leaving the block closes the connection mid-stream
        kept_body = kept.result().json()
        assert httpx.post(endpoint, json=chat("hi", max_tokens=4), timeout=60).status_code == 200
        stats = httpx.get(url + "/stats", timeout=60).json()
    assert recorded.most_live == 2  # the two decoded together
    dropped, kept_out, _ = (recorded.outputs[i] for i in range(3))
    assert dropped.finish_reason == "cancelled" and len(dropped.token_ids) < limit
    assert (stats["cancelled_requests"], stats["cancelled_tokens"]) == (1, len(dropped.token_ids))
    # both rows as they decode without the drop: the dropped one up to where it left, the other to its end
    reference = SpeculativeDecoder(tiny).generate([chat_ids(tiny, dropped_prompt), chat_ids(tiny, kept_prompt)],
                                                  [len(dropped.token_ids), 60])
    assert dropped.token_ids == reference[0].token_ids
    assert kept_out.token_ids == reference[1].token_ids
    assert kept_body["choices"][0]["message"]["content"] == full_text(tiny.tokenizer, reference[1].token_ids, ())[0]


@pytest.mark.servers
def test_a_client_that_gives_up_on_a_plain_request_stops_its_decoding(tiny, monkeypatch) -> None:
    engine = SidecarEngine(tiny)
    recorded = RecordedSteps(monkeypatch)
    # long enough to outlast the client's second many times over: our own forward decodes the tiny pair's 1,000
    # tokens in 0.9 s on a quiet 2-core CPU, so a limit of 1,000 let the request finish before the client left
    limit = 4000
    with serving(create_app(engine, ServerConfig(model_name="tiny"))) as (url, _):
        endpoint = url + "/v1/chat/completions"
        with pytest.raises(httpx.ReadTimeout):  # the client closes its connection after a second
            httpx.post(endpoint, json=chat("The city council approved a new budget on Tuesday.", max_tokens=limit),
                       timeout=httpx.Timeout(60, read=1.0))
        assert httpx.post(endpoint, json=chat("hi", max_tokens=4), timeout=60).status_code == 200
        stats = httpx.get(url + "/stats", timeout=60).json()
    assert len(recorded.outputs) == 2
    gone, short = recorded.outputs[0], recorded.outputs[1]
    assert gone.finish_reason == "cancelled" and len(gone.token_ids) < limit
    assert short.finish_reason != "cancelled"
    assert (stats["cancelled_requests"], stats["cancelled_tokens"]) == (1, len(gone.token_ids))


@pytest.mark.servers
def test_a_client_that_leaves_during_its_sidecars_ends_them(tiny, monkeypatch) -> None:
    """#34.8: a request whose client leaves while its sidecars decode frees their slots at the next step, and
    the server counts it as cancelled (on 556d98e its 16 sidecars of 1,024 tokens ran on: cancelled_requests 0)."""
    engine = SidecarEngine(tiny)
    recorded = RecordedSteps(monkeypatch)
    sidecars = [{"name": f"tags{i}", "instruction": "Then list every tag you can think of.", "max_tokens": 1024}
                for i in range(16)]
    with serving(create_app(engine, ServerConfig(model_name="tiny"))) as (url, _):
        endpoint = url + "/v1/chat/completions"
        body = chat(DOCS[0], max_tokens=3) | {"sidecars": sidecars}
        with pytest.raises(httpx.ReadTimeout):  # the main output takes 3 tokens; the client leaves a second in
            httpx.post(endpoint, json=body, timeout=httpx.Timeout(60, read=1.0))
        assert httpx.post(endpoint, json=chat("hi", max_tokens=4), timeout=60).status_code == 200
        stats = httpx.get(url + "/stats", timeout=60).json()
    gone = recorded.outputs[0]
    assert gone.finish_reason != "cancelled"  # its main output was done: it left during its sidecars
    assert stats["cancelled_requests"] == 1
    assert stats["cancelled_tokens"] < len(gone.token_ids) + 16 * 1024
