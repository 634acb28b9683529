"""The FastAPI app: OpenAI-compatible endpoints over one model pair, every route behind the key but ``/health``.

Endpoints:

- ``GET /health``: liveness, no key needed: 200 ``{"status": "ok", ...}``, or 503 ``{"status": "unhealthy",
  "reason": ...}`` once the batch worker has died (every request would then be refused), or 503
  ``{"status": "warming_up", ...}`` while it warms the compiled decode forwards (``server.worker``).
- ``GET /v1/models``: the served model and ``<served name>/draft``, the pair's draft, which only scores prompts.
- ``POST /v1/chat/completions``: ``messages``, ``max_tokens`` / ``max_completion_tokens`` (default
  ``DEFAULT_MAX_TOKENS``, clipped to the context), ``temperature`` (default 1, as OpenAI; 0, and
  anything below ``sidecar.decoding.sampling.MIN_SAMPLING_TEMPERATURE``, is greedy and token-identical to the
  target alone), ``top_p`` (the most likely token always stays in the nucleus), ``seed`` (int64, as
  OpenAI), ``stop`` (up to ``sidecar.decoding.stops.MAX_STOP_STRINGS`` strings of at most ``MAX_STOP_CHARS``
  characters), ``stream`` (SSE chunks), ``stream_options.include_usage``, ``logprobs`` and
  ``top_logprobs`` (0..20, only with ``logprobs``). Logprobs are OpenAI's ``choices[0].logprobs =
  {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], "refusal": null}``, one
  entry per completion token (end-of-turn included), under the target's raw temperature-1 distribution
  whatever the sampling settings (``sidecar.decoding.logprobs``); each stream chunk carries the entries of the tokens
  committed since the previous one. Extension: ``sidecars``, a list of ``{name, instruction, max_tokens,
  attend_document, parser, bridge, stop, choices, regex, json_schema}`` (``bridge``: the text the draft
  continues from after the main output, default the engine task's, ``SidecarTask.bridge``: the chat
  template's turn boundary, so the sidecar answers in an assistant turn of its own; ``stop``: the
  sidecar's own stop strings, which cut its text, parsed as cut; the draft decodes on to its end of turn or
  ``max_tokens``, and ``usage`` counts those tokens; ``choices``/``regex``/``json_schema``: its constraint).
  The request's ``stop`` ends the main output, and the sidecars continue from it
  without the stop string. The request then runs through :class:`SidecarEngine`
  (a first system message -> system, the last message, the user's -> document, the turns between ->
  history, which a sidecar sees only with ``attend_document``) and the response has a top-level ``sidecars``
  object ``{name: {text, parsed, parse_error, finish_reason, usage}}``; with
  ``logprobs`` each also has ``logprobs`` in the same shape, under the draft model that wrote it.
  Streamed, the choice's ``finish_reason`` follows the main output's last token at once, then each sidecar
  comes in a chunk of its own (``choices`` empty, ``sidecars`` holding that one), in the request's order, as
  the sidecars finish decoding; then the usage chunk. ``usage`` also counts ``drafted_tokens`` and
  ``accepted_tokens``. vLLM's extensions:
  ``prompt_logprobs`` (0..5; not with ``stream`` or ``sidecars``) adds a top-level ``prompt_logprobs``, one
  entry per prompt token: ``null`` for the first, else ``{"<token id>": {"logprob", "rank",
  "decoded_token"}}`` for the token and its top alternatives; ``add_generation_prompt`` (default true) and
  ``continue_final_message`` (the prompt ends inside the last, assistant, message: for scoring it) shape the
  templated prompt. The draft's id takes only ``prompt_logprobs`` with ``max_tokens`` 1 (that token is the
  pair's).
- ``POST /v1/completions``: OpenAI's legacy completions, as lm-evaluation-harness uses them: ``prompt``
  (text, tokenized as text without a chat template after the tokenizer's BOS if it adds one; or token ids,
  taken as they are; or a list of one such prompt), ``max_tokens`` (default 16; 0 with ``echo`` scores the
  prompt and generates nothing), ``echo``, ``logprobs`` (0..5), ``temperature``, ``top_p``, ``seed``,
  ``stop``; no ``stream``. With ``echo`` the text is the prompt followed by the completion, and
  ``logprobs`` covers the prompt's tokens too: ``{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}``, the first token's logprob and top ``null``, each ``top_logprobs`` entry the token
  itself and its top alternatives keyed by their text (``bytes:\\xNN...`` for a token whose bytes are not
  UTF-8 alone, as OpenAI spells it, so that no two share a key), ``text_offset`` each token's start in the
  text in characters (of the
  prompt as sent, whatever the tokenizer's normalisation: ``LogprobFormatter.offsets_in``). The
  draft's id takes only ``echo`` with ``max_tokens`` 0. Prompt log-probabilities come from one forward of
  the named model over the prompt, log-softmax in float32 of its logits (``sidecar.decoding.scoring``),
  run by the batch worker between decoding steps.
- Every other field OpenAI defines for these two routes is accepted only where it cannot change the answer
  (``user``, ``metadata``, a zero penalty, ``response_format`` of type ``text``, ...) and otherwise refused
  with a 400 naming it (``server.schema.refusal``); so is any field the server does not know. Output
  constraints (``response_format`` ``json_object``/``json_schema``, vLLM's ``guided_choice``/``guided_regex``/
  ``guided_json``, one per request) are enforced on the main output while it decodes (docs/constraints.md):
  a regex or schema that cannot be enforced is a 400 naming its field. A sidecar spec may also give
  ``choices``, ``regex`` or ``json_schema`` (``SidecarTask``'s), which constrain that sidecar. The token
  space constraints need is built at startup, before ``/health`` answers.
- ``GET /stats``: batching statistics (``steps``, ``step_sizes``: how many requests each decoding step
  worked on, ``failed_steps``, ``queue_depth``: requests waiting for a slot; see ``server.worker.BatchStats``),
  the requests whose client left while they decoded (``cancelled_requests``, ``cancelled_tokens``), the
  device-time ledger's totals (``device``: forwards, measured seconds, and the seconds charged to each
  phase, which sum to the measured ones), the server's RSS, the capture mode with each model's counters
  (``capture``) and the load's warm-up (``warm_up``: ``ready``, and per capacity warmed each model's shapes,
  compiles, seconds and graph bytes).
- ``GET /metrics``: the same totals and per-request traffic, latency, token and speculation counts in the
  Prometheus text format (``server.metrics`` lists them), for a scraper that sends the key.

Requests run in one continuous batch on one worker thread (``server.worker``): each joins at the first
step with a free slot and leaves when it is done, whatever the others' settings; a client that disconnects
cancels its request, which leaves the batch at the next decoding step. Errors are OpenAI-style JSON
``{"error": {"message", "type", "param", "code"}}``; tracebacks stay in the server log.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import psutil
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.config import ServerConfig
from server.errors import APIError, UnexpectedErrors, validation_error
from server.metrics import ServerMetrics
from server.schema import ChatCompletionRequest, CompletionRequest, refusal
from server.service import ChatService
from server.worker import Job
from sidecar.decoding.decoder import capture_stats
from sidecar.decoding.rows import GenerationOutput
from sidecar.tasks.engine import SidecarEngine

Req = TypeVar("Req", ChatCompletionRequest, CompletionRequest)


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


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (after the body, the ASGI server's next message)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(engine: SidecarEngine, config: ServerConfig) -> FastAPI:
    service = ChatService(engine, config)
    metrics = ServerMetrics(service.worker)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(service.build_token_space)  # before the first request: /health answers after it
        service.worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(service.worker.stop)
            service.close()

    app = FastAPI(title="sidecar", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.state.metrics = metrics
    app.add_middleware(UnexpectedErrors)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None
                        ).response()

    async def authenticate(request: Request) -> None:
        if not config.api_key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    api = APIRouter(dependencies=[Depends(authenticate)])

    @app.get("/health", response_model=None)
    async def health() -> dict[str, Any] | JSONResponse:
        pair = engine.pair
        about = {"model": config.model_name, "pair": pair.name, "device": str(pair.device)}
        if service.worker.failure is not None:
            reason = f"the batch worker has died ({service.worker.failure}); restart the server"
            return JSONResponse({"status": "unhealthy", "reason": reason, **about}, status_code=503)
        if not service.worker.ready.is_set():
            reason = "warming up the compiled decode forwards (SIDECAR_WARMUP); requests wait for it"
            return JSONResponse({"status": "warming_up", "reason": reason, **about}, status_code=503)
        return {"status": "ok", **about}

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": int(service.worker.stats.started), "owned_by": "sidecar"}
            for name in (config.model_name, service.draft_name)]}

    @api.get("/stats")
    async def stats() -> dict[str, Any]:
        return service.worker.stats.snapshot() | {"queue_depth": service.worker.queue.qsize(),
                                                  "rss_bytes": psutil.Process().memory_info().rss,
                                                  "dtype": service.engine.pair.dtype_report,
                                                  "capture": capture_stats(service.engine.pair),
                                                  "warm_up": {"ready": service.worker.ready.is_set(),
                                                              "capacities": service.worker.warm_ups}}

    @api.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @api.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> JSONResponse | StreamingResponse:
        arrived = time.monotonic()
        with metrics.refusals():
            job, req = await submit(request)
            if req.stream:
                completion_id, created = f"chatcmpl-{job.id}", int(time.time())
                return StreamingResponse(metrics.watch_stream(service.stream(req, job, completion_id, created),
                                                              job, arrived),
                                         media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            body = await service.answer(req, job, f"chatcmpl-{job.id}", int(time.time()), _disconnected(request))
        metrics.answered(job, job.future.result(), arrived)
        return JSONResponse(body)

    @api.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> JSONResponse:
        arrived = time.monotonic()
        with metrics.refusals():
            job, req = await submit(request, CompletionRequest)
            body = await service.answer_completions(req, job, f"cmpl-{job.id}", int(time.time()),
                                                    _disconnected(request))
        result = job.future.result()
        if isinstance(result, GenerationOutput):
            metrics.answered(job, result, arrived)
        else:
            metrics.scored(body["usage"]["prompt_tokens"], arrived)
        return JSONResponse(body)

    async def submit(request: Request, schema: type[Req] = ChatCompletionRequest) -> tuple[Job, Req]:
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
            req = schema.model_validate(payload)
        except ValidationError as exc:
            raise validation_error(exc) from None
        if (refused := refusal(req)) is not None:
            param, why = refused
            raise APIError(400, why, param=param, code="unsupported_parameter")
        return await service.submit(req), req

    app.include_router(api)
    return app
