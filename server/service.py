"""Chat and completions requests to worker jobs and worker results to OpenAI-shaped responses.

A request is validated against the model's context and the decoder's bounds before it is queued, so the
worker sees only jobs it can run; ``usage`` also counts ``drafted_tokens`` and ``accepted_tokens``.
With ``logprobs`` every completion token has an entry (``server.logprobs``), the end-of-turn token too;
a stream's chunks carry the entries of the tokens committed since the previous chunk, so they add up to
the non-streamed list even where the text of a token is held back (a partial character, a possible stop).

Tokenizing prompts and turning tokens into text run on one text thread, never on the event loop, so a
large request cannot stall other clients or ``/health``. A client that goes away cancels its job: the
worker skips it or drops it from its batch at the next decoding step.

A prompt's log-probabilities (chat's ``prompt_logprobs``, an ``echo`` of completions with ``logprobs``) are
a scoring job (``server.worker.ScoreWork``) queued just before the request's generation, or alone when
``max_tokens`` is 0. The model id ``<served name>/draft`` scores with the pair's draft; it generates nothing
of its own, so it takes only requests that score: completions with ``echo`` and ``max_tokens`` 0, and chat
with ``prompt_logprobs`` and ``max_tokens`` 1, whose one token the pair (the target) writes.
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
from server.logprobs import LogprobFormatter, text_offsets
from server.schema import ChatCompletionRequest, CompletionRequest, SidecarSpec
from server.stream import TextStream, full_text
from server.worker import DONE, BatchWorker, Job, MainDone, ScoreWork
from sidecar.decoding.constraints import Constraint, ConstraintError, token_space
from sidecar.decoding.rows import DecodeRow, GenerationOutput
from sidecar.decoding.scoring import PromptLogprob
from sidecar.errors import InputError
from sidecar.tasks.engine import SidecarEngine
from sidecar.tasks.prompts import chat_prompt, encode
from sidecar.tasks.rows import DocumentResult, SidecarOutput, SidecarRequest
from sidecar.tasks.task import SidecarTask

_FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
# the engine's task fields by the names a sidecar spec gives them
_SPEC_NAMES = {"max_new_tokens": "max_tokens"}
T = TypeVar("T")


def _usage(prompt: int, completion: int, drafted: int = 0, accepted: int = 0) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "drafted_tokens": drafted, "accepted_tokens": accepted}


def _main_usage(main: GenerationOutput) -> dict[str, int]:
    return _usage(main.stats.prompt_tokens, len(main.token_ids), main.stats.drafted, main.stats.accepted)


def _sidecar_json(output: SidecarOutput, task: SidecarTask | None, stop: tuple[str, ...],
                  formatter: LogprobFormatter) -> dict[str, Any]:
    """A sidecar output as the API gives it: its text cut before its first stop string and parsed again then
    (the draft decodes a sidecar to its end of turn or limit: the tokens past a stop are counted in usage)."""
    # The draft decodes the sidecar alone (no speculation); its prompt is the reused context plus the fed tokens.
    prompt = output.stats.prompt_tokens  # what it attends to: the same alone or batched
    text, parsed, error = output.text, output.parsed, output.parse_error
    finish = _FINISH_REASONS.get(output.finish_reason, output.finish_reason)
    cut = [text.find(s) for s in stop if s in text]
    if cut and task is not None:
        text, finish = text[: min(cut)], "stop"
        parsed, error = task.parse(text)
    body = {"text": text, "parsed": parsed, "parse_error": error, "finish_reason": finish,
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

    def build_token_space(self) -> None:
        """Wrap the pair's tokenizer for constrained decoding now (2-6 s for Qwen's vocabulary), at startup:
        made by the first constrained request instead, it would stall the worker's batch for as long. The
        space is the one every batch's matchers ask for (``SlotBatch._matcher``: the target's logits, the
        pair's end-of-sequence ids), cached per tokenizer by ``token_space``."""
        pair = self.engine.pair
        token_space(pair.tokenizer, pair.target.get_output_embeddings().out_features, sorted(set(pair.eos_token_ids)))

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._text_thread, fn, *args)

    async def submit(self, req: ChatCompletionRequest | CompletionRequest) -> Job:
        """Tokenize and validate ``req`` on the text thread and queue it for the worker (its scoring job first)."""
        make = self.job if isinstance(req, ChatCompletionRequest) else self.completions_job
        job = await self._off_loop(make, req, asyncio.get_running_loop())
        try:
            if job.scoring is not None:
                self.worker.submit(job.scoring)
            self.worker.submit(job)
        except APIError:
            job.cancel()  # a scoring job already queued is skipped
            raise
        return job

    async def _results(self, job: Job, disconnected: Awaitable[None]) -> tuple[Any, Any]:
        """(``job``'s result, its scoring job's or None), unless ``disconnected`` (the client leaving) completes
        first: then the jobs are cancelled and a 499 answers nobody. A job's error is raised, the other cancelled."""
        jobs = [job] if job.scoring is None else [job.scoring, job]
        gone = asyncio.ensure_future(disconnected)
        try:
            pending = {j.future for j in jobs}
            while pending and not gone.done():
                done, pending = await asyncio.wait([*pending, gone], return_when=asyncio.FIRST_COMPLETED)
                pending.discard(gone)
                if any(not f.cancelled() and f.exception() is not None for f in done if f is not gone):
                    break
        finally:
            gone.cancel()
            if any(not j.future.done() for j in jobs):  # the client has gone, the server is stopping, or one failed
                job.cancel()
        for j in jobs:
            if j.future.done() and not j.future.cancelled() and j.future.exception() is not None:
                raise j.future.exception()
        if any(j.future.cancelled() for j in jobs):
            raise APIError(499, "the client closed the connection", code="client_closed_request")
        return job.future.result(), None if job.scoring is None else job.scoring.future.result()

    async def answer(self, req: ChatCompletionRequest, job: Job, completion_id: str, created: int,
                     disconnected: Awaitable[None]) -> dict[str, Any]:
        """The non-streamed chat response (``_results`` says when there is none)."""
        result, scores = await self._results(job, disconnected)
        return await self._off_loop(self.completion, req, job, result, completion_id, created, scores)

    async def answer_completions(self, req: CompletionRequest, job: Job, completion_id: str, created: int,
                                 disconnected: Awaitable[None]) -> dict[str, Any]:
        """The legacy completions response (``_results`` says when there is none)."""
        result, scores = await self._results(job, disconnected)
        return await self._off_loop(self.legacy_completion, req, job, result, scores, completion_id, created)

    def _model(self, name: str) -> str:
        """"target" or "draft": which of the pair's models the model id ``name`` names."""
        if name == self.config.model_name:
            return "target"
        if name == self.draft_name:
            return "draft"
        raise APIError(404, f"the model {name!r} does not exist; this server serves {self.config.model_name!r} "
                            f"(and scores with {self.draft_name!r})", param="model", code="model_not_found")

    @property
    def draft_name(self) -> str:
        """The model id that names the pair's draft (for scoring)."""
        return f"{self.config.model_name}/draft"

    def job(self, req: ChatCompletionRequest, loop: asyncio.AbstractEventLoop) -> Job:
        """``req`` as the worker's job, its decoding fields set and checked as the engine will check them."""
        model = self._model(req.model)
        if model == "draft" and (req.prompt_logprobs is None or req.limit != 1):
            raise APIError(400, f"the model {req.model!r} only scores prompts: ask for prompt_logprobs with "
                                "max_tokens 1 (the one token is the pair's)", param="model")
        sampling = req.sampling
        constraint = self._constraint(req)
        work: DecodeRow | SidecarRequest
        try:
            if req.sidecars is not None:
                request, row, sidecar_stops = self._sidecar_request(req)
                work = replace(request, max_new_tokens=self._max_tokens(req, row), sampling=sampling,
                               top_logprobs=req.engine_top_logprobs, stop=req.stop, constraint=constraint)
                # the main row as the engine builds it: the draft's context must also hold the sidecar outputs
                row = self.engine.decode_row(0, work)
            else:
                messages = [{"role": m.template_role, "content": m.text} for m in req.messages]
                prompt = chat_prompt(self.tokenizer, messages, req.add_generation_prompt, req.continue_final_message)
                row = work = DecodeRow(prompt, self._max_tokens(req, DecodeRow(prompt, 1)), sampling=sampling,
                                       stop=req.stop, top_logprobs=req.engine_top_logprobs, constraint=constraint)
            self.engine.decoder.validate([row], 1)
        except InputError as exc:
            raise APIError(400, str(exc), param="messages") from None
        job = Job(work, loop, loop.create_future(), tokens=asyncio.Queue() if req.stream else None)
        if req.sidecars is not None:
            job.sidecar_stops = sidecar_stops
        if req.prompt_logprobs is not None:
            job.scoring = Job(ScoreWork(model, row.target_prompt, req.prompt_logprobs), loop, loop.create_future())
        return job

    def completions_job(self, req: CompletionRequest, loop: asyncio.AbstractEventLoop) -> Job:
        """``req`` as the worker's job: the prompt's scoring alone when ``max_tokens`` is 0, else its generation
        with the scoring job attached when ``echo`` asks for the prompt's logprobs."""
        model = self._model(req.model)
        if model == "draft" and req.max_tokens:
            raise APIError(400, f"the model {req.model!r} only scores prompts: send echo with max_tokens 0",
                           param="model")
        constraint = self._constraint(req)
        prompt = self.prompt_ids(req.prompt)
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        scoring = ScoreWork(model, prompt, req.logprobs or 0)
        if not req.max_tokens:
            if len(prompt) > self.engine.pair.max_context:
                raise APIError(400, f"the prompt has {len(prompt)} tokens, more than the model's context of "
                                    f"{self.engine.pair.max_context} tokens; shorten it", param="prompt",
                               code="context_length_exceeded")
            return Job(scoring, loop, loop.create_future())
        row = DecodeRow(prompt, self._max_tokens(req, DecodeRow(prompt, 1), "prompt"), sampling=req.sampling,
                        stop=req.stop, top_logprobs=req.logprobs, constraint=constraint)
        try:
            self.engine.decoder.validate([row], 1)
        except InputError as exc:
            raise APIError(400, str(exc), param="prompt") from None
        job = Job(row, loop, loop.create_future())
        if req.scores_prompt:
            job.scoring = Job(scoring, loop, loop.create_future())
        return job

    @staticmethod
    def _constraint(req: ChatCompletionRequest | CompletionRequest) -> Constraint | None:
        """The request's output constraint as the engine enforces it; one it cannot is a 400 naming its field."""
        try:
            return req.engine_constraint()
        except ConstraintError as exc:
            raise APIError(400, f"{exc.field}: {exc.reason}", param=exc.field) from None

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A completions prompt's ids: token ids as they are, text as text after the tokenizer's BOS if it adds one."""
        if isinstance(prompt, list):
            vocab = len(self.tokenizer)
            if any(not 0 <= token < vocab for token in prompt):
                raise APIError(400, f"the prompt's token ids must lie in [0, {vocab}), the tokenizer's vocabulary",
                               param="prompt")
            return list(prompt)
        bos = self.tokenizer.bos_token_id
        starts = bos is not None and self.tokenizer("", add_special_tokens=True)["input_ids"][:1] == [bos]
        return ([bos] if starts else []) + encode(self.tokenizer, prompt)

    def prompt_offsets(self, prompt: str | list[int], token_ids: list[int]) -> list[int]:
        """Where each prompt token starts in the echoed prompt (``prompt_text``), in characters: a text prompt
        is echoed as sent, so its offsets come from the tokenizer's own mapping (``offsets_in``)."""
        if isinstance(prompt, str):
            return self.formatter.offsets_in(prompt, token_ids)
        return text_offsets([self.formatter.width(token) for token in token_ids])

    def prompt_text(self, prompt: str | list[int]) -> str:
        """A completions prompt as text: token ids spell it as ``text_offset`` counts them."""
        if isinstance(prompt, str):
            return prompt
        return b"".join(self.formatter.width(token) for token in prompt).decode("utf-8", errors="replace")

    def _sidecar_request(self, req: ChatCompletionRequest) -> tuple[SidecarRequest, DecodeRow,
                                                                    dict[str, tuple[str, ...]]]:
        """(the request, its main row as the target sees it, each sidecar's stop strings)."""
        messages = req.messages
        system = None
        if messages[0].template_role == "system":
            system, messages = messages[0].text, messages[1:]
        if not messages or messages[-1].role != "user":
            raise APIError(400, "with sidecars, the last message must be the user's: the document the main output "
                                "answers, after any earlier turns", param="messages")
        history = [(m.template_role, m.text) for m in messages[:-1]]
        tasks, stops = [], {}
        for i, raw in enumerate(req.sidecars or []):
            # the spec's own errors name the client's fields as sent; only the engine's task, built from a valid
            # spec, names a field by the engine's name (a client's own max_new_tokens stays an unknown field)
            try:
                spec = SidecarSpec.model_validate(raw)
            except ValidationError as exc:
                raise validation_error(exc, f"sidecars.{i}.") from None
            try:
                tasks.append(spec.task())
            except ValidationError as exc:
                raise validation_error(exc, f"sidecars.{i}.", _SPEC_NAMES) from None
            stops[spec.name] = tuple(spec.stop or ())
        if not tasks:
            raise APIError(400, "sidecars must list at least one task (or be left out)", param="sidecars")
        # The document is the user's text as is; the main instruction is empty because it is part of that text.
        request = SidecarRequest(document=messages[-1].text, instruction="", system=system, sidecars=tasks,
                                 history=history)
        try:
            bare, compound = self.engine.prompts(request)
        except InputError as exc:
            raise APIError(400, str(exc), param="sidecars" if "sidecar" in str(exc) else "messages") from None
        hidden = [compound.spans[f"sidecar:{t.name}"] for t in tasks]
        return request, DecodeRow(bare.token_ids, 1, compound.token_ids, hidden), stops

    def _max_tokens(self, req: ChatCompletionRequest | CompletionRequest, row: DecodeRow,
                    param: str = "messages") -> int:
        prompt = max(len(row.target_prompt), len(row.draft_prompt or []))
        # the decoder's own bound (SpeculativeDecoder.validate): prompt + new tokens + gamma + 1 <= context
        room = self.engine.pair.max_context - prompt - self.engine.decoder.gamma - 1
        if room < 1 or (req.limit is not None and req.limit > room):
            asked = f" plus {req.limit} new tokens" if req.limit is not None else ""
            raise APIError(400, f"the prompt has {prompt} tokens{asked}, more than the model's context of "
                                f"{self.engine.pair.max_context} tokens allows (room for {max(room, 0)} new "
                                f"tokens); shorten the {param} or lower max_tokens",
                           param=param, code="context_length_exceeded")
        return req.limit if req.limit is not None else min(DEFAULT_MAX_TOKENS, room)

    def completion(self, req: ChatCompletionRequest, job: Job, result: object, completion_id: str, created: int,
                   scores: list[PromptLogprob] | None = None) -> dict[str, Any]:
        main, sidecars = self._split(result, job)
        text, stopped = full_text(self.tokenizer, main.token_ids, job.stop)
        body: dict[str, Any] = {
            "id": completion_id, "object": "chat.completion", "created": created, "model": req.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                         "logprobs": self.formatter.logprobs(main.logprobs),
                         "finish_reason": self._finish(main, stopped)}],
            "usage": _main_usage(main),
        }
        if sidecars is not None:
            body["sidecars"] = sidecars
        if scores is not None:
            body["prompt_logprobs"] = self.formatter.prompt_logprobs(scores)
        return body

    def legacy_completion(self, req: CompletionRequest, job: Job, result: object, scores: list[PromptLogprob] | None,
                          completion_id: str, created: int) -> dict[str, Any]:
        """The completions response; ``result`` is the generation, or the prompt's scores when ``max_tokens``
        is 0 (which ends at once: finish reason "length")."""
        if isinstance(job.work, ScoreWork):
            prompt, main, text, finish, scores = job.work.token_ids, None, "", "length", result
        else:
            assert isinstance(result, GenerationOutput) and isinstance(job.work, DecodeRow)
            prompt, main = job.work.target_prompt, result
            text, stopped = full_text(self.tokenizer, main.token_ids, job.stop)
            finish = self._finish(main, stopped)
        shown = self.prompt_text(req.prompt) + text if req.echo else text
        logprobs: dict[str, list] | None = None
        if req.logprobs is not None:
            ids, entries, offsets = [], [], []
            if req.echo:
                ids, entries, offsets = list(prompt), [None, *scores], self.prompt_offsets(req.prompt, prompt)
            if main is not None and main.logprobs is not None:
                ids += main.token_ids
                entries += main.logprobs
                offsets += text_offsets([self.formatter.width(t) for t in main.token_ids], len(shown) - len(text))
            logprobs = self.formatter.legacy(ids, entries, offsets)
            # tokens after a stop string are not in the text: they start where it ends
            logprobs["text_offset"] = [min(offset, len(shown)) for offset in logprobs["text_offset"]]
        return {"id": completion_id, "object": "text_completion", "created": created, "model": req.model,
                "choices": [{"index": 0, "text": shown, "logprobs": logprobs, "finish_reason": finish}],
                "usage": _usage(len(prompt), 0) if main is None else _main_usage(main)}

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
        finished = False  # whether the finish chunk went out
        try:
            yield chunk({"role": "assistant", "content": ""})
            done = False
            while not done:
                # every commit waiting is turned into text in one trip to the text thread; the main output's end
                # finishes the choice at once, before the sidecars that still decode
                items = [await job.tokens.get()]
                while not job.tokens.empty():
                    items.append(job.tokens.get_nowait())
                commits = []
                for item in items:
                    if item is DONE or isinstance(item, MainDone):
                        for piece, logprobs in await self._off_loop(self._pieces, text, commits):
                            yield chunk({"content": piece}, logprobs=logprobs)
                        commits = []
                        done = item is DONE
                        if isinstance(item, MainDone):
                            finished = True
                            async for piece in self._finish_chunks(text, item.output, chunk):
                                yield piece
                    else:
                        commits.append(item)
                for piece, logprobs in await self._off_loop(self._pieces, text, commits):
                    yield chunk({"content": piece}, logprobs=logprobs)
            try:
                result = job.future.result()
            except APIError as exc:
                yield _sse(exc.body())
                yield b"data: [DONE]\n\n"
                return
            main, sidecars = await self._off_loop(self._split, result, job)
            if not finished:
                async for piece in self._finish_chunks(text, main, chunk):
                    yield piece
            # each sidecar in a chunk of its own, in the request's order; no choice, like usage's
            tasks = job.work.sidecars if isinstance(job.work, SidecarRequest) else []
            for name in [t.name for t in tasks if t.name in (sidecars or {})]:
                yield _sse({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                            "model": self.config.model_name, "choices": [], "sidecars": {name: sidecars[name]}})
            if req.stream_options is not None and req.stream_options.include_usage:
                yield _sse({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                            "model": self.config.model_name, "choices": [], "usage": _main_usage(main)})
            yield b"data: [DONE]\n\n"
        finally:
            if not job.future.done():  # the client hung up: the worker skips the job or drops it at the next step
                job.cancel()

    async def _finish_chunks(self, text: TextStream, main: GenerationOutput,
                             chunk: Callable[..., bytes]) -> AsyncIterator[bytes]:
        """The text held back until the end (a partial stop string that was none), then the finish reason."""
        if piece := await self._off_loop(text.finish):
            yield chunk({"content": piece})
        yield chunk({}, self._finish(main, text.stopped))

    def _pieces(self, text: TextStream, commits: list[tuple[list[int], Any]]) -> list[tuple[str, Any]]:
        """(text released, logprobs JSON) per commit that has either: a chunk per commit when logprobs were
        asked for, so its entries travel even while its text waits."""
        pieces = []
        for ids, entries in commits:
            piece = text.push(ids)
            if piece or entries:
                pieces.append((piece, self.formatter.logprobs(entries)))
        return pieces

    def _split(self, result: object, job: Job) -> tuple[GenerationOutput, dict[str, Any] | None]:
        if isinstance(result, DocumentResult):
            tasks = {t.name: t for t in job.work.sidecars} if isinstance(job.work, SidecarRequest) else {}
            return result.main, {name: _sidecar_json(out, tasks.get(name), job.sidecar_stops.get(name, ()),
                                                     self.formatter) for name, out in result.sidecars.items()}
        assert isinstance(result, GenerationOutput)
        return result, None

    @staticmethod
    def _finish(main: GenerationOutput, stopped: bool) -> str:
        return "stop" if stopped else _FINISH_REASONS[main.finish_reason]


def _sse(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"
