"""What the sidecar engine takes and gives: a request with its sidecar tasks, and each output with its stats."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from sidecar.decoding.logprobs import TokenLogprob
from sidecar.decoding.rows import GenerationOutput
from sidecar.decoding.sampling import Sampling
from sidecar.runtime.kv_cache import RowSnapshot
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


@dataclass
class SidecarStats:
    new_tokens: int = 0
    context_tokens: int = 0  # KV columns the row attends to when its decoding starts
    feed_tokens: int = 0  # tokens fed before decoding: catch-up + bridge (sidecar) or whole prompt (standalone)
    feed_seconds: float = 0.0
    decode_seconds: float = 0.0
    seconds: float = 0.0
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
    parsed: list[str] | str | None
    parse_error: str | None
    finish_reason: str
    stats: SidecarStats
    logprobs: list[TokenLogprob] | None = None  # the draft's, one per token id, when asked for


@dataclass
class DocumentResult:
    main: GenerationOutput
    sidecars: dict[str, SidecarOutput]


@dataclass
class SidecarRow:
    """A (request, task) row waiting to join the sidecar batch: its snapshot of the draft's cache."""

    request: int
    task: SidecarTask
    task_number: int  # the task's place in its request: its draws' stream
    sampling: Sampling
    top_logprobs: int | None
    snapshot: RowSnapshot
    catch_up: list[int]  # main-output tokens the draft cache lacks, fed as while drafting
    document: range  # snapshot columns of the document and of the task's instruction
    instruction: range
    bridge: list[int]
