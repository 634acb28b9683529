"""Constraints enforced by the engine on the tiny pair (docs/constraints.md): constrained main rows equal
constrained target-only decoding (greedy) and follow the masked target (sampled); constrained sidecar and
standalone rows equal the draft's own constrained decoding and always parse, whatever rides with them."""

from __future__ import annotations

import pytest
import torch
from decoding import assert_speculated, constrained_greedy, last_logits, random_prompts, target_alone

from sidecar import SidecarEngine, SidecarRequest, SpeculativeDecoder
from sidecar.decoding.batch import stream_through
from sidecar.decoding.constraints import token_space
from sidecar.decoding.matcher import RowMatcher, apply_bitmask, fill_bitmask
from sidecar.decoding.rows import DecodeRow
from sidecar.decoding.sampling import Sampling
from sidecar.tasks.prompts import DEFAULT_SYSTEM, build_prompt
from sidecar.tasks.task import SidecarTask

LIMIT = 80  # fits each task's longest output on the tiny pair
TASKS = [
    SidecarTask(name="topic", instruction="Then give its topic.", max_new_tokens=LIMIT,
                choices=["politics", "sport", "sports", "science and tech"]),
    SidecarTask(name="tags", instruction="Then give hashtags.", max_new_tokens=LIMIT,
                regex=r"#[a-z]{2,8}( #[a-z]{2,8}){1,3}"),
    SidecarTask(name="entities", instruction="Then list the names as JSON.", max_new_tokens=LIMIT, json_schema={
        "type": "object",
        "properties": {"names": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 8}},
                       "year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
        "required": ["names", "year"], "additionalProperties": False}),
]
DOCS = [
    "The city council approved a new budget on Tuesday after a long debate about schools and roads.",
    "Prices rose 3.5 percent in 2017 while 1,200 workers lost their jobs at the factory in Berlin.",
    "The president met leaders in Moscow and Doha.",
]


def space_of(pair):
    return token_space(pair.tokenizer, pair.target.get_output_embeddings().out_features, pair.eos_token_ids)


def assert_parses(task: SidecarTask, output) -> None:
    assert output.finish_reason == "eos", (task.name, output.text)
    assert output.parse_error is None, (task.name, output.text, output.parse_error)


@pytest.mark.parametrize(("gamma", "adaptive", "copying"), [(1, False, False), (4, False, False), (4, True, False),
                                                        (4, False, True)])
def test_constrained_main_rows_equal_constrained_target_only(tiny, gamma, adaptive, copying):
    """Each task's constraint on a main row, with a free row in the same batch: the masked first token,
    verify (of the draft's proposals, or of prompt lookup's copies) and plain steps (the adaptive controller
    explores one) give the target's own constrained greedy output, token for token, and leave the free row
    as it was."""
    space = space_of(tiny)
    if copying:  # every ordinary token once: lookup always finds a continuation to copy
        g = torch.Generator().manual_seed(gamma)
        prompts = [(torch.randperm(len(tiny.tokenizer) - 3, generator=g) + 3).tolist() for _ in range(4)]
    else:
        prompts = random_prompts(tiny, [12, 7, 15, 9], seed=gamma + adaptive)
    rows = [DecodeRow(p, LIMIT, constraint=t.constraint) for p, t in zip(prompts, TASKS, strict=False)]
    rows.append(DecodeRow(prompts[-1], 24))
    outputs = SpeculativeDecoder(tiny, gamma=gamma, adaptive=adaptive).decode(rows, batch_size=len(rows))
    for task, prompt, out in zip(TASKS, prompts, outputs, strict=False):
        expected = constrained_greedy(tiny.target, space, task.constraint, prompt, LIMIT)
        assert out.token_ids == expected, task.name
        assert out.finish_reason == "eos" and task.parse(out.text)[1] is None
    assert outputs[-1].token_ids == target_alone(tiny, prompts[-1], 24)
    assert_speculated(outputs[:-1], accepts=False)
    assert not copying or sum(o.stats.lookup_drafted for o in outputs[:-1]) > 0


def test_sampled_constrained_main_rows_follow_the_masked_target(tiny):
    """Sampled constrained rows keep a draft with min(1, p/q) on the masked target: the verified second
    token is distributed as the masked target's softmax after each row's first token."""
    space = space_of(tiny)
    constraint = TASKS[1].constraint
    prompt = random_prompts(tiny, [10], seed=5)[0]
    rows = [DecodeRow(prompt, 3, sampling=Sampling(1.0, 1.0, seed), constraint=constraint) for seed in range(400)]
    outputs = SpeculativeDecoder(tiny, gamma=1, adaptive=False, prompt_lookup=False).decode(rows, batch_size=16)
    assert_speculated(outputs, accepts=False)
    exact = {}
    for first in {o.token_ids[0] for o in outputs}:
        matcher = RowMatcher(space, constraint)
        matcher.accept(first)
        logits = last_logits(tiny.target, [*prompt, first], 1, space.vocab_size)
        apply_bitmask(logits, fill_bitmask([matcher], space.vocab_size))
        exact[first] = torch.softmax(logits[0], -1)
    # each row's second token is drawn from its own first token's masked distribution: their mixture
    mixture = torch.stack([exact[o.token_ids[0]] for o in outputs]).mean(0)
    second = torch.tensor([o.token_ids[1] for o in outputs])
    empirical = torch.bincount(second, minlength=mixture.shape[0]).float() / len(second)
    assert float(mixture[second].min()) > 0, "a token the constraint refuses was kept"
    reference = torch.multinomial(mixture, len(second), replacement=True, generator=torch.Generator().manual_seed(3))
    noise = torch.bincount(reference, minlength=mixture.shape[0]).float() / len(second)
    distance, noise_distance = float((empirical - mixture).abs().sum()) / 2, float((noise - mixture).abs().sum()) / 2
    assert distance < 2 * noise_distance + 0.05, (distance, noise_distance)


def test_constrained_standalone_rows_equal_the_drafts_constrained_decoding(tiny):
    """The standalone tagger's rows choose under their mask: each output is the draft's own constrained
    greedy output for its prompt, and parses."""
    space = space_of(tiny)
    summaries = ["The council approved the budget.", "Jobs were lost in Berlin."]
    results = SidecarEngine(tiny).standalone(summaries, TASKS, batch_size=4)
    for summary, outputs in zip(summaries, results, strict=True):
        for task in TASKS:
            prompt = build_prompt(tiny.tokenizer, summary, task.standalone_instruction, DEFAULT_SYSTEM).token_ids
            assert outputs[task.name].token_ids == constrained_greedy(tiny.draft, space, task.constraint, prompt,
                                                                      LIMIT)
            assert_parses(task, outputs[task.name])


def test_constrained_sidecars_riding_wide_steps_equal_their_own_steps(tiny):
    """Sidecar rows that ride in several draft forwards a step (beside main rows still drafting) run their
    matcher ahead and back to what they keep; they give what they give alone (the static schedule, one
    forward a step), and parse."""
    engine = SidecarEngine(tiny, gamma=4, adaptive=False)
    # main outputs of different lengths, so that sidecars start while other main rows still draft
    requests = [SidecarRequest(d, sidecars=TASKS, max_new_tokens=m) for d, m in zip(DOCS, [6, 30, 18], strict=True)]
    runs = {}
    for schedule in ("continuous", "static"):
        batch = engine.batch(2, schedule)
        runs[schedule] = (dict(stream_through(batch, requests)), batch.trace.steps)
    continuous, steps = runs["continuous"]
    assert any(s.riders and s.draft_forwards > 1 for s in steps), "no sidecar row rode a wide step"
    static, _ = runs["static"]
    for index in range(len(DOCS)):
        for task in TASKS:
            assert continuous[index].sidecars[task.name].token_ids == static[index].sidecars[task.name].token_ids
            assert_parses(task, continuous[index].sidecars[task.name])


def test_constrained_sidecars_parse_when_sampled_and_cut_short_at_their_limit(tiny):
    """Sampled constrained sidecars parse; a sidecar cut by its token limit is the start of the uncut one
    (its matcher was rolled back to what it kept)."""
    engine = SidecarEngine(tiny, gamma=3, adaptive=False)
    sampled = engine.run([SidecarRequest(d, sidecars=TASKS) for d in DOCS], max_new_tokens=16, batch_size=2,
                         sidecar_sampling=Sampling(1.0, 1.0, 7))
    for result in sampled:
        for task in TASKS:
            assert_parses(task, result.sidecars[task.name])
    short = [SidecarTask(**{**t.model_dump(), "max_new_tokens": 5}) for t in TASKS]
    whole = engine.run([SidecarRequest(d, sidecars=TASKS) for d in DOCS], max_new_tokens=16, batch_size=2)
    cut = engine.run([SidecarRequest(d, sidecars=short) for d in DOCS], max_new_tokens=16, batch_size=2)
    for a, b in zip(whole, cut, strict=True):
        for task in TASKS:
            full, part = a.sidecars[task.name], b.sidecars[task.name]
            assert full.token_ids[:5] == part.token_ids
            assert_parses(task, full)
