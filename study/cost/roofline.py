"""The roofline of one forward of a decoder-only model: the larger of its compute time and its memory time.

A forward feeds ``tokens`` new tokens to each of ``batch`` rows whose KV caches already hold ``context``
entries, and ``logits`` positions per row reach the LM head. With the sizes of :class:`ModelFacts`
(M = ``layer_matmul_parameters``, H = ``lm_head_parameters``, L = ``layers``, A = ``attention_width``, the
query width heads x head dim)::

    linear FLOPs    = 2 x M x batch x tokens + 2 x H x batch x logits
    attention FLOPs = 4 x L x A x batch x keys,     keys = tokens x context + tokens x (tokens + 1) / 2
    bytes           = weight bytes per step + batch x (context + tokens) x KV bytes per token
    seconds         = max((linear + attention FLOPs) / peak dense FLOP/s, bytes / peak bandwidth)
                      + host floor (``host_floor``: the capture mode's host cost per forward at this batch, if given;
                        where it overlaps the device, ``HostFloor.overlapped``, the forward's own cost is in the max)

- Linear: every weight of a layer's linear maps multiplies every new token once (a multiply-add, 2 FLOPs).
  The LM head runs only where a next token is needed: once per row for a prefill or a decode step, as the
  engine runs it; at every fed token for a speculative verify forward. So a prompt of T tokens costs about
  2 x parameters x T. Norms, biases, rotary embeddings and the softmax are left out:
  a few FLOPs per element, not per weight.
- Attention: a new token scores each key it attends (QKᵀ) and sums its value (AV), 2 x A FLOPs each. The
  i-th new token attends the context and the first i new tokens (causal), which sums to ``keys``; a fresh
  prompt of T tokens costs about 4 x L x A x T x T/2 per row.
- Bytes: the weights are streamed once per forward whatever the batch, and each row's KV entries the
  forward attends, cached and new, once.

Prefill and decode are the same forward: a decode step feeds one token per row. A prefill of a long prompt
at batch is compute-bound; a decode step, and a small batch of short prompts, stay bandwidth-bound. FLOPs
and bytes are linear in ``context``, so rows with different contexts are priced exactly at their mean.
The peaks are ideals that real kernels reach a fraction of (``calibration`` measures how far): this is a
projection, not a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from study.cost.errors import CostInputError, count, number
from study.cost.facts import ModelFacts

if TYPE_CHECKING:
    from study.cost.host_floor import HostFloor


class Device(Protocol):
    """What the roofline needs of a device: peak memory bandwidth and peak dense FLOP/s (a catalog GPU)."""

    @property
    def bandwidth_bytes_s(self) -> float: ...

    @property
    def flops_s(self) -> float: ...


@dataclass(frozen=True)
class Peaks:
    """A device given by its peaks alone, for one outside the catalog."""

    bandwidth_bytes_s: float
    flops_s: float

    def __post_init__(self) -> None:
        number("bandwidth", self.bandwidth_bytes_s)
        number("FLOP/s", self.flops_s)


def _check(batch: int, tokens: int, context: float) -> None:
    count("a forward's batch", batch)
    count("a forward's tokens", tokens)
    number("a forward's context", context, positive=False)


def forward_flops(facts: ModelFacts, batch: int, tokens: int, context: float, logits: int = 1) -> float:
    """FLOPs of one forward that feeds ``tokens`` tokens to each of ``batch`` rows holding ``context`` entries,
    ``logits`` of them per row reaching the LM head."""
    _check(batch, tokens, context)
    if not 1 <= logits <= tokens:
        raise CostInputError(f"logits must be between 1 and the tokens fed ({tokens}), got {logits}")
    linear = 2 * facts.layer_matmul_parameters * tokens + 2 * facts.lm_head_parameters * logits
    keys = tokens * context + tokens * (tokens + 1) / 2
    attention = 4 * facts.layers * facts.attention_width * keys
    return batch * (linear + attention)


def forward_bytes(facts: ModelFacts, batch: int, tokens: int, context: float) -> float:
    """Bytes that forward moves: the weights once, and each row's KV entries, cached and new, once."""
    _check(batch, tokens, context)
    return facts.weight_bytes_per_step + batch * (context + tokens) * facts.kv_bytes_per_token


def forward_seconds(
    facts: ModelFacts, device: Device, batch: int, tokens: int, context: float, logits: int = 1,
    host: HostFloor | None = None,
) -> float:
    """The roofline time of that forward: compute time or memory time, whichever is longer, with ``host``'s
    floor for a model of this depth at this batch (``HostFloor.forward_seconds``; none without it)."""
    compute = forward_flops(facts, batch, tokens, context, logits) / device.flops_s
    memory = forward_bytes(facts, batch, tokens, context) / device.bandwidth_bytes_s
    return max(compute, memory) if host is None else host.forward_seconds(max(compute, memory), facts.layers, batch)


def prefill_seconds(facts: ModelFacts, device: Device, batch: int, tokens: int, context: float = 0,
                    host: HostFloor | None = None) -> float:
    """One prefill forward of ``tokens`` prompt tokens per row for ``batch`` rows, onto caches that hold
    ``context`` entries already (0: a fresh prompt)."""
    return forward_seconds(facts, device, batch, tokens, context, host=host)


def decode_step_seconds(facts: ModelFacts, device: Device, batch: int, context: float,
                        host: HostFloor | None = None) -> float:
    """One decode step: one new token for each of ``batch`` rows whose caches hold ``context`` entries (one
    forward: with ``host``, a plain step's floor, ``HostFloor.plain``)."""
    return forward_seconds(facts, device, batch, 1, context, host=None if host is None else host.plain)
