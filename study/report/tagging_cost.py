"""What one mode's tagging phase costs per request, line by line: the numbers every verdict is computed from.

Measured, the lines are the device seconds the engine's ledger (``sidecar/runtime/ledger.py``) attributed to
the tagging rows: a forward's seconds shared among the rows it served in proportion to their tokens in it.
Projected, they are the roofline's seconds of the same forwards, shared by the same rule (``study.cost``).
Either way a sidecar's lines are its prefill (catch-up and bridge feed), its decode steps and its instruction
line (the masked instruction's share of the main row's draft prefill: what sidecar mode adds to the main
phase); a standalone tagger's are its prefill (its whole prompt) and its decode steps. A verdict compares
device seconds per tag token, and nothing else, so it follows from the lines shown under it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TaggingCost:
    """Device seconds per request of each line of one mode's tagging phase, and the tag tokens it made.

    ``prefill_s`` is None where the prefill was not priced (a projection without the draft's shape, which
    prices decode steps only; ``tag_tokens`` is then the one token a decode step makes per request).
    """

    tag_tokens: float
    prefill_s: float | None
    decode_s: float
    instruction_s: float = 0.0

    @property
    def seconds(self) -> float:
        """The lines added up: device seconds per request."""
        return (self.prefill_s or 0.0) + self.decode_s + self.instruction_s

    @property
    def seconds_per_tag_token(self) -> float:
        return self.seconds / self.tag_tokens

    @property
    def tokens_per_s(self) -> float:
        """Tag tokens per device second."""
        return self.tag_tokens / self.seconds

    @classmethod
    def per_request(cls, requests: float, tag_tokens: float, prefill_s: float | None, decode_s: float,
                    instruction_s: float = 0.0) -> TaggingCost:
        """From totals over ``requests`` requests."""
        return cls(tag_tokens / requests, None if prefill_s is None else prefill_s / requests, decode_s / requests,
                   instruction_s / requests)


def saving_pct(sidecar: TaggingCost, standalone: TaggingCost) -> float:
    """How much less a sidecar tag token costs than a standalone one, in percent (negative: it costs more): one
    minus the ratio of their device seconds per tag token. On one GPU type the price of a token is its device
    time times the rent, so this needs no price."""
    return (1 - sidecar.seconds_per_tag_token / standalone.seconds_per_tag_token) * 100
