"""Draft logits over the target's vocabulary: the two models of a pair may have different embedding sizes."""

from __future__ import annotations

import torch


def align_vocab(draft_logits: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """Draft logits [..., V_draft] over the target's vocabulary [..., V]: ids the draft lacks get probability 0,
    ids the target lacks are cut, so that a draft token is always one the target can score."""
    extra = target_vocab - draft_logits.shape[-1]
    if extra > 0:
        return torch.nn.functional.pad(draft_logits, (0, extra), value=float("-inf"))
    return draft_logits[..., :target_vocab]
