"""A position-indexed KV cache where every row of the batch has its own length.

Row ``b`` holds ``lengths[b]`` filled columns. A forward writes its ``q`` new key/value columns at
``lengths[b] .. lengths[b] + q`` of each row and only ``commit`` moves the write pointer, so rolling back
rejected draft tokens costs nothing: the next forward overwrites them. Columns can also be hidden
(``visible`` is False) without being removed — that is how a sidecar instruction stays in the draft's
cache but out of its attention — or physically removed with ``keep_columns`` (document eviction), which
compacts each row while the rows keep their original rotary positions.

The object plugs into Hugging Face models through the ``cache=`` argument: attention layers call
``update`` and receive the filled part of the buffers; the 4D mask from ``attention_mask`` decides what
each query may see. Our own forward (``sidecar.runtime.decoder_stack``) reads and writes the same buffers and
builds that mask on the device instead.

Every row has one column past its capacity, the trash column: padding (rows or query columns added to reach
a bucket's shape) writes there, and no real query attends to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from sidecar.runtime.transfers import to_device


class RowKVCache:
    """``lengths`` and ``position_offset`` live on the host (numpy, one int per row): every forward needs
    the longest row to size its mask, and reading that from the device would wait for the device. The
    caller commits the host values it has anyway (the accepted counts come back with the tokens)."""

    def __init__(self, model: PreTrainedModel, batch_size: int, capacity: int) -> None:
        config = model.config.get_text_config()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (batch_size, config.num_key_value_heads, capacity + 1, head_dim)  # + the trash column
        param = next(model.parameters())
        self.device = param.device
        self.layers = config.num_hidden_layers
        self.keys = [torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in range(self.layers)]
        self.values = [torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in range(self.layers)]
        self.lengths = np.zeros(batch_size, dtype=np.int64)
        # rotary position of column 0 minus 0: positions advance with lengths, plus a per-row offset
        # that grows when columns are evicted, so later tokens keep their original positions.
        self.position_offset = np.zeros(batch_size, dtype=np.int64)
        self.visible = torch.ones(batch_size, capacity + 1, dtype=torch.bool, device=param.device)
        self.span = torch.full((batch_size, capacity + 1), -1, dtype=torch.long, device=param.device)
        self._write_index: torch.Tensor | None = None
        self._kv_len = 0
        # the cache whose buffers this one's rows are, and the first of them (``rows_view``)
        self.root = self
        self.start = 0
        self._buckets: dict[tuple[int, int], BucketBuffers] = {}  # (start, rows) -> ``bucket``'s buffers

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] - 1  # the trash column holds nothing of a row's

    def bytes_per_column(self) -> int:
        k = self.keys[0]
        return 2 * self.layers * k.shape[1] * k.shape[3] * k.element_size()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values, self.visible, self.span))

    def reset(self) -> None:
        """Empty every row, as a new cache is: lengths and rotary offsets 0, every column visible and in no hidden
        span. Keys and values stay as they are: no query reads a column before its row writes it."""
        self.lengths[:] = 0
        self.position_offset[:] = 0
        self.visible.fill_(True)
        self.span.fill_(-1)

    def row_bytes(self) -> np.ndarray:
        """KV bytes each row actually holds (filled columns), as read by one decode step."""
        return self.lengths * self.bytes_per_column()

    # -- one forward --

    def prepare(self, query_len: int, dtype: torch.dtype, query_span: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Position ids [B, q] and the additive 4D mask [B, 1, q, kv_len] for the next forward.

        ``query_span`` [B, q] marks new tokens that belong to a hidden span (id >= 0; -1 for ordinary
        tokens): such columns are hidden from every later query but tokens of the same span see each
        other, so a hidden instruction's own keys are computed exactly as if it were visible.
        """
        longest = int(self.lengths.max())
        if longest + query_len > self.capacity:
            raise RuntimeError("KV cache capacity exceeded; the engine sized it too small")
        write = self.lengths[:, None] + np.arange(query_len)  # [B, q], on the host
        # one copy for both: the write columns and their rotary positions
        self._write_index, positions = to_device(np.stack([write, write + self.position_offset[:, None]]),
                                                 self.device)
        self._kv_len = longest + query_len
        device = self.device
        if query_span is None:
            query_span = torch.full_like(self._write_index, -1)
        self.span.scatter_(1, self._write_index, query_span)
        self.visible.scatter_(1, self._write_index, query_span < 0)
        columns = torch.arange(self._kv_len, device=device)
        causal = columns[None, None, :] <= self._write_index[:, :, None]  # [B, q, kv]
        span = self.span[:, None, : self._kv_len]
        same_span = (span == query_span[:, :, None]) & (query_span[:, :, None] >= 0)
        allowed = causal & (self.visible[:, None, : self._kv_len] | same_span)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return positions, mask[:, None]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        assert self._write_index is not None, "prepare() must run before a forward"
        index = self._write_index[:, None, :, None].expand(-1, key_states.shape[1], -1, key_states.shape[3])
        self.keys[layer_idx].scatter_(2, index, key_states)
        self.values[layer_idx].scatter_(2, index, value_states)
        return self.keys[layer_idx][:, :, : self._kv_len], self.values[layer_idx][:, :, : self._kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.lengths.max())

    def commit(self, accepted_columns: int | Sequence[int] | np.ndarray) -> None:
        """Keep ``accepted_columns[b]`` (host ints; one int for every row) of the columns the last forward
        wrote for each row."""
        self.lengths += np.asarray(accepted_columns, dtype=np.int64)  # in place: a ``rows_view`` moves its parent's too

    def rollback(self, lengths: Sequence[int] | np.ndarray) -> None:
        np.minimum(self.lengths, np.asarray(lengths, dtype=np.int64), out=self.lengths)

    def rollback_row(self, row: int, length: int) -> None:
        """Keep at most ``length`` columns of row ``row``."""
        self.lengths[row] = min(int(self.lengths[row]), length)

    # -- row surgery --

    def move_rows(self, order: list[int]) -> None:
        """Slot ``i`` takes row ``order[i]`` (distinct rows) for every ``i < len(order)``, in place.

        Rows already in their slot are not copied, so in the order ``compaction_order`` gives only the rows
        that fill a freed slot move, not the whole batch's buffers. Slots from ``len(order)`` on keep what
        they held: the caller counts them as free."""
        moves = [(slot, source) for slot, source in enumerate(order) if slot != source]
        if not moves:
            return
        slots, sources = to_device(list(zip(*moves, strict=True)), self.device)
        for tensor in (*self.keys, *self.values, self.visible, self.span):
            tensor[slots] = tensor[sources]  # [moves, ...]: the sources are gathered before any slot is written
        moved = np.array(moves, dtype=np.int64)  # [moves, 2]: (slot, source)
        self.lengths[moved[:, 0]] = self.lengths[moved[:, 1]]
        self.position_offset[moved[:, 0]] = self.position_offset[moved[:, 1]]

    def copy_into(self, target: RowKVCache) -> None:
        """Make ``target``'s rows (as many as this cache has, with room for its longest) hold this cache's
        rows: their filled columns, lengths and rotary offsets. Columns past the longest row are not copied."""
        filled = int(self.lengths.max(initial=0))  # host ints: no wait for the device
        for dst, src in zip((*target.keys, *target.values), (*self.keys, *self.values), strict=True):
            dst[:, :, :filled] = src[:, :, :filled]  # [B, kv_heads, filled, head_dim]
        target.visible[:, :filled] = self.visible[:, :filled]
        target.span[:, :filled] = self.span[:, :filled]
        target.lengths[:] = self.lengths
        target.position_offset[:] = self.position_offset

    def rows_view(self, start: int, stop: int) -> RowKVCache:
        """Rows ``start:stop`` as a cache that shares this one's buffers, so that a forward on it writes
        those rows in place, and its ``commit`` moves their lengths here too."""
        view = object.__new__(RowKVCache)
        view.device = self.device
        view.layers = self.layers
        view.keys = [k[start:stop] for k in self.keys]
        view.values = [v[start:stop] for v in self.values]
        view.lengths = self.lengths[start:stop]
        view.position_offset = self.position_offset[start:stop]
        view.visible = self.visible[start:stop]
        view.span = self.span[start:stop]
        view._write_index = None
        view._kv_len = 0
        view.root = self.root
        view.start = self.start + start
        return view

    def bucket(self, rows: int) -> BucketBuffers:
        """The buffers of these rows and the ones after them in the root cache, ``rows`` in all (at most to the
        root's end): a forward padded up to a bucket's batch writes its padding rows there. The same tensor
        objects on every call for a bucket, so that a capture marks their addresses static once
        (``sidecar.runtime.capture``); they hold the root's storage, not the root, so a cache dropped is freed."""
        rows = min(rows, self.root.batch_size - self.start)
        buckets = self.root._buckets
        found = buckets.get((self.start, rows))
        if found is None:
            root, stop = self.root, self.start + rows
            found = buckets[(self.start, rows)] = BucketBuffers(
                [k[self.start : stop] for k in root.keys], [v[self.start : stop] for v in root.values],
                root.visible[self.start : stop], root.span[self.start : stop])
        return found

    def copy_prefix(self, source: int, length: int) -> None:
        """Give every other row row ``source``'s first ``length`` columns, a prompt prefix they share, and
        make that their length. For rows that hold nothing yet: the columns carry positions 0 .. length - 1."""
        for buffer in (*self.keys, *self.values):
            buffer[:, :, :length] = buffer[source, :, :length]
        self.visible[:, :length] = self.visible[source, :length]
        self.span[:, :length] = self.span[source, :length]
        self.lengths[np.arange(self.batch_size) != source] = length

    def snapshot(self, row: int, columns: Sequence[int]) -> RowSnapshot:
        """Copy row ``row`` reduced to ``columns`` (ascending); the rest of the row is evicted.

        Kept keys already carry their rotary positions, so a row whose document was evicted attends
        exactly as if the document were only masked.
        """
        index = to_device(columns, self.device)
        return RowSnapshot(
            keys=[k[row, :, index].clone() for k in self.keys],
            values=[v[row, :, index].clone() for v in self.values],
            visible=self.visible[row, index].clone(),
            next_position=int(columns[-1]) + int(self.position_offset[row]) + 1,
        )

    def write_snapshot(self, row: int, snapshot: RowSnapshot) -> None:
        """Make row ``row`` hold ``snapshot``: its columns, visibility and rotary positions (room assumed)."""
        n = snapshot.length
        for layer in range(self.layers):
            self.keys[layer][row, :, :n] = snapshot.keys[layer]
            self.values[layer][row, :, :n] = snapshot.values[layer]
        self.visible[row, :n] = snapshot.visible
        self.span[row, :n] = -1
        self.lengths[row] = n
        self.position_offset[row] = snapshot.next_position - n

    @classmethod
    def from_snapshots(cls, model: PreTrainedModel, snapshots: list[RowSnapshot], extra: int) -> RowKVCache:
        """A batch cache whose row i is ``snapshots[i]``, with room for ``extra`` more columns per row."""
        cache = cls(model, len(snapshots), max(s.length for s in snapshots) + extra)
        for i, snapshot in enumerate(snapshots):
            cache.write_snapshot(i, snapshot)
        return cache


@dataclass
class BucketBuffers:
    """Some rows' buffers, as ``RowKVCache.bucket`` keeps them for the forwards padded to a bucket."""

    keys: list[torch.Tensor]  # per layer [rows, kv_heads, C + 1, D]
    values: list[torch.Tensor]
    visible: torch.Tensor  # [rows, C + 1]
    span: torch.Tensor  # [rows, C + 1]
    static: bool = False  # whether their addresses were marked static for CUDA graphs (``sidecar.runtime.capture``)

    @property
    def rows(self) -> int:
        return self.visible.shape[0]

    @property
    def columns(self) -> int:
        return self.visible.shape[1]  # the trash column included

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*self.keys, *self.values, self.visible, self.span)


@dataclass
class RowSnapshot:
    """One row's kept KV columns, detached from any batch."""

    keys: list[torch.Tensor]  # per layer [kv_heads, n, head_dim]
    values: list[torch.Tensor]
    visible: torch.Tensor  # [n]
    next_position: int

    @property
    def length(self) -> int:
        return self.visible.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def compaction_order(keep: list[int]) -> list[int]:
    """The kept slots ``keep`` (ascending) in the order ``RowKVCache.move_rows`` copies least: a kept row
    below ``len(keep)`` stays in its slot, and the kept rows above fill the others."""
    kept = len(keep)
    staying = {slot for slot in keep if slot < kept}
    movers = iter(slot for slot in keep if slot >= kept)
    return [slot if slot in staying else next(movers) for slot in range(kept)]
