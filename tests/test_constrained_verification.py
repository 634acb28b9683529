"""The step's verify hook (docs/constraints.md, ``StepRunner._verify``) run by hand on the tiny pair:
speculative greedy decoding with masks along the drafts (``RowMatcher.draft_masks``) and rollback of masked
proposals gives exactly the constrained target-only output, and that output parses."""

from __future__ import annotations

import pytest
import torch
from decoding import constrained_greedy, last_logits

from sidecar.decoding.acceptance import accept_greedy
from sidecar.decoding.constraints import token_space
from sidecar.decoding.matcher import RowMatcher, allocate_bitmask, apply_bitmask, fill_bitmask
from sidecar.tasks.task import SidecarTask

TASKS = [
    SidecarTask(name="topic", instruction="x", choices=["politics", "sport", "sports", "science and tech"]),
    SidecarTask(name="tags", instruction="x", regex=r"#[a-z]{2,8}( #[a-z]{2,8}){1,3}"),
    SidecarTask(name="entities", instruction="x", json_schema={
        "type": "object",
        "properties": {"names": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 8}},
                       "year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
        "required": ["names", "year"], "additionalProperties": False}),
]
LIMIT = 80


def speculative(pair, space, task, prompt: list[int], gamma: int, mask_drafts: bool) -> list[int]:
    matcher, out = RowMatcher(space, task.constraint), []
    while len(out) < LIMIT and not (out and out[-1] in space.eos_ids):
        drafts: list[int] = []
        while len(drafts) < gamma and not (drafts and drafts[-1] in space.eos_ids):
            logits = last_logits(pair.draft, prompt + out + drafts, 1, space.vocab_size)
            if mask_drafts:  # the draft proposes within the constraint: the matcher goes ahead, then back
                apply_bitmask(logits, fill_bitmask([matcher], space.vocab_size))
            drafts.append(int(logits.argmax(-1)))
            if mask_drafts:
                matcher.accept(drafts[-1])
        if mask_drafts:
            matcher.rollback(len(drafts))
        logits = last_logits(pair.target, prompt + out + drafts, len(drafts) + 1, space.vocab_size)
        masks = allocate_bitmask(len(drafts) + 1, space.vocab_size)
        before = list(matcher.tokens)
        matcher.draft_masks(drafts, masks)
        assert matcher.tokens == before
        apply_bitmask(logits, masks)
        accepted, following = accept_greedy(torch.tensor([drafts]), logits[None], None)
        committed = [*drafts[: int(accepted[0])], int(following[0])]
        for token in committed[: LIMIT - len(out)]:
            matcher.accept(token)
            out.append(token)
            if token in space.eos_ids:
                break
    return out


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
@pytest.mark.parametrize("mask_drafts", [False, True], ids=["free drafts", "masked drafts"])
def test_constrained_speculative_greedy_equals_constrained_target_only(tiny, task, mask_drafts):
    pair = tiny
    vocab = pair.target.get_output_embeddings().out_features
    assert vocab > len(pair.tokenizer)  # the tiny target's vocabulary is padded, as Qwen's is
    space = token_space(pair.tokenizer, vocab, pair.eos_token_ids)
    for seed in range(3):
        prompt = torch.randint(3, len(pair.tokenizer), (12,), generator=torch.Generator().manual_seed(seed)).tolist()
        expected = constrained_greedy(pair.target, space, task.constraint, prompt, LIMIT)
        assert expected[-1] in space.eos_ids, "the budget cut the constrained output"
        assert task.parse(pair.tokenizer.decode(expected[:-1]))[1] is None
        for gamma in (1, 4):
            assert speculative(pair, space, task, prompt, gamma, mask_drafts) == expected, (seed, gamma)
