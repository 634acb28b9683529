"""OpenAI-compatible HTTP server over one model pair, with dynamic batching and sidecar tasks.

Endpoints:

- ``GET /health``: liveness, no key needed.
- ``GET /v1/models``: the one served model.
- ``POST /v1/chat/completions``: ``messages``, ``max_tokens`` / ``max_completion_tokens`` (default
  ``DEFAULT_MAX_TOKENS``, clipped to the context), ``temperature`` (default 1, as OpenAI; 0, and
  anything below ``sidecar.speculative.MIN_SAMPLING_TEMPERATURE``, is greedy and token-identical to the
  target alone), ``top_p`` (the most likely token always stays in the nucleus), ``seed`` (int64, as
  OpenAI), ``stop``, ``stream`` (SSE chunks) and ``stream_options.include_usage``. Extension:
  ``sidecars``, a list of ``{name, instruction, max_tokens, attend_document, parser}``; the request then
  runs through :class:`SidecarEngine` (system message -> system, the one user message -> document) and
  the response has a top-level ``sidecars`` object ``{name: {text, parsed, parse_error, finish_reason,
  usage}}`` (in the last chunk when streaming).
  ``usage`` also counts ``drafted_tokens`` and ``accepted_tokens``.
- ``GET /stats``: batching statistics (batch-size histogram, queue depth) and the server's RSS.

One worker thread owns the models. It collects requests for ``batch_wait_ms`` (up to ``max_batch``),
groups those that can share a decoding call (same sampling settings, same stop strings, with or
without sidecars) and runs each group as one batch with per-row token limits. Errors are OpenAI-style
JSON ``{"error": {"message", "type", "param", "code"}}``; tracebacks stay in the server log.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hmac
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import psutil
import torch
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import PreTrainedTokenizerBase

from server.config import API_KEY_ENV, DEFAULT_MAX_TOKENS, ServerConfig
from sidecar.engine import DocumentResult, SidecarEngine, SidecarOutput, SidecarRequest
from sidecar.errors import InputError
from sidecar.speculative import DecodeRow, GenerationOutput, Sampling
from sidecar.tasks import SidecarTask

logger = logging.getLogger(__name__)

_FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


# -- errors -----------------------------------------------------------------------------------------


class APIError(Exception):
    """An error answered as OpenAI's JSON error object with ``status``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _validation_error(exc: ValidationError, prefix: str = "", rename: dict[str, str] | None = None) -> APIError:
    """A 400 naming the first bad field as ``param``; ``rename`` maps engine field names to the API's."""

    def where(loc: tuple) -> str:
        return prefix + ".".join(str((rename or {}).get(str(part), part)) for part in loc)

    errors = exc.errors()
    problems = "; ".join(f"{where(e['loc']) or 'body'}: {e['msg']}" for e in errors[:5])
    return APIError(400, f"invalid request: {problems}", param=where(errors[0]["loc"]) or None, code="invalid_value")


# -- request schema ---------------------------------------------------------------------------------


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # "developer" is OpenAI's newer name for the system role; tools are not supported.
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)

    @property
    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role


class SidecarSpec(BaseModel):
    """A sidecar task as the API spells it (``max_tokens`` like the main request)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    instruction: str
    max_tokens: int = 32
    attend_document: bool = False
    parser: Literal["hashtags", "text"] = "text"

    def task(self) -> SidecarTask:
        return SidecarTask(name=self.name, instruction=self.instruction, max_new_tokens=self.max_tokens,
                           attend_document=self.attend_document, parser=self.parser)


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    # Unknown fields (user, metadata, penalties, ...) are ignored like other OpenAI-compatible servers do;
    # fields that would silently change the answer's meaning are refused below.
    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    # OpenAI's own bound (int64). torch's generators take -2**63 .. 2**64 - 1, so the engine's seed + 1 for the
    # sidecar phase fits too; a seed outside would fail in the worker, with every request batched alongside.
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    tools: list[Any] | None = None
    logprobs: bool = False
    sidecars: list[dict[str, Any]] | None = Field(None, max_length=16)

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> list[str] | None:
        stops = [value] if isinstance(value, str) else value
        if stops is not None and (len(stops) > 4 or any(not s for s in stops)):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops or None

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        if self.n != 1:
            raise ValueError("n must be 1: one choice per request")
        if self.tools:
            raise ValueError("tools are not supported")
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        return self

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- configuration and statistics -------------------------------------------------------------------


@dataclass
class BatchStats:
    """What the worker has run; read by ``GET /stats`` from the event loop, written by the worker."""

    started: float = field(default_factory=time.time)
    requests: int = 0
    batches: int = 0
    failed_batches: int = 0
    sizes: Counter[int] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, size: int, ok: bool) -> None:
        with self.lock:
            self.requests += size
            self.batches += 1
            self.failed_batches += int(not ok)
            self.sizes[size] += 1

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                "requests": self.requests,
                "batches": self.batches,
                "failed_batches": self.failed_batches,
                "batch_sizes": {str(size): count for size, count in sorted(self.sizes.items())},
                "max_batch_size": max(self.sizes, default=0),
                "mean_batch_size": self.requests / self.batches if self.batches else 0.0,
                "uptime_s": time.time() - self.started,
            }


# -- the worker -------------------------------------------------------------------------------------

_DONE = object()  # end of a job's token stream


@dataclass
class Job:
    """One request as the worker runs it; ``prompt`` for plain chat, ``request`` with sidecars."""

    max_tokens: int
    sampling: Sampling
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    prompt: list[int] | None = None
    request: SidecarRequest | None = None
    stop: tuple[str, ...] = ()
    tokens: asyncio.Queue | None = None  # new token ids while streaming, then _DONE
    id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def key(self) -> tuple:
        """Jobs with equal keys can share one decoding call."""
        if self.sampling.greedy:
            sampling: tuple = ("greedy",)
        elif self.sampling.seed is not None:
            # One generator serves a whole batch, so a seeded request is reproducible only alone.
            sampling = ("seeded", self.id)
        else:
            sampling = (self.sampling.temperature, self.sampling.top_p)
        if self.request is not None:
            # SidecarEngine.run takes one max_new_tokens for all rows and no stop strings.
            return ("sidecar", sampling, self.max_tokens)
        return ("plain", sampling, self.stop)

    def emit(self, ids: list[int]) -> None:
        if self.tokens is not None:
            self.loop.call_soon_threadsafe(self.tokens.put_nowait, ids)

    def finish(self, result: object = None, error: BaseException | None = None) -> None:
        def resolve() -> None:
            if not self.future.done():
                if error is not None:
                    self.future.set_exception(error)
                else:
                    self.future.set_result(result)
            if self.tokens is not None:
                self.tokens.put_nowait(_DONE)

        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            self.loop.call_soon_threadsafe(resolve)


class BatchWorker:
    """The thread that owns the models and runs queued jobs in dynamic batches."""

    def __init__(self, engine: SidecarEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.stats = BatchStats()
        self.queue: queue.Queue[Job | None] = queue.Queue(maxsize=config.max_queue)
        self._thread = threading.Thread(target=self._loop, name="sidecar-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        # The sentinel may wait behind a full queue; the jobs before it still run.
        self.queue.put(None)
        self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            raise APIError(503, "the server is overloaded; retry later", "server_error", code="overloaded") from None

    def _collect(self, first: Job) -> tuple[list[Job], bool]:
        """``first`` plus whatever arrives within the batch window; (jobs, stop requested)."""
        jobs = [first]
        deadline = time.monotonic() + self.config.batch_wait_ms / 1000
        while len(jobs) < self.config.max_batch:
            try:
                job = self.queue.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                break
            if job is None:
                return jobs, True
            jobs.append(job)
        return jobs, False

    def _loop(self) -> None:
        stopping = False
        while not stopping:
            first = self.queue.get()
            if first is None:
                break
            jobs, stopping = self._collect(first)
            groups: dict[tuple, list[Job]] = {}
            for job in jobs:
                # a client that went away before its batch started costs nothing
                if not job.future.cancelled():
                    groups.setdefault(job.key, []).append(job)
            for group in groups.values():
                self._run(group)

    def _run(self, jobs: list[Job]) -> None:
        sampling = jobs[0].sampling

        def on_tokens(row: int, ids: list[int]) -> None:
            jobs[row].emit(ids)

        try:
            results: Sequence[object]
            if jobs[0].request is not None:
                results = self.engine.run(
                    [job.request for job in jobs if job.request is not None], max_new_tokens=jobs[0].max_tokens,
                    temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed,
                    batch_size=len(jobs), on_tokens=on_tokens)
            else:
                results = self.engine.decoder.generate(
                    [job.prompt for job in jobs if job.prompt is not None], [job.max_tokens for job in jobs],
                    temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed,
                    batch_size=len(jobs), stop=list(jobs[0].stop) or None, on_tokens=on_tokens)
        except Exception as exc:
            self.stats.record(len(jobs), ok=False)
            error = self._api_error(exc, len(jobs))
            for job in jobs:
                job.finish(error=error)
            return
        self.stats.record(len(jobs), ok=True)
        for job, result in zip(jobs, results, strict=True):
            job.finish(result)

    @staticmethod
    def _api_error(exc: Exception, batch: int) -> APIError:
        if isinstance(exc, InputError):  # requests are validated before queueing, so this is rare
            logger.warning("batch of %d refused by the engine: %s", batch, exc)
            return APIError(400, str(exc))
        if isinstance(exc, torch.OutOfMemoryError):
            logger.error("batch of %d ran out of memory", batch)
            return APIError(503, "out of memory; retry with fewer tokens", "server_error", code="out_of_memory")
        logger.exception("batch of %d failed", batch)
        return APIError(500, "internal error while generating; see the server log", "server_error")


# -- text ------------------------------------------------------------------------------------------


class TextStream:
    """Text of a growing list of token ids, released only at whole characters and never past a stop string.

    Decoding looks back only to where the previous release ended (which is a clean character boundary),
    so a step costs O(new tokens). The whole answer fed at once gives exactly the tokenizer's decode;
    streaming releases prefixes of that same text.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.text = ""  # decoded so far, up to a clean boundary
        self.sent = 0  # characters of self.text released
        self.stopped = False
        self._prefix = 0  # ids[_prefix:_read] decode to the tail of self.text
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _advance(self, final: bool) -> None:
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        # A trailing U+FFFD is an incomplete multi-byte character: wait for its next token.
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)

    def _release(self, final: bool) -> str:
        end = len(self.text)
        hits = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        if hits:
            end, self.stopped = min(hits), True
        elif not final:
            # hold back a tail that may grow into a stop string
            end -= max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        end = max(end, self.sent)
        chunk, self.sent = self.text[self.sent : end], end
        return chunk

    def push(self, ids: list[int]) -> str:
        """Add new ids; returns newly releasable text (possibly empty)."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        self._advance(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text once the ids are complete."""
        if self.stopped:
            return ""
        self._advance(final=True)
        return self._release(final=True)


def full_text(tokenizer: PreTrainedTokenizerBase, ids: list[int], stop: Sequence[str]) -> tuple[str, bool]:
    """(text, cut at a stop string): the same text a stream of ``ids`` releases."""
    stream = TextStream(tokenizer, stop)
    text = stream.push(ids) + stream.finish()
    return text, stream.stopped


# -- request handling -------------------------------------------------------------------------------


def _usage(prompt: int, completion: int, drafted: int = 0, accepted: int = 0) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "drafted_tokens": drafted, "accepted_tokens": accepted}


def _main_usage(main: GenerationOutput) -> dict[str, int]:
    return _usage(main.stats.prompt_tokens, len(main.token_ids), main.stats.drafted, main.stats.accepted)


def _sidecar_json(output: SidecarOutput) -> dict[str, Any]:
    # The draft decodes the sidecar alone (no speculation); its prompt is the reused context plus the fed tokens.
    prompt = output.stats.context_tokens + output.stats.feed_tokens
    return {"text": output.text, "parsed": output.parsed, "parse_error": output.parse_error,
            "finish_reason": _FINISH_REASONS.get(output.finish_reason, output.finish_reason),
            "usage": _usage(prompt, output.stats.new_tokens)}


class ChatService:
    """Turns API requests into worker jobs and worker results into API responses."""

    def __init__(self, engine: SidecarEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.worker = BatchWorker(engine, config)
        # The worker decodes with the pair's tokenizer on its thread; a private copy keeps the event loop's
        # encoding off that object (HF fast tokenizers are not guaranteed to be safe under concurrent use).
        self.tokenizer = copy.deepcopy(engine.pair.tokenizer)

    def job(self, req: ChatCompletionRequest, loop: asyncio.AbstractEventLoop) -> Job:
        if req.model != self.config.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves "
                                f"{self.config.model_name!r}", param="model", code="model_not_found")
        sampling = Sampling(req.temperature, req.top_p, req.seed)
        future = loop.create_future()
        tokens: asyncio.Queue | None = asyncio.Queue() if req.stream else None
        if req.sidecars is not None:
            request, row = self._sidecar_request(req)
            max_tokens = self._max_tokens(req, row)
            job = Job(max_tokens, sampling, loop, future, request=request, tokens=tokens)
        else:
            messages = [{"role": m.template_role, "content": m.text} for m in req.messages]
            rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            prompt = self.tokenizer.encode(rendered, add_special_tokens=False)
            row = DecodeRow(prompt, 1)
            max_tokens = self._max_tokens(req, row)
            job = Job(max_tokens, sampling, loop, future, prompt=prompt, stop=tuple(req.stop or ()), tokens=tokens)
        row.max_new_tokens = max_tokens
        try:
            self.engine.decoder.validate([row], sampling, 1)
        except InputError as exc:
            raise APIError(400, str(exc), param="messages") from None
        return job

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
                raise _validation_error(exc, f"sidecars.{i}.", {"max_new_tokens": "max_tokens"}) from None
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
                         "logprobs": None, "finish_reason": self._finish(main, stopped)}],
            "usage": _main_usage(main),
        }
        if sidecars is not None:
            body["sidecars"] = sidecars
        return body

    async def stream(self, req: ChatCompletionRequest, job: Job, completion_id: str,
                     created: int) -> AsyncIterator[bytes]:
        def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
            body = {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                    "model": self.config.model_name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}
            return _sse(body)

        assert job.tokens is not None
        text = TextStream(self.tokenizer, job.stop)
        try:
            yield chunk({"role": "assistant", "content": ""})
            while (ids := await job.tokens.get()) is not _DONE:
                if piece := text.push(ids):
                    yield chunk({"content": piece})
            try:
                result = job.future.result()
            except APIError as exc:
                yield _sse(exc.body())
                yield b"data: [DONE]\n\n"
                return
            main, sidecars = self._split(result)
            if piece := text.finish():
                yield chunk({"content": piece})
            yield chunk({}, self._finish(main, text.stopped), **({"sidecars": sidecars} if sidecars else {}))
            if req.stream_options is not None and req.stream_options.include_usage:
                yield _sse({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                            "model": self.config.model_name, "choices": [], "usage": _main_usage(main)})
            yield b"data: [DONE]\n\n"
        finally:
            # a client that hung up before its batch started is skipped by the worker
            job.future.cancel()

    @staticmethod
    def _split(result: object) -> tuple[GenerationOutput, dict[str, Any] | None]:
        if isinstance(result, DocumentResult):
            return result.main, {name: _sidecar_json(out) for name, out in result.sidecars.items()}
        assert isinstance(result, GenerationOutput)
        return result, None

    @staticmethod
    def _finish(main: GenerationOutput, stopped: bool) -> str:
        return "stop" if stopped else _FINISH_REASONS[main.finish_reason]


def _sse(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"


async def _read_body(request: Request, limit: int) -> bytes:
    too_large = APIError(413, f"request body larger than {limit} bytes", param=None, code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for part in request.stream():  # chunked uploads have no content-length: count as we read
        body += part
        if len(body) > limit:
            raise too_large
    return bytes(body)


def create_app(engine: SidecarEngine, config: ServerConfig) -> FastAPI:
    service = ChatService(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        service.worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(service.worker.stop)

    app = FastAPI(title="sidecar", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None
                        ).response()

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after this handler, so the server logs the traceback; the client gets none.
        return APIError(500, "internal server error; see the server log", "server_error").response()

    async def authenticate(request: Request) -> None:
        if not config.api_key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    api = APIRouter(dependencies=[Depends(authenticate)])

    @app.get("/health")
    async def health() -> dict[str, Any]:
        pair = engine.pair
        return {"status": "ok", "model": config.model_name, "pair": pair.name, "device": str(pair.device)}

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = {"id": config.model_name, "object": "model", "created": int(service.worker.stats.started),
                 "owned_by": "sidecar"}
        return {"object": "list", "data": [model]}

    @api.get("/stats")
    async def stats() -> dict[str, Any]:
        return service.worker.stats.snapshot() | {"queue_depth": service.worker.queue.qsize(),
                                                  "rss_bytes": psutil.Process().memory_info().rss}

    @api.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> JSONResponse | StreamingResponse:
        raw = await _read_body(request, config.max_body_bytes)
        try:
            payload = json.loads(raw)
        # ValueError: malformed JSON (JSONDecodeError), bad UTF-8, an integer past Python's digit limit;
        # RecursionError: nesting deeper than the interpreter's stack (a body of a few thousand "[").
        except (ValueError, RecursionError) as exc:
            raise APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(payload, dict):
            raise APIError(400, "the body must be a JSON object", code="invalid_json")
        try:
            req = ChatCompletionRequest.model_validate(payload)
        except ValidationError as exc:
            raise _validation_error(exc) from None
        job = service.job(req, asyncio.get_running_loop())
        service.worker.submit(job)
        completion_id, created = f"chatcmpl-{job.id}", int(time.time())
        if req.stream:
            return StreamingResponse(service.stream(req, job, completion_id, created),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        result = await job.future
        return JSONResponse(service.completion(req, job, result, completion_id, created))

    app.include_router(api)
    return app


# -- running it -------------------------------------------------------------------------------------


def serve(pair_name: str, host: str = "127.0.0.1", port: int = 8000, *, api_key: str | None = None,
          max_batch: int = 8, batch_wait_ms: float = 5.0, gamma: int = 4, max_body_bytes: int = 1 << 20,
          max_queue: int = 256, model_name: str | None = None) -> None:
    """Load the pair, then serve it until interrupted."""
    import uvicorn

    from sidecar.models import load_pair

    pair = load_pair(pair_name)
    engine = SidecarEngine(pair, gamma=gamma)
    config = ServerConfig(model_name=model_name or pair_name, api_key=api_key or None, max_batch=max_batch,
                          batch_wait_ms=batch_wait_ms, max_body_bytes=max_body_bytes, max_queue=max_queue)
    logger.info("serving pair %s as model %r on %s:%d (auth %s)", pair_name, config.model_name, host, port,
                "on" if config.api_key else "off")
    uvicorn.run(create_app(engine, config), host=host, port=port, log_level="info")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _log_tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:]


@contextlib.contextmanager
def running_server(pair_name: str = "qwen-coder-small", *, api_key: str | None = None,
                   model_name: str | None = None, max_batch: int = 8, batch_wait_ms: float = 5.0, gamma: int = 4,
                   extra_args: Sequence[str] = (), startup_timeout_s: float = 600.0,
                   log_path: Path | None = None) -> Iterator[str]:
    """Run ``sidecar serve`` in a subprocess on a free loopback port; yields its OpenAI base URL (``.../v1``).

    The key travels in the environment, not on the command line where ``ps`` would show it. The server's
    output goes to ``log_path`` (a temporary file by default). The server is stopped on exit.
    """
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    if api_key:
        env[API_KEY_ENV] = api_key
    with contextlib.ExitStack() as stack:
        if log_path is None:
            log_path = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sidecar-serve-"))) / "server.log"
        # Another process can take the free port before the server binds it; then try another one.
        for attempt in range(3):
            port = _free_port()
            args = ["serve", "--pair", pair_name, "--host", "127.0.0.1", "--port", str(port), "--max-batch",
                    str(max_batch), "--batch-wait-ms", str(batch_wait_ms), "--gamma", str(gamma), *extra_args]
            if model_name:
                args += ["--model-name", model_name]
            with log_path.open("ab") as log:
                proc = subprocess.Popen([sys.executable, "-m", "cli", *args],
                                        stdout=log, stderr=subprocess.STDOUT, env=env)
            stack.callback(_stop, proc)
            if _wait_healthy(proc, port, startup_timeout_s, log_path):
                break
            if "address already in use" not in _log_tail(log_path).lower() or attempt == 2:
                raise RuntimeError(f"sidecar serve exited with code {proc.returncode}:\n{_log_tail(log_path)}")
        yield f"http://127.0.0.1:{port}/v1"


def _wait_healthy(proc: subprocess.Popen, port: int, timeout_s: float, log_path: Path) -> bool:
    """True once /health answers; False if the process exits first."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    return True
            time.sleep(0.2)
    raise TimeoutError(f"sidecar serve did not become healthy within {timeout_s:.0f}s:\n{_log_tail(log_path)}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # uvicorn finishes open requests, then exits
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
