"""Counter-based random numbers: every draw of a sampled row is a pure function of (draw key, output
position, purpose).

A row's draws therefore never depend on which rows share its batch, when it joined, or how many draws
other rows made: a seeded row decodes the same tokens alone or in any batch. Purposes keep the draws of
one position apart (the draft's token, the acceptance test, the target's token). The mix is splitmix64's
finaliser over int64 tensors, whose multiplications wrap on every torch device.
"""

from __future__ import annotations

import secrets

import torch

DRAFT, ACCEPT, NEXT = 1, 2, 3


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)
_POSITION = _signed(0xD1B54A32D192ED03)
_PURPOSE = _signed(0x8CB92BA72F3D8DD7)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical shift of int64 values (torch shifts arithmetically)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    x = x * _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def uniforms(draw_keys: torch.Tensor, positions: torch.Tensor, purpose: int) -> torch.Tensor:
    """Uniforms in [0, 1) of shape ``positions`` [B, k] (float64) for rows with ``draw_keys`` [B] (int64)."""
    x = mix(draw_keys[:, None] + positions * _POSITION + _signed(purpose * _PURPOSE % (1 << 64)))
    return _shift_right(x, 11).double() * (2.0**-53)


# seeds are taken modulo 2^63, the range of the int64 the mix runs on
SEED_MASK = (1 << 63) - 1


def nth_seed(seed: int | None, i: int) -> int | None:
    """The seed of row ``i`` of a call seeded ``seed``: ``seed + i``, so that a seeded call's rows draw apart."""
    return None if seed is None else (seed + i) & SEED_MASK


def draw_key(seed: int | None, stream: int = 0) -> int:
    """The key of one row's draws: from its seed (and a stream number, so that a request's sidecar
    outputs draw apart from its main output), or fresh from the OS when it has no seed."""
    if seed is None:
        return secrets.randbits(62)
    base = mix(torch.tensor([seed & SEED_MASK], dtype=torch.long))
    return int(mix(base + stream)[0])
