"""The batch worker: one thread owns the models and one running batch, and only it decodes.

The loop admits, then steps. Every queued request joins the running ``SidecarBatch`` as soon as the batch
has a slot for it, whatever its sampling settings, stop strings, logprobs or sidecars (each row carries its
own), and the batch takes one decoding step; the jobs that step completed are finished. A short request
sent while a long one decodes therefore joins at the next step and returns first. The worker blocks on the
queue only while the batch is idle; the first request then waits up to ``batch_wait_ms`` for others to share
its prefill, and a running batch never waits.

Every job the worker takes is finished exactly once, with a result or an ``APIError``. A job whose client
left before it joined the batch is dropped at no cost; one whose client leaves while it decodes leaves the
batch at the next step (finish reason "cancelled"), and so do its sidecars if it leaves while they run. A
step that raises fails every job in the batch (the engine refusing input 400, out of memory 503, anything
else 500) and the loop goes on with an empty batch. After the stop sentinel the batch runs until its last
job is finished. A seeded request decodes the same tokens whatever shares the batch with it
(``sidecar.decoding.randomness``). Should the loop itself raise, the worker is dead: it answers every job it
holds or that is queued with 503 ``worker_failed``, refuses new ones the same way, and ``failure`` says why
(``GET /health`` reports it). Out of memory, in a step, a join or a scoring forward, also releases the KV
caches kept for later batches (``sidecar.runtime.pools.release_free``), as the nightly run's retry does, and
the keys and values of the prompts the prefix caches keep.

Before its loop the worker warms the compiled or captured decode forwards (``SIDECAR_WARMUP``:
``SpeculativeDecoder.warm_at_load``) on its own thread, the one that replays them (inductor's CUDA graphs are
per thread): every batch bucket of ``max_batch`` rows (and as many draft-only rows, the sidecars') at the
capacity buckets from 64 columns, at most ``MAX_FREE_SHAPES`` of them and none past the context (64 .. 512: a
short prompt with the default ``max_tokens``); a longer request's cache warms when it is allocated. Until then
``ready`` is unset (``GET /health`` answers 503 ``warming_up``) and requests queue.

A scoring job (``ScoreWork``: a prompt's log-probabilities) joins no batch: the worker runs its one forward
when it takes the job from the queue, between two decoding steps, so it never races the batch's forwards
and leaves the batch's rows as they were. Its forward is not in the device-time ledger, which accounts
decoding steps. The worker keeps a ``PrefixCache`` per model (``sidecar.decoding.prefix_cache``) of at most
``prompt_cache_mib`` MiB: a prompt sharing its leading tokens with one scored recently (a judge's scorer
prompts share instruction and summary) forwards only its new tokens; ``GET /stats`` reports its counters
under ``prompt_cache``, empty when ``prompt_cache`` is off (``sidecar serve --no-prompt-cache``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
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
from sidecar.decoding.logprobs import TokenLogprob
from sidecar.decoding.prefix_cache import PrefixCache
from sidecar.decoding.rows import DecodeRow, GenerationOutput
from sidecar.decoding.scoring import prompt_logprobs
from sidecar.errors import InputError
from sidecar.runtime.pools import release_free
from sidecar.runtime.slots import row_columns
from sidecar.runtime.warmup import summary, warms_at_load
from sidecar.tasks.batch import SidecarBatch
from sidecar.tasks.engine import SidecarEngine
from sidecar.tasks.rows import DocumentResult, SidecarRequest

logger = logging.getLogger(__name__)


@dataclass
class BatchStats:
    """What the worker has run; read by ``GET /stats`` from the event loop, written by the worker.

    ``requests`` counts finished jobs and ``failed_requests`` those finished with an error. A step is one
    ``SidecarBatch.step``; ``step_sizes[n]`` counts the steps that worked on ``n`` requests (joining, decoding
    their main output, or decoding their sidecars), so its mean is the batch's average occupancy in requests.
    ``failed_steps`` counts the steps that raised (each failed every job in the batch).
    """

    started: float = field(default_factory=time.time)
    requests: int = 0
    failed_requests: int = 0
    steps: int = 0
    failed_steps: int = 0
    step_sizes: Counter[int] = field(default_factory=Counter)
    # requests whose client left while they decoded, and the tokens decoded for them until they left
    cancelled_requests: int = 0
    cancelled_tokens: int = 0
    # the device-time ledger's totals (``sidecar.runtime.ledger``) over the worker's batches: measured forward
    # seconds, and the seconds charged to each phase (main, sidecar, instruction)
    device: dict[str, Any] = field(default_factory=lambda: {"forwards": 0, "measured_seconds": 0.0,
                                                            "charged_seconds": 0.0, "charged_seconds_by_phase": {}})
    # each model's prompt-scoring prefix cache (``PrefixCache.counters``), by "target" and "draft"
    prompt_cache: dict[str, dict[str, int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record_step(self, size: int, finished: int, failed: int = 0, cancelled_tokens: Sequence[int] = ()) -> None:
        """A step over ``size`` requests that finished ``finished`` of them, ``failed`` of those with an error."""
        with self.lock:
            self.steps += 1
            self.failed_steps += int(failed > 0)
            self.step_sizes[size] += 1
            self.requests += finished
            self.failed_requests += failed
            self.cancelled_requests += len(cancelled_tokens)
            self.cancelled_tokens += sum(cancelled_tokens)

    def record_device(self, totals: dict[str, Any], earlier: dict[str, Any]) -> None:
        """The current batch's ledger ``totals`` on top of ``earlier`` batches' (a failed step replaces the batch)."""
        phases = dict(earlier["charged_seconds_by_phase"])
        for phase, seconds in totals["charged_seconds_by_phase"].items():
            phases[phase] = phases.get(phase, 0.0) + seconds
        with self.lock:
            self.device = {key: earlier[key] + totals[key]
                           for key in ("forwards", "measured_seconds", "charged_seconds")}
            self.device["charged_seconds_by_phase"] = phases

    def record_scored(self, failed: bool, caches: dict[str, PrefixCache]) -> None:
        """A scoring job the worker ran outside the batch (``ScoreWork``), and its prefix ``caches`` after it."""
        with self.lock:
            self.requests += 1
            self.failed_requests += int(failed)
        self.record_prompt_caches(caches)

    def record_prompt_caches(self, caches: dict[str, PrefixCache]) -> None:
        """The prefix ``caches``' counters as they are now."""
        counters = {model: cache.counters() for model, cache in caches.items()}
        with self.lock:
            self.prompt_cache = counters

    def record_refused(self) -> None:
        """A job the batch refused to take (its error is the job's answer); no step ran for it."""
        with self.lock:
            self.requests += 1
            self.failed_requests += 1

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            work = sum(size * count for size, count in self.step_sizes.items())
            return {
                "requests": self.requests,
                "failed_requests": self.failed_requests,
                "steps": self.steps,
                "failed_steps": self.failed_steps,
                "step_sizes": {str(size): count for size, count in sorted(self.step_sizes.items())},
                "max_step_size": max(self.step_sizes, default=0),
                "mean_step_size": work / self.steps if self.steps else 0.0,
                "cancelled_requests": self.cancelled_requests,
                "cancelled_tokens": self.cancelled_tokens,
                "device": {**self.device, "charged_seconds_by_phase": dict(self.device["charged_seconds_by_phase"])},
                "prompt_cache": {model: dict(counters) for model, counters in self.prompt_cache.items()},
                "uptime_s": time.time() - self.started,
            }


DONE = object()  # end of a job's token stream


@dataclass(frozen=True)
class MainDone:
    """In a job's token stream: its main output is final (its sidecars, if any, still decode)."""

    output: GenerationOutput


def cancelled(result: DocumentResult) -> bool:
    """Whether a request ended because its client left: during its main output or its sidecars."""
    return result.main.finish_reason == "cancelled" or any(
        s.finish_reason == "cancelled" for s in result.sidecars.values())


@dataclass(frozen=True)
class ScoreWork:
    """Score ``token_ids`` under the pair's ``model`` ("target" or "draft") with ``top`` alternatives per token;
    the job's result is ``prompt_logprobs``' list."""

    model: str
    token_ids: list[int]
    top: int

    stop = None  # a job's stop strings: scoring writes no text


@dataclass
class Job:
    """One request as the worker runs it: a plain chat row, a request with sidecars, its decoding fields set,
    or a prompt to score."""

    work: DecodeRow | SidecarRequest | ScoreWork
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    # while streaming: (new token ids, their logprobs or None), MainDone once the main output is final, then DONE
    tokens: asyncio.Queue | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # set from the event loop once the client has gone; the worker reads it between decoding steps
    gone: threading.Event = field(default_factory=threading.Event)
    # ``time.monotonic()`` when the worker emitted the main output's first and latest tokens (``/metrics``)
    first_token_at: float | None = None
    last_token_at: float | None = None
    # the job that scores this one's prompt, queued just before it (``prompt_logprobs``, ``echo``)
    scoring: Job | None = None
    # each sidecar's own stop strings, by task name: its text is cut at them (``server.service``)
    sidecar_stops: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def stop(self) -> tuple[str, ...]:
        return tuple(self.work.stop or ())

    def cancel(self) -> None:
        """The client has gone (called on the event loop): skip the job, or stop decoding it."""
        self.gone.set()
        if self.scoring is not None:
            self.scoring.cancel()
        self.future.cancel()

    def emit(self, ids: list[int], logprobs: list[TokenLogprob] | None) -> None:
        self.last_token_at = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = self.last_token_at
        if self.tokens is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is reading the stream
                self.loop.call_soon_threadsafe(self.tokens.put_nowait, (ids, logprobs))

    def main_done(self, output: GenerationOutput) -> None:
        """The main output is final: a stream can finish it before the sidecars (after the tokens emitted)."""
        if self.tokens is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is reading the stream
                self.loop.call_soon_threadsafe(self.tokens.put_nowait, MainDone(output))

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
    """The thread that owns the models and runs queued jobs in one continuous batch."""

    def __init__(self, engine: SidecarEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.stats = BatchStats()
        self.queue: queue.Queue[Job | None] = queue.Queue(maxsize=config.max_queue)
        self._jobs: dict[int, Job] = {}  # the jobs in the batch, by their index there
        self._running: SidecarBatch | None = None  # the batch (``_loop``)
        self._indices = itertools.count()
        # why the loop died ("OverflowError: ..."); None while it runs or after a clean stop
        self.failure: str | None = None
        # set once the warm-up is done (at once where there is nothing to warm); its reports, one per capacity
        self.ready = threading.Event()
        self.warm_ups: list[dict] = []
        if not warms_at_load(engine.pair.capture_mode):
            self.ready.set()
        # scored prompts of each model, for the next prompt that shares their leading tokens (this thread's
        # alone); none with ``prompt_cache`` off
        self.prefix_caches = {model: PrefixCache(max_bytes=config.prompt_cache_mib << 20)
                              for model in ("target", "draft")} if config.prompt_cache else {}
        self.stats.record_prompt_caches(self.prefix_caches)
        self._thread = threading.Thread(target=self._run, name="sidecar-worker", daemon=True)

    @property
    def running(self) -> int:
        """Requests in the running batch."""
        return len(self._jobs)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        # The sentinel may wait behind a full queue; the jobs before it still run.
        self.queue.put(None)
        self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        if self.failure is not None:
            raise self._failed_error()
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            raise APIError(503, "the server is overloaded; retry later", "server_error", code="overloaded") from None
        if self.failure is not None:  # it died while this job was being queued: nobody will take it
            self._refuse_the_rest(self._failed_error())

    def _failed_error(self) -> APIError:
        return APIError(503, f"the batch worker has died ({self.failure}); restart the server", "server_error",
                        code="worker_failed")

    def _run(self) -> None:
        try:
            self._warm_up()
            self._loop()
        except BaseException as exc:
            logger.exception("the batch worker died")
            self.failure = f"{type(exc).__name__}: {exc}"
            error = self._failed_error()
            jobs = list(self._jobs.values())
            self._jobs.clear()
            for job in jobs:
                job.finish(error=error)
            self._refuse_the_rest(error)

    def _warm_up(self) -> None:
        """Warm the forwards the batches will run (see the module's docstring), then say ready."""
        if not self.ready.is_set():
            decoder, started = self.engine.decoder, time.perf_counter()
            self.warm_ups = decoder.warm_at_load(self.config.max_batch, row_columns(1, 1, decoder.gamma),
                                                 self.engine.pair.max_context, max_draft_rows=self.config.max_batch)
            logger.info("%s", summary(self.warm_ups, time.perf_counter() - started))
        self.ready.set()

    def _batch(self) -> SidecarBatch:
        with self.stats.lock:
            self._earlier_device = self.stats.device  # what the batches before this one charged
        return self.engine.batch(self.config.max_batch, on_tokens=self._on_tokens, cancelled=self._cancelled,
                                 on_main=self._on_main)

    def _on_tokens(self, index: int, ids: list[int], logprobs: list[TokenLogprob] | None) -> None:
        self._jobs[index].emit(ids, logprobs)

    def _on_main(self, index: int, output: GenerationOutput) -> None:
        self._jobs[index].main_done(output)

    def _cancelled(self, index: int) -> bool:
        return self._jobs[index].gone.is_set()

    def _loop(self) -> None:
        # the running batch lives in this attribute alone, so that a step that fails can let go of it (``_step``)
        self._running = self._batch()
        stopping = False
        while not stopping or self._jobs:
            if not stopping:
                stopping = self._fill(self._running, wait=not self._jobs)
            if self._jobs:
                self._step()
        self._refuse_the_rest(APIError(503, "the server is stopping; retry later", "server_error",
                                       code="shutting_down"))

    def _fill(self, batch: SidecarBatch, wait: bool) -> bool:
        """Move queued jobs into ``batch`` while it has a slot for them; True once the stop sentinel is taken.

        With ``wait`` (the batch is idle) block for the first job that joins, then take those that arrive
        within ``batch_wait_ms`` of it."""
        deadline: float | None = None
        while batch.wants_rows():
            try:
                if wait:
                    job = self.queue.get(timeout=None if deadline is None else max(deadline - time.monotonic(), 0))
                else:
                    job = self.queue.get_nowait()
            except queue.Empty:
                return False
            if job is None:
                return True
            if self._join(batch, job) and deadline is None:
                deadline = time.monotonic() + self.config.batch_wait_ms / 1000
        return False

    def _join(self, batch: SidecarBatch, job: Job) -> bool:
        """Add ``job`` to ``batch``; False when it does not join (its client has gone, the engine refused it, or
        it scores a prompt, which is done now)."""
        if job.gone.is_set():  # a client that went away before its job joined costs nothing
            return False
        if isinstance(job.work, ScoreWork):
            self._score(job, job.work)
            return False
        index = next(self._indices)
        try:
            if isinstance(job.work, SidecarRequest):
                batch.add(index, job.work)
            else:
                batch.add_row(index, job.work)
        except Exception as exc:  # requests are validated before queueing, so this is rare
            error = self._api_error(exc, "a request joining the batch")
        else:
            self._jobs[index] = job
            return True
        self.stats.record_refused()
        self._fail([job], error)
        return False

    def _score(self, job: Job, work: ScoreWork) -> None:
        """Run a scoring job now, on this thread, between two steps of the batch."""
        model = self.engine.pair.target if work.model == "target" else self.engine.pair.draft
        try:
            result = prompt_logprobs(model, work.token_ids, work.top, self.prefix_caches.get(work.model))
        except Exception as exc:
            error = self._api_error(exc, f"scoring a prompt of {len(work.token_ids)} tokens")
        else:
            self.stats.record_scored(failed=False, caches=self.prefix_caches)
            job.finish(result)
            return
        self.stats.record_scored(failed=True, caches=self.prefix_caches)
        self._fail([job], error)

    def _step(self) -> None:
        """One step of the running batch; finishes the jobs it completed. A batch that failed mid-step is in no
        state to continue: it is dropped before its jobs are answered (out of memory then frees its KV caches
        with the rest, ``_fail``) and a fresh batch takes its place."""
        size = len(self._jobs)
        try:
            done = self._running.step()
        except Exception as exc:
            error = self._api_error(exc, f"a step over {size} requests")
        else:
            self.stats.record_device(self._running.ledger.totals(), self._earlier_device)
            finished = [(self._jobs.pop(index), result) for index, result in done]
            self.stats.record_step(size, finished=len(finished), cancelled_tokens=[
                len(result.main.token_ids) + sum(len(s.token_ids) for s in result.sidecars.values())
                for _, result in finished if cancelled(result)])
            for job, result in finished:
                job.finish(result if isinstance(job.work, SidecarRequest) else result.main)
            return
        jobs = list(self._jobs.values())  # answered after the except block (``_fail``)
        self._jobs.clear()
        self._running = None
        self.stats.record_step(size, finished=len(jobs), failed=len(jobs))
        self._fail(jobs, error)
        self._running = self._batch()

    def _refuse_the_rest(self, error: APIError) -> None:
        """Answer the queued jobs, which no batch will run (behind the stop sentinel, or after a failure)."""
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.finish(error=error)

    def _fail(self, jobs: list[Job], error: APIError) -> None:
        """Answer ``jobs`` with ``error``; out of memory first releases what is kept for later work.

        Called after the ``except`` block of the error, whose traceback holds the frames of the forward that
        failed and with them tensors (the cached keys and values it attended to): only then are they freed."""
        if error.code == "out_of_memory":
            # a failed batch (dropped by ``_step``) refers to itself through its callbacks: only the collector
            # frees its caches, and they must go before the next batch allocates its own
            gc.collect()
            # the caches kept for later batches (the next batch allocates what it needs), and the scored prompts'
            # keys and values (their counters stay)
            freed = release_free()
            prompts = sum(cache.bytes for cache in self.prefix_caches.values())
            for cache in self.prefix_caches.values():
                cache.clear()
            self.stats.record_prompt_caches(self.prefix_caches)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            logger.error("released %d bytes of free KV caches and %d of cached prompts' keys and values", freed,
                         prompts)
        for job in jobs:
            job.finish(error=error)

    @staticmethod
    def _api_error(exc: Exception, what: str) -> APIError:
        """The answer to the jobs that ``exc`` failed, ``what`` saying where in the log."""
        if isinstance(exc, InputError):
            logger.warning("%s refused by the engine: %s", what, exc)
            return APIError(400, str(exc))
        if isinstance(exc, torch.OutOfMemoryError):
            logger.error("%s ran out of memory", what)
            return APIError(503, "out of memory; retry with fewer tokens", "server_error", code="out_of_memory")
        logger.exception("%s failed", what)
        return APIError(500, "internal error while generating; see the server log", "server_error")
