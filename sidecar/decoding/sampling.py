"""Per-row sampling parameters, and the device tensors one step decodes a mixed batch with.

A batch mixes greedy and sampled rows with their own temperature, top_p and seed. ``RowSampling`` holds
them for the rows in slot order, uploaded once per step without waiting for the device, and decides
tokens: greedy rows by argmax, sampled rows by inverse-CDF sampling with their own counter-based
uniforms (``sidecar.decoding.randomness``) keyed by output position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from sidecar.decoding.acceptance import sample_with, warp
from sidecar.decoding.randomness import NEXT, uniforms
from sidecar.runtime.transfers import to_device

# Dividing float32 logits by a temperature near 1e-38 overflows to inf and sampling gets NaN; far above that,
# at 1e-5, logits 0.001 apart already differ by a factor of e^100, so lower temperatures are decoded greedily.
MIN_SAMPLING_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    @property
    def seeded(self) -> bool:
        """A sampled row with a seed: it must decode the same tokens whatever shares its batch."""
        return self.seed is not None and not self.greedy


class SampledRow(Protocol):
    """What a batch's live row (``sidecar.decoding.rows.LiveRow``) holds for its sampling."""

    sampling: Sampling
    draw_key: int
    tokens: list[int]


class RowSampling:
    """The live rows' sampling, slot by slot. ``positions[b]``: how many tokens row ``b`` has output, the
    index of the next token it commits; draws for later tokens of one step add their offset."""

    @classmethod
    def of(cls, rows: Sequence[SampledRow], device: torch.device) -> RowSampling:
        """The sampling of live ``rows`` in slot order, each at its next output position: the one way a batch
        builds it (an admission's first tokens, a step's draft forwards, its target forward)."""
        return cls([r.sampling for r in rows], [r.draw_key for r in rows], [len(r.tokens) for r in rows], device)

    def __init__(self, samplings: Sequence[Sampling], draw_keys: Sequence[int], positions: Sequence[int],
                 device: torch.device) -> None:
        self.greedy = [s.greedy for s in samplings]
        self.all_greedy = all(self.greedy)
        if self.all_greedy:
            return
        ints = np.array([list(draw_keys), list(positions), self.greedy], dtype=np.int64)
        floats = np.array([[1.0 if s.greedy else s.temperature for s in samplings],
                           [1.0 if s.greedy else s.top_p for s in samplings]], dtype=np.float32)
        ints_d, floats_d = to_device(ints, device), to_device(floats, device, torch.float32)
        self.keys, self.positions, self.greedy_mask = ints_d[0], ints_d[1], ints_d[2].bool()
        self.temperature, self.top_p = floats_d[0], floats_d[1]
        self.nucleus = any(s.top_p < 1 for s, g in zip(samplings, self.greedy, strict=True) if not g)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's warped distribution over ``logits`` [B, ..., V] (greedy rows: at temperature 1)."""
        return warp(logits, self.temperature, self.top_p if self.nucleus else 1.0)

    def draws(self, offsets: torch.Tensor, purpose: int) -> torch.Tensor:
        """Uniforms [B, k] for the tokens ``offsets`` [k] or [B, k] past each row's position."""
        positions = self.positions[:, None] + (offsets if offsets.dim() == 2 else offsets[None, :])
        return uniforms(self.keys, positions, purpose)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token [B] from logits [B, V] at each row's position: argmax or a draw from p."""
        choice = logits.argmax(-1)
        if self.all_greedy:
            return choice
        offsets = torch.zeros(1, dtype=torch.long, device=logits.device)
        drawn = sample_with(self.probs(logits), self.draws(offsets, NEXT)[:, 0])
        return torch.where(self.greedy_mask, choice, drawn)
