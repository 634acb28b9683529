"""Plain records passed between the flows, the Parquet reader and :class:`storage.Database`.

They carry no engine types, so ``storage`` never imports torch; the constructors ``main_phase`` and
``sidecar_phase`` read the engine's record of a row's counters by attribute (``RowCounters``). Their fields
are the columns of the tables that store them; ``storage.tables`` derives the Arrow schemas from the
annotations.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from vocab.modes import MODES, Mode
from vocab.numbers import finite, logprob

# A request's stats are stored per phase: the speculative main task, then the draft-only sidecar task.
Phase = Literal["main", "sidecar"]
# storage.parquet gives the first five; "over_context" is for the flows, after the engine's token count
RejectReason = Literal["empty", "null", "duplicate_id", "not_utf8", "too_long", "over_context"]
RunStatus = Literal["running", "completed", "failed"]
CostSource = Literal["measured", "projected"]
# what a cost line's tokens/s divides by: the device seconds the engine's ledger attributed, or the roofline's
CostTiming = Literal["device_ledger", "roofline"]
# main: sidecar against standalone tags; control: a document's own tags against another's; hard: against its
# own with about half replaced by another's; null: a tag set against itself in reversed order (the
# migrations hold the same lists as CHECK constraints)
GameKind = Literal["main", "control", "hard", "null"]
# how a judge's verdicts are read: the pairwise method's letters (probability) or JSON (text), or the
# likelihood method's scores
JudgeMode = Literal["probability", "text", "likelihood"]
# One launch of one shard of a run (``shard_attempts``): running until the parent sees it end.
AttemptStatus = Literal["running", "completed", "failed", "crashed", "cancelled"]


@dataclass(frozen=True)
class Document:
    """One usable input document; ``row_index`` is its row in the input file. ``doc_id`` keys the
    document's outputs, so it is never empty or whitespace and unique among a run's usable documents
    (``storage.parquet`` rejects other rows, ``Database`` refuses to store them)."""

    doc_id: str
    text: str
    row_index: int
    title: str | None = None


@dataclass(frozen=True)
class RejectedDocument:
    """An input row that will not be run, with why. ``doc_id`` is None when the id was null: the row is
    known by ``row_index``, and no made-up id can collide with a real one."""

    doc_id: str | None
    reason: RejectReason
    row_index: int
    detail: str = ""
    title: str | None = None
    text: str | None = None


class RowCounters(Protocol):
    """A row's counters as the engine keeps them (``sidecar.decoding.stats.GenerationStats``, one record for main
    and sidecar rows), read here by attribute without importing the engine."""

    new_tokens: int
    prompt_tokens: int
    drafted: int
    accepted: int
    target_forwards: int
    draft_forwards: int
    prefill_seconds: float
    decode_seconds: float
    wall_seconds: float
    queue_seconds: float
    first_token_seconds: float
    kv_bytes: int
    batch_size: int
    prefill_tokens: int
    prefill_forwards: int
    prefill_device_seconds: float
    decode_tokens: int
    decode_forwards: int
    decode_device_seconds: float
    instruction_tokens: int
    instruction_device_seconds: float


@dataclass(frozen=True)
class RequestStats:
    """Counters of one phase of one request: its cost ledger and its latency, apart.

    Cost: the engine's device-time ledger (``sidecar/runtime/ledger.py``) times every forward on the device
    and splits its seconds among the rows it served in proportion to their tokens in it. ``prefill_*`` and
    ``decode_*`` are this row's tokens in prefill and decode forwards, how many forwards it was in, and the
    device seconds attributed to it from them; ``instruction_*`` (sidecar phase only) are the task's masked
    instruction tokens in the main row's draft prefill and their share of it: what sidecar mode adds to
    the main phase, charged to the sidecar (0 for a standalone tagger). All None for a row written by an
    engine without the ledger, never a made-up 0.

    Latency, wall clock: ``queue_s`` from the row's arrival in its batch until its admission began,
    ``first_token_s`` until its first token was committed, ``prefill_s``/``decode_s``/``wall_s`` the
    batch's clock up to this row's end (shared by the rows of a batch; ``batch_id`` in
    :class:`OutputRecord` tells which rows ran together). ``ended_s`` places the phase on its batch's
    clock: seconds from the start of the engine stream or call the request ran in until this phase was
    done; None for a batch whose rows all started with it. None of the wall-clock fields is a cost."""

    phase: Phase
    new_tokens: int
    drafted: int = 0
    accepted: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    prompt_tokens: int | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    wall_s: float | None = None
    # BIGINT in SQL: one request's KV cache can pass the 2 GiB an int32 counts
    kv_bytes: int | None = field(default=None, metadata={"arrow_type": "int64"})
    batch_size: int | None = None
    ended_s: float | None = None
    prefill_tokens: int | None = None
    prefill_forwards: int | None = None
    prefill_device_s: float | None = None
    decode_tokens: int | None = None
    decode_forwards: int | None = None
    decode_device_s: float | None = None
    instruction_tokens: int | None = None
    instruction_device_s: float | None = None
    queue_s: float | None = None
    first_token_s: float | None = None

    @classmethod
    def main_phase(cls, stats: RowCounters) -> RequestStats:
        """From the engine's record of the target-exact main output."""
        return cls(
            phase="main",
            new_tokens=stats.new_tokens,
            drafted=stats.drafted,
            accepted=stats.accepted,
            target_forwards=stats.target_forwards,
            draft_forwards=stats.draft_forwards,
            prompt_tokens=stats.prompt_tokens,
            prefill_s=stats.prefill_seconds,
            decode_s=stats.decode_seconds,
            wall_s=stats.wall_seconds,
            batch_size=stats.batch_size,
            **_ledger(stats),
        )

    @classmethod
    def sidecar_phase(cls, stats: RowCounters) -> RequestStats:
        """From the engine's record of a sidecar task's (or a standalone tagger's) output: the draft model alone,
        one forward per new token. The tokens fed before decoding (the ledger's ``prefill_tokens``) count as
        the prompt."""
        return cls(
            phase="sidecar",
            new_tokens=stats.new_tokens,
            draft_forwards=stats.draft_forwards,
            prompt_tokens=stats.prefill_tokens,
            prefill_s=stats.prefill_seconds,
            decode_s=stats.decode_seconds,
            wall_s=stats.wall_seconds,
            kv_bytes=stats.kv_bytes,
            batch_size=stats.batch_size,
            **_ledger(stats),
            instruction_tokens=stats.instruction_tokens,
            instruction_device_s=stats.instruction_device_seconds,
        )

    @classmethod
    def together(cls, parts: Sequence[RequestStats]) -> RequestStats:
        """One phase's stats of several outputs of one request (its sidecar tasks) as one row: counts, bytes and
        device seconds add up; the batch clock's fields (``*_s`` but ``queue_s``/``first_token_s``, which take
        the earliest) and ``batch_size`` take the latest or largest. A count some part lacks stays None. One
        part comes back unchanged."""
        if not parts:
            raise ValueError("together needs at least one RequestStats")
        phases = {p.phase for p in parts}
        if len(phases) != 1:
            raise ValueError(f"together joins stats of one phase, got {sorted(phases)}")
        if len(parts) == 1:
            return parts[0]
        merged: dict[str, Any] = {"phase": parts[0].phase}
        for name in cls.__dataclass_fields__:
            if name == "phase":
                continue
            values = [getattr(p, name) for p in parts]
            if any(v is None for v in values):
                merged[name] = None
            elif name in _LATEST:
                merged[name] = max(values)
            elif name in _EARLIEST:
                merged[name] = min(values)
            else:
                merged[name] = sum(values)
        return cls(**merged)


# RequestStats fields that are moments or sizes of the shared batch, not amounts: joined by max or min
_LATEST = frozenset({"prefill_s", "decode_s", "wall_s", "batch_size", "ended_s"})
_EARLIEST = frozenset({"queue_s", "first_token_s"})


def _ledger(stats: RowCounters) -> dict[str, Any]:
    """The ledger's and the latency's fields both phases share."""
    return {
        "prefill_tokens": stats.prefill_tokens,
        "prefill_forwards": stats.prefill_forwards,
        "prefill_device_s": stats.prefill_device_seconds,
        "decode_tokens": stats.decode_tokens,
        "decode_forwards": stats.decode_forwards,
        "decode_device_s": stats.decode_device_seconds,
        "queue_s": stats.queue_seconds,
        "first_token_s": stats.first_token_seconds,
    }


@dataclass(frozen=True)
class SidecarRecord:
    """One sidecar task's output for one document in one mode (``sidecar_outputs``).

    ``parsed`` is the task parser's value as JSON text (a list of tags, a string), None when the text could not
    be parsed (``parse_error`` says why); ``text`` is kept either way. ``new_tokens`` and ``device_s`` are this
    task's own tokens and its share of the device-time ledger (its prefill, decode and masked instruction
    seconds; None from an engine without the ledger); the request's sidecar phase in ``request_stats`` holds
    all its tasks together."""

    task: str
    text: str
    parsed: str | None = field(metadata={"arrow_type": "json"})
    parse_error: str | None = None
    finish_reason: str | None = None
    new_tokens: int | None = None
    device_s: float | None = None

    @classmethod
    def of(cls, task: str, text: str, value: Any, **fields: Any) -> SidecarRecord:
        """A task's output with its parsed ``value`` (None: not parsed) encoded as JSON."""
        return cls(task, text, None if value is None else json.dumps(value), **fields)

    def value(self) -> Any:
        """``parsed`` decoded (None when it could not be parsed)."""
        return None if self.parsed is None else json.loads(self.parsed)


@dataclass(frozen=True)
class OutputRecord:
    """Everything stored for one document in one mode; written together by ``Database.write_batch``.

    ``summary`` is the main output for the sidecar modes and the summary given to the tagger in
    ``standalone`` mode (``main_tokens`` then None); ``sidecars`` holds one output per sidecar task, all
    decoded from that one main output.
    """

    doc_id: str
    mode: Mode
    summary: str
    sidecars: list[SidecarRecord]
    main_tokens: int | None = None
    finish_reason: str | None = None
    batch_id: int | None = None
    stats: list[RequestStats] = field(default_factory=list)


def check_outputs(rows: Sequence[OutputRecord], writer: str) -> None:
    """Refuse what one write cannot hold: two rows for one (doc_id, mode), an unknown mode, two stats rows for
    one phase of a request, two outputs of one task in a request. ``writer`` names the write in the message."""
    keys = [(r.doc_id, r.mode) for r in rows]
    if len(set(keys)) != len(keys):
        raise ValueError(f"{writer} got two rows for the same (doc_id, mode)")
    for record in rows:
        if record.mode not in MODES:
            raise ValueError(f"unknown mode {record.mode!r}; modes are {MODES}")
        phases = [s.phase for s in record.stats]
        if len(set(phases)) != len(phases):
            raise ValueError(f"{record.doc_id!r}/{record.mode}: two stats rows for one phase {phases}")
        tasks = [s.task for s in record.sidecars]
        if len(set(tasks)) != len(tasks):
            raise ValueError(f"{record.doc_id!r}/{record.mode}: two outputs of one sidecar task {tasks}")


@dataclass(frozen=True)
class RanOn:
    """Where the requests of a run's own writes ran: stored on each ``request_stats`` row they write, so that
    the ``throughput`` view reports every row under its own GPU type, also when a run is resumed on another
    device, or in-process after shards (whose parts carry the same columns, ``storage.parts.ShardInfo``)."""

    host: str
    device: str | None  # e.g. "cuda:0", "cpu"
    gpu_type: str | None  # ``ModelPair.gpu_type``, e.g. "NVIDIA H100 80GB HBM3"

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("a request needs the host it ran on")


@dataclass(frozen=True)
class JudgementRecord:
    """One game of a pairwise judgement: the judge saw ``mode_a``'s tags first, then ``mode_b``'s.

    Game 2 swaps the positions of game 1. ``winner`` is the winning side, ``"tie"``, or None when the answer could
    not be parsed or the call failed (``error``). In a ``control`` game the sides are ``own`` and ``other`` (the
    sidecar tags of ``foil_doc_id``), in a ``hard`` game ``own`` and ``mixed`` (about half of them replaced by
    ``foil_doc_id``'s), in a ``null`` game ``original`` and ``reversed``. ``p_a`` and ``p_b`` are the probabilities
    of answering A and B (probability mode only)."""

    doc_id: str
    judge_model: str
    prompt_version: str
    game: Literal[1, 2]
    mode_a: str
    mode_b: str
    raw_answer: str | None
    winner: str | None
    error: str | None = None
    kind: GameKind = "main"
    p_a: float | None = None
    p_b: float | None = None
    foil_doc_id: str | None = None
    # the sidecar task whose outputs the game compares (storage/migrations/013_judge_tasks.sql)
    task: str = "hashtags"

    def __post_init__(self) -> None:
        # a NaN or infinite probability would poison the views' means: refused before it is stored
        for name in ("p_a", "p_b"):
            if (value := getattr(self, name)) is not None:
                finite(f"{name} of {self.doc_id!r} game {self.game}", value, 0.0, 1.0)


@dataclass(frozen=True)
class JudgementScoreRecord:
    """One output of a document's ``task`` scored by the likelihood method (a tag set for hashtags; ``tags``
    holds any other output as its one element): the mean log probability of its tokens
    after the scorer prompt ``prompt_version`` with the document's summary (``given_own``) and with
    ``baseline_doc_id``'s (``given_baseline``), by ``judge_model``; their difference is the set's PMI.
    ``side`` is the kind's subject or other side, as a game's sides are named (``foil_doc_id`` as there)."""

    doc_id: str
    judge_model: str
    prompt_version: str
    kind: GameKind
    side: str
    tags: list[str]
    baseline_doc_id: str
    given_own: float | None = None
    given_baseline: float | None = None
    tokens: int | None = None
    error: str | None = None
    foil_doc_id: str | None = None
    task: str = "hashtags"

    def __post_init__(self) -> None:
        # an infinite mean log probability makes the PMI NaN in the views: refused before it is stored
        for name in ("given_own", "given_baseline"):
            if (value := getattr(self, name)) is not None:
                logprob(f"{name} of {self.doc_id!r} {self.kind} {self.side}", value)


@dataclass(frozen=True)
class JudgeSettingsRecord:
    """What a judge flow reads its run's verdicts with: the ``mode``, the share of controls ``threshold``
    below which they are unreliable, the least calibrated margin (NULL in the text mode), and a ``note``:
    why the mode is what it is, or why the method gave no scores (an endpoint without log probabilities)."""

    judge_model: str
    prompt_version: str
    mode: JudgeMode
    threshold: float
    margin_floor: float | None = None
    note: str | None = None
    task: str = "hashtags"


@dataclass(frozen=True)
class JudgeTaskRecord:
    """What a judge flow found a run's sidecar task to be: the ``instruction`` it asked about (None: tag lists,
    judged by the hashtag prompts), and for a task it cannot score, why (``not_judged``; None when judged)."""

    task: str
    instruction: str | None = None
    not_judged: str | None = None


@dataclass(frozen=True)
class CostRecord:
    """One line of the cost report: a throughput and what a million generated tokens cost. ``timed_by`` says
    what the throughput divides by (``costs`` shows no rate for a measured line without it: one stored
    before the ledger, from wall time)."""

    gpu_type: str
    mode: str
    batch_size: int
    tokens_per_s: float
    source: CostSource
    pair: str = ""
    ms_per_step: float | None = None
    usd_per_gpu_hour: float | None = None
    usd_per_mtok: float | None = None
    run_id: str | None = None
    note: str | None = None
    timed_by: CostTiming | None = None
