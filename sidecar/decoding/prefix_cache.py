"""A small LRU of scored prompts, so scoring a prompt that shares its leading tokens with a recent one forwards
only what is new (as serving engines reuse a shared prefix: vLLM's automatic prefix caching, SGLang's radix
cache).

An entry is one scored prompt of one model: its token ids, the model's keys and values at every position
(per layer, [1, kv_heads, n, head_dim]) and the ``PromptLogprob`` entries computed for it with their ``top``
alternatives. ``sidecar.decoding.scoring.prompt_logprobs`` looks up the entry sharing the longest prefix with
a new prompt (at least ``min_prefix`` tokens, and with at least as many alternatives as asked), takes the
shared positions' entries from it and forwards the rest over its keys and values; then it stores the new
prompt. Stored tensors are never written: a forward gets a fresh cache that copies the slice it attends to.

Bounded by entries (``max_entries``) and bytes of keys and values (``max_bytes``), least recently used out
first (the server's ``--prompt-cache-mib``; without a cache, ``--no-prompt-cache``, every prompt runs whole);
a prompt longer than ``max_tokens`` is neither looked up nor kept. One cache serves one model (same
object, dtype and device): bound to another, it forgets everything. Not thread-safe: its owner (the server's
worker thread) uses it alone.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sidecar.decoding.scoring import PromptLogprob

# a judge's scorer prompts share their instruction and summary (~100 tokens); a shorter match saves little
MIN_PREFIX = 16
MAX_ENTRIES = 32
MAX_BYTES = 256 << 20
MAX_TOKENS = 4096

KeysValues = tuple[tuple[torch.Tensor, torch.Tensor], ...]


@dataclass(frozen=True)
class PrefixEntry:
    """A scored prompt: ``token_ids``, each layer's (keys, values) over them, and the entries of
    ``token_ids[1:]`` with ``top`` alternatives each."""

    token_ids: tuple[int, ...]
    keys_values: KeysValues
    entries: tuple[PromptLogprob, ...]
    top: int

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.keys_values)


def shared_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    """Recently scored prompts of one model, least recently used first (see the module's docstring).

    ``hits`` counts lookups that found a shared prefix, ``misses`` those that did not (a prompt too long to
    cache counts as neither); ``reused_tokens`` the positions taken from the cache, ``forwarded_tokens`` those
    the model ran."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES, min_prefix: int = MIN_PREFIX,
                 max_tokens: int = MAX_TOKENS) -> None:
        if min_prefix < 2:
            raise ValueError(f"min_prefix must be at least 2 (one position reused, one forwarded), not {min_prefix}")
        if max_entries < 1 or max_bytes < 1:
            field, value = ("max_entries", max_entries) if max_entries < 1 else ("max_bytes", max_bytes)
            raise ValueError(f"{field} must be at least 1, not {value}: to cache nothing, pass no PrefixCache")
        if max_tokens < min_prefix:
            raise ValueError(f"max_tokens ({max_tokens}) must be at least min_prefix ({min_prefix}): no prompt "
                             "could both be cached and share a prefix long enough to reuse")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.min_prefix, self.max_tokens = min_prefix, max_tokens
        self._entries: OrderedDict[tuple[int, ...], PrefixEntry] = OrderedDict()
        self._model: tuple[weakref.ref, torch.dtype, torch.device] | None = None
        self.bytes = 0
        self.hits = self.misses = self.reused_tokens = self.forwarded_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def bind(self, model: torch.nn.Module) -> None:
        """Serve ``model``: another model (or the same in another dtype or on another device) clears the cache."""
        current = self._model
        if current is None or current[0]() is not model or current[1:] != (model.dtype, model.device):
            self.clear()
            self._model = (weakref.ref(model), model.dtype, model.device)

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def cacheable(self, token_ids: Sequence[int]) -> bool:
        return len(token_ids) <= self.max_tokens

    def lookup(self, token_ids: Sequence[int], top: int) -> tuple[PrefixEntry, int] | None:
        """The entry with ``top`` or more alternatives sharing the most leading tokens with ``token_ids``, and
        how many, where that is at least ``min_prefix`` (or all of a shorter prompt); counts a hit or a miss."""
        best: tuple[PrefixEntry, int] | None = None
        for entry in self._entries.values():
            if entry.top >= top:
                shared = shared_length(entry.token_ids, token_ids)
                if best is None or shared > best[1]:
                    best = (entry, shared)
        if best is None or best[1] < min(self.min_prefix, len(token_ids)):
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(best[0].token_ids)
        return best

    def store(self, entry: PrefixEntry) -> None:
        """Keep ``entry`` as the most recent, dropping entries it extends and the least recent over the bounds;
        an entry over ``max_bytes`` alone is not kept."""
        size = entry.nbytes
        if size > self.max_bytes or not self.cacheable(entry.token_ids):
            return
        extended = [key for key, old in self._entries.items()  # everything they hold, the new one holds
                    if old.top <= entry.top and key == entry.token_ids[: len(key)]]
        for key in extended:
            self._drop(key)
        self._drop(entry.token_ids)
        self._entries[entry.token_ids] = entry
        self.bytes += size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: tuple[int, ...]) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes

    def counters(self) -> dict[str, Any]:
        return {"hits": self.hits, "misses": self.misses, "reused_tokens": self.reused_tokens,
                "forwarded_tokens": self.forwarded_tokens, "entries": len(self._entries), "bytes": self.bytes,
                "max_bytes": self.max_bytes}
