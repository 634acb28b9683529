"""Constrained outputs (sidecar.decoding.constraints, sidecar.decoding.matcher): tasks that check their
constraint, masks that make any logits decode to output that parses, exact rollback, padded vocabularies."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from sidecar.decoding.constraints import ConstraintError, constraint_from, token_space
from sidecar.decoding.matcher import (
    ConstraintViolation,
    RowMatcher,
    allocate_bitmask,
    apply_bitmask,
    fill_bitmask,
    unpack_bitmask,
    unpack_on_host,
    unpack_with_shifts,
)
from sidecar.models.tiny import tiny_tokenizer
from sidecar.tasks.task import HASHTAGS, SidecarTask

TOPICS = ["politics", "sport", "sports", 'say "hi"', "naïve café", "back\\slash", "two\nlines"]
TAGS = r"#[a-z]{2,12}( #[a-z]{2,12}){2,4}"
DATE = r"\d{4}-(0[1-9]|1[0-2])-[0-3]\d"
ENTITIES = {
    "type": "object",
    "properties": {
        "people": {"type": "array", "maxItems": 3, "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 12},
                           "role": {"enum": ["author", "subject", "source"]}},
            "required": ["name", "role"], "additionalProperties": False}},
        "places": {"type": "array", "maxItems": 3, "items": {"type": "string", "minLength": 1, "maxLength": 10}},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "confirmed": {"type": "boolean"},
    },
    "required": ["people", "places", "year", "confirmed"],
    "additionalProperties": False,
}
TASKS = [
    SidecarTask(name="topic", instruction="Then name the topic.", choices=TOPICS),
    SidecarTask(name="tags", instruction="Then write hashtags.", regex=TAGS),
    SidecarTask(name="date", instruction="Then give the date.", regex=DATE),
    SidecarTask(name="entities", instruction="Then list the entities as JSON.", json_schema=ENTITIES),
]
TINY_PADDING = 45  # logits past the tiny tokenizer's ids, as a padded embedding has


@pytest.fixture(scope="module", params=["tiny", pytest.param("qwen", marks=pytest.mark.real)])
def space(request):
    """A token space over a padded vocabulary: the tiny tokenizer's 512 ids in 557 logits, or the real Qwen
    tokenizer's ids in its models' 151,936 logits (the tokenizer alone: about a second to load)."""
    if request.param == "tiny":
        tokenizer = tiny_tokenizer()
        vocab = len(tokenizer) + TINY_PADDING
    else:
        from sidecar.models.loading import load_tokenizer

        tokenizer = load_tokenizer("qwen-coder-small")
        vocab = 151_936
    eos = sorted({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")})
    return tokenizer, token_space(tokenizer, vocab, eos)


def greedy(space, tasks: list[SidecarTask], seed: int, budget: int = 400) -> list[list[int]]:
    """Each task's tokens by argmax over masked random logits, all rows in one batch as a step decodes them;
    a row leaves at an end-of-sequence id."""
    _, ts = space
    generator = torch.Generator().manual_seed(seed)
    matchers = [RowMatcher(ts, task.constraint) for task in tasks]
    outputs: list[list[int]] = [[] for _ in tasks]
    live = list(range(len(tasks)))
    for _ in range(budget):
        if not live:
            break
        logits = torch.randn(len(live), ts.vocab_size, generator=generator) * 5
        bitmask = fill_bitmask([matchers[i] for i in live], ts.vocab_size)
        apply_bitmask(logits, bitmask)
        for row, token in zip(list(live), logits.argmax(-1).tolist(), strict=True):
            matchers[row].accept(token)
            if token in ts.eos_ids:
                live.remove(row)
            else:
                outputs[row].append(token)
    assert not live, f"rows {live} did not finish in {budget} tokens"
    return outputs


# -- tasks --


@pytest.mark.parametrize(("fields", "field", "words"), [
    ({"regex": "a(?=b)"}, "regex", "look-around"),
    ({"regex": "[a-"}, "regex", "invalid pattern"),
    ({"regex": ""}, "regex", "non-empty"),
    ({"json_schema": {"type": "strin"}}, "json_schema", "not a valid JSON Schema"),
    ({"json_schema": {"type": "string", "format": "no-such-format"}}, "json_schema", "cannot be enforced"),
    ({"json_schema": ["not", "a", "schema"]}, "json_schema", "dict"),
    ({"choices": []}, "choices", "at least one"),
    ({"choices": ["a", ""]}, "choices", "non-empty"),
    ({"choices": ["a", "b", "a"]}, "choices", "duplicate"),
])
def test_a_bad_constraint_is_an_error_naming_its_field(fields, field, words):
    with pytest.raises(ValidationError) as raised:
        SidecarTask(name="t", instruction="Then answer.", **fields)
    (error,) = raised.value.errors()
    assert error["loc"][0] == field and words in str(error["msg"])


@pytest.mark.parametrize(("fields", "words"), [
    ({"choices": ["a"], "regex": "a"}, "regex: choices and regex exclude each other"),
    ({"regex": "a", "json_schema": {"type": "string"}}, "json_schema: regex and json_schema exclude each other"),
    ({"choices": ["a"], "parser": "hashtags"}, "parser: 'hashtags' parses free text"),
])
def test_constraints_exclude_each_other_and_the_hashtag_parser(fields, words):
    with pytest.raises(ValidationError, match=words):
        SidecarTask(name="t", instruction="Then answer.", **fields)


def test_two_constraints_are_refused_outside_a_task_too():
    with pytest.raises(ConstraintError) as raised:
        constraint_from(["a"], "a", {"type": "string"})
    assert raised.value.field == "regex"


def test_a_free_text_task_dumps_as_before_so_run_ids_stay():
    assert list(HASHTAGS.model_dump()) == ["name", "instruction", "max_new_tokens", "attend_document", "parser",
                                           "bridge"]
    topic = TASKS[0]
    assert topic.model_dump(mode="json")["choices"] == TOPICS and "regex" not in topic.model_dump()
    assert SidecarTask.model_validate(topic.model_dump()).constraint == topic.constraint


def test_parse_returns_the_constrained_value_or_says_why_not():
    topic, tags, _, entities = TASKS
    assert topic.parse("naïve café") == ("naïve café", None)
    assert topic.parse(" sport\n") == ("sport", None)
    assert topic.parse("football") == (None, "not one of the 7 choices")
    assert tags.parse("#a1 #b") == (None, "does not match the regex")
    assert tags.parse("#climate #energy #policy") == ("#climate #energy #policy", None)
    value = {"people": [{"name": "Ada", "role": "author"}], "places": [], "year": 2024, "confirmed": True}
    assert entities.parse(json.dumps(value)) == (value, None)
    assert entities.parse('{"people": [') [1].startswith("not JSON")
    wrong = dict(value, year=1066)
    assert entities.parse(json.dumps(wrong)) == (None, "does not match the schema at year: 1066 is less than the "
                                                       "minimum of 1900")


# -- decoding under the mask --


@pytest.mark.parametrize("seed", range(6))
def test_greedy_decoding_of_random_logits_under_the_mask_always_parses(space, seed):
    tokenizer, _ = space
    outputs = greedy(space, TASKS, seed)
    for task, tokens in zip(TASKS, outputs, strict=True):
        text = tokenizer.decode(tokens)
        value, error = task.parse(text)
        assert error is None, (task.name, text, error)
        if task.json_schema is not None:
            assert text == json.dumps(value, ensure_ascii=False) or json.loads(text) == value


def test_end_of_sequence_is_allowed_exactly_when_the_output_is_complete(space):
    tokenizer, ts = space
    matcher = RowMatcher(ts, SidecarTask(name="t", instruction="x", choices=["sport", "sports"]).constraint)

    def allowed() -> set[int]:
        bitmask = fill_bitmask([matcher], ts.vocab_size)
        return set(np.flatnonzero(unpack_bitmask(bitmask, ts.vocab_size, torch.device("cpu"))[0].numpy()).tolist())

    assert not allowed() & set(ts.eos_ids) and not matcher.complete
    for token in tokenizer.encode("sport", add_special_tokens=False):
        matcher.accept(token)
    assert set(ts.eos_ids) <= allowed() and matcher.complete and not matcher.finished
    assert any(tokenizer.decode([t]) == "s" for t in allowed())  # "sports" can still follow
    matcher.accept(tokenizer.encode("s", add_special_tokens=False)[0])
    assert allowed() == set(ts.eos_ids) and matcher.finished
    matcher.accept(ts.eos_ids[0])
    assert matcher.ended and allowed() == set(ts.eos_ids)  # an ended row's later tokens: its end again
    with pytest.raises(ConstraintViolation, match="after the row's end of sequence"):
        matcher.accept(ts.eos_ids[0])
    matcher.rollback(1)
    assert not matcher.ended and matcher.complete


def test_padded_vocabulary_ids_are_never_allowed(space):
    tokenizer, ts = space
    # every state of a decode: the padding's ids stay refused, and logits past the bitmask's words too
    for task, tokens in zip(TASKS, greedy(space, TASKS, seed=11), strict=True):
        matcher = RowMatcher(ts, task.constraint)
        for token in tokens:
            bitmask = fill_bitmask([matcher], ts.vocab_size)
            assert not unpack_bitmask(bitmask, ts.vocab_size, torch.device("cpu"))[0, len(tokenizer):].any()
            matcher.accept(token)
    wider = torch.zeros(1, ts.vocab_size + 70)
    apply_bitmask(wider, allocate_bitmask(1, ts.vocab_size))
    assert torch.isinf(wider[0, 32 * ((ts.vocab_size + 31) // 32):]).all()
    assert not torch.isinf(wider[0, : ts.vocab_size]).any()


def test_a_token_the_mask_refuses_is_a_violation_and_changes_nothing(space):
    tokenizer, ts = space
    matcher = RowMatcher(ts, TASKS[2].constraint)  # a date: digits first
    before = fill_bitmask([matcher], ts.vocab_size)
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    with pytest.raises(ConstraintViolation, match="not allowed by the row's regex"):
        matcher.accept(letter)
    assert torch.equal(fill_bitmask([matcher], ts.vocab_size), before) and matcher.tokens == []


# -- rollback, for speculative verification --


@pytest.mark.parametrize("seed", range(3))
def test_rollback_restores_the_mask_exactly(space, seed):
    _, ts = space
    rng = np.random.default_rng(seed)
    for task, tokens in zip(TASKS, greedy(space, TASKS, seed), strict=True):
        matcher = RowMatcher(ts, task.constraint)
        masks = [fill_bitmask([matcher], ts.vocab_size)]
        position = 0
        while position < len(tokens):
            # take up to 5 tokens (a verify's drafts), give back some or all of them, and go on from there
            take = tokens[position : position + int(rng.integers(1, 6))]
            for token in take:
                matcher.accept(token)
                masks.append(fill_bitmask([matcher], ts.vocab_size))
            back = int(rng.integers(0, len(take) + 1))
            matcher.rollback(back)
            del masks[len(masks) - back :]
            position += len(take) - back
            assert torch.equal(fill_bitmask([matcher], ts.vocab_size), masks[-1]), (task.name, position)
            assert matcher.tokens == tokens[:position]
        # the end too is taken back, whether the output could have gone on or not
        finished = matcher.finished
        matcher.accept(ts.eos_ids[0])
        assert matcher.finished
        matcher.rollback(1)
        assert torch.equal(fill_bitmask([matcher], ts.vocab_size), masks[-1]) and matcher.finished == finished
        with pytest.raises(ValueError, match="cannot roll back"):
            matcher.rollback(len(matcher.tokens) + 1)


def test_draft_masks_are_the_masks_along_the_drafts_and_leave_the_matcher_in_place(space):
    tokenizer, ts = space
    task = TASKS[3]
    (tokens,) = greedy(space, [task], seed=3)
    matcher = RowMatcher(ts, task.constraint)
    for token in tokens[:4]:
        matcher.accept(token)
    drafts = tokens[4:9]
    before = fill_bitmask([matcher], ts.vocab_size)
    masks = allocate_bitmask(len(drafts) + 1, ts.vocab_size)
    assert matcher.draft_masks(drafts, masks) == len(drafts)
    assert torch.equal(masks[:1], before) and matcher.tokens == tokens[:4]
    for j, token in enumerate(drafts):  # the same masks, taken one token at a time
        matcher.accept(token)
        assert torch.equal(masks[j + 1 : j + 2], fill_bitmask([matcher], ts.vocab_size))
    matcher.rollback(len(drafts))
    # a refused draft: the drafts after it cannot be accepted, their masks repeat the last valid one
    refused = tokenizer.encode("!", add_special_tokens=False)[0]
    bad = [drafts[0], refused, drafts[1]]
    masks = allocate_bitmask(len(bad) + 1, ts.vocab_size)
    assert matcher.draft_masks(bad, masks) == 1
    assert torch.equal(masks[2], masks[1]) and torch.equal(masks[3], masks[1])
    assert torch.equal(fill_bitmask([matcher], ts.vocab_size), before)


# -- the mask's arithmetic --


def test_both_unpackings_agree_with_the_bits():
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 2, 5), dtype=torch.int32, generator=generator)
    expected = torch.tensor([[[bool(int(w) >> b & 1) for w in row for b in range(32)] for row in rows]
                             for rows in bitmask.tolist()])
    assert torch.equal(unpack_on_host(bitmask), expected)
    assert torch.equal(unpack_with_shifts(bitmask), expected)
    logits = torch.randn(3, 2, 150, generator=generator)
    masked = logits.clone()
    apply_bitmask(masked, bitmask)  # [B, K, V] logits: a verify's positions
    assert torch.equal(torch.isinf(masked), ~expected[..., :150])
    assert torch.equal(masked[expected[..., :150]], logits[expected[..., :150]])


def test_an_unconstrained_batch_gets_no_mask_and_unconstrained_rows_allow_everything(space):
    _, ts = space
    assert fill_bitmask([None, None], ts.vocab_size) is None
    matcher = RowMatcher(ts, TASKS[0].constraint)
    bitmask = fill_bitmask([None, matcher, None], ts.vocab_size)
    assert (bitmask[[0, 2]] == -1).all() and not (bitmask[1] == -1).all()
    with pytest.raises(ValueError, match="token space has"):
        fill_bitmask([matcher], ts.vocab_size + 1)


def test_token_spaces_are_made_once_per_tokenizer(space):
    tokenizer, ts = space
    assert token_space(tokenizer, ts.vocab_size, list(reversed(ts.eos_ids))) is ts
    assert token_space(tokenizer, ts.vocab_size + 32, ts.eos_ids) is not ts
