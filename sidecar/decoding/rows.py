"""The rows of a decoding batch: what callers give (``DecodeRow``, ``DraftRow``), what they get back
(``GenerationOutput`` with its counters, ``sidecar.decoding.stats.GenerationStats``), and what the batch keeps
per live row (``MainRow``, ``DraftOnlyRow``).

Two kinds of row share a batch. A *main* row is decoded by speculation: the target verifies what the
draft (or prompt lookup) proposes, so its output is the target's. A *draft-only* row is decoded by the
draft model alone, one token per draft forward: a sidecar task continuing from a finished main row's draft
cache, or a standalone prompt. Each carries its own sampling, stop strings and logprob request.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from sidecar.decoding.constraints import Constraint
from sidecar.decoding.logprobs import TokenLogprob
from sidecar.decoding.matcher import RowMatcher
from sidecar.decoding.sampling import Sampling
from sidecar.decoding.stats import GenerationStats
from sidecar.decoding.stops import TokenStops
from sidecar.runtime.kv_cache import RowKVCache, RowSnapshot
from sidecar.runtime.ledger import Account

# (caller's key of the row, tokens just committed, their logprob entries when asked for, else None)
TokenCallback = Callable[[Hashable, list[int], list[TokenLogprob] | None], None]
# (caller's key of the row) -> whether nobody waits for the row any more; asked once per step, on the host
CancelCheck = Callable[[Hashable], bool]


@dataclass
class GenerationOutput:
    token_ids: list[int]
    text: str
    finish_reason: str  # "eos" | "stop" | "length" | "cancelled"
    stats: GenerationStats
    # one entry per token id, from the logits of the model that wrote it (``sidecar.decoding.logprobs``)
    logprobs: list[TokenLogprob] | None = None


# -- what callers give --


@dataclass
class DecodeRow:
    """A main row: one request decoded by speculation; the draft may see a longer prompt than the target."""

    target_prompt: list[int]
    max_new_tokens: int
    draft_prompt: list[int] | None = None
    # (start, end) column ranges of the draft prompt hidden from the draft during decoding, one per sidecar
    draft_hidden: list[tuple[int, int]] = field(default_factory=list)
    sampling: Sampling = field(default_factory=Sampling)
    stop: list[str] | None = None  # stop strings: the output ends before the first one it contains
    top_logprobs: int | None = None  # None: no logprobs; k: each token's logprob and k alternatives
    keep_draft: bool = False  # its draft cache is handed on when it finishes (``DraftHandoff``)
    constraint: Constraint | None = None  # the target chooses only what it allows (docs/constraints.md)


@dataclass
class DraftRow:
    """A draft-only row: its start (a ``snapshot`` of another row's draft cache, then ``feed``; or, with no
    snapshot, ``feed`` as a whole prompt to prefill) and how to decode after it."""

    feed: list[int]
    max_new_tokens: int
    draw_key: int  # its random draws' key (``sidecar.decoding.randomness``); 0 for a greedy row
    snapshot: RowSnapshot | None = None
    sampling: Sampling = field(default_factory=Sampling)
    top_logprobs: int | None = None
    # accounts of work done for this row before it joined (a sidecar's share of its main row's draft work)
    carried: Account = field(default_factory=Account)
    phase: str = "sidecar"  # the ledger's label of its work: "sidecar" or "standalone"
    constraint: Constraint | None = None  # the draft chooses only what it allows (docs/constraints.md)


@dataclass
class DraftHandoff:
    """A finished main row's draft cache, caught up with its whole output, for the sidecars that continue
    from it. ``instruction[i]`` and ``catch_up[i]`` are the device time charged to hidden span ``i``: its
    share of the draft prefill, and of the catch-up feed that brought the cache level with the output."""

    index: Hashable
    output: GenerationOutput
    cache: RowKVCache
    slot: int
    instruction: list[Account]
    catch_up: list[Account]


HandoffCallback = Callable[[DraftHandoff], None]


# -- what the batch keeps per live row --


@dataclass
class LiveRow:
    """What every live row has: its key, limits, draws, output so far, and its ledger account."""

    key: Hashable
    max_new_tokens: int
    sampling: Sampling
    draw_key: int
    top_logprobs: int | None
    added: float  # perf_counter when the caller added it
    account: Account = field(default_factory=Account)
    stats: GenerationStats = field(default_factory=GenerationStats)
    stops: TokenStops | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    # the last committed token, which no cache of the row holds yet: the next forward feeds it
    pending_token: int = -1
    finish: str | None = None
    admitted: float = 0.0  # perf_counter when its admission began
    decoding_from: float = 0.0
    phase: str = "main"  # the ledger's label of its work
    # its constraint's state, which follows ``tokens`` between steps (a draft-only row's runs ahead within one)
    matcher: RowMatcher | None = None

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.tokens)


@dataclass
class MainRow(LiveRow):
    request: DecodeRow = field(default_factory=lambda: DecodeRow([0], 1))
    has_draft: bool = False  # whether the draft model holds its prompt (else it decodes plainly or by copying)
    # committed tokens before ``pending_token`` that its draft cache does not hold yet
    backlog: list[int] = field(default_factory=list)
    instruction: list[Account] = field(default_factory=list)  # per hidden span (``DraftHandoff``)
    catch_up: list[Account] = field(default_factory=list)
    hands_on: bool = False  # its draft cache goes to ``on_handoff`` when it finishes (unless cancelled)
    catching_up: bool = False  # finished: it stays in the draft pool for one step to feed its catch-up
    output: GenerationOutput | None = None  # once it has finished


@dataclass
class DraftOnlyRow(LiveRow):
    feed: list[int] = field(default_factory=list)  # tokens to feed before its first one (a join feed)
    phase: str = "sidecar"
    carried: Account = field(default_factory=Account)
    snapshot: RowSnapshot | None = None  # what it joins from, until it has joined
