"""What the sidecar engine takes and gives: a request with its sidecar tasks, and each output with its stats."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sidecar.decoding.constraints import Constraint
from sidecar.decoding.logprobs import TokenLogprob
from sidecar.decoding.rows import GenerationOutput
from sidecar.decoding.sampling import Sampling
from sidecar.decoding.stats import GenerationStats
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


# a sidecar output's counters are the row's own record (``sidecar.decoding.stats``); the public name stays
SidecarStats = GenerationStats


@dataclass
class SidecarOutput:
    name: str
    text: str
    token_ids: list[int]
    # SidecarTask.parse's value: hashtags, text, a choice, a regex match, or any JSON value (a JSON schema task)
    parsed: Any
    parse_error: str | None
    finish_reason: str
    stats: GenerationStats  # the draft-only row's, with its instruction line (``GenerationStats``)
    logprobs: list[TokenLogprob] | None = None  # the draft's, one per token id, when asked for


@dataclass
class DocumentResult:
    main: GenerationOutput
    sidecars: dict[str, SidecarOutput]
