"""The device-time ledger: what every forward cost, charged to the rows it served.

The rule, defined here once: **a forward's measured device seconds are split among the rows in it in
proportion to the tokens each row had in it.** A row's tokens in a forward are the real tokens it fed
there: its prompt (or the part of it in that forward) in a prefill, its pending token and drafts in a
verify, its feed in a draft forward (backlog and pending token, a catch-up, a bridge, or the one token it
decodes). A prompt prefix computed once and copied to the other rows of its group counts as theirs too, in
equal shares. Padding belongs to no row, so its cost is shared in the same proportion. One row may charge its
tokens to several accounts: a main row's draft prefill charges its hidden sidecar instructions to those
sidecars. Per forward, then, the charged seconds sum to the measured seconds, and over a batch to the
batch's measured forward time: the invariant ``tests/test_ledger.py`` checks, with a forward hook as the
independent count.

A charge says what the row was doing: ``prefill`` (feeding tokens it does not decode: a prompt, a
catch-up, a bridge) or ``decode`` (writing output), whatever the forward it rode in.

Seconds are device time: on a GPU, CUDA events around the forward, read after the step's one sync; on a
CPU, the clock around it (``sidecar.runtime.timing.DeviceTimer``). Host work between forwards is no
row's: it is the difference between a batch's wall time and the ledger's total.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from sidecar.runtime.timing import DeviceTimer

Kind = Literal["prefill", "decode"]
Model = Literal["target", "draft"]


@dataclass
class Account:
    """Device time charged to one row in one phase: tokens in, forwards, and seconds, for prefill and decode."""

    prefill_tokens: float = 0.0
    prefill_forwards: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: float = 0.0
    decode_forwards: int = 0
    decode_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    def charge(self, kind: Kind, tokens: float, seconds: float) -> None:
        if kind == "prefill":
            self.prefill_tokens += tokens
            self.prefill_forwards += 1
            self.prefill_seconds += seconds
        else:
            self.decode_tokens += tokens
            self.decode_forwards += 1
            self.decode_seconds += seconds

    def add(self, other: Account) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class DeviceCost:
    """A row's account as its output's stats carry it (token counts rounded: a shared feed splits them)."""

    prefill_tokens: int = 0
    prefill_forwards: int = 0
    prefill_device_seconds: float = 0.0
    decode_tokens: int = 0
    decode_forwards: int = 0
    decode_device_seconds: float = 0.0

    def take(self, account: Account) -> None:
        """Copy the ledger's account of the row in."""
        self.prefill_tokens = round(account.prefill_tokens)
        self.prefill_forwards = account.prefill_forwards
        self.prefill_device_seconds = account.prefill_seconds
        self.decode_tokens = round(account.decode_tokens)
        self.decode_forwards = account.decode_forwards
        self.decode_device_seconds = account.decode_seconds

    def cost(self) -> dict[str, int | float]:
        """The cost fields alone, to carry them into another ``DeviceCost``."""
        return {name: getattr(self, name) for name in DeviceCost.__dataclass_fields__}


@dataclass(frozen=True)
class Charge:
    """``tokens`` a row had in a forward, charged to ``account`` as ``kind`` work; ``label`` names the
    account's phase for the forward's record (``main``, ``sidecar``, ``instruction``, ``standalone``)."""

    account: Account
    kind: Kind
    tokens: float
    label: str


@dataclass(frozen=True)
class ForwardRecord:
    """One timed forward, as the roofline replays it (``study.cost.replay``)."""

    model: Model
    kind: Kind  # prefill: a prompt-feeding forward; decode: a step's verify, plain or draft forward
    rows: int
    padded_tokens: int  # rows x query width
    context: int  # KV columns the rows attend to after the forward, summed over rows
    tokens: dict[str, float]  # real tokens by the label of the accounts they were charged to
    seconds: float
    step: int | None = None  # the decode step it ran in (``Ledger.begin_step``); None: a prefill, or not known


class Ledger:
    """Times forwards and charges their seconds to accounts by the rule above.

    ``records`` keeps the latest ``keep`` forwards (all with ``keep=None``) for replay and occupancy, so a
    long-lived server's ledger stays the same size; the totals cover every forward.
    """

    def __init__(self, timer: DeviceTimer, keep: int | None = 4096) -> None:
        self.timer = timer
        self.records: deque[ForwardRecord] = deque(maxlen=keep)
        self.forwards = 0
        self.measured_seconds = 0.0
        self.charged_seconds = 0.0
        self.charged_by_label: dict[str, float] = {}  # seconds charged per account label, over every forward
        self.steps = 0  # decode steps begun: a decode forward's record names the step it ran in

    def begin_step(self) -> None:
        """A decode step begins: its forwards' records share its number, so a replay can price the host work
        around a step once (``study.cost.replay``)."""
        self.steps += 1

    @contextmanager
    def forward(self, model: Model, kind: Kind, rows: int, charges: Sequence[Charge], padded_tokens: int,
                context: int, also: Callable[[float], None] | None = None, forwards: int = 1) -> Iterator[None]:
        """Time the forward over ``rows`` rows queued inside and charge its seconds to ``charges``; ``also``
        hears the seconds too (the step controller's cost fit). On a GPU the charge lands at ``collect``.

        ``forwards`` > 1: what runs inside is that many forwards alike, one after another, in one call (a
        chain of draft forwards, ``sidecar.decoding.draft_chain``), which no clock can split: each is charged
        an equal share, as ``charges`` and ``padded_tokens`` say for one of them, its context the one before's
        plus the tokens it wrote."""
        charges = list(charges)
        tokens = sum(c.tokens for c in charges)  # one forward's: each of a chain's writes as many
        step = self.steps if kind == "decode" and self.steps else None  # now: on a GPU it settles after the step

        def settle_all(seconds: float) -> None:
            for k in range(forwards):
                settle(seconds / forwards, context + k * round(tokens))

        def settle(seconds: float, context: int = context) -> None:
            for c in charges:
                share = seconds * c.tokens / tokens if tokens else seconds / len(charges)
                c.account.charge(c.kind, c.tokens, share)
                self.charged_seconds += share
                self.charged_by_label[c.label] = self.charged_by_label.get(c.label, 0.0) + share
            self.forwards += 1
            self.measured_seconds += seconds
            by_label: dict[str, float] = {}
            for c in charges:
                by_label[c.label] = by_label.get(c.label, 0.0) + c.tokens
            self.records.append(ForwardRecord(model, kind, rows, padded_tokens, context, by_label, seconds, step))
            if also is not None:
                also(seconds)

        with self.timer(settle if forwards == 1 else settle_all):
            yield

    def totals(self) -> dict[str, object]:
        """What the ledger has measured and charged so far (the server's ``/stats``)."""
        return {"forwards": self.forwards, "measured_seconds": self.measured_seconds,
                "charged_seconds": self.charged_seconds, "charged_seconds_by_phase": dict(self.charged_by_label)}

    def collect(self, wait: bool = False) -> None:
        """Charge the forwards whose timing has arrived (all of them with ``wait``: see ``DeviceTimer``)."""
        self.timer.collect(wait)
