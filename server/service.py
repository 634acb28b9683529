"""Chat requests to worker jobs and worker results to OpenAI-shaped responses.

A request is validated against the model's context and the decoder's bounds before it is queued, so the
worker sees only jobs it can run; ``usage`` also counts ``drafted_tokens`` and ``accepted_tokens``.
With ``logprobs`` every completion token has an entry (``server.logprobs``), the end-of-turn token too;
a stream's chunks carry the entries of the tokens committed since the previous chunk, so they add up to
the non-streamed list even where the text of a token is held back (a partial character, a possible stop).

Tokenizing prompts and turning tokens into text run on one text thread, never on the event loop, so a
large request cannot stall other clients or ``/health``. A client that goes away cancels its job: the
worker skips it or drops it from its batch at the next decoding step.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

from pydantic import ValidationError

from server.config import DEFAULT_MAX_TOKENS, ServerConfig
from server.errors import APIError, validation_error
from server.logprobs import LogprobFormatter
from server.schema import ChatCompletionRequest, SidecarSpec
from server.stream import TextStream, full_text
from server.worker import DONE, BatchWorker, Job
from sidecar.decoding.rows import DecodeRow, GenerationOutput
from sidecar.decoding.sampling import Sampling
from sidecar.errors import InputError
from sidecar.tasks.engine import SidecarEngine
from sidecar.tasks.prompts import chat_prompt
from sidecar.tasks.rows import DocumentResult, SidecarOutput, SidecarRequest

_FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
T = TypeVar("T")


def _usage(prompt: int, completion: int, drafted: int = 0, accepted: int = 0) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "drafted_tokens": drafted, "accepted_tokens": accepted}


def _main_usage(main: GenerationOutput) -> dict[str, int]:
    return _usage(main.stats.prompt_tokens, len(main.token_ids), main.stats.drafted, main.stats.accepted)


def _sidecar_json(output: SidecarOutput, formatter: LogprobFormatter) -> dict[str, Any]:
    # The draft decodes the sidecar alone (no speculation); its prompt is the reused context plus the fed tokens.
    prompt = output.stats.context_tokens  # what it attends to: the same alone or batched
    body = {"text": output.text, "parsed": output.parsed, "parse_error": output.parse_error,
            "finish_reason": _FINISH_REASONS.get(output.finish_reason, output.finish_reason),
            "usage": _usage(prompt, output.stats.new_tokens)}
    if output.logprobs is not None:
        body["logprobs"] = formatter.logprobs(output.logprobs)
    return body


class ChatService:
    """Turns API requests into worker jobs and worker results into API responses."""

    def __init__(self, engine: SidecarEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.worker = BatchWorker(engine, config)
        # The worker decodes with the pair's tokenizer on its thread; a private copy, used only on the one
        # text thread, keeps this side's work off that object (HF fast tokenizers are not guaranteed to be
        # safe under concurrent use) and off the event loop.
        self.tokenizer = copy.deepcopy(engine.pair.tokenizer)
        self.formatter = LogprobFormatter(self.tokenizer)
        self._text_thread = ThreadPoolExecutor(1, thread_name_prefix="sidecar-text")

    def close(self) -> None:
        self._text_thread.shutdown(wait=True, cancel_futures=True)

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._text_thread, fn, *args)

    async def submit(self, req: ChatCompletionRequest) -> Job:
        """Tokenize and validate ``req`` on the text thread and queue it for the worker."""
        job = await self._off_loop(self.job, req, asyncio.get_running_loop())
        self.worker.submit(job)
        return job

    async def answer(self, req: ChatCompletionRequest, job: Job, completion_id: str, created: int,
                     disconnected: Awaitable[None]) -> dict[str, Any]:
        """The non-streamed response, unless ``disconnected`` (the client leaving) completes first: then the
        job is cancelled and a 499 answers nobody."""
        gone = asyncio.ensure_future(disconnected)
        try:
            await asyncio.wait([job.future, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not job.future.done():  # the client has gone, or the server is stopping
                job.cancel()
        if job.future.cancelled():
            raise APIError(499, "the client closed the connection", code="client_closed_request")
        return await self._off_loop(self.completion, req, job, job.future.result(), completion_id, created)

    def job(self, req: ChatCompletionRequest, loop: asyncio.AbstractEventLoop) -> Job:
        """``req`` as the worker's job, its decoding fields set and checked as the engine will check them."""
        if req.model != self.config.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves "
                                f"{self.config.model_name!r}", param="model", code="model_not_found")
        sampling = Sampling(req.temperature, req.top_p, req.seed)
        work: DecodeRow | SidecarRequest
        try:
            if req.sidecars is not None:
                request, row = self._sidecar_request(req)
                work = replace(request, max_new_tokens=self._max_tokens(req, row), sampling=sampling,
                               top_logprobs=req.engine_top_logprobs)
                # the main row as the engine builds it: the draft's context must also hold the sidecar outputs
                row = self.engine.decode_row(0, work)
            else:
                messages = [{"role": m.template_role, "content": m.text} for m in req.messages]
                prompt = chat_prompt(self.tokenizer, messages)
                row = work = DecodeRow(prompt, self._max_tokens(req, DecodeRow(prompt, 1)), sampling=sampling,
                                       stop=req.stop, top_logprobs=req.engine_top_logprobs)
            self.engine.decoder.validate([row], 1)
        except InputError as exc:
            raise APIError(400, str(exc), param="messages") from None
        return Job(work, loop, loop.create_future(), tokens=asyncio.Queue() if req.stream else None)

    def _sidecar_request(self, req: ChatCompletionRequest) -> tuple[SidecarRequest, DecodeRow]:
        if req.stop:
            raise APIError(400, "stop is not supported together with sidecars", param="stop")
        messages = req.messages
        system = None
        if messages[0].template_role == "system":
            system, messages = messages[0].text, messages[1:]
        if len(messages) != 1 or messages[0].role != "user":
            raise APIError(400, "with sidecars, messages must be one user message (the document), optionally "
                                "after one system message; earlier turns are not supported", param="messages")
        tasks = []
        for i, spec in enumerate(req.sidecars or []):
            try:
                tasks.append(SidecarSpec.model_validate(spec).task())
            except ValidationError as exc:
                raise validation_error(exc, f"sidecars.{i}.", {"max_new_tokens": "max_tokens"}) from None
        if not tasks:
            raise APIError(400, "sidecars must list at least one task (or be left out)", param="sidecars")
        # The document is the user's text as is; the main instruction is empty because it is part of that text.
        request = SidecarRequest(document=messages[0].text, instruction="", system=system, sidecars=tasks)
        try:
            bare, compound = self.engine.prompts(request)
        except InputError as exc:
            raise APIError(400, str(exc), param="sidecars" if "sidecar" in str(exc) else "messages") from None
        hidden = [compound.spans[f"sidecar:{t.name}"] for t in tasks]
        return request, DecodeRow(bare.token_ids, 1, compound.token_ids, hidden)

    def _max_tokens(self, req: ChatCompletionRequest, row: DecodeRow) -> int:
        prompt = max(len(row.target_prompt), len(row.draft_prompt or []))
        # the decoder's own bound (SpeculativeDecoder.validate): prompt + new tokens + gamma + 1 <= context
        room = self.engine.pair.max_context - prompt - self.engine.decoder.gamma - 1
        if room < 1 or (req.limit is not None and req.limit > room):
            asked = f" plus {req.limit} new tokens" if req.limit is not None else ""
            raise APIError(400, f"the prompt has {prompt} tokens{asked}, more than the model's context of "
                                f"{self.engine.pair.max_context} tokens allows (room for {max(room, 0)} new "
                                "tokens); shorten the messages or lower max_tokens",
                           param="messages", code="context_length_exceeded")
        return req.limit if req.limit is not None else min(DEFAULT_MAX_TOKENS, room)

    def completion(self, req: ChatCompletionRequest, job: Job, result: object, completion_id: str,
                   created: int) -> dict[str, Any]:
        main, sidecars = self._split(result)
        text, stopped = full_text(self.tokenizer, main.token_ids, job.stop)
        body: dict[str, Any] = {
            "id": completion_id, "object": "chat.completion", "created": created, "model": self.config.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                         "logprobs": self.formatter.logprobs(main.logprobs),
                         "finish_reason": self._finish(main, stopped)}],
            "usage": _main_usage(main),
        }
        if sidecars is not None:
            body["sidecars"] = sidecars
        return body

    async def stream(self, req: ChatCompletionRequest, job: Job, completion_id: str,
                     created: int) -> AsyncIterator[bytes]:
        def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: dict[str, Any] | None = None,
                  **extra: Any) -> bytes:
            body = {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                    "model": self.config.model_name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}], **extra}
            return _sse(body)

        assert job.tokens is not None
        text = TextStream(self.tokenizer, job.stop)
        try:
            yield chunk({"role": "assistant", "content": ""})
            done = False
            while not done:
                # every commit waiting is turned into text in one trip to the text thread
                items = [await job.tokens.get()]
                while not job.tokens.empty():
                    items.append(job.tokens.get_nowait())
                done = items[-1] is DONE
                for piece, logprobs in await self._off_loop(self._pieces, text, items[:-1] if done else items):
                    yield chunk({"content": piece}, logprobs=logprobs)
            try:
                result = job.future.result()
            except APIError as exc:
                yield _sse(exc.body())
                yield b"data: [DONE]\n\n"
                return
            main, sidecars = await self._off_loop(self._split, result)
            if piece := await self._off_loop(text.finish):
                yield chunk({"content": piece})
            yield chunk({}, self._finish(main, text.stopped), **({"sidecars": sidecars} if sidecars else {}))
            if req.stream_options is not None and req.stream_options.include_usage:
                yield _sse({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                            "model": self.config.model_name, "choices": [], "usage": _main_usage(main)})
            yield b"data: [DONE]\n\n"
        finally:
            if not job.future.done():  # the client hung up: the worker skips the job or drops it at the next step
                job.cancel()

    def _pieces(self, text: TextStream, commits: list[tuple[list[int], Any]]) -> list[tuple[str, Any]]:
        """(text released, logprobs JSON) per commit that has either: a chunk per commit when logprobs were
        asked for, so its entries travel even while its text waits."""
        pieces = []
        for ids, entries in commits:
            piece = text.push(ids)
            if piece or entries:
                pieces.append((piece, self.formatter.logprobs(entries)))
        return pieces

    def _split(self, result: object) -> tuple[GenerationOutput, dict[str, Any] | None]:
        if isinstance(result, DocumentResult):
            return result.main, {name: _sidecar_json(out, self.formatter) for name, out in result.sidecars.items()}
        assert isinstance(result, GenerationOutput)
        return result, None

    @staticmethod
    def _finish(main: GenerationOutput, stopped: bool) -> str:
        return "stop" if stopped else _FINISH_REASONS[main.finish_reason]


def _sse(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"
