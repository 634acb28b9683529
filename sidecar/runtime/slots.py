"""A pool of KV-cache slots for a running batch, allocated once per model for ``max_batch`` rows.

Invariant: the live rows occupy slots ``0 .. live - 1``; ``active`` is a view of those rows over the pool's
buffers, so a forward costs only the live rows. Rows join in the free slots just past the live ones
(``admit`` hands out a view of them to prefill in place, ``write`` fills them from snapshots) and leave
through ``remove``, which moves the highest live rows into the freed slots (``compaction_order``) without
touching the others. Each slot holds
``capacity`` columns; a KV token budget fixes it (``max_batch * capacity <= budget``), otherwise it is a power of
two (``capacity_bucket``: compiled forwards take their shapes from it) and the pool grows when a row needs more
columns than it has, copying only the live rows' filled columns.

The buffers come from ``sidecar.runtime.pools``: a pool whose last live row leaves gives them back, and takes
them (or those another batch of the model gave back, of the same shape) again when rows join, so consecutive
batches run on the same buffers, and compiled or captured forwards on the addresses they were made for.
"""

from __future__ import annotations

from functools import partial

from transformers import PreTrainedModel

from sidecar.errors import InputError
from sidecar.runtime.capture import capacity_bucket
from sidecar.runtime.kv_cache import RowKVCache, RowSnapshot, compaction_order
from sidecar.runtime.pools import give_back, take
from sidecar.runtime.warmup import warm_new


class SlotPool:
    def __init__(self, model: PreTrainedModel, max_batch: int, capacity: int,
                 kv_budget_tokens: int | None = None) -> None:
        self.model = model
        self.max_batch = max_batch
        self.budget_capacity = None if kv_budget_tokens is None else kv_budget_tokens // max_batch
        self._capacity = capacity_bucket(capacity) if self.budget_capacity is None else self.budget_capacity
        # None while given back (no live row)
        self.cache: RowKVCache | None = take(model, max_batch, self._capacity, partial(warm_new, model))
        self.live = 0
        self.active = self.cache.rows_view(0, 0)

    @property
    def free(self) -> int:
        return self.max_batch - self.live

    @property
    def capacity(self) -> int:
        return self._capacity

    def ensure_capacity(self, columns: int) -> None:
        """Make every slot hold ``columns`` columns; refused beyond a KV token budget."""
        if columns > self.capacity:
            if self.budget_capacity is not None:
                raise InputError(f"a row needs {columns} KV columns but the KV token budget gives each of the "
                                 f"{self.max_batch} slots {self.budget_capacity}; raise the budget or shorten the "
                                 "input")
            self._capacity = capacity_bucket(max(columns, self.capacity * 3 // 2))
        if self.cache is not None and self.cache.capacity == self._capacity:
            return
        grown = take(self.model, self.max_batch, self._capacity, partial(warm_new, self.model))
        if self.cache is not None:
            self.active.copy_into(grown.rows_view(0, self.live))
            give_back(self.model, self.cache)
        self.cache = grown
        self.active = grown.rows_view(0, self.live)

    def admit(self, rows: int) -> RowKVCache:
        """Take ``rows`` free slots, emptied, and return them as a view to prefill; they are live from now on."""
        assert rows <= self.free, "admit beyond the pool"
        self.ensure_capacity(0)  # buffers again, if the pool gave them back
        start, stop = self.live, self.live + rows
        cache = self.cache
        cache.lengths[start:stop] = 0
        cache.position_offset[start:stop] = 0
        cache.visible[start:stop] = True
        cache.span[start:stop] = -1
        self.live = stop
        self.active = cache.rows_view(0, stop)
        return cache.rows_view(start, stop)

    def remove(self, keep: list[int]) -> list[int]:
        """Keep only the live slots ``keep`` (ascending); returns the order: new slot i holds old ``order[i]``."""
        if self.cache is None:
            return []
        order = compaction_order(keep)
        self.cache.move_rows(order)
        self.live = len(keep)
        self.active = self.cache.rows_view(0, self.live)
        if not keep:
            self.release()
        return order

    def release(self) -> None:
        """Give the buffers back (``sidecar.runtime.pools``) while no row is live; rows joining take them again."""
        assert self.live == 0, "a pool with live rows keeps its buffers"
        if self.cache is not None:
            give_back(self.model, self.cache)
            self.cache = None

    def write(self, snapshots: list[RowSnapshot]) -> RowKVCache:
        """Admit one row per snapshot (rows cut out of another cache) and return them as a view."""
        view = self.admit(len(snapshots))
        for row, snapshot in enumerate(snapshots):
            view.write_snapshot(row, snapshot)
        return view


def row_columns(prompt_tokens: int, max_new_tokens: int, gamma: int) -> int:
    """KV columns a row may fill: its prompt (for a row joining from a snapshot, the snapshot and its feed),
    its new tokens, and one step's widest write past its last token (a verify of its pending token and
    ``gamma`` drafts, or ``gamma`` draft forwards). Requests are checked against the model's context with
    the same count."""
    return prompt_tokens + max_new_tokens + gamma + 1
