"""Prometheus metrics of the server (``GET /metrics``), named after vLLM's with our prefix ``sidecar:``.

Per chat-completions or completions request (counted once its answer is known, on the event loop; a
completions request that only scores its prompt, ``max_tokens`` 0, counts its prompt tokens and latency
under finish reason length):

- ``sidecar:requests_total{outcome}``: ok, 4xx, 5xx, or cancelled (the client left); a streamed request whose
  error arrives in the stream counts under that error's status. ``sidecar:request_success_total
  {finished_reason}``: the ok ones by finish reason (stop, length), as vLLM's.
- ``sidecar:time_to_first_token_seconds``, ``sidecar:time_per_output_token_seconds`` (the mean gap between
  the main output's tokens) and ``sidecar:e2e_request_latency_seconds``, all from the request's arrival.
- ``sidecar:prompt_tokens_total``, ``sidecar:generation_tokens_total`` (main output) and
  ``sidecar:sidecar_generation_tokens_total{sidecar}`` (each task's output, by its name; names past
  ``MAX_SIDECAR_LABELS`` distinct ones count under ``_other``, so clients cannot grow the label set without bound).
- ``sidecar:spec_decode_num_draft_tokens_total``, ``sidecar:spec_decode_num_accepted_tokens_total`` and
  ``sidecar:spec_decode_num_target_forwards_total`` of the main outputs: acceptance rate = accepted / draft,
  tokens per target forward = generation tokens / target forwards (rates of counters, as vLLM's).

Read at each scrape from the worker's ``BatchStats`` snapshot (the same one ``/stats`` returns):
``sidecar:num_requests_running``, ``sidecar:num_requests_waiting``, ``sidecar:batch_slots``, the counters
``sidecar:batch_steps_total`` and ``sidecar:batch_step_requests_total`` (slot occupancy = step requests /
steps / slots), ``sidecar:cancelled_tokens_total``, and the device-time ledger's ``sidecar:device_forwards_total``,
``sidecar:device_measured_seconds_total`` and ``sidecar:device_charged_seconds_total{phase}``, and the prompt
scoring prefix caches' ``sidecar:prompt_cache_hits_total{model}``, ``sidecar:prompt_cache_misses_total{model}``,
``sidecar:prompt_cache_reused_tokens_total{model}`` and ``sidecar:prompt_cache_forwarded_tokens_total{model}``
(model: target or draft; none without prompt caches, ``--no-prompt-cache``).

Read at each scrape from the pair's capture counters (``sidecar.decoding.decoder.capture_stats``, ``/stats``'s
``capture``): ``sidecar:capture_mode_info{mode}`` (1, the mode the forwards run in), per model (target, draft)
``sidecar:capture_forwards_total``, ``sidecar:capture_graph_calls_total`` (calls of a compiled forward; a chain
of draft forwards is one) and ``sidecar:capture_compiles_total``, and the faults, which must stay 0 (alert on
any increase): ``sidecar:capture_recompiles_total`` (a shape compiled again after warm-up),
``sidecar:capture_graph_breaks_total`` and ``sidecar:capture_cudagraph_skips_total`` (a graph left uncaptured
in cudagraph mode, which runs at compiled speed); and the decoding steps' ``sidecar:step_syncs_total`` (reads
of the device: a GPU waits at each) and ``sidecar:step_host_seconds_total`` (the steps' wall time less those
reads; none in ``hf`` mode, which keeps no counters).

The registry is the app's own, so several servers in one process do not share (or clash over) metrics.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from server.errors import APIError
from server.worker import BatchWorker, Job
from sidecar.decoding.decoder import capture_stats
from sidecar.decoding.rows import GenerationOutput
from sidecar.tasks.rows import DocumentResult

MAX_SIDECAR_LABELS = 64
OTHER_SIDECARS = "_other"
# from a tiny model's milliseconds on a GPU to a large model's minutes on a CPU
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


def outcome(status: int) -> str:
    """The ``outcome`` label of a request answered with HTTP ``status`` (499: the client closed the request)."""
    if status == 499:
        return "cancelled"
    return "ok" if status < 400 else "4xx" if status < 500 else "5xx"


def per_model(prefix: str, by_model: dict[str, dict], keys: tuple[tuple[str, str], ...]
              ) -> Iterator[CounterMetricFamily]:
    """A counter family ``prefix + key`` per (key, help) of ``keys``, labelled by model, from ``by_model``'s
    {model: {key: value}}."""
    for key, about in keys:
        family = CounterMetricFamily(prefix + key, about, labels=["model"])
        for model, counters in sorted(by_model.items()):
            family.add_metric([model], counters[key])
        yield family


class _WorkerCollector(Collector):
    """The worker's batching and device-time totals, read from one ``BatchStats`` snapshot per scrape."""

    def __init__(self, worker: BatchWorker) -> None:
        self.worker = worker

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self.worker.stats.snapshot()
        device = stats["device"]
        yield GaugeMetricFamily("sidecar:num_requests_running", "Requests in the running batch.",
                                value=self.worker.running)
        yield GaugeMetricFamily("sidecar:num_requests_waiting", "Requests queued for a slot.",
                                value=self.worker.queue.qsize())
        yield GaugeMetricFamily("sidecar:batch_slots", "Slots of the batch (--max-batch).",
                                value=self.worker.config.max_batch)
        yield CounterMetricFamily("sidecar:batch_steps", "Decoding steps of the batch.", value=stats["steps"])
        work = sum(int(size) * count for size, count in stats["step_sizes"].items())
        yield CounterMetricFamily("sidecar:batch_step_requests",
                                  "Requests worked on, summed over steps (over steps: mean occupancy).", value=work)
        yield CounterMetricFamily("sidecar:cancelled_tokens", "Tokens decoded for requests whose client left.",
                                  value=stats["cancelled_tokens"])
        yield CounterMetricFamily("sidecar:device_forwards", "Forwards timed by the device-time ledger.",
                                  value=device["forwards"])
        yield CounterMetricFamily("sidecar:device_measured_seconds", "Device seconds the ledger measured.",
                                  value=device["measured_seconds"])
        charged = CounterMetricFamily("sidecar:device_charged_seconds",
                                      "Device seconds the ledger charged to each phase.", labels=["phase"])
        for phase, seconds in sorted(device["charged_seconds_by_phase"].items()):
            charged.add_metric([phase], seconds)
        yield charged
        yield from per_model("sidecar:prompt_cache_", stats["prompt_cache"], (
            ("hits", "Scored prompts that reused a cached prefix."),
            ("misses", "Scored prompts that found no cached prefix."),
            ("reused_tokens", "Prompt positions taken from the prefix cache."),
            ("forwarded_tokens", "Prompt positions forwarded by cached scoring.")))
        yield from self._capture()

    def _capture(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        capture = capture_stats(self.worker.engine.pair)
        mode = GaugeMetricFamily("sidecar:capture_mode_info", "The capture mode the decode forwards run in.",
                                 labels=["mode"])
        mode.add_metric([capture["mode"] or "unknown"], 1)
        yield mode
        yield from per_model("sidecar:capture_", capture["counters"], (
            ("forwards", "Forwards of each model, prefill included."),
            ("graph_calls", "Calls of a compiled forward (a chain of draft forwards is one)."),
            ("compiles", "Graphs compiled for a shape first seen."),
            ("recompiles", "Graphs compiled again for a shape already compiled: must stay 0."),
            ("graph_breaks", "Graph breaks: must stay 0."),
            ("cudagraph_skips", "Graphs left uncaptured in cudagraph mode: must stay 0.")))
        steps = capture["steps"]
        yield CounterMetricFamily("sidecar:step_syncs", "Reads of device values the decoding steps made.",
                                  value=steps["syncs"])
        yield CounterMetricFamily("sidecar:step_host_seconds", "Decoding steps' wall time less their reads.",
                                  value=steps["step_seconds"] - steps["read_seconds"])


class ServerMetrics:
    """The app's metrics registry and the calls that record a request's answer in it."""

    def __init__(self, worker: BatchWorker) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_WorkerCollector(worker))
        reg = self.registry
        self.requests = Counter("sidecar:requests", "Chat-completions requests by outcome.", ["outcome"],
                                registry=reg)
        self.success = Counter("sidecar:request_success", "Answered requests by finish reason.",
                               ["finished_reason"], registry=reg)
        self.ttft = Histogram("sidecar:time_to_first_token_seconds", "Arrival to the first output token.",
                              buckets=TTFT_BUCKETS, registry=reg)
        self.tpot = Histogram("sidecar:time_per_output_token_seconds",
                              "Mean gap between a request's output tokens after the first.",
                              buckets=TPOT_BUCKETS, registry=reg)
        self.e2e = Histogram("sidecar:e2e_request_latency_seconds", "Arrival to the whole answer.",
                             buckets=E2E_BUCKETS, registry=reg)
        self.prompt_tokens = Counter("sidecar:prompt_tokens", "Prompt tokens of answered requests.", registry=reg)
        self.generation_tokens = Counter("sidecar:generation_tokens", "Main-output tokens of answered requests.",
                                         registry=reg)
        self.sidecar_tokens = Counter("sidecar:sidecar_generation_tokens", "Sidecar-output tokens by task name.",
                                      ["sidecar"], registry=reg)
        self.drafted = Counter("sidecar:spec_decode_num_draft_tokens", "Tokens drafted for main outputs.",
                               registry=reg)
        self.accepted = Counter("sidecar:spec_decode_num_accepted_tokens", "Drafted tokens the target accepted.",
                                registry=reg)
        self.target_forwards = Counter("sidecar:spec_decode_num_target_forwards",
                                       "Target forwards of main outputs (the prefill counts as one).", registry=reg)
        for name in ("ok", "4xx", "5xx", "cancelled"):  # every outcome present from the start, so rates begin at 0
            self.requests.labels(name)
        self._sidecar_names: set[str] = set()

    def refused(self, status: int) -> None:
        self.requests.labels(outcome(status)).inc()

    @contextlib.contextmanager
    def refusals(self) -> Iterator[None]:
        """Count a request whose handling raises as refused: an ``APIError`` by its status, anything else 500."""
        try:
            yield
        except APIError as exc:
            self.refused(exc.status)
            raise
        except Exception:
            self.refused(500)
            raise

    def answered(self, job: Job, result: GenerationOutput | DocumentResult, arrived: float) -> None:
        """A request answered with ``result``; ``arrived`` is its ``time.monotonic()`` at arrival."""
        done = time.monotonic()
        main = result.main if isinstance(result, DocumentResult) else result
        self.requests.labels("ok").inc()
        self.success.labels(main.finish_reason).inc()
        self.e2e.observe(done - arrived)
        if job.first_token_at is not None:
            self.ttft.observe(job.first_token_at - arrived)
            if len(main.token_ids) > 1 and job.last_token_at is not None:
                self.tpot.observe((job.last_token_at - job.first_token_at) / (len(main.token_ids) - 1))
        self.prompt_tokens.inc(main.stats.prompt_tokens)
        self.generation_tokens.inc(len(main.token_ids))
        self.drafted.inc(main.stats.drafted)
        self.accepted.inc(main.stats.accepted)
        self.target_forwards.inc(main.stats.target_forwards)
        if isinstance(result, DocumentResult):
            for name, output in result.sidecars.items():
                self.sidecar_tokens.labels(self._sidecar_label(name)).inc(output.stats.new_tokens)

    def scored(self, prompt_tokens: int, arrived: float) -> None:
        """A request that only scored a prompt of ``prompt_tokens`` tokens (completions with ``max_tokens`` 0)."""
        self.requests.labels("ok").inc()
        self.success.labels("length").inc()
        self.e2e.observe(time.monotonic() - arrived)
        self.prompt_tokens.inc(prompt_tokens)

    def _sidecar_label(self, name: str) -> str:
        if name not in self._sidecar_names and len(self._sidecar_names) >= MAX_SIDECAR_LABELS:
            return OTHER_SIDECARS
        self._sidecar_names.add(name)
        return name

    async def watch_stream(self, chunks: AsyncIterator[bytes], job: Job, arrived: float) -> AsyncIterator[bytes]:
        """``chunks`` of a streamed answer, recording its outcome once it ends (an error arrives in the stream)."""
        try:
            async with contextlib.aclosing(chunks):  # closed now, not when collected: that cancels the job
                async for chunk in chunks:
                    yield chunk
        except Exception:
            self.refused(500)
            raise
        except BaseException:  # the client hung up: the response task was cancelled or the stream closed
            self.refused(499)
            raise
        error = job.future.exception() if not job.future.cancelled() else APIError(499, "the client left")
        if error is None:
            self.answered(job, job.future.result(), arrived)
        else:
            self.refused(error.status if isinstance(error, APIError) else 500)
