"""KV caches kept across batches: a batch that is done with its cache gives it back, and the next batch of the
same model that needs the same shape gets it, emptied, instead of a new allocation.

Why: compiled and captured forwards read the cache's buffers. In ``cudagraph`` mode every graph holds the
buffers' addresses, so a batch on new buffers re-records every graph it replays (and inductor gives up CUDA
graphs for a function after ``cudagraph_unexpected_rerecord_limit`` re-records); a batch on the buffers of the
one before replays the graphs it recorded. Allocating also costs the device an allocation and a memset per batch.

A cache is either lent (to one ``SlotPool``: never to two) or free. The free ones are kept per model, at most one
per shape (rows, capacity, dtype, device, made in inference mode or not), at most ``MAX_FREE_SHAPES`` shapes, and
handed out again emptied: every row's length and rotary offset 0, every column visible and in no hidden span.
Their keys and values keep the previous batch's numbers, which no query reads: a row's columns are written
before its queries reach them (prefill, snapshots, the causal mask) and padding writes only the trash column.
Free caches are released (``release_free``) when memory must be freed: before a retry after running out of
memory (``pipeline.memory.release_memory``), and by ``take`` itself when an allocation fails.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from sidecar.runtime.kv_cache import RowKVCache

# free caches kept per model: shapes beyond it release the least recently given back
MAX_FREE_SHAPES = 4

_lock = threading.Lock()  # the server's worker and a caller's thread may both run batches of one model
_pools: weakref.WeakKeyDictionary[PreTrainedModel, KVPools] = weakref.WeakKeyDictionary()


def shape_key(model: PreTrainedModel, rows: int, capacity: int, inference: bool) -> tuple:
    """What makes two caches interchangeable; ``inference``: made under ``torch.inference_mode`` (the engine's
    batches), whose tensors no code outside it may write."""
    param = next(model.parameters())
    return rows, capacity, param.dtype, param.device, inference


class KVPools:
    """One model's KV caches: the free ones by shape, and which are lent."""

    def __init__(self) -> None:
        self.free: OrderedDict[tuple, RowKVCache] = OrderedDict()
        self.lent: weakref.WeakSet[RowKVCache] = weakref.WeakSet()  # held by a batch (one dropped unreturned leaves)
        self.allocated = 0  # caches made, for the tests and the counters
        self.reused = 0  # caches handed out again

    def free_bytes(self) -> int:
        return sum(cache.nbytes() for cache in self.free.values())


def pools_of(model: PreTrainedModel) -> KVPools:
    with _lock:
        pools = _pools.get(model)
        if pools is None:
            pools = _pools[model] = KVPools()
        return pools


def take(model: PreTrainedModel, rows: int, capacity: int,
         allocated: Callable[[RowKVCache], object] | None = None) -> RowKVCache:
    """A cache of ``rows`` rows and ``capacity`` columns for ``model``, emptied, lent until ``give_back``.
    ``allocated`` hears of a cache just made, before it is emptied (``sidecar.runtime.warmup.warm_new``)."""
    pools = pools_of(model)
    key = shape_key(model, rows, capacity, torch.is_inference_mode_enabled())
    with _lock:
        cache = pools.free.pop(key, None)
        if cache is not None:
            pools.reused += 1
            pools.lent.add(cache)
    if cache is not None:
        cache.reset()
        return cache
    try:
        cache = RowKVCache(model, rows, capacity)
    except torch.OutOfMemoryError:
        release_free()  # the free caches of every model, then once more
        cache = RowKVCache(model, rows, capacity)
    with _lock:
        pools.allocated += 1
        pools.lent.add(cache)
    if allocated is not None:
        allocated(cache)
        cache.reset()
    return cache


def give_back(model: PreTrainedModel, cache: RowKVCache) -> None:
    """``cache`` (from ``take``) is no batch's any more; nothing may use it after this."""
    assert cache.root is cache, "give back a whole cache, not a view of its rows"
    pools = pools_of(model)
    key = shape_key(model, cache.batch_size, cache.capacity, cache.keys[0].is_inference())
    with _lock:
        if cache not in pools.lent:
            raise RuntimeError("a KV cache given back that was not lent (or given back twice)")
        pools.lent.discard(cache)
        if key in pools.free:
            return  # one free cache per shape: this one goes with its last reference
        pools.free[key] = cache
        while len(pools.free) > MAX_FREE_SHAPES:
            pools.free.popitem(last=False)


def release_free(model: PreTrainedModel | None = None) -> int:
    """Drop the free caches (of ``model``, else of every model); returns the bytes they held. The memory returns
    to the allocator (on CUDA, to the device after ``torch.cuda.empty_cache``) once nothing refers to them."""
    with _lock:
        chosen = [_pools[model]] if model is not None and model in _pools else (
            [] if model is not None else list(_pools.values()))
        freed = 0
        for pools in chosen:
            freed += pools.free_bytes()
            pools.free.clear()
    return freed
