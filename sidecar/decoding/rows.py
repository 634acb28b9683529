"""What the decoding loop takes and gives: a request row, its output, its statistics, and the callbacks.

``DecodeRow`` carries its own sampling, stop strings and logprob request, so one batch mixes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from sidecar.decoding.logprobs import TokenLogprob
from sidecar.decoding.sampling import Sampling
from sidecar.runtime.kv_cache import RowKVCache

# (row index, tokens just committed, their logprob entries when asked for, else None)
TokenCallback = Callable[[int, list[int], list[TokenLogprob] | None], None]
# (row index) -> whether nobody waits for the row any more; asked once per decoding step, on the host
CancelCheck = Callable[[int], bool]


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    drafted: int = 0  # by the draft model and by prompt lookup
    accepted: int = 0
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    target_forwards: int = 0  # the prefill counts as one: it yields the first token
    draft_forwards: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    # Rows of one batch share forwards, so these are the batch's wall-clock phases up to this row's end. The
    # loop does not wait for the draft's prefill, so on a GPU part of it may show in decode_seconds.
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    wall_seconds: float = 0.0
    batch_size: int = 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    def as_dict(self) -> dict:
        return asdict(self) | {"acceptance_rate": self.acceptance_rate,
                               "tokens_per_target_forward": self.tokens_per_target_forward}


@dataclass
class GenerationOutput:
    token_ids: list[int]
    text: str
    finish_reason: str  # "eos" | "stop" | "length" | "cancelled"
    stats: GenerationStats
    # one entry per token id, from the target's logits (``sidecar.decoding.logprobs``); None unless asked for
    logprobs: list[TokenLogprob] | None = None


@dataclass
class DecodeRow:
    """One request as the decoding loop sees it; the draft may see a longer prompt than the target."""

    target_prompt: list[int]
    max_new_tokens: int
    draft_prompt: list[int] | None = None
    # (start, end) column ranges of the draft prompt hidden from the draft during decoding
    draft_hidden: list[tuple[int, int]] = field(default_factory=list)
    sampling: Sampling = field(default_factory=Sampling)
    stop: list[str] | None = None  # stop strings: the output ends before the first one it contains
    top_logprobs: int | None = None  # None: no logprobs; k: each token's logprob and k alternatives
    keep_draft: bool = False  # a sidecar continues from its draft cache: ``on_finish`` hears it, draft prefilled


# Called when a row finishes, before it leaves the batch (a cancelled row leaves without it): (row index,
# output, draft cache, slot of the row in that cache). The draft cache holds the draft prompt plus a prefix
# of the row's new tokens; the sidecar engine continues from there.
FinishCallback = Callable[[int, GenerationOutput, RowKVCache, int], None]

