"""Warm-up of compiled and captured decode forwards: every batch bucket's forwards of a KV cache's shape run
once before any row does, so compiles (and, in ``cudagraph`` mode, graph recording) happen at load, with a
progress bar, and not in the middle of a batch, where they would stall its rows and spoil the step costs the
controller measures.

The shapes: for a cache of R rows and C columns, every batch bucket up to R (``capture.batch_bucket``) at each
of the model's decode widths. The target's are 1 (a plain step), 2 .. gamma + 1 (a verify of 1 .. gamma
drafts: the width shrinks near the rows' limits and when drafting stops early) and an adaptive decoder's
max_copy + 1 (the longest copy's verify, which longer copies pad to: ``sidecar.decoding.plan.verify_widths``);
the draft's 1 (each draft
forward after a step's first), 2 (a step's first, feeding the last accepted draft and the pending token) and
gamma + 3 (``sidecar.decoding.plan.feed_widths``: a first feed of 3 .. gamma + 3 columns, the backlog of plain
or lookup steps, pads to it; a wider one, a sidecar's bridge or a row catching up, runs as forwards of it), so
no feed compiles after warm-up. The draft's chains of 1 ..
gamma - 1 forwards (``sidecar.decoding.draft_chain``, set by ``set_chains``) are warmed at every batch bucket,
greedy and sampled (one graph for any batch with sampled rows: ``chain_flags``), so a sampled request compiles
nothing either; a deployment that only decodes greedy (the nightly run) warms the greedy ones alone
(``set_sampled``). A chain that keeps its logits (a row asking for logprobs) compiles when it first comes.

``SpeculativeDecoder`` sets the widths on each model's runner (``set_widths``) and whether a cache is warmed as
soon as it is allocated (on by default in ``cudagraph`` mode, an option in ``compile`` mode);
``SpeculativeDecoder.warm`` warms the caches of a batch limit and a row length explicitly, and
``SpeculativeDecoder.warm_at_load`` those of the capacities ``load_capacities`` picks, at load (``sidecar serve``,
the nightly run), where ``SIDECAR_WARMUP`` (``warms_at_load``) says so.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from sidecar.runtime.capture import BATCH_BUCKETS, CAPTURE_CALLS, StackRunner, capacity_bucket, runner_of
from sidecar.runtime.kv_cache import RowKVCache
from sidecar.runtime.pools import MAX_FREE_SHAPES, give_back, take
from sidecar.settings import Settings

logger = logging.getLogger(__name__)


@dataclass
class WarmUp:
    """What warming one cache's shapes cost."""

    rows: int
    capacity: int
    shapes: int  # (batch bucket, width) pairs run, and (batch bucket, chain length, greedy or sampled) triples
    compiles: int
    seconds: float
    graph_bytes: int  # CUDA memory the graphs took (0 off CUDA and in compile mode)
    cudagraph_skips: int  # cudagraph mode: graphs inductor left uncaptured (``CaptureCounters``)
    calls: Counter = field(default_factory=Counter)  # the runner's calls per shape key (``CaptureCounters.shapes``)

    def as_dict(self) -> dict:
        return {"rows": self.rows, "capacity": self.capacity, "shapes": self.shapes, "compiles": self.compiles,
                "seconds": round(self.seconds, 3), "graph_bytes": self.graph_bytes,
                "cudagraph_skips": self.cudagraph_skips}


def batch_buckets(rows: int) -> list[int]:
    """The batch buckets a cache of ``rows`` rows pads its forwards to."""
    return [bucket for bucket in BATCH_BUCKETS if bucket < rows] + [rows]


def allocation_default() -> bool | None:
    """Whether a decoder warms each new cache (``set_widths``' ``on_allocate``) when its caller says nothing:
    ``SIDECAR_WARMUP`` on: yes, off: no, auto: in ``cudagraph`` mode (None)."""
    return {"on": True, "off": False}.get(Settings().warmup)


def warms_at_load(mode: str | None) -> bool:
    """Whether a server or a nightly run whose forwards run in ``mode`` warms them at load (``SIDECAR_WARMUP``):
    on in ``compile`` and ``cudagraph``, auto in ``cudagraph`` only, off never; eager and hf have nothing to warm."""
    setting = Settings().warmup
    return mode in ("compile", "cudagraph") and (setting == "on" or (setting == "auto" and mode == "cudagraph"))


def load_capacities(shortest: int, longest: int) -> list[int]:
    """The KV capacities (``capacity_bucket``) a load warms for rows needing ``shortest`` .. ``longest``
    columns: each bucket from the first, at most ``MAX_FREE_SHAPES`` of them (the free caches the pools keep per
    model: a further one would push out the buffers an earlier one's CUDA graphs were recorded on). A longer
    row's cache is warmed when it is allocated, where the decoder warms new caches (``set_widths``)."""
    first, last = capacity_bucket(shortest), capacity_bucket(max(shortest, longest))
    capacities = [first]
    while capacities[-1] < last and len(capacities) < MAX_FREE_SHAPES:
        capacities.append(capacities[-1] * 2)
    return capacities


def summary(reports: list[dict], seconds: float) -> str:
    """One log line for ``SpeculativeDecoder.warm_at_load``'s reports (one per capacity, each model's)."""
    models = [report for capacity in reports for name, report in capacity.items() if name != "capacity"]
    return (f"warm-up: capacities {[r['capacity'] for r in reports]}, {sum(m['shapes'] for m in models)} shapes, "
            f"{sum(m['compiles'] for m in models)} compiles, graphs {sum(m['graph_bytes'] for m in models)} bytes, "
            f"in {seconds:.1f} s")


def set_widths(model: PreTrainedModel, widths: set[int], on_allocate: bool | None) -> None:
    """Warm ``model``'s caches at ``widths`` (added to those other decoders asked for), and as soon as each is
    allocated where ``on_allocate`` (None: in ``cudagraph`` mode)."""
    runner = runner_of(model)
    if runner is None or not runner.static:
        return
    runner.widths |= widths
    runner.warm_on_allocate = runner.mode == "cudagraph" if on_allocate is None else on_allocate


def set_chains(model: PreTrainedModel, forwards: set[int], warm: Callable[..., object]) -> None:
    """Warm ``model``'s chains of each of ``forwards`` forwards too, each run by ``warm(rows, forwards,
    sampled=...)``: greedy, and sampled unless ``set_sampled`` says not."""
    runner = runner_of(model)
    if runner is None or not runner.static:
        return
    runner.chain_forwards |= forwards
    runner.warm_chain = warm


def set_sampled(model: PreTrainedModel, sampled: bool) -> None:
    """Whether ``model``'s warm-ups warm its sampled chains too (by default they do): a greedy deployment's
    need not."""
    runner = runner_of(model)
    if runner is not None and runner.static:
        runner.warm_sampled = sampled


def warm_up(model: PreTrainedModel, rows: int, columns: int, name: str = "") -> WarmUp | None:
    """Warm the cache a batch of ``rows`` rows needing ``columns`` columns each will take (``capacity_bucket``),
    and give it back for that batch: its graphs are recorded on the buffers it will run on."""
    with torch.inference_mode():  # the engine's batches take caches made in it
        cache = take(model, rows, capacity_bucket(columns))
        try:
            return warm_cache(model, cache, name)
        finally:
            give_back(model, cache)


def warm_new(model: PreTrainedModel, cache: RowKVCache) -> WarmUp | None:
    """Warm a cache just allocated, where its model's runner says so (``set_widths``)."""
    runner = runner_of(model)
    if runner is None or not runner.static or not runner.warm_on_allocate:
        return None
    return warm_cache(model, cache)


def warm_cache(model: PreTrainedModel, cache: RowKVCache, name: str = "") -> WarmUp | None:
    """Run each batch bucket's decode forwards of ``cache``'s shape once (a CUDA graph's recording takes
    ``CAPTURE_CALLS``), unless this cache was warmed already; the forwards write uncommitted columns, which the
    cache's next ``reset`` (``sidecar.runtime.pools.take``) empties. None where the model's forwards are eager."""
    runner: StackRunner | None = runner_of(model)
    if runner is None or not runner.static or not runner.widths:
        return None
    # a cache made anew for a shape (its free one released) is warmed again: CUDA graphs hold its addresses;
    # and so is one a greedy warm-up left, when its sampled chains are asked for
    key = (cache.batch_size, cache.capacity, cache.keys[0].data_ptr(), runner.warm_sampled)
    if key in runner.warmed:
        return None
    counters = runner.counters
    compiles, graph_bytes, skips = counters.compiles, counters.graph_bytes, counters.cudagraph_skips
    started = time.perf_counter()
    ran_before = Counter(counters.shapes)
    buckets = batch_buckets(cache.batch_size)
    # (bucket, width, None) a forward; (bucket, forwards, sampled) a chain
    shapes: list[tuple[int, int, bool | None]] = [
        (bucket, width, None) for bucket in buckets for width in sorted(runner.widths)]
    if runner.warm_chain is not None:
        shapes += [(bucket, forwards, sampled) for bucket in buckets for forwards in sorted(runner.chain_forwards)
                   for sampled in ((False, True) if runner.warm_sampled else (False,))]
    calls = CAPTURE_CALLS if runner.mode == "cudagraph" else 1
    what = f"warm-up {name or model.config.model_type} ({cache.batch_size} rows, {cache.capacity} columns)"
    with torch.inference_mode():
        for bucket, width, sampled in tqdm(shapes, desc=what, leave=False, disable=None, dynamic_ncols=True):
            ids = torch.zeros(bucket, width, dtype=torch.long, device=cache.device)
            for _ in range(calls):
                if sampled is not None:  # a chain of ``width`` forwards one column wide
                    runner.warm_chain(cache.rows_view(0, bucket), width, sampled=sampled)
                else:
                    runner(cache.rows_view(0, bucket), ids)
    runner.warmed.add(key)
    report = WarmUp(cache.batch_size, cache.capacity, len(shapes), counters.compiles - compiles,
                    time.perf_counter() - started, counters.graph_bytes - graph_bytes, counters.cudagraph_skips - skips,
                    counters.shapes - ran_before)
    runner.warm_ups.append(report)
    logger.info("%s: %d shapes, %d compiles in %.1f s, graphs %d bytes", what, report.shapes, report.compiles,
                report.seconds, report.graph_bytes)
    if report.cudagraph_skips and cache.device.type == "cuda":
        logger.warning("%s: %d graphs not captured as CUDA graphs, they run at compile mode's speed: %s", what,
                       report.cudagraph_skips, "; ".join(counters.skip_reasons) or "no reason logged")
    return report
