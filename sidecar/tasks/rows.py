"""What the sidecar engine takes and gives: a request with its sidecar tasks, and each output with its stats."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from sidecar.decoding.constraints import Constraint
from sidecar.decoding.logprobs import TokenLogprob
from sidecar.decoding.rows import GenerationOutput
from sidecar.decoding.sampling import Sampling
from sidecar.runtime.ledger import DeviceCost
from sidecar.tasks.prompts import DEFAULT_SYSTEM, SUMMARIZE_INSTRUCTION
from sidecar.tasks.task import SidecarTask


@dataclass
class SidecarRequest:
    """One document and its tasks. The decoding fields are per request (None: the call's or the default):
    ``sampling`` for the main output, ``sidecar_sampling`` for the sidecar outputs (default: ``sampling``)."""

    document: str
    instruction: str = SUMMARIZE_INSTRUCTION
    system: str | None = DEFAULT_SYSTEM
    sidecars: list[SidecarTask] = field(default_factory=list)
    max_new_tokens: int | None = None
    sampling: Sampling | None = None
    sidecar_sampling: Sampling | None = None
    stop: list[str] | None = None
    top_logprobs: int | None = None
    # a chat's turns before the document (the last user message), after the system message: (role, content)
    history: list[tuple[str, str]] = field(default_factory=list)
    # what the main output must be (a server request's response_format or guided_*; docs/constraints.md)
    constraint: Constraint | None = None


@dataclass
class SidecarStats(DeviceCost):
    """One sidecar (or standalone) output's counters. Latency on the host's wall clock; cost from the device-time
    ledger (``sidecar.runtime.ledger``): a sidecar's prefill is its share of its main row's catch-up feed and
    its own bridge, and ``instruction_*`` is its masked instruction's share of the main row's draft prefill:
    what sidecar mode adds to the main output's work, charged to the sidecar."""

    new_tokens: int = 0
    context_tokens: int = 0  # tokens the row attends to when it writes its first token (its usage's prompt)
    feed_tokens: int = 0  # tokens fed before decoding: its catch-up share and bridge, or a whole prompt
    draft_forwards: int = 0
    feed_seconds: float = 0.0
    decode_seconds: float = 0.0
    seconds: float = 0.0
    queue_seconds: float = 0.0
    first_token_seconds: float = 0.0
    instruction_tokens: int = 0
    instruction_device_seconds: float = 0.0
    kv_bytes: int = 0
    attended_document: bool = False
    batch_size: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class SidecarOutput:
    name: str
    text: str
    token_ids: list[int]
    # SidecarTask.parse's value: hashtags, text, a choice, a regex match, or any JSON value (a JSON schema task)
    parsed: Any
    parse_error: str | None
    finish_reason: str
    stats: SidecarStats
    logprobs: list[TokenLogprob] | None = None  # the draft's, one per token id, when asked for


@dataclass
class DocumentResult:
    main: GenerationOutput
    sidecars: dict[str, SidecarOutput]
