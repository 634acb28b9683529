"""The server's continuous batch: requests join a running batch whatever their settings, leave when done, and
every job is answered exactly once, on the tiny pair."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch
from serving import chat, serving

from server.app import create_app
from server.config import ServerConfig
from server.errors import APIError
from server.schema import ChatCompletionRequest, CompletionRequest
from server.service import ChatService
from server.worker import Job
from sidecar import HASHTAGS, SidecarEngine
from sidecar.errors import InputError
from sidecar.tasks.batch import SidecarBatch

LONG = "The city council approved a new budget on Tuesday after a long debate about schools and roads."
SHORT = "Prices rose 3.5 percent in 2017."
OTHERS = ["Officials said the plan would add jobs at the plant.", "The team won its third game in a row.",
          "Leaders signed an agreement on climate and technology.", "1,200 workers lost their jobs at the factory."]
TAGS = {"name": "hashtags", "instruction": HASHTAGS.instruction, "max_tokens": 8, "parser": "hashtags"}


@pytest.fixture(scope="module")
def engine(tiny) -> SidecarEngine:
    return SidecarEngine(tiny)


@contextlib.contextmanager
def started(engine: SidecarEngine, **config: Any) -> Iterator[ChatService]:
    """A chat service whose worker runs, without HTTP in front of it."""
    service = ChatService(engine, ServerConfig(model_name="tiny", **config))
    service.worker.start()
    try:
        yield service
    finally:
        service.worker.stop()
        service.close()


async def submit(service: ChatService, body: dict) -> tuple[ChatCompletionRequest, Job]:
    req = ChatCompletionRequest.model_validate(body)
    return req, await service.submit(req)


async def answer(service: ChatService, body: dict) -> dict:
    """The non-streamed response body to ``body``; a worker that never answers fails the test."""
    req, job = await submit(service, body)
    return service.completion(req, job, await asyncio.wait_for(job.future, 300), "chatcmpl-test", 0)


async def answers(service: ChatService, bodies: list[dict]) -> list[dict]:
    """Responses to ``bodies``, all queued before the first is answered."""
    return list(await asyncio.gather(*(answer(service, body) for body in bodies)))


def text(response: dict) -> str:
    return response["choices"][0]["message"]["content"]


def blocking_steps(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """(entered, release): every batch step waits for ``release``, and ``entered`` says one has begun."""
    step = SidecarBatch.step
    entered, release = threading.Event(), threading.Event()

    def blocked(batch: SidecarBatch) -> object:
        entered.set()
        assert release.wait(60)
        return step(batch)

    monkeypatch.setattr(SidecarBatch, "step", blocked)
    return entered, release


@pytest.mark.servers
def test_a_short_request_sent_while_a_long_one_decodes_finishes_first(engine: SidecarEngine) -> None:
    with started(engine) as service:  # the expected answers, each decoded alone
        long_alone, short_alone = (asyncio.run(answer(service, chat(p, max_tokens=m))) for p, m in
                                   [(LONG, 160), (SHORT, 6)])
    assert long_alone["choices"][0]["finish_reason"] == "length", "the long answer must run to its limit"
    with serving(create_app(engine, ServerConfig(model_name="tiny", batch_wait_ms=0))) as (url, _), \
            ThreadPoolExecutor(1) as pool:
        endpoint = url + "/v1/chat/completions"
        pieces: list[str] = []
        short = None
        with httpx.stream("POST", endpoint, json=chat(LONG, max_tokens=160, stream=True), timeout=300) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                pieces.append(json.loads(line.removeprefix("data: "))["choices"][0]["delta"].get("content") or "")
                if short is None and any(pieces):  # the long request is decoding: send the short one
                    short = pool.submit(httpx.post, endpoint, json=chat(SHORT, max_tokens=6), timeout=300)
            # the long stream has ended: the short request, sent after it began, must already be answered
            short_done_first = short is not None and short.done()
        assert short_done_first
        assert text(short.result().json()) == text(short_alone)
        assert "".join(pieces) == text(long_alone)


def test_requests_with_different_settings_share_one_step(engine: SidecarEngine) -> None:
    bodies = [chat(LONG, max_tokens=16), chat(OTHERS[0], max_tokens=16, stop=["e t"]),
              chat(OTHERS[1], max_tokens=16, logprobs=True, top_logprobs=2),
              chat(OTHERS[2], max_tokens=16, temperature=0.9, top_p=0.9, seed=11),
              chat(OTHERS[3], max_tokens=16, sidecars=[TAGS])]
    with started(engine, batch_wait_ms=1000) as service:
        alone = [asyncio.run(answer(service, body)) for body in bodies]
        assert service.worker.stats.snapshot()["max_step_size"] == 1
        together = asyncio.run(answers(service, bodies))
        stats = service.worker.stats.snapshot()
    assert stats["max_step_size"] == len(bodies), stats  # all five in one step
    assert stats["failed_steps"] == 0 and stats["requests"] == 2 * len(bodies)
    for one, shared in zip(alone, together, strict=True):
        assert text(shared) == text(one)
        assert shared["choices"][0]["finish_reason"] == one["choices"][0]["finish_reason"]
    entries = together[2]["choices"][0]["logprobs"]["content"]
    assert len(entries) == together[2]["usage"]["completion_tokens"] and len(entries[0]["top_logprobs"]) == 2
    assert together[0]["choices"][0]["logprobs"] is None and "hashtags" in together[4]["sidecars"]


@pytest.mark.parametrize("sidecars", [None, [TAGS]])
def test_a_seeded_request_gives_the_same_text_alone_and_batched(engine: SidecarEngine, sidecars: list | None) -> None:
    extra = {"sidecars": sidecars} if sidecars else {}
    seeded = chat(SHORT, max_tokens=20, temperature=1.0, seed=1234, **extra)
    # others of every kind around it, seeded ones too, so its draws would show any sharing
    others = [chat(OTHERS[0], max_tokens=24), chat(OTHERS[1], max_tokens=12, temperature=0.7, seed=1234),
              chat(OTHERS[2], max_tokens=28, temperature=1.3, top_p=0.8, seed=5, **extra),
              chat(OTHERS[3], max_tokens=6, temperature=1.0)]
    with started(engine, batch_wait_ms=1000) as service:
        alone = asyncio.run(answer(service, seeded))
        together = asyncio.run(answers(service, [others[0], others[1], seeded, others[2], others[3]]))[2]
        again = asyncio.run(answers(service, [*others[:2], seeded]))[2]
        stats = service.worker.stats.snapshot()
    assert stats["max_step_size"] == 5  # it did share its steps
    assert text(together) == text(again) == text(alone)
    if sidecars:
        assert together["sidecars"]["hashtags"]["text"] == alone["sidecars"]["hashtags"]["text"]


@pytest.mark.parametrize(("error", "status", "code"), [
    (InputError("the engine refused it"), 400, None),
    (torch.OutOfMemoryError("CUDA out of memory"), 503, "out_of_memory"),
    (RuntimeError("a bug"), 500, None),
])
def test_a_step_that_raises_fails_its_batch_and_the_worker_goes_on(engine: SidecarEngine, monkeypatch,
                                                                   error: Exception, status: int,
                                                                   code: str | None) -> None:
    step = SidecarBatch.step

    def broken(batch: SidecarBatch) -> object:
        raise error

    monkeypatch.setattr(SidecarBatch, "step", broken)
    with started(engine, batch_wait_ms=500) as service:
        async def run() -> list[BaseException | dict]:
            return await asyncio.gather(answer(service, chat(LONG, max_tokens=4)),
                                        answer(service, chat(SHORT, max_tokens=4, sidecars=[TAGS])),
                                        return_exceptions=True)

        failures = asyncio.run(run())
        monkeypatch.setattr(SidecarBatch, "step", step)
        after = asyncio.run(answer(service, chat(SHORT, max_tokens=4)))
        stats = service.worker.stats.snapshot()
    assert all(isinstance(f, APIError) and (f.status, f.code) == (status, code) for f in failures), failures
    assert after["choices"][0]["finish_reason"] in ("stop", "length")
    assert (stats["failed_steps"], stats["failed_requests"], stats["requests"]) == (1, 2, 3)


def test_a_request_the_batch_refuses_fails_alone(engine: SidecarEngine, monkeypatch) -> None:
    add_row = SidecarBatch.add_row

    def refusing(batch: SidecarBatch, index: int, row: object) -> None:
        if row.max_new_tokens == 3:
            raise InputError("refused")
        add_row(batch, index, row)

    monkeypatch.setattr(SidecarBatch, "add_row", refusing)
    with started(engine, batch_wait_ms=500) as service:
        async def run() -> list[BaseException | dict]:
            return await asyncio.gather(answer(service, chat(LONG, max_tokens=3)),
                                        answer(service, chat(SHORT, max_tokens=4)), return_exceptions=True)

        refused, served = asyncio.run(run())
        stats = service.worker.stats.snapshot()
    assert isinstance(refused, APIError) and refused.status == 400
    assert served["choices"][0]["finish_reason"] in ("stop", "length")
    assert (stats["requests"], stats["failed_requests"], stats["failed_steps"]) == (2, 1, 0)


def test_a_request_whose_client_left_before_it_joined_costs_nothing(engine: SidecarEngine, monkeypatch) -> None:
    entered, release = blocking_steps(monkeypatch)
    joined: list[int] = []
    add_row = SidecarBatch.add_row
    monkeypatch.setattr(SidecarBatch, "add_row", lambda batch, index, row: (joined.append(index),
                                                                            add_row(batch, index, row))[1])
    with started(engine, max_batch=1, batch_wait_ms=0) as service:
        async def run() -> tuple[dict, bool]:
            running = asyncio.ensure_future(answer(service, chat(LONG, max_tokens=4)))
            while not entered.is_set():
                await asyncio.sleep(0.01)
            _, left = await submit(service, chat(SHORT, max_tokens=4))  # queued behind the full batch
            left.cancel()
            release.set()
            return await running, left.future.cancelled()

        first, cancelled = asyncio.run(run())
        after = asyncio.run(answer(service, chat(SHORT, max_tokens=4)))
        stats = service.worker.stats.snapshot()
    assert cancelled and text(first) is not None and text(after) is not None
    assert joined == [0, 1]  # the request that left never joined the batch
    assert stats["requests"] == 2 and stats["cancelled_requests"] == 0


def test_stopping_finishes_the_batch_and_refuses_what_queued_after(engine: SidecarEngine, monkeypatch) -> None:
    entered, release = blocking_steps(monkeypatch)
    with started(engine, max_batch=1, batch_wait_ms=0) as service:
        async def run() -> list[object]:
            jobs = [(await submit(service, chat(LONG, max_tokens=4)))[1]]
            while not entered.is_set():
                await asyncio.sleep(0.01)
            jobs.append((await submit(service, chat(SHORT, max_tokens=4)))[1])  # waits for a slot
            stopping = threading.Thread(target=service.worker.stop)
            stopping.start()
            while service.worker.queue.qsize() < 2:  # the stop sentinel is queued behind the second job
                await asyncio.sleep(0.01)
            jobs.append((await submit(service, chat(SHORT, max_tokens=4)))[1])  # after the sentinel
            release.set()
            results = await asyncio.wait_for(asyncio.gather(*(job.future for job in jobs), return_exceptions=True),
                                             300)
            await asyncio.to_thread(stopping.join)
            return results

        first, second, late = asyncio.run(run())
    assert first.finish_reason in ("eos", "length") and second.finish_reason in ("eos", "length")
    assert isinstance(late, APIError) and (late.status, late.code) == (503, "shutting_down")
    assert not service.worker._thread.is_alive()


@pytest.mark.slow
def test_a_long_lived_batch_keeps_its_memory_flat(engine: SidecarEngine) -> None:
    """The server keeps one batch for its whole life: 3,500 steps of requests joining and leaving, some with
    sidecars, leave its Python memory and its records the size they were after the first 1,500, by when its
    bounded windows are full (the controller's 1,024 decisions the largest).

    Python memory is counted in the interpreter's allocated blocks (``sys.getallocatedblocks``), which costs
    nothing per step, unlike tracing every allocation: anything kept per step or per request (2,000 of each)
    would add at least one block each, while a bounded window adds none once full."""
    import gc
    import sys

    from sidecar.decoding.controller import DECISIONS_KEPT
    from sidecar.decoding.rows import DecodeRow
    from sidecar.tasks.rows import SidecarRequest

    batch = engine.batch(2, trace_keep=64)
    prompt = engine.prompts(SidecarRequest(SHORT))[0].token_ids
    added = 0

    def run(steps: int) -> None:
        nonlocal added
        for _ in range(steps):
            while batch.wants_rows():
                if added % 5 == 0:
                    batch.add(added, SidecarRequest(SHORT, sidecars=[HASHTAGS.model_copy(update={"max_new_tokens": 3})],
                                                    max_new_tokens=3))
                else:
                    batch.add_row(added, DecodeRow(prompt, 2 + added % 3))
                added += 1
            batch.step()

    run(1_500)
    assert len(engine.decoder.controller.decisions) == DECISIONS_KEPT, "the warm-up fills the largest window"
    gc.collect()  # garbage the collector would free is no growth
    before, admitted = sys.getallocatedblocks(), added
    run(2_000)
    gc.collect()
    growth = sys.getallocatedblocks() - before
    assert added - admitted > 1_500
    # rows in flight at either end and the allocator's own caches move the count by 30-120 blocks; a block kept
    # every fourth step would pass 500
    assert growth < 500, f"Python memory grew by {growth} blocks over 2,000 steps and {added - admitted} requests"
    slots = batch.slots
    assert len(slots.trace.events) <= 64 and len(slots.ledger.records) <= 64
    assert len(engine.decoder.controller.decisions) <= DECISIONS_KEPT and len(batch.requests) <= 4


def test_out_of_memory_in_a_step_releases_the_free_kv_caches(engine: SidecarEngine, monkeypatch) -> None:
    """Caches batches gave back are kept for the next batch (``sidecar.runtime.pools``); a step that runs out
    of memory releases them, as the nightly run's retry does, and the worker goes on allocating anew."""
    from sidecar.runtime.pools import give_back, pools_of, take

    models = (engine.pair.target, engine.pair.draft)
    step = SidecarBatch.step

    def out_of_memory(batch: SidecarBatch) -> object:
        raise torch.OutOfMemoryError("CUDA out of memory")

    with started(engine) as service:
        asyncio.run(answer(service, chat(SHORT, max_tokens=4)))
        with torch.inference_mode():  # a free cache of each model, whatever the request left
            for model in models:
                give_back(model, take(model, 3, 64))
        assert all(pools_of(model).free for model in models)
        monkeypatch.setattr(SidecarBatch, "step", out_of_memory)
        with pytest.raises(APIError) as failed:
            asyncio.run(answer(service, chat(SHORT, max_tokens=4)))
        assert (failed.value.status, failed.value.code) == (503, "out_of_memory")
        assert not any(pools_of(model).free for model in models), "out of memory left the free caches"
        monkeypatch.setattr(SidecarBatch, "step", step)
        assert asyncio.run(answer(service, chat(SHORT, max_tokens=4)))["choices"][0]["finish_reason"] in (
            "stop", "length")


def test_a_step_out_of_memory_frees_its_batchs_kv_caches_before_answering(engine: SidecarEngine,
                                                                         monkeypatch) -> None:
    """A batch that failed mid-step is dropped, and out of memory frees the KV caches it held, before its jobs
    are answered and before a new batch takes memory: the worker must not hold the old caches beside new ones."""
    from server.worker import BatchWorker
    from sidecar.runtime.pools import pools_of

    models = (engine.pair.target, engine.pair.draft)
    step, fail = SidecarBatch.step, BatchWorker._fail
    held: list[weakref.ref] = []
    alive_after_fail: list[int] = []

    def out_of_memory_mid_step(batch: SidecarBatch) -> object:
        step(batch)  # the rows join: the batch takes its caches
        held.extend(weakref.ref(cache) for model in models for cache in pools_of(model).lent)
        raise torch.OutOfMemoryError("CUDA out of memory")

    def recording_fail(worker: BatchWorker, jobs: list[Job], error: APIError) -> None:
        fail(worker, jobs, error)
        alive_after_fail.append(sum(ref() is not None for ref in held))

    monkeypatch.setattr(SidecarBatch, "step", out_of_memory_mid_step)
    monkeypatch.setattr(BatchWorker, "_fail", recording_fail)
    with started(engine) as service, pytest.raises(APIError) as failed:
        asyncio.run(answer(service, chat(SHORT, max_tokens=4)))
    assert failed.value.code == "out_of_memory" and held, "the step took no cache"
    assert alive_after_fail == [0], f"{alive_after_fail} of the failed batch's caches outlived its failure"


async def scored(service: ChatService, prompt: str, model: str = "tiny") -> list:
    """The prompt's scores (``prompt_logprobs``' entries), as a completions request with echo scores it."""
    req = CompletionRequest.model_validate({"model": model, "prompt": prompt, "echo": True, "logprobs": 0,
                                            "max_tokens": 0})
    return await asyncio.wait_for((await service.submit(req)).future, 300)


@pytest.mark.parametrize("where", ["a step", "a scoring forward"])
def test_out_of_memory_drops_the_prompt_caches_tensors(engine: SidecarEngine, monkeypatch, where: str) -> None:
    """The worker's prefix caches keep scored prompts' keys and values on the device for later prompts; out of
    memory, in a decoding step or a scoring forward, drops them all (their tensors freed at once, so emptying
    the allocator's cache gives their memory back) while their counters stay, and scoring goes on anew."""
    summary = LONG + " Tags:"
    with started(engine) as service:
        for model in ("tiny", "tiny/draft"):
            asyncio.run(scored(service, summary + " #budget #roads", model))
        caches = service.worker.prefix_caches
        kept = [weakref.ref(tensor) for cache in caches.values() for entry in cache._entries.values()
                for pair in entry.keys_values for tensor in pair]
        assert kept and all(len(cache) == 1 for cache in caches.values())

        def out_of_memory(*args: object) -> object:
            raise torch.OutOfMemoryError("CUDA out of memory")

        with contextlib.ExitStack() as restore, pytest.raises(APIError) as failed:
            if where == "a step":
                monkeypatch.setattr(SidecarBatch, "step", out_of_memory)
                restore.callback(monkeypatch.undo)
                asyncio.run(answer(service, chat(SHORT, max_tokens=4)))
            else:  # the target's forward runs out, as the device would
                restore.callback(engine.pair.target.get_input_embeddings().register_forward_hook(out_of_memory).remove)
                asyncio.run(scored(service, summary + " #schools #council"))
        assert (failed.value.status, failed.value.code) == (503, "out_of_memory")
        assert all(ref() is None for ref in kept), "out of memory left tensors of the prompt caches"
        counters = service.worker.stats.snapshot()["prompt_cache"]
        assert all((c["entries"], c["bytes"], c["misses"]) == (0, 0, 1) for c in counters.values()), counters
        again = asyncio.run(scored(service, summary + " #schools #council"))
        assert len(again) > 1 and len(caches["target"]) == 1 and caches["target"].misses == 2


@pytest.mark.servers
def test_an_eager_server_warms_nothing_and_is_ready_at_once(engine: SidecarEngine, monkeypatch) -> None:
    """``SIDECAR_WARMUP=on`` warms compiled and captured forwards at load; eager ones have nothing to warm: the
    worker is ready before it starts and ``/stats`` reports no warm-up."""
    monkeypatch.setenv("SIDECAR_WARMUP", "on")
    assert engine.pair.capture_mode == "eager"
    with serving(create_app(engine, ServerConfig(model_name="tiny"))) as (url, _):
        health = httpx.get(url + "/health", timeout=60)
        stats = httpx.get(url + "/stats", timeout=60).json()
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert stats["warm_up"] == {"ready": True, "capacities": []}
    assert all(not c["warm_ups"] for c in stats["capture"]["counters"].values())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_compiled_server_warms_up_before_its_first_request_which_compiles_nothing(monkeypatch) -> None:
    """``SIDECAR_CAPTURE=compile`` with ``SIDECAR_WARMUP=on`` (one-layer pair: compiling is slow on a CPU):
    ``/health`` says ``warming_up`` until the worker has compiled every batch bucket's decode forwards at the
    capacity buckets up to its context, ``/stats`` reports them before any request, and a first request that fits them
    compiles nothing."""
    import time

    from sidecar.models.tiny import tiny_pair
    from sidecar.runtime.capture import runner_of

    monkeypatch.setenv("SIDECAR_CAPTURE", "compile")
    monkeypatch.setenv("SIDECAR_WARMUP", "on")
    # dynamo keeps graphs by code object, across pairs: an earlier test's one-layer pair of the same shapes would
    # leave this warm-up nothing to compile (it did, after tests/test_capture.py in one worker)
    torch._dynamo.reset()
    pair = tiny_pair(layers=1)
    pair.target.config.max_position_embeddings = 128  # a context of 128: capacities 64 and 128 warm, no more
    engine = SidecarEngine(pair, gamma=1)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(torch._dynamo.reset)  # dynamo shares graphs across pairs: later tests compile their own
        url, _ = cleanup.enter_context(serving(create_app(engine, ServerConfig(model_name="tiny", max_batch=1))))
        statuses = set()
        deadline = time.monotonic() + 500
        while (health := httpx.get(url + "/health", timeout=60)).status_code != 200:
            assert health.json()["status"] == "warming_up", health.json()
            statuses.add(health.json()["status"])
            assert time.monotonic() < deadline, "the warm-up did not end"
            time.sleep(0.2)
        stats = httpx.get(url + "/stats", timeout=60).json()
        compiles = {name: runner_of(model).counters.compiles for name, model in (
            ("target", pair.target), ("draft", pair.draft))}
        response = httpx.post(url + "/v1/chat/completions", json=chat(SHORT, max_tokens=8), timeout=300)
        after = httpx.get(url + "/stats", timeout=60).json()
    assert statuses <= {"warming_up"}
    assert response.status_code == 200, response.text
    warm_up = stats["warm_up"]
    assert warm_up["ready"] and [c["capacity"] for c in warm_up["capacities"]] == [64, 128]
    # batch bucket 1 at the target's widths 1, 2; buckets 1, 2 (a main row and a sidecar's) at the draft's 1, 2
    # and 4 (gamma + 3: a first feed of 3 or 4 columns, wider in chunks of 4, so plain steps compile nothing)
    assert all((c["target"]["shapes"], c["draft"]["shapes"]) == (2, 6) for c in warm_up["capacities"])
    assert stats["steps"] == 0 and all(c["compiles"] > 0 for c in stats["capture"]["counters"].values())
    assert {name: c["compiles"] for name, c in after["capture"]["counters"].items()} == compiles, \
        "the first request compiled"
    assert after["steps"] > 0 and all(c["forwards"] > stats["capture"]["counters"][name]["forwards"]
                                      for name, c in after["capture"]["counters"].items())
