"""How a model's decode forwards run: eager, compiled, or captured as CUDA graphs, over bucketed shapes.

Modes (``SIDECAR_CAPTURE``, the ``capture`` argument of ``SpeculativeDecoder`` and ``load_pair``):

* ``eager``: our decoder stack (``sidecar.runtime.decoder_stack``) run by PyTorch op by op. Shapes follow the
  batch and attention reads only the columns some row fills.
* ``compile``: the same stack through ``torch.compile(fullgraph=True)`` (inductor). Every decode forward takes a
  bucket's shape: the batch padded up to the next bucket, the query as wide as the forward's kind needs,
  attention over the cache's whole capacity. ``decode_shape`` chooses it, for the step plan, which names it to
  the runner (``ForwardShape``); the runner checks it (``check_shape``) and pads to it. One compile per bucket;
  a recompile after that is a fault the counters report. From ``REGIONAL_DEPTH`` layers, each layer's arithmetic
  is nested compile regions compiled once for all layers (``DecoderStack``), so a bucket's compile barely grows
  with the depth.
* ``cudagraph``: ``compile`` in inductor's ``reduce-overhead`` mode, which captures each bucket's forward as a
  CUDA graph and replays it: one launch per forward instead of several per layer. CUDA only.
* ``hf``: Hugging Face's own forward (the reference, and the path for architectures our stack lacks).

Prefill forwards run eager in every mode: their widths are the prompts', not a step's. Compiled and captured
forwards keep their buffers from batch to batch (``sidecar.runtime.pools``) and can compile every bucket before
a batch runs (``sidecar.runtime.warmup``). In both, several one-column forwards that feed each other can run as
one call of a compiled region (``StackRunner.chain``): a step's draft forwards after its first
(``sidecar.decoding.draft_chain``), one graph launch instead of one per forward.
"""

from __future__ import annotations

import collections
import functools
import inspect
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedModel

from sidecar.errors import InputError
from sidecar.runtime.decoder_stack import LENGTH, OFFSET, VALID, DecoderStack, real_columns, supports
from sidecar.runtime.kv_cache import BucketBuffers, RowKVCache
from sidecar.runtime.padding import MAX_WIDTH, PaddedWidths, padded_widths
from sidecar.runtime.transfers import to_device
from sidecar.settings import PREFIX, Settings, parse_capture

MODES = ("eager", "compile", "cudagraph", "hf")
AUTO = "auto"  # CUDA: cudagraph; CPU: eager or compile, whichever the pair runs faster here
# batch buckets: a decode forward's rows are padded up to the next (and at most to the cache's rows)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# a decode forward's query width: exact up to this (the verify's gamma + 1, a draft's feed), else padded up to
# a power of two (a catching-up row's feed, the verify of a copy longer than gamma)
EXACT_WIDTHS = 8
# compiled shapes one code object may hold (every model's and bucket's share it)
RECOMPILE_LIMIT = 512
# compiled entries one code object may hold in all (dynamo's global safety cap, default 256)
ACCUMULATED_LIMIT = 4096
# the depth from which a compiled stack runs each layer as nested compile regions, compiled once for all layers:
# 28 layers compile in about 0.6 of the time (a cold cache, 2-core CPU), but each region's call costs host time
# (a fifth more per compiled forward at tiny width on a CPU; nothing once captured as a CUDA graph) and a region
# is cached less well, so a shallow stack (the tests' pairs) inlines its layers
REGIONAL_DEPTH = 8
# calls of a shape by which inductor's CUDA graph trees have warmed it up and recorded its graph
CAPTURE_CALLS = 3
# eager attention reads the filled columns rounded up to this, so its shapes repeat from step to step
EAGER_COLUMNS = 64
# the filled columns the one-row forwards timed for their widths attend to (``padded_widths``): a short prompt's
PADDING_CONTEXT = 4 * EAGER_COLUMNS


def attended_columns(cache: RowKVCache, longest: int) -> int:
    """The columns an eager forward's attention reads when its longest row fills ``longest``: rounded up to
    ``EAGER_COLUMNS``, within the cache."""
    return min(-(-longest // EAGER_COLUMNS) * EAGER_COLUMNS, cache.capacity)


def resolve_capture(requested: str | None, device: torch.device, model: PreTrainedModel,
                    cpu_auto: Callable[[], tuple[str, str]] | None = None) -> tuple[str, str]:
    """(mode, why): ``requested``, else ``SIDECAR_CAPTURE``, else ``auto``, made concrete for ``device`` and
    ``model``'s architecture. ``cpu_auto`` decides ``auto`` on a CPU (the decoder's measures eager against
    compile: ``sidecar.decoding.capture_choice``); without it a CPU runs eager."""
    mode = parse_capture(requested, "the capture argument") if requested else None
    source = "capture" if mode else f"{PREFIX}CAPTURE"
    mode = mode or Settings().capture or AUTO
    if mode != "hf" and not supports(model):
        return "hf", f"{model.config.model_type}: no own decoder stack for this architecture, Hugging Face's forward"
    if mode == "cudagraph" and device.type != "cuda":
        raise InputError(f"capture mode cudagraph needs a CUDA device, not {device.type}: use compile or eager")
    if mode == AUTO:
        if device.type == "cuda":
            return "cudagraph", "auto: CUDA, decode forwards captured as CUDA graphs"
        if device.type == "cpu" and cpu_auto is not None:
            return cpu_auto()
        return "eager", f"auto: {device.type.upper()}, eager (compile: SIDECAR_CAPTURE=compile)"
    return mode, f"{source}={mode}"


def capacity_bucket(columns: int) -> int:
    """The KV columns a pool allocates for rows that need ``columns``: a power of two (at least 64), so that
    pools made for other prompts mostly share a capacity, and compiled forwards their shapes."""
    return max(64, 1 << (columns - 1).bit_length())


def batch_bucket(rows: int, limit: int) -> int:
    """The bucket ``rows`` pads up to, at most ``limit`` (the cache's rows)."""
    for bucket in BATCH_BUCKETS:
        if bucket >= rows:
            return min(bucket, limit)
    return rows


def width_bucket(width: int) -> int:
    """The query width a decode forward of ``width`` columns pads up to."""
    return width if width <= EXACT_WIDTHS else 1 << (width - 1).bit_length()


@dataclass(frozen=True)
class ForwardShape:
    """What one decode forward takes: its real ``rows``, the ``batch`` they are padded up to, and its query
    ``width`` (padded likewise). The scheduler names it (``sidecar.decoding.plan.StepPlan``); the runner runs it."""

    rows: int
    batch: int
    width: int


def decode_shape(rows: int, width: int, limit: int, static: bool) -> ForwardShape:
    """The shape a decode forward of ``rows`` x ``width`` runs at over a cache of ``limit`` rows: the buckets
    (``batch_bucket``, ``width_bucket``) where the runner is ``static`` (compiled or captured), the real shape
    otherwise. The one place a bucket is chosen: the scheduler calls it, and so does a forward that no plan
    shapes (warm-up, benchmarks)."""
    if not static:
        return ForwardShape(rows, rows, width)
    return ForwardShape(rows, batch_bucket(rows, limit), width_bucket(width))


def check_shape(shape: ForwardShape, rows: int, width: int, limit: int, static: bool) -> None:
    """Refuse ``shape`` for a decode forward of ``rows`` x ``width`` over a cache of ``limit`` rows unless it is
    a bucket of the runner's mode (``static``: padded to ``batch_bucket``/``width_bucket``; eager: the real
    shape) and holds the forward: the runner runs the plan's shape and derives none of its own."""
    mode = "a compiled" if static else "an eager"
    if shape.rows != rows:
        problem = f"names {shape.rows} rows but the forward has {rows}"
    elif shape.batch < rows or shape.width < width:
        problem = f"is smaller than the forward's {rows} rows x {width} columns"
    elif static and batch_bucket(shape.batch, limit) != shape.batch:
        problem = f"pads to batch {shape.batch}, not a batch bucket of a cache of {limit} rows (capture.batch_bucket)"
    elif static and width_bucket(shape.width) != shape.width:
        problem = f"pads to width {shape.width}, not a width bucket (capture.width_bucket)"
    elif not static and (shape.batch, shape.width) != (rows, width):
        problem = f"pads {rows} x {width} to {shape.batch} x {shape.width}; eager forwards run their real shape"
    else:
        return
    raise ValueError(f"{mode} decode forward's shape {shape} {problem}")


@dataclass
class CaptureCounters:
    """What a run's forwards cost in compilation and host work, counted per model: the quantities that say
    what a GPU will do (``bench.host_overhead``, the engine's stats)."""

    compiles: int = 0  # graphs compiled for a shape first seen
    recompiles: int = 0  # graphs compiled again for a shape already compiled: must stay 0
    graph_breaks: int = 0  # must stay 0 (fullgraph=True refuses them: this counts what dynamo reports)
    forwards: int = 0  # prefill's included
    graph_calls: int = 0  # calls of a compiled region: one per decode forward, one per chain of forwards
    chained_forwards: int = 0  # decode forwards run inside a chain (``StackRunner.chain``): one graph call each chain
    static_marks: int = 0  # cache buffers marked as static addresses for CUDA graphs: each once (``static_buffers``)
    compile_seconds: float = 0.0
    # host time inside compiled calls, compiles included: on a CPU the forwards' own work, on a GPU their launches;
    # a step's time less this is the host work a CUDA graph would not take away (``bench.host_overhead``)
    graph_seconds: float = 0.0
    graph_bytes: int = 0  # CUDA memory the captures reserved (their pools and static buffers); 0 elsewhere
    # ``cudagraph`` mode: times inductor left a graph uncaptured, at its compile (a mutated input not marked static,
    # a CPU tensor) or at a call past CUDA graph trees' re-record limit: must stay 0 on CUDA; on a CPU every graph
    # is one. ``skip_reasons``: inductor's messages for them (logged on CUDA only), each once
    cudagraph_skips: int = 0
    skip_reasons: list[str] = field(default_factory=list)
    # a decode forward's (batch, width, columns), a chain's (batch, 1, columns, forwards, its flags) -> calls
    shapes: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        return {"compiles": self.compiles, "recompiles": self.recompiles, "graph_breaks": self.graph_breaks,
                "forwards": self.forwards, "graph_calls": self.graph_calls, "chained_forwards": self.chained_forwards,
                "distinct_shapes": len(self.shapes), "compile_seconds": round(self.compile_seconds, 3),
                "graph_seconds": round(self.graph_seconds, 6),
                "graph_bytes": self.graph_bytes, "cudagraph_skips": self.cudagraph_skips,
                "skip_reasons": list(self.skip_reasons)}


def _dynamo_counts() -> tuple[int, int, int]:
    """Graphs dynamo compiled, graph breaks, and graphs inductor left uncaptured in ``reduce-overhead`` mode:
    process-wide totals, read before and after a call."""
    from torch._dynamo.utils import counters

    return (int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values())),
            int(counters["inductor"]["cudagraph_skips"]))


class _SkipMessages(logging.Handler):
    """Keeps the messages inductor logs when it leaves a graph uncaptured (``log_cudagraph_skip_and_bump_counter``,
    at compile time and when CUDA graph trees give up re-recording), so a run can say why, not only how often.
    The latest few only: past the re-record limit every call of that graph logs again."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.emitted = 0
        self.latest: collections.deque[str] = collections.deque(maxlen=16)

    def emit(self, record: logging.LogRecord) -> None:
        self.emitted += 1
        self.latest.append(record.getMessage())

    def since(self, emitted: int) -> list[str]:
        """The messages logged after the ``emitted``-th (those still kept)."""
        return list(self.latest)[len(self.latest) - min(self.emitted - emitted, len(self.latest)):]


@functools.cache
def _skip_messages() -> _SkipMessages:
    from torch._inductor import cudagraph_utils

    handler = _SkipMessages()
    cudagraph_utils.cudagraphs_log.addHandler(handler)
    return handler


_thread = threading.local()


def configure_thread() -> None:
    """Raise dynamo's caps in the calling thread, once per thread. Dynamo's config is per thread: a thread other
    than the one that made the runner (the server's batch worker) starts from the defaults, and the default
    ``accumulated_recompile_limit`` (256 entries of one code object, every model's and bucket's, whatever the
    region's own ``recompile_limit``) fails a fullgraph compile past it: a server's two models at 8 batch
    buckets, 7 widths and 4 capacities need more."""
    if getattr(_thread, "configured", False):
        return
    import torch._dynamo

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, ACCUMULATED_LIMIT)
    _thread.configured = True


def region_limits() -> dict[str, int]:
    """``torch.compile``'s keyword for the compiled region's own recompile limit, where this torch has it (2.12 on;
    the GPU image's 2.11 has not): the limit again on the region, as dynamo's config is per thread
    (``configure_thread``), which sets it everywhere."""
    return {"recompile_limit": RECOMPILE_LIMIT} if "recompile_limit" in _compile_parameters() else {}


@functools.cache
def _compile_parameters() -> frozenset[str]:
    return frozenset(inspect.signature(torch.compile).parameters)


def pad_batch(tensor: torch.Tensor, rows: int, fill: float | bool) -> torch.Tensor:
    """``tensor`` [B, ...] with ``rows`` more rows of ``fill`` (any dtype, bool included)."""
    if not rows:
        return tensor
    return torch.cat([tensor, tensor.new_full((rows, *tensor.shape[1:]), fill)])


# a chain's body: (stack, LM head, ids [B], rows [B, 3], keys, values, visible, span, *per-row tensors,
# forwards=..., **flags) -> tensors [B, ...]; see ``StackRunner.chain``
ChainBody = Callable[..., tuple[torch.Tensor, ...]]


class StackRunner:
    """Runs ``model``'s forwards in ``mode``: decode forwards (a step's) over bucketed shapes, prefill eager."""

    def __init__(self, model: PreTrainedModel, mode: str) -> None:
        if mode not in MODES or mode == "hf":
            raise ValueError(f"a StackRunner runs eager, compile or cudagraph, not {mode!r}")
        self.mode = mode
        # compiled at depth, each layer's arithmetic is regions compiled once for all layers (``DecoderStack``)
        self.stack = DecoderStack(model, regional=mode != "eager" and len(model.base_model.layers) >= REGIONAL_DEPTH)
        self.head = model.get_output_embeddings()
        self.counters = CaptureCounters()
        self._compiled_shapes: set[tuple] = set()
        self._compiled = None
        self._chains: dict[ChainBody, Callable] = {}  # each chain body compiled over this model's stack
        # warm-up (``sidecar.runtime.warmup``): the decode widths to warm, whether a cache is warmed when it is
        # allocated, the (rows, capacity, address) caches warmed, and what each warm-up cost
        self.widths: set[int] = set()
        # the chains of forwards to warm (their lengths), how to run one over a cache's rows (greedy, or sampled:
        # its keyword ``sampled``) and whether the sampled ones are warmed too
        self.chain_forwards: set[int] = set()
        self.warm_chain: Callable[..., object] | None = None
        self.warm_sampled = True
        self.warm_on_allocate = False
        self.warmed: set[tuple[int, int, int, bool]] = set()
        self.warm_ups: list = []
        if mode != "eager":
            configure_thread()
            self._compiled = self._compile(self.stack.forward)
        self.pack = True  # eager forwards with padded columns compute only the real tokens (benchmarks turn it off)
        # eager decode forwards of one row run at the cheapest width that holds them (the extra columns are
        # padding, written to the trash column) where narrower forwards are measured slower (``padded_widths``)
        self.pad_to = PaddedWidths()
        if mode == "eager":
            param = next(model.parameters())
            self.pad_to = padded_widths(param.device, param.dtype, self._shape_key(model),
                                        self._one_row_forwards(model))

    @staticmethod
    def _shape_key(model: PreTrainedModel) -> tuple:
        """What a forward's time depends on besides dtype and threads: the model's shape and its layers' layout."""
        config = model.config.get_text_config()
        layout = tuple(sorted({str(getattr(m, "packed_rows", type(m).__name__))
                               for m in model.base_model.layers[0].modules()
                               if isinstance(m, nn.Linear) or hasattr(m, "packed_rows")}))
        return (config.model_type, config.num_hidden_layers, config.hidden_size, config.intermediate_size,
                config.num_attention_heads, config.num_key_value_heads, layout)

    def _one_row_forwards(self, model: PreTrainedModel) -> Callable[[int], Callable[[], object]]:
        """``width`` -> a call of this model's eager decode forward of one row and ``width`` columns after
        ``PADDING_CONTEXT`` filled ones, unpadded, over one scratch cache made at the first (``padded_widths``
        times them); what the cache holds does not change a forward's time, and nothing is committed."""
        scratch: list[RowKVCache] = []

        def forward_of(width: int) -> Callable[[], object]:
            if not scratch:
                scratch.append(RowKVCache(model, 1, PADDING_CONTEXT + MAX_WIDTH))
                scratch[0].commit(PADDING_CONTEXT)
            cache = scratch[0]
            ids = torch.zeros(1, width, dtype=torch.long, device=cache.device)
            span = torch.full((1, width), -1, dtype=torch.long, device=cache.device)
            rows = self._rows(cache, 1, np.array([width]))
            attend = attended_columns(cache, PADDING_CONTEXT + width)
            return lambda: self.stack(ids, rows, span, cache.keys, cache.values, cache.visible, cache.span, attend)

        return forward_of

    def _compile(self, fn: Callable) -> Callable:
        return torch.compile(fn, fullgraph=True, dynamic=False,
                             mode="reduce-overhead" if self.mode == "cudagraph" else None, **region_limits())

    @property
    def static(self) -> bool:
        return self._compiled is not None

    def _rows(self, cache: RowKVCache, padded: int, real: np.ndarray) -> torch.Tensor:
        """The forward's per-row state [padded, 3] on the device, in one transfer; padding rows hold nothing
        real and write to the trash column."""
        rows = np.zeros((padded, 3), dtype=np.int64)
        batch = cache.batch_size
        rows[:batch, LENGTH] = cache.lengths
        rows[:batch, OFFSET] = cache.position_offset
        rows[:batch, VALID] = real
        return to_device(rows, cache.device)

    def shape_for(self, cache: RowKVCache, rows: int, width: int, shape: ForwardShape | None = None) -> ForwardShape:
        """The shape a decode forward of ``rows`` x ``width`` over ``cache`` runs at: ``shape`` (the step plan's),
        refused unless it is a bucket of this runner's mode that holds the forward (``check_shape``); without
        one, ``decode_shape``'s, as the scheduler would have named it."""
        limit = cache.root.batch_size - cache.start
        if shape is None:
            return decode_shape(rows, width, limit, self.static)
        check_shape(shape, rows, width, limit, self.static)
        return shape

    def static_buffers(self, cache: RowKVCache, batch: int) -> BucketBuffers:
        """The buffers of a forward padded to ``batch`` rows (a bucket: ``shape_for``); in ``cudagraph`` mode
        marked as static addresses the first time (the graphs read and write them in place, at the addresses
        they were recorded on), not on every call: at 28 layers that is 58 calls of host time per forward."""
        buffers = cache.bucket(batch)
        if self.mode == "cudagraph" and not buffers.static:
            import torch._dynamo

            for tensor in buffers.tensors():
                torch._dynamo.mark_static_address(tensor)
            self.counters.static_marks += len(buffers.tensors())
            buffers.static = True
        return buffers

    def __call__(self, cache: RowKVCache, ids: torch.Tensor, query_span: torch.Tensor | None = None,
                 valid: list[int] | None = None, decode: bool = True,
                 shape: ForwardShape | None = None) -> torch.Tensor:
        """Hidden states [B, q, H] of ``ids`` [B, q] over ``cache`` (``valid[b]`` real columns of row b, else
        all q); the new columns are written but not committed, as with ``RowKVCache.prepare``. A decode forward
        runs at ``shape`` (the step plan's; ``shape_for``), a prefill at its real shape."""
        batch, width = ids.shape
        if not decode and shape is not None:
            raise ValueError(f"a prefill forward runs its real shape, not {shape}")
        real = np.full(batch, width, dtype=np.int64) if valid is None else np.asarray(valid, dtype=np.int64)
        longest = int((cache.lengths + real).max())
        if longest > cache.capacity:
            raise RuntimeError("KV cache capacity exceeded; the engine sized it too small")
        if decode:
            shape = self.shape_for(cache, batch, width, shape)
        self.counters.forwards += 1
        if not (self.static and decode):
            if query_span is None:
                query_span = torch.full((batch, width), -1, dtype=torch.long, device=cache.device)
            attend = attended_columns(cache, longest)
            if decode:
                self.counters.shapes[(batch, width, attend)] += 1
            if decode and (extra := self.decode_tokens(batch, batch * width) - batch * width):  # one row, padded
                hidden = self.stack(torch.nn.functional.pad(ids, (0, extra)), self._rows(cache, batch, real),
                                    torch.nn.functional.pad(query_span, (0, extra), value=-1), cache.keys,
                                    cache.values, cache.visible, cache.span, attend)
                return hidden[:, :width]
            return self.stack(ids, self._rows(cache, batch, real), query_span, cache.keys, cache.values,
                              cache.visible, cache.span, attend, self._packed(real, width, cache.device))
        padded, wide = shape.batch, shape.width
        buffers = self.static_buffers(cache, padded)
        if query_span is None:
            query_span = torch.full((padded, wide), -1, dtype=torch.long, device=cache.device)
        else:
            query_span = torch.nn.functional.pad(query_span, (0, wide - width, 0, padded - batch), value=-1)
        if padded > batch or wide > width:
            ids = torch.nn.functional.pad(ids, (0, wide - width, 0, padded - batch))
        hidden = self._call(self._compiled, (padded, wide, buffers.columns), cache.device, ids,
                            self._rows(cache, padded, real), query_span, buffers.keys, buffers.values,
                            buffers.visible, buffers.span)
        return hidden[:batch, :width]

    def decode_tokens(self, rows: int, tokens: int) -> int:
        """The tokens a decode forward of ``rows`` rows and ``tokens`` real tokens computes: one row runs at the
        cheapest width that holds it (``pad_to``: eager mode; the padding goes to the trash column), several rows
        as they are."""
        return self.pad_to.of(tokens) if rows == 1 else tokens

    def _packed(self, real: np.ndarray, width: int, device: torch.device) -> torch.Tensor | None:
        """The real columns' flat indices [T] where some row of an eager forward is padded (``DecoderStack``'s
        packing), else None; not where the real tokens alone would run padded to the padded layout's width or
        wider (``pad_to``: a narrower product measured slower)."""
        total = int(real.sum())
        if not self.pack or total == len(real) * width or self.pad_to.of(total) >= len(real) * width:
            return None
        return to_device(real_columns(real, width), device)

    def chain(self, cache: RowKVCache, body: ChainBody, ids: torch.Tensor, forwards: int,
              per_row: Sequence[tuple[torch.Tensor, float | bool]] = (), shape: ForwardShape | None = None,
              **flags: int | bool) -> tuple[torch.Tensor, ...]:
        """``forwards`` one-column decode forwards over every row of ``cache`` as ONE call of a compiled region:
        ``body(stack, head, ids, rows, keys, values, visible, span, *per_row, forwards=forwards, **flags)``
        loops over them inside the graph, each forward's token feeding the next and the rows' lengths advancing
        on the device, so the host launches one graph and reads nothing between them. ``ids`` [B] feed the
        first; ``per_row`` tensors [B, ...] are padded to ``shape``'s batch (the plan's, one column wide;
        ``shape_for``) with their fill value; ``flags`` are static (a graph each). Returns ``body``'s tensors for
        the real rows. Writes ``forwards`` columns per row, not committed (the caller commits them once)."""
        if not self.static:
            raise ValueError(f"a chain of forwards runs compiled, not in {self.mode} mode")
        batch = ids.shape[0]
        if int(cache.lengths.max()) + forwards > cache.capacity:
            raise RuntimeError("KV cache capacity exceeded; the engine sized it too small")
        padded = self.shape_for(cache, batch, 1, shape).batch
        buffers = self.static_buffers(cache, padded)
        compiled = self._chains.get(body)
        if compiled is None:
            compiled = self._chains[body] = self._compile(functools.partial(body, self.stack, self.head))
        self.counters.forwards += forwards
        self.counters.chained_forwards += forwards
        shape = (padded, 1, buffers.columns, forwards, tuple(sorted(flags.items())))
        out = self._call(compiled, shape, cache.device, pad_batch(ids, padded - batch, 0),
                         self._rows(cache, padded, np.ones(batch, dtype=np.int64)), buffers.keys, buffers.values,
                         buffers.visible, buffers.span, *(pad_batch(t, padded - batch, fill) for t, fill in per_row),
                         forwards=forwards, **flags)
        # a CUDA graph's outputs are its own buffers, overwritten by its next replay: the step reads them later
        return tuple(t[:batch].clone() if self.mode == "cudagraph" else t[:batch] for t in out)

    def _call(self, compiled: Callable, shape: tuple, device: torch.device, *args, **kwargs):
        """One call of a compiled region for ``shape``, counted: compiles, recompiles, graph breaks, graph bytes."""
        configure_thread()
        self.counters.shapes[shape] += 1
        self.counters.graph_calls += 1
        captures = self.mode == "cudagraph"
        if captures:
            torch.compiler.cudagraph_mark_step_begin()
            messages = _skip_messages()
            logged = messages.emitted
        graphs, breaks, skips = _dynamo_counts()
        measure_bytes = captures and device.type == "cuda" and self.counters.shapes[shape] <= CAPTURE_CALLS
        reserved = torch.cuda.memory_reserved(device) if measure_bytes else 0
        started = time.perf_counter()
        out = compiled(*args, **kwargs)
        self.counters.graph_seconds += time.perf_counter() - started
        new_graphs, new_breaks, new_skips = _dynamo_counts()
        self.counters.graph_breaks += new_breaks - breaks
        if captures:
            self.counters.cudagraph_skips += new_skips - skips
            self.counters.skip_reasons.extend(dict.fromkeys(m for m in messages.since(logged)
                                                            if m not in self.counters.skip_reasons))
        if measure_bytes:
            self.counters.graph_bytes += torch.cuda.memory_reserved(device) - reserved
        if new_graphs > graphs:
            self.counters.compile_seconds += time.perf_counter() - started
            if shape in self._compiled_shapes:
                self.counters.recompiles += new_graphs - graphs
            else:
                self.counters.compiles += new_graphs - graphs
        self._compiled_shapes.add(shape)
        return out


def attach(model: PreTrainedModel, mode: str) -> StackRunner | None:
    """Make ``model``'s forwards (``sidecar.runtime.forward.forward``) run in ``mode``; ``hf`` detaches. The
    runner of each mode is kept on the model, so switching back reuses what it compiled."""
    runners = model.__dict__.setdefault("sidecar_runners", {})  # not submodules: they only refer to the model's
    if mode != "hf" and mode not in runners:
        runners[mode] = StackRunner(model, mode)
    runner = runners.get(mode)
    model.__dict__["sidecar_runner"] = runner
    return runner


def runner_of(model: PreTrainedModel) -> StackRunner | None:
    return model.__dict__.get("sidecar_runner")


def decode_tokens(model: PreTrainedModel, rows: int, tokens: int) -> int:
    """The tokens a decode forward of ``rows`` rows and ``tokens`` real tokens computes on ``model``
    (``StackRunner.decode_tokens``; Hugging Face's forward computes them as they are)."""
    runner = runner_of(model)
    return tokens if runner is None else runner.decode_tokens(rows, tokens)


def compiles(model: PreTrainedModel) -> bool:
    """Whether ``model``'s decode forwards run compiled (``compile`` or ``cudagraph``: bucketed shapes)."""
    runner = runner_of(model)
    return runner is not None and runner.static


def packs(model: PreTrainedModel) -> bool:
    """Whether ``model``'s forwards compute only their rows' real tokens: an eager decoder stack packs them
    (``DecoderStack``); compiled forwards run their padded bucket, Hugging Face's its padded shape."""
    runner = runner_of(model)
    return runner is not None and not runner.static and runner.pack


def forward_module(model: PreTrainedModel) -> torch.nn.Module:
    """The module one eager forward of ``model`` calls once (its stack's, else Hugging Face's base model): where
    a hook sees every forward."""
    runner = runner_of(model)
    return model.base_model if runner is None else runner.stack
