"""How a model's decode forwards run: eager, compiled, or captured as CUDA graphs, over bucketed shapes.

Modes (``SIDECAR_CAPTURE``, the ``capture`` argument of ``SpeculativeDecoder`` and ``load_pair``):

* ``eager``: our decoder stack (``sidecar.runtime.decoder_stack``) run by PyTorch op by op. Shapes follow the
  batch and attention reads only the columns some row fills.
* ``compile``: the same stack through ``torch.compile(fullgraph=True)`` (inductor). Every decode forward takes a
  bucket's shape: the batch padded up to the next bucket, the query as wide as the forward's kind needs,
  attention over the cache's whole capacity. One compile per bucket; a recompile after that is a fault the
  counters report.
* ``cudagraph``: ``compile`` in inductor's ``reduce-overhead`` mode, which captures each bucket's forward as a
  CUDA graph and replays it: one launch per forward instead of several per layer. CUDA only.
* ``hf``: Hugging Face's own forward (the reference, and the path for architectures our stack lacks).

Prefill forwards run eager in every mode: their widths are the prompts', not a step's. Compiled and captured
forwards keep their buffers from batch to batch (``sidecar.runtime.pools``) and can compile every bucket before
a batch runs (``sidecar.runtime.warmup``).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import PreTrainedModel

from sidecar.errors import InputError
from sidecar.runtime.decoder_stack import LENGTH, OFFSET, VALID, DecoderStack, supports
from sidecar.runtime.kv_cache import RowKVCache
from sidecar.runtime.transfers import to_device
from sidecar.settings import PREFIX, Settings, parse_capture

MODES = ("eager", "compile", "cudagraph", "hf")
AUTO = "auto"  # CUDA: cudagraph; CPU: eager
# batch buckets: a decode forward's rows are padded up to the next (and at most to the cache's rows)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# a decode forward's query width: exact up to this (the verify's gamma + 1, a draft's feed), else padded up to
# a power of two (a catching-up row's feed)
EXACT_WIDTHS = 8
# compiled shapes one code object may hold (every model's and bucket's share it)
RECOMPILE_LIMIT = 512
# calls of a shape by which inductor's CUDA graph trees have warmed it up and recorded its graph
CAPTURE_CALLS = 3
# eager attention reads the filled columns rounded up to this, so its shapes repeat from step to step
EAGER_COLUMNS = 64


def resolve_capture(requested: str | None, device: torch.device, model: PreTrainedModel) -> tuple[str, str]:
    """(mode, why): ``requested``, else ``SIDECAR_CAPTURE``, else ``auto``, made concrete for ``device`` and
    ``model``'s architecture."""
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
        # on a CPU a compiled step saves host time but costs a compile per bucket (seconds to minutes at load)
        return "eager", "auto: CPU, eager (compile: SIDECAR_CAPTURE=compile)"
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


@dataclass
class CaptureCounters:
    """What a run's forwards cost in compilation and host work, counted per model: the quantities that say
    what a GPU will do (``bench.host_overhead``, the engine's stats)."""

    compiles: int = 0  # graphs compiled for a shape first seen
    recompiles: int = 0  # graphs compiled again for a shape already compiled: must stay 0
    graph_breaks: int = 0  # must stay 0 (fullgraph=True refuses them: this counts what dynamo reports)
    forwards: int = 0  # prefill's included
    compile_seconds: float = 0.0
    graph_bytes: int = 0  # CUDA memory the captures reserved (their pools and static buffers); 0 elsewhere
    shapes: Counter = field(default_factory=Counter)  # a decode forward's (batch, width, columns) -> forwards

    def as_dict(self) -> dict:
        return {"compiles": self.compiles, "recompiles": self.recompiles, "graph_breaks": self.graph_breaks,
                "forwards": self.forwards, "distinct_shapes": len(self.shapes),
                "compile_seconds": round(self.compile_seconds, 3), "graph_bytes": self.graph_bytes}


def _dynamo_counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))


class StackRunner:
    """Runs ``model``'s forwards in ``mode``: decode forwards (a step's) over bucketed shapes, prefill eager."""

    def __init__(self, model: PreTrainedModel, mode: str) -> None:
        if mode not in MODES or mode == "hf":
            raise ValueError(f"a StackRunner runs eager, compile or cudagraph, not {mode!r}")
        self.mode = mode
        self.stack = DecoderStack(model)
        self.counters = CaptureCounters()
        self._compiled_shapes: set[tuple] = set()
        self._compiled = None
        # warm-up (``sidecar.runtime.warmup``): the decode widths to warm, whether a cache is warmed when it is
        # allocated, the (rows, capacity, address) caches warmed, and what each warm-up cost
        self.widths: set[int] = set()
        self.warm_on_allocate = False
        self.warmed: set[tuple[int, int, int]] = set()
        self.warm_ups: list = []
        if mode != "eager":
            import torch._dynamo

            # one code object serves every model and bucket: dynamo's per-code limit must hold them all
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            torch._dynamo.config.accumulated_recompile_limit = max(
                torch._dynamo.config.accumulated_recompile_limit, 4096)
            # the limit again on the compiled region: dynamo's config is per thread, and the server's worker
            # thread, which runs the forwards, would otherwise get the default 8 and fail at the ninth shape
            self._compiled = torch.compile(self.stack.forward, fullgraph=True, dynamic=False,
                                           mode="reduce-overhead" if mode == "cudagraph" else None,
                                           recompile_limit=RECOMPILE_LIMIT)

    @property
    def static(self) -> bool:
        return self._compiled is not None

    def __call__(self, cache: RowKVCache, ids: torch.Tensor, query_span: torch.Tensor | None = None,
                 valid: list[int] | None = None, decode: bool = True) -> torch.Tensor:
        """Hidden states [B, q, H] of ``ids`` [B, q] over ``cache`` (``valid[b]`` real columns of row b, else
        all q); the new columns are written but not committed, as with ``RowKVCache.prepare``."""
        batch, width = ids.shape
        lengths = cache.lengths
        real = np.full(batch, width, dtype=np.int64) if valid is None else np.asarray(valid, dtype=np.int64)
        longest = int((lengths + real).max())
        if longest > cache.capacity:
            raise RuntimeError("KV cache capacity exceeded; the engine sized it too small")
        static = self.static and decode
        view = cache.padded(batch_bucket(batch, cache.root.batch_size - cache.start)) if static else cache
        view = view or cache
        rows = np.zeros((view.batch_size, 3), dtype=np.int64)  # padding rows: nothing real, write to trash
        rows[:batch, LENGTH] = lengths
        rows[:batch, OFFSET] = cache.position_offset
        rows[:batch, VALID] = real
        rows_dev = to_device(rows, cache.device)
        if query_span is None:
            query_span = torch.full((view.batch_size, width), -1, dtype=torch.long, device=cache.device)
        elif view.batch_size > batch:
            query_span = torch.nn.functional.pad(query_span, (0, 0, 0, view.batch_size - batch), value=-1)
        wide = width_bucket(width) if static else width
        if view.batch_size > batch or wide > width:
            ids = torch.nn.functional.pad(ids, (0, wide - width, 0, view.batch_size - batch))
            query_span = torch.nn.functional.pad(query_span, (0, wide - width), value=-1)
        self.counters.forwards += 1
        if not static:
            attend = min(-(-longest // EAGER_COLUMNS) * EAGER_COLUMNS, cache.capacity)
            if decode:
                self.counters.shapes[(view.batch_size, width, attend)] += 1
            return self.stack(ids, rows_dev, query_span, view.keys, view.values, view.visible, view.span, attend)
        shape = (view.batch_size, wide, view.capacity + 1)
        self.counters.shapes[shape] += 1
        if self.mode == "cudagraph":
            # the cache's buffers are written in place by every replay: their addresses must be the graph's
            for tensor in (*view.keys, *view.values, view.visible, view.span):
                torch._dynamo.mark_static_address(tensor)
            torch.compiler.cudagraph_mark_step_begin()
        graphs, breaks = _dynamo_counts()
        reserved = torch.cuda.memory_reserved(view.device) if self.mode == "cudagraph" else 0
        started = time.perf_counter()
        hidden = self._compiled(ids, rows_dev, query_span, view.keys, view.values, view.visible, view.span)
        new_graphs, new_breaks = _dynamo_counts()
        self.counters.graph_breaks += new_breaks - breaks
        if self.mode == "cudagraph" and self.counters.shapes[shape] <= CAPTURE_CALLS:
            self.counters.graph_bytes += torch.cuda.memory_reserved(view.device) - reserved
        if new_graphs > graphs:
            self.counters.compile_seconds += time.perf_counter() - started
            if shape in self._compiled_shapes:
                self.counters.recompiles += new_graphs - graphs
            else:
                self.counters.compiles += new_graphs - graphs
        self._compiled_shapes.add(shape)
        return hidden[:batch, :width]


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


def forward_module(model: PreTrainedModel) -> torch.nn.Module:
    """The module one eager forward of ``model`` calls once (its stack's, else Hugging Face's base model): where
    a hook sees every forward."""
    runner = runner_of(model)
    return model.base_model if runner is None else runner.stack
