"""A row's counters: one record, ``GenerationStats``, from the batch that decodes the row to everything that
reads it (the engine's and the sidecar outputs, the server's usage and metrics, the stored
``storage.RequestStats`` of each phase).

A main row fills the speculation counters; a draft-only row (a sidecar task or a standalone prompt) fills
``draft_forwards`` and, for a sidecar task, the ``instruction_*`` line its task adds to the main row's draft
prefill. Both carry latency on the host's wall clock and cost from the device-time ledger.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from sidecar.runtime.ledger import Account, DeviceCost


@dataclass
class GenerationStats(DeviceCost):
    """A row's counters. Cost (the ``DeviceCost`` fields): the device-time ledger's account of the row
    (``sidecar.runtime.ledger``): tokens it fed (a draft-only row's ``prefill_tokens`` are its feed: a sidecar's
    share of the catch-up and its bridge, or a whole prompt), forwards it was in and device seconds charged
    to it."""

    prompt_tokens: int = 0  # tokens the row attends to when it writes its first token (its usage's prompt)
    new_tokens: int = 0
    drafted: int = 0  # by the draft model and by prompt lookup
    accepted: int = 0  # of them, those the row kept (none past its end of turn, a stop or its limit)
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    target_forwards: int = 0  # the prefill counts as one: it yields the first token
    draft_forwards: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    # Latency, on the host's wall clock: the admission's prefill, the row's decoding, and admission start to
    # finish; from when the row was added to its batch: the wait for a slot and the first token.
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    wall_seconds: float = 0.0
    queue_seconds: float = 0.0
    first_token_seconds: float = 0.0
    kv_bytes: int = 0  # KV bytes the row held when it finished: what its last step read
    batch_size: int = 1  # rows live once it joined
    # a sidecar task's masked instruction in its main row's draft prefill, and its share of that prefill: what
    # sidecar mode adds to the main row's work, charged to the sidecar (0 elsewhere)
    instruction_tokens: int = 0
    instruction_device_seconds: float = 0.0
    attended_document: bool = False  # a sidecar task that kept its document in view

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    def charge_instruction(self, account: Account) -> None:
        """Take a sidecar task's instruction line from the ledger's account of its hidden span."""
        self.instruction_tokens = round(account.prefill_tokens)
        self.instruction_device_seconds = account.prefill_seconds

    def as_dict(self) -> dict:
        return asdict(self) | {"acceptance_rate": self.acceptance_rate,
                               "tokens_per_target_forward": self.tokens_per_target_forward}
