"""The batch worker: one thread owns the models, and only it decodes.

It collects requests for ``batch_wait_ms`` (up to ``max_batch``), groups those that can share a decoding
call (same sampling settings, same stop strings, with or without sidecars, same logprobs asked) and runs
each group as one batch with per-row token limits. Every job it runs is finished exactly once, with a result or an
``APIError``; a job whose client left before its batch began is skipped, and one whose client leaves while it
decodes leaves its batch at the next step (``SpeculativeDecoder.decode``'s ``cancelled``) and gets no sidecars.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from server.config import ServerConfig
from server.errors import APIError
from sidecar.engine import SidecarEngine
from sidecar.errors import InputError
from sidecar.logprobs import TokenLogprob
from sidecar.rows import GenerationOutput
from sidecar.sampling import Sampling
from sidecar.sidecar_rows import DocumentResult, SidecarRequest

logger = logging.getLogger(__name__)


@dataclass
class BatchStats:
    """What the worker has run; read by ``GET /stats`` from the event loop, written by the worker."""

    started: float = field(default_factory=time.time)
    requests: int = 0
    batches: int = 0
    failed_batches: int = 0
    sizes: Counter[int] = field(default_factory=Counter)
    # requests whose client left while they decoded, and the tokens decoded for them until they left
    cancelled_requests: int = 0
    cancelled_tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, size: int, ok: bool, cancelled_tokens: Sequence[int] = ()) -> None:
        with self.lock:
            self.requests += size
            self.batches += 1
            self.failed_batches += int(not ok)
            self.sizes[size] += 1
            self.cancelled_requests += len(cancelled_tokens)
            self.cancelled_tokens += sum(cancelled_tokens)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                "requests": self.requests,
                "batches": self.batches,
                "failed_batches": self.failed_batches,
                "batch_sizes": {str(size): count for size, count in sorted(self.sizes.items())},
                "max_batch_size": max(self.sizes, default=0),
                "mean_batch_size": self.requests / self.batches if self.batches else 0.0,
                "cancelled_requests": self.cancelled_requests,
                "cancelled_tokens": self.cancelled_tokens,
                "uptime_s": time.time() - self.started,
            }


DONE = object()  # end of a job's token stream


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
    tokens: asyncio.Queue | None = None  # (new token ids, their logprobs or None) while streaming, then DONE
    top_logprobs: int | None = None  # None: no logprobs
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # set from the event loop once the client has gone; the worker reads it between decoding steps
    gone: threading.Event = field(default_factory=threading.Event)

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
            return ("sidecar", sampling, self.max_tokens, self.top_logprobs)
        return ("plain", sampling, self.stop, self.top_logprobs)

    def cancel(self) -> None:
        """The client has gone (called on the event loop): skip the job, or stop decoding it."""
        self.gone.set()
        self.future.cancel()

    def emit(self, ids: list[int], logprobs: list[TokenLogprob] | None) -> None:
        if self.tokens is not None:
            self.loop.call_soon_threadsafe(self.tokens.put_nowait, (ids, logprobs))

    def finish(self, result: object = None, error: BaseException | None = None) -> None:
        def resolve() -> None:
            if not self.future.done():
                if error is not None:
                    self.future.set_exception(error)
                else:
                    self.future.set_result(result)
            if self.tokens is not None:
                self.tokens.put_nowait(DONE)

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
                if not job.gone.is_set():
                    groups.setdefault(job.key, []).append(job)
            for group in groups.values():
                self._run(group)

    def _run(self, jobs: list[Job]) -> None:
        sampling, top_logprobs = jobs[0].sampling, jobs[0].top_logprobs

        def on_tokens(row: int, ids: list[int], logprobs: list[TokenLogprob] | None) -> None:
            jobs[row].emit(ids, logprobs)

        def cancelled(row: int) -> bool:
            return jobs[row].gone.is_set()

        try:
            results: Sequence[DocumentResult | GenerationOutput]
            if jobs[0].request is not None:
                results = self.engine.run(
                    [job.request for job in jobs if job.request is not None], max_new_tokens=jobs[0].max_tokens,
                    temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed,
                    batch_size=len(jobs), on_tokens=on_tokens, top_logprobs=top_logprobs, cancelled=cancelled)
            else:
                results = self.engine.decoder.generate(
                    [job.prompt for job in jobs if job.prompt is not None], [job.max_tokens for job in jobs],
                    temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed,
                    batch_size=len(jobs), stop=list(jobs[0].stop) or None, on_tokens=on_tokens,
                    top_logprobs=top_logprobs, cancelled=cancelled)
        except Exception as exc:
            self.stats.record(len(jobs), ok=False)
            error = self._api_error(exc, len(jobs))
            for job in jobs:
                job.finish(error=error)
            return
        mains = [result.main if isinstance(result, DocumentResult) else result for result in results]
        self.stats.record(len(jobs), ok=True, cancelled_tokens=[len(main.token_ids) for main in mains
                                                               if main.finish_reason == "cancelled"])
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
