"""Speculative decoding against plain decoding of the target, per capture mode: does drafting pay on a GPU?

A speculative step at fixed ``gamma`` runs ``gamma`` one-token draft forwards and one verify forward of the
target over ``gamma + 1`` tokens per row (logits at each); at acceptance ``a`` (accepted / drafted, as the
engine measures it) it yields ``1 + a x gamma`` tokens per row: the accepted drafts and the target's own
token. Plain decoding runs one one-token target forward per token. Each forward is priced by the roofline
plus the capture mode's host floor (``host_floor``: a speculative step's forwards each pay a share of its host
work around them, a plain step's forward the plain step's), so

    speculative s per token = (gamma x draft forward + verify forward) / (1 + a x gamma)
    plain s per token       = target forward
    speedup                 = plain / speculative     (below 1: speculation is slower than plain decoding)

With 28-layer models in eager mode the floor is paid ``gamma + 1`` times per step against once per plain
token, so a draft forward costs about what a target forward does and speculation can lose (issue #40). Read as
overlapping the device (``HostFloor.overlapping``), a target forward's bytes hide its floor while a draft forward's
cannot, which costs speculation more than the serial reading does.
"""

from __future__ import annotations

from dataclasses import dataclass

from study.cost.errors import CostInputError
from study.cost.facts import ModelFacts
from study.cost.host_floor import HostFloor
from study.cost.roofline import Device, decode_step_seconds, forward_seconds
from study.cost.workload import STUDY_TOKENS

DEFAULT_GAMMA = 4  # the benchmark's fixed-gamma step
# The target's context while it decodes the summary, with the study's counts: system, document and
# instruction, and half the summary.
STUDY_CONTEXT = STUDY_TOKENS.system + STUDY_TOKENS.document + STUDY_TOKENS.instruction + STUDY_TOKENS.summary / 2


@dataclass(frozen=True)
class SpeculationRow:
    """Seconds per generated token of each row, speculative and plain, in one capture mode at one batch."""

    capture: str
    batch: int
    gamma: int
    acceptance: float
    speculative_s_per_token: float
    plain_s_per_token: float
    floor_measured: bool  # False: the mode's floor is unmeasured (0), the times are lower bounds
    overlapped: bool = False  # a forward's own host cost read as overlapping its device time (``HostFloor``)

    @property
    def reading(self) -> str:
        """The capture mode and, where overlapped, that reading: how tables name the row."""
        return self.capture + (" overlapped" if self.overlapped else "")

    @property
    def speedup(self) -> float:
        return self.plain_s_per_token / self.speculative_s_per_token

    @property
    def slower(self) -> bool:
        return self.speedup < 1

    @property
    def speedup_text(self) -> str:
        """'1.42x'; with a third or fourth decimal where two would round a slower row up to '1.00x'."""
        for digits in (2, 3, 4):
            text = f"{self.speedup:.{digits}f}"
            if not self.slower or float(text) < 1:
                break
        return text + "x"


def speculation_vs_plain(target: ModelFacts, draft: ModelFacts, device: Device, batch: int, context: float,
                         acceptance: float, host: HostFloor, gamma: int = DEFAULT_GAMMA) -> SpeculationRow:
    """Both decodings of ``batch`` rows holding ``context`` entries each, on ``device`` in ``host``'s mode."""
    if not 0 <= acceptance <= 1:
        raise CostInputError(f"acceptance must be between 0 and 1, got {acceptance}")
    if gamma < 1:
        raise CostInputError(f"gamma must be at least 1, got {gamma}")
    drafts = sum(forward_seconds(draft, device, batch, 1, context + i, host=host) for i in range(gamma))
    verify = forward_seconds(target, device, batch, gamma + 1, context, logits=gamma + 1, host=host)
    plain = decode_step_seconds(target, device, batch, context, host)
    return SpeculationRow(host.capture, batch, gamma, acceptance, (drafts + verify) / (1 + acceptance * gamma),
                          plain, host.measured, host.overlapped)
