"""Enforcing constraints while decoding: one ``RowMatcher`` per constrained row, and the batch's token mask.

Each step, for the rows of a batch (``None``: unconstrained):

    bitmask = fill_bitmask(matchers)          # [B, W] int32 on the host, bit t of row b: token t allowed
    apply_bitmask(logits, bitmask)            # logits [B, V] (or [B, K, V] with bitmask [B, K, W]) in place
    ... choose tokens from the masked logits ...
    matcher.accept(token)                     # for each constrained row's chosen token

Speculative verification scores a row's pending position and its drafts in one forward; ``draft_masks``
gives the masks along the drafts ([K + 1, W], the state after 0..K drafts) and leaves the matcher where it
was, so that after acceptance the row accepts its committed tokens, and ``rollback(k)`` undoes tokens a
row took back. A row's end-of-sequence ids are allowed only where its output is complete; once nothing can
follow (``finished``) they are all it allows.

The mask is filled on the host (llguidance computes it there) and applied on the logits' device: on the CPU
by numpy's bit unpacking, elsewhere by shifts on the device, after a copy of the packed mask (V / 8 bytes a
row).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from sidecar.decoding.constraints import Constraint, TokenSpace

if TYPE_CHECKING:
    import llguidance


@functools.cache
def _executor() -> llguidance.LLExecutor:
    """Fills the masks of several rows on its own threads, without the GIL; made at the first constrained step
    (llguidance is imported only where a row is constrained: ``sidecar.decoding.constraints``). llguidance.torch
    wraps the same call, but importing it costs seconds (its apply kernel is compiled by torch.compile), and its
    kernel is not used here."""
    import llguidance

    return llguidance.LLExecutor()


class ConstraintViolation(RuntimeError):
    """A row was handed a token its constraint does not allow: its mask was not applied."""


class RowMatcher:
    """One row's place in its constraint: what may come next, what it has taken, and how to take it back."""

    def __init__(self, space: TokenSpace, constraint: Constraint) -> None:
        self.space = space
        self.constraint = constraint
        self._matcher = space.matcher(constraint)
        self.tokens: list[int] = []  # what it has accepted, end-of-sequence included
        # llguidance takes an end-of-sequence id after an output that nothing can extend without recording
        # it, so a rollback must not count it
        self._unrecorded_end = False

    @property
    def words(self) -> int:
        """Bitmask width: 32 token ids a word."""
        return bitmask_words(self.space.vocab_size)

    @property
    def complete(self) -> bool:
        """The output so far is a whole answer: an end-of-sequence id is allowed now."""
        return self._matcher.is_accepting()

    @property
    def finished(self) -> bool:
        """Nothing can follow but an end-of-sequence id (or one was accepted)."""
        return self._matcher.is_stopped()

    @property
    def ended(self) -> bool:
        """The row has accepted an end-of-sequence id: it takes nothing more (its mask allows only them)."""
        return bool(self.tokens) and self.tokens[-1] in self.space.eos_ids

    def fill(self, out: torch.Tensor) -> None:
        """Write the next-token mask into ``out`` [W] (int32, contiguous, on the host)."""
        _check_mask_row(out, self.words)
        self._matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * out.element_size())

    def accept(self, token: int) -> None:
        """Take the row's chosen ``token``; a token the mask did not allow is a ``ConstraintViolation`` and
        leaves the matcher as it was."""
        if self.ended:
            raise ConstraintViolation(f"token {token} after the row's end of sequence")
        if not self.allows(token):
            raise ConstraintViolation(f"token {token} is not allowed by the row's {self.constraint.kind} "
                                      f"after {len(self.tokens)} tokens")
        if token in self.space.eos_ids and self._matcher.is_stopped():
            self._unrecorded_end = True
            self.tokens.append(token)
            return
        if not self._matcher.consume_token(token):
            raise ConstraintViolation(f"token {token} broke the row's {self.constraint.kind}: "
                                      f"{self._matcher.get_error()}")
        self.tokens.append(token)

    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next (without computing the whole mask)."""
        if self.ended:
            return False
        if token in self.space.eos_ids:  # llguidance's token validation leaves end-of-sequence ids out
            return self._matcher.is_accepting() and not self._matcher.is_error()
        return self._matcher.validate_tokens([token]) == 1

    def rollback(self, count: int) -> None:
        """Undo the last ``count`` accepted tokens: the mask is then the one before them, exactly."""
        if not 0 <= count <= len(self.tokens):
            raise ValueError(f"cannot roll back {count} of {len(self.tokens)} accepted tokens")
        recorded = count - (1 if count and self._unrecorded_end else 0)
        if recorded and not self._matcher.rollback(recorded):
            raise ConstraintViolation(f"rolling back {count} tokens failed: {self._matcher.get_error()}")
        if count:
            self._unrecorded_end = False
        del self.tokens[len(self.tokens) - count :]

    def draft_masks(self, drafts: Sequence[int], out: torch.Tensor) -> int:
        """The masks for a verify over [pending, drafts]: ``out[j]`` [K + 1, W] is the mask after the first
        ``j`` drafts, and the matcher is left where it was. Drafts past the first one the constraint refuses
        cannot be accepted (that position's mask refuses it), so their masks repeat the last valid one.
        Returns how many drafts the constraint allows in a row."""
        if out.shape[0] != len(drafts) + 1:
            raise ValueError(f"draft_masks needs {len(drafts) + 1} mask rows, got {out.shape[0]}")
        taken = 0
        self.fill(out[0])
        for token in drafts:
            if not self.allows(token):
                break
            self.accept(token)
            taken += 1
            self.fill(out[taken])
        out[taken + 1 :] = out[taken]
        self.rollback(taken)
        return taken


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, W] int32 on the host, every token allowed (what an unconstrained row's mask is)."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def fill_bitmask(matchers: Sequence[RowMatcher | None], vocab_size: int) -> torch.Tensor | None:
    """The batch's next-token masks [B, W] (unconstrained rows allow everything); None when no row is
    constrained, so an unconstrained batch pays nothing."""
    rows = [(m, b) for b, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    for m, _ in rows:
        if m.space.vocab_size != vocab_size:
            raise ValueError(f"a row's token space has {m.space.vocab_size} ids, the logits {vocab_size}")
    bitmask = allocate_bitmask(len(matchers), vocab_size)
    if len(rows) == 1:
        m, b = rows[0]
        m.fill(bitmask[b])
    else:
        # each constrained row's mask lands in its own row of the batch's bitmask (W words of 4 bytes a row)
        _executor().unsafe_compute_mask_ptr([(m._matcher, b) for m, b in rows], bitmask.data_ptr(),
                                          bitmask.shape[1] * 4, bitmask.shape[0])
    return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of refused tokens to -inf, in place on the logits' device. ``logits`` [..., V] and
    ``bitmask`` [..., W] agree in their leading dims; logits past the bitmask's 32 * W ids (a vocabulary
    padded further than the space knew) are refused too."""
    if bitmask.dtype != torch.int32 or bitmask.shape[:-1] != logits.shape[:-1]:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} {bitmask.dtype} does not fit logits "
                         f"{tuple(logits.shape)}: want int32 with the same leading dims")
    allowed = unpack_bitmask(bitmask, logits.shape[-1], logits.device)
    logits.masked_fill_(~allowed, float("-inf"))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Bool [..., vocab_size] on ``device`` from the packed int32 [..., W] (bit t % 32 of word t // 32); ids
    past 32 * W are refused."""
    if device.type == "cpu":
        allowed = unpack_on_host(bitmask)
    else:
        allowed = unpack_with_shifts(bitmask.to(device, non_blocking=True))
    width = allowed.shape[-1]
    if width >= vocab_size:
        return allowed[..., :vocab_size]
    pad = torch.zeros((*allowed.shape[:-1], vocab_size - width), dtype=torch.bool, device=allowed.device)
    return torch.cat([allowed, pad], -1)


def unpack_on_host(bitmask: torch.Tensor) -> torch.Tensor:
    """Bool [..., 32 * W] by numpy's bit unpacking: a tenth of the shifts' time on a CPU. The words' bytes
    are read in the host's order, little-endian on every platform torch ships for."""
    bits = np.unpackbits(bitmask.cpu().contiguous().numpy().view(np.uint8), axis=-1, bitorder="little")
    return torch.from_numpy(bits).view(torch.bool)


def unpack_with_shifts(bitmask: torch.Tensor) -> torch.Tensor:
    """Bool [..., 32 * W] on the bitmask's device, by 32 shifts of each word (an accelerator's way)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask[..., None] >> shifts) & 1).bool().flatten(-2)


def _check_mask_row(out: torch.Tensor, words: int) -> None:
    if out.dtype != torch.int32 or out.device.type != "cpu" or not out.is_contiguous() or out.shape != (words,):
        raise ValueError(f"a mask row is int32 [{words}], contiguous on the host; got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
